"""A converted model's training step on each data path, in one run (issue 35; tools/gpu-check runs it).

    mpiexec -n 2 python tools/gpu_step.py [--device cuda|cpu] [--models example_unet,wxformer]
                                          [--size 1x6x1x128x256] [--steps 5] [--json FILE]

On every rank of the job (2 ranks sharing one GPU, or one GPU each) the same model, converted with
:func:`credit_mpi.nn.convert_to_domain_parallel`, trains with each data path in turn:

* ``torch``: ``transport="torch"``: NCCL when each rank has its own GPU (stream-ordered, no host sync),
  else gloo (ranks sharing a GPU: NCCL refuses them; gloo moves the bytes through host memory);
* ``mpi-direct``: ``transport="mpi"`` with device pointers to a CUDA-aware MPI (one event wait of the
  producing stream per exchange), only when the job's MPI is CUDA-aware (:func:`credit_mpi.gpu.cuda_awareness_report`);
* ``mpi-staged``: ``transport="mpi"`` through pinned host memory (the path of an MPI that is not CUDA-aware);
  on ``--device cpu`` the same staging code on a simulated device (CPU tensors taken for device memory);
* ``CREDIT``: miles-credit's own ``credit.domain_parallel`` converter over the torch default group (NCCL or
  gloo as bridged), when miles-credit is installed and the field splits evenly;
* ``one process``: the unconverted model on the whole field, on rank 0 (the reference).

Per variant: the step time (median of ``--steps`` timed steps after one warm-up; the slowest rank's;
``torch.cuda.synchronize()`` around each step on a GPU), its ratio to ``torch``'s and to one process's,
the max abs error of the gathered output against one process's (float32), and the memory per rank
(peak CUDA memory allocated in the step on a GPU; saved activations on CPU). One table, printed by rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import credit_mpi  # noqa: E402
from credit_mpi import gpu  # noqa: E402
from credit_mpi.partition import band_range  # noqa: E402
from credit_mpi.transport import arrays  # noqa: E402

MiB = 2**20


def _models():
    import bench_step  # benchmarks/bench_step.py: the same builders as the CPU benchmark

    with contextlib.suppress(Exception):  # CREDIT's modules import behind its post block's stand-in (tests/credit_stand_ins.py)
        from tests.credit_stand_ins import credit_models

        credit_models()
    return bench_step


@contextlib.contextmanager
def _route(kind: str, device: str):
    """The MPI path's route for device memory: ``direct`` (CUDA-aware) or ``staged``; on CPU a simulated device."""
    saved = gpu.is_cuda_aware, arrays._SIMULATE_DEVICE, arrays.host_bytes, arrays.host_numpy
    try:
        if kind == "direct":
            gpu.is_cuda_aware = lambda comm=None: True
        elif kind == "staged":
            gpu.is_cuda_aware = lambda comm=None: False
            if device == "cpu":  # the staging code on CPU tensors taken for device memory
                arrays._SIMULATE_DEVICE = True
                arrays.host_bytes = lambda x, adapter=None: None
                arrays.host_numpy = lambda x, adapter=None: None
        yield
    finally:
        gpu.is_cuda_aware, arrays._SIMULATE_DEVICE, arrays.host_bytes, arrays.host_numpy = saved


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(model, x, count, reduce):
    out = model(x.clone().requires_grad_())
    (out.float().square().sum() / count).backward()
    if reduce is not None:
        reduce()
    model.zero_grad(set_to_none=True)
    return out.detach()


