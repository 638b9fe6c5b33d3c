"""Per-call cost of a training loop: halo_exchange, HaloExchange and gather_tensor against raw mpi4py and gloo.

    mpiexec -n 2 python benchmarks/bench_percall.py [--repeats 15] [--json FILE]

The per-call cost table of docs/performance.rst: each rank holds a float32 band (B, C, h, W), the
same shapes call after call, and the script times, interleaved (so that the
machine's noise falls on every method alike):

* ``halo``: ``halo_exchange(x, 1)`` (numpy) against the least raw mpi4py
  code with the same result (allocate the padded array, copy the band in,
  two ``Sendrecv`` of the packed edge rows, zeros at the global edges) and
  against the reference's method (torch.distributed gloo
  ``batch_isend_irecv`` of the edge rows, then ``torch.cat``);
* ``halo fwd+bwd``: ``HaloExchange(1)`` forward and backward of a torch
  tensor that requires grad, against the same raw code forward and its
  adjoint (two ``Sendrecv`` of the halo gradients, added to the edge rows)
  inside a ``torch.autograd.Function``;
* ``gather``: ``gather_tensor(x)`` returning a new array each call against
  raw ``Allgather`` into a reused buffer (the issue's floor), raw
  ``Allgather`` into a fresh buffer, ``gather_tensor(x, out=...)`` and the
  reference's ``all_gather`` + ``torch.cat`` (gloo);
* ``gather 2d``: each rank's band is a block of the most nearly square
  domain grid (1x2 on 2 ranks, 2x2 on 4): ``gather_tensor(x, (-2, -1))``
  against one raw ``Alltoallw`` of the same bytes into a reused buffer
  (every rank's block straight into its place through a subarray type).

Every method's result is checked against the others before timing. The
MPI methods are timed interleaved with each other, the gloo method in blocks
of its own after them (on 2 cores gloo's threads slowed whichever MPI block
ran next, by up to 25%). A time
is the slowest rank's mean per call over a block of calls (``Barrier``
before each block); the table shows the median over ``--repeats`` blocks
and the ratio of medians. The raw and gloo methods are those of
:mod:`credit_mpi.cli.bench` (``credit-mpi bench`` measures with them too);
besides them only public names of credit_mpi are used, so the script also
runs against older checkouts (``PYTHONPATH=<checkout>``) that have them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from credit_mpi.cli import bench

SHAPES = {"0.26 MB": (4, 8, 23, 90), "2 MB": (4, 16, 45, 180), "33 MB": (4, 16, 180, 720)}


def raw_adjoint(comm, g, w=1):
    """The adjoint of ``bench.raw_halo``: the band's gradient, halo gradients sent home and added."""
    rank, size = comm.Get_rank(), comm.Get_size()
    up = rank - 1 if rank > 0 else MPI.PROC_NULL
    down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    rows = g.shape[-2] - 2 * w
    gx = g[..., w : w + rows, :].copy()
    top = np.ascontiguousarray(g[..., :w, :])
    bottom = np.ascontiguousarray(g[..., w + rows :, :])
    from_up, from_down = np.zeros_like(top), np.zeros_like(bottom)
    comm.Sendrecv(top, up, 2, from_down, down, 2)
    comm.Sendrecv(bottom, down, 3, from_up, up, 3)
    gx[..., rows - w :, :] += from_down
    gx[..., :w, :] += from_up
    return gx


def raw_halo_module(comm, w=1):
    """``bench.raw_halo`` / :func:`raw_adjoint` as a differentiable function of a torch CPU tensor."""
    import torch

    class RawHalo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.from_numpy(bench.raw_halo(comm, x.detach().numpy(), w)())

        @staticmethod
        def backward(ctx, g):
            return torch.from_numpy(raw_adjoint(comm, g.contiguous().numpy(), w))

    return RawHalo.apply


