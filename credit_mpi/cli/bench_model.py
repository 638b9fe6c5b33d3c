"""A converted model's step: saved activation memory per rank, step time and the communication share.

The measurements behind ``benchmarks/bench_model.py`` (the example UNet at
1, 2, 4 ranks) and the memory tests: :func:`saved_activation_bytes` counts
what autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage once, parameters left out), so a layer's memory is measured,
not timed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any


def saved_activation_bytes(run: Callable[[], Any], params: Iterable[Any] = ()) -> tuple[int, Any]:
    """``(bytes, run())``: the bytes of every storage autograd saves for backward during ``run()``.

    Each storage counts once, whole (a view keeps its whole storage alive),
    and the storages of ``params`` (the model's parameters: not activations)
    not at all. The count holds while ``run()``'s result (and its graph) is
    alive: a saved storage cannot be freed and reused before then.
    """
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def halo_row_bytes(model: Any, x: Any, domain_size: int) -> int:
    """Per rank, the bytes the halo rows can add to what the layers save on ``domain_size`` bands.

    For each layer of the plan (:func:`credit_mpi.nn.describe`) that reads
    rows of its neighbours: ``halo_before + halo_after`` rows of its input
    (a convolution on a band saves its input with the halo rows, one process
    saves it without). ``model`` is the unconverted model, ``x`` the global
    input (one no-grad forward learns each layer's row size).
    """
    import torch

    from ..nn import describe

    plan = describe(model, tuple(x.shape), domain_size)
    halos = {r.path: r.halo_before + r.halo_after for r in plan.rows if r.halo_before + r.halo_after}
    row: dict[str, int] = {}

    def hook(path):
        def record(_module, args):
            t = args[0]
            row[path] = t.numel() * t.element_size() // t.shape[-2]

        return record

    handles = [m.register_forward_pre_hook(hook(p)) for p, m in model.named_modules() if p in halos]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return sum(halos[p] * row.get(p, 0) for p in halos)


def _step(model: Any, x: Any, count: int) -> Any:
    """One training step's compute: forward, a loss (this band's share of a global mean square), backward."""
    out = model(x)
    (out.square().sum() / count).backward()
    return out


def _wait_idle(comm: Any) -> None:
    """A barrier that sleeps (MPICH's spins: ranks outside the measured group would take the cores)."""
    import time

    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def measure(build: Callable[[], Any], shape: tuple[int, ...], sizes: Iterable[int], iters: int = 5) -> list[dict]:
    """The model's step on each domain size of ``sizes`` (collective over COMM_WORLD; rank 0 gets the rows).

    Per domain size ``d`` (world ranks ``0..d-1``, the others sleep):
    ``saved_mib`` the most saved activation MiB of any rank
    (:func:`saved_activation_bytes`), ``bound_mib`` = 1.1 x (one process's
    / d) + :func:`halo_row_bytes`, ``step_s`` the slowest rank's median
    step (forward, backward, :func:`credit_mpi.reduce_gradients`), and
    ``local_s`` the same step of the unconverted model on the band alone
    (the same shapes, no communication, halos replaced by its own padding):
    ``comm_share`` = 1 - local_s / step_s, the part of the step that the
    communication (and its waiting) costs; ``overlap_s`` the step with
    ``credit_mpi.nn.conv.OVERLAP`` on, ``overlap_vs_local`` = overlap_s / local_s;
    ``pad_s`` the converted step with every halo a local pad of the same shape
    (:func:`credit_mpi.nn.conv.local_halos`: agreements and statistics still run), and
    ``overlap_vs_pad`` / ``step_vs_pad`` the steps with and without overlap over it:
    what the halo messages cost, overlapped or not.
    """
    import statistics
    import time

    import torch
    from mpi4py import MPI

    import credit_mpi
    from credit_mpi.nn import conv, convert_to_domain_parallel
    from credit_mpi.partition import band_range

    world = MPI.COMM_WORLD
    torch.manual_seed(0)
    ref = build()
    xg = torch.randn(shape)
    count = xg.numel()
    one, _ = saved_activation_bytes(lambda: ref(xg.clone().requires_grad_()), ref.parameters())
    rows = []
    for d in sizes:
        sub = world.Split(0 if world.Get_rank() < d else MPI.UNDEFINED, world.Get_rank())
        if sub == MPI.COMM_NULL:
            _wait_idle(world)
            continue
        manager = credit_mpi.DomainParallelManager(None, d, comm=sub)
        model = convert_to_domain_parallel(build(), manager)
        model.load_state_dict(ref.state_dict())
        a, b = band_range(shape[-2], d, sub.Get_rank(), uneven=True)
        x = xg.narrow(-2, a, b - a).contiguous()
        saved, out = saved_activation_bytes(lambda m=model, x=x: m(x.clone().requires_grad_()), model.parameters())
        out.sum().backward()
        times = {"step": [], "overlap": [], "pad": [], "local": []}
        for _ in range(iters):  # interleaved: the machine's load changes alike for all four
            for name, m in (("step", model), ("overlap", model), ("pad", model), ("local", ref)):
                conv.OVERLAP = name == "overlap"  # every rank alike (the layers agree on it)
                with conv.local_halos() if name == "pad" else contextlib.nullcontext():
                    sub.Barrier()
                    t0 = time.perf_counter()
                    _step(m, x.clone().requires_grad_(), count)
                    if m is model:
                        credit_mpi.reduce_gradients(list(model.parameters()), manager)
                    times[name].append(time.perf_counter() - t0)
                m.zero_grad()
        conv.OVERLAP = False
        step, overlap, pad, local = (sub.allreduce(statistics.median(times[k]), op=MPI.MAX)
                                     for k in ("step", "overlap", "pad", "local"))
        saved = sub.allreduce(saved, op=MPI.MAX)
        halo = halo_row_bytes(build(), xg, d)
        rows.append({"ranks": d, "saved_mib": saved / 2**20, "bound_mib": (1.1 * one / d + halo) / 2**20,
                     "halo_mib": halo / 2**20, "step_s": step, "overlap_s": overlap, "local_s": local,
                     "pad_s": pad, "comm_share": 1 - local / step, "overlap_vs_local": overlap / local,
                     "overlap_vs_pad": overlap / pad, "step_vs_pad": step / pad})
        manager.free()
        sub.Free()
        _wait_idle(world)
    return rows


def table(rows: list[dict]) -> str:
    """The rows of :func:`measure` as a text table, with each step time as a ratio to one rank's."""
    head = (f"{'ranks':>5}  {'saved MiB/rank':>14}  {'bound MiB':>9}  {'halo MiB':>8}  {'step s':>7}  {'x 1 rank':>8}  "
            f"{'comm share':>10}  {'overlap s':>9}  {'overlap / local':>15}  {'pad s':>7}  {'step / pad':>10}  {'overlap / pad':>13}")
    base = rows[0]["step_s"]
    lines = [head] + [
        f"{r['ranks']:>5}  {r['saved_mib']:>14.1f}  {r['bound_mib']:>9.1f}  {r['halo_mib']:>8.2f}  {r['step_s']:>7.3f}  "
        f"{r['step_s'] / base:>8.2f}  {100 * r['comm_share']:>9.0f}%  {r['overlap_s']:>9.3f}  {r['overlap_vs_local']:>15.2f}  "
        f"{r['pad_s']:>7.3f}  {r['step_vs_pad']:>10.3f}  {r['overlap_vs_pad']:>13.3f}"
        for r in rows
    ]
    return "\n".join(lines)