def run_variant(name, model, x, count, reduce, device, steps, world, alone=False, route=None):
    """``(median seconds of the slowest rank, output, memory MiB)`` of ``steps`` timed steps after one warm-up."""
    rank = world.Get_rank()
    times, out, mem = [], None, 0.0
    with _route(route, device) if route else contextlib.nullcontext():
        for i in range(steps + 1):
            world.Barrier()
            t = 0.0
            if not alone or rank == 0:
                if device == "cuda" and i == steps:
                    torch.cuda.reset_peak_memory_stats()
                _sync(device)
                t0 = time.perf_counter()
                out = _step(model, x, count, reduce)
                _sync(device)
                t = time.perf_counter() - t0
                if device == "cuda" and i == steps:
                    mem = torch.cuda.max_memory_allocated() / MiB
            if i:
                times.append(world.allreduce(t, op=MPI.MAX))
        if device != "cuda" and (not alone or rank == 0):
            from credit_mpi.cli.bench_model import saved_activation_bytes

            nbytes, _ = saved_activation_bytes(lambda: model(x.clone().requires_grad_()), model.parameters())
            mem = nbytes / MiB
    return statistics.median(times), out, mem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--models", default="example_unet,wxformer")
    parser.add_argument("--size", default="1x6x1x128x256", help="batch x channels x time x lat x lon")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the table here (rank 0)")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    device = args.device
    if device == "cuda":
        gpu.bind_device(world, library="torch")
    manager = credit_mpi.DomainParallelManager(None, n)
    report = gpu.cuda_awareness_report(world) if device == "cuda" else {"cuda_aware": False, "reason": "CPU run"}
    backend = None if device == "cuda" else "gloo"  # None: NCCL when every rank has its own GPU, else gloo
    credit_mpi.init_torch_distributed(manager, backend)
    import torch.distributed as dist

    chosen = dist.get_backend(manager.torch_group("domain"))
    lines = [f"gpu_step: {n} ranks, device {device}, torch backend {chosen}, CUDA-aware MPI: "
             f"{report.get('cuda_aware')} ({report.get('reason')})"]
    if device == "cuda" and chosen != "nccl":
        lines.append("note: NCCL needs one GPU per rank; the torch path runs on gloo (host copies) here")
    size = tuple(int(s) for s in args.size.split("x"))
    table = []
    for model_name in args.models.split(","):
        build, shape = _models().MODELS[model_name](size)
        h = shape[-2]
        torch.manual_seed(0)
        ref = build(h).to(device)
        xg = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
        count = xg.numel()
        a, b = band_range(h, n, rank, uneven=True)
        xb = xg.narrow(-2, a, b - a).contiguous()
        variants = []
        for name, transport, route in (("torch", "torch", None), ("mpi-direct", "mpi", "direct"),
                                       ("mpi-staged", "mpi", "staged")):
            if name == "mpi-direct" and not (device == "cuda" and report.get("cuda_aware")):
                lines.append(f"{model_name}: {name} skipped (the MPI is not CUDA-aware here)")
                continue
            model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager, transport=transport)
            variants.append((name, model, xb, (lambda m=model: credit_mpi.reduce_gradients(list(m.parameters()), manager)),
                             False, route))
        if device == "cuda" and chosen != "nccl":
            lines.append(f"{model_name}: CREDIT skipped (its halo sends CUDA tensors point to point: NCCL, one GPU per rank)")
        elif h % n == 0:
            theirs, reduce = _models()._credit_converter(copy.deepcopy(ref), manager)
            if theirs is not None:
                variants.append(("CREDIT", theirs, xb, reduce, False, None))
            else:
                lines.append(f"{model_name}: CREDIT skipped (credit.domain_parallel not importable: miles-credit not installed)")
        variants.append(("one process", copy.deepcopy(ref), xg, None, True, None))
        results = {}
        for name, model, x, reduce, alone, route in variants:
            try:
                seconds, out, mem = run_variant(name, model, x, count, reduce, device, args.steps, world, alone, route)
            except Exception as exc:  # noqa: BLE001 - one variant's failure is reported, the others still run
                lines.append(f"{model_name}: {name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            mems = world.gather(mem, root=0)
            parts = world.gather(None if out is None or alone else out.float().cpu(), root=0)
            results[name] = (seconds, mems, None if alone else parts, out.float().cpu() if alone and rank == 0 else None)
        if rank == 0 and "one process" in results:
            whole = results["one process"][3]
            base = results.get("torch", results["one process"])[0]
            for name, (seconds, mems, parts, _) in results.items():
                err = 0.0 if parts is None else float((torch.cat(parts, -2) - whole).abs().max())
                table.append({"model": model_name, "variant": name, "step_s": seconds, "vs_torch": seconds / base,
                              "vs_one_process": seconds / results["one process"][0], "max_abs_error": err,
                              "mem_mib_per_rank": [round(m, 1) for m in mems]})
    if rank == 0:
        lines.append(f"{'model':14} {'variant':12} {'step s':>9} {'/torch':>7} {'/1 proc':>8} {'max err':>10}  memory MiB per rank")
        for r in table:
            lines.append(f"{r['model']:14} {r['variant']:12} {r['step_s']:9.4f} {r['vs_torch']:7.2f} {r['vs_one_process']:8.2f} "
                         f"{r['max_abs_error']:10.2e}  {r['mem_mib_per_rank']}")
        print("\n".join(lines), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"lines": lines, "table": table}, indent=1))
    ok = world.bcast(bool(table) and not any("FAILED" in line for line in lines) if rank == 0 else None, root=0)
    manager.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