def raw_alltoallw_gather(comm, x, grid):
    """Every rank's block ``x`` (equal blocks, row-major ranks of ``grid``) into a reused global buffer: one ``Alltoallw``."""
    rows, cols = grid
    n = comm.Get_size()
    b, c, h, w = x.shape
    out = np.empty((b, c, rows * h, cols * w), x.dtype)
    whole = MPI.FLOAT if x.dtype == np.float32 else MPI.DOUBLE
    types = [whole.Create_subarray(out.shape, x.shape, (0, 0, (r // cols) * h, (r % cols) * w)).Commit() for r in range(n)]
    send = [x, [x.size] * n, [0] * n, [whole] * n]
    recv = [out, [1] * n, [0] * n, types]

    def run():
        comm.Alltoallw(send, recv)
        return out

    return run


def gather_2d_cases(x, size):
    """``gather 2d``'s methods, on a manager of the most nearly square grid (returned: the caller frees it)."""
    from credit_mpi import DomainParallelManager, gather_tensor

    grid = bench.square_grid(size)
    manager = DomainParallelManager(None, size, domain_grid=grid)
    cases = {
        "credit": lambda: gather_tensor(x, (-2, -1), manager=manager),
        "raw": raw_alltoallw_gather(manager.domain_group, x, grid),
    }
    return cases, manager


def time_cases(comm, cases, repeats, number):
    """Interleaved blocks, rotating order: {name: [slowest rank's mean seconds per call, per block]}."""
    for fn in cases.values():
        for _ in range(3):
            fn()
    local = {name: [] for name in cases}
    names = list(cases)
    for block in range(repeats):
        # each round starts with the next method: none always follows the same one (or the Barrier's wake-up)
        for name in names[block % len(names) :] + names[: block % len(names)]:
            fn = cases[name]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            local[name].append((time.perf_counter() - t0) / number)
    slowest = {}
    for name, t in local.items():
        mine = np.array(t)
        worst = np.empty_like(mine)
        comm.Allreduce(mine, worst, op=MPI.MAX)
        slowest[name] = worst.tolist()
    return slowest


def time_row(comm, cases, repeats, number):
    """One row's (times, medians): the MPI methods interleaved with each other, gloo after them.

    (gloo's threads would otherwise run beside the MPI blocks on a machine with a core per rank.)
    """
    times = time_cases(comm, {name: fn for name, fn in cases.items() if name != "gloo"}, repeats, number)
    if "gloo" in cases:
        times.update(time_cases(comm, {"gloo": cases["gloo"]}, repeats, number))
    return times, {name: statistics.median(t) for name, t in times.items()}


def parse_args(argv, doc: str, repeats: int, sizes: dict, ops: str) -> argparse.Namespace:
    """The options every per-call benchmark script takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--sizes", default=",".join(sizes), help="comma-separated subset of " + ", ".join(sizes))
    parser.add_argument("--ops", default=ops)
    parser.add_argument("--number", type=int, default=0, help="calls per timed block (default: about 30 MB per block, 3 to 200)")
    parser.add_argument("--json", default=None, help="write the raw times here (rank 0)")
    return parser.parse_args(argv)


def write_json(report: dict, path: str | None, rank: int) -> None:
    """The raw times, from rank 0, where ``--json`` asks for them."""
    if rank == 0 and path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    import credit_mpi
    from credit_mpi import DomainParallelManager, gather_tensor, halo_exchange

    args = parse_args(argv, __doc__, 15, SHAPES, "halo,halo fwd+bwd,gather,gather 2d")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    ops = args.ops.split(",")
    report = {"ranks": size, "credit_mpi": credit_mpi.__file__, "rows": []}
    with DomainParallelManager(None, size) as manager:
        comm = manager.domain_group
        group = bench.gloo_group(manager)
        for label in args.sizes.split(","):
            b, c, h, w = SHAPES[label]
            x = np.random.default_rng(rank).standard_normal((b, c, h, w), dtype=np.float32)
            xt = torch.from_numpy(x)
            number = args.number or max(3, min(200, int(3e7 // x.nbytes)))
            rows = {}
            if "halo" in ops:
                cases = {
                    "credit": lambda x=x: halo_exchange(x, 1, manager=manager),
                    "raw": bench.raw_halo(comm, x),
                    "gloo": bench.gloo_halo_cat(xt, 1, group),
                }
                rows["halo"] = cases
            if "halo fwd+bwd" in ops:
                module = credit_mpi.HaloExchange(1, manager=manager)
                raw = raw_halo_module(comm)
                xg = xt.clone().requires_grad_(True)
                g = torch.ones((b, c, h + 2, w))

                def fwd_bwd(f, xg=xg, g=g):
                    def run():
                        y = f(xg)
                        y.backward(g)
                        grad, xg.grad = xg.grad, None
                        return y.detach(), grad

                    return run

                rows["halo fwd+bwd"] = {"credit": fwd_bwd(module), "raw": fwd_bwd(raw)}
            if "gather" in ops:
                out = gather_tensor(x, manager=manager)
                rows["gather"] = {
                    "credit": lambda x=x: gather_tensor(x, manager=manager),
                    "raw": bench.raw_allgather(comm, x),
                    "raw fresh": bench.raw_allgather(comm, x, fresh=True),
                    "credit out=": lambda x=x, out=out: gather_tensor(x, manager=manager, out=out),
                    "gloo": bench.gloo_all_gather_cat(xt, -2, group),
                }
            grid_manager = None
            if "gather 2d" in ops:
                rows["gather 2d"], grid_manager = gather_2d_cases(x, size)
            for op, cases in rows.items():
                _verify(op, cases, comm)
                times, med = time_row(comm, cases, args.repeats, number)
                report["rows"].append({"op": op, "size": label, "shape": [b, c, h, w], "times": times, "median": med})
                if rank == 0:
                    cells = "  ".join(f"{n} {m * 1e6:8.1f} us" for n, m in med.items())
                    ratios = "  ".join(f"{n}/credit {m / med['credit']:.2f}" for n, m in med.items() if n != "credit")
                    print(f"{op:13s} {label:8s} {cells}   credit/raw {med['credit'] / med['raw']:.2f}  {ratios}", flush=True)
            if grid_manager is not None:
                grid_manager.free()
        dist.barrier(group)
    write_json(report, args.json, rank)
    return 0


def _verify(op, cases, comm):
    import torch

    results = {name: fn() for name, fn in cases.items()}
    if op == "gather":
        results["raw"] = np.concatenate(list(results["raw"]), axis=-2)
        results["raw fresh"] = np.concatenate(list(results["raw fresh"]), axis=-2)
    first = None
    for name, r in results.items():
        parts = r if isinstance(r, tuple) else (r,)
        parts = [p.numpy() if isinstance(p, torch.Tensor) else p for p in parts]
        if first is None:
            first = parts
        elif not all(np.array_equal(a, b) for a, b in zip(parts, first, strict=True)):
            raise AssertionError(f"{op}: {name} differs from credit on rank {comm.Get_rank()}")


if __name__ == "__main__":
    raise SystemExit(main())
