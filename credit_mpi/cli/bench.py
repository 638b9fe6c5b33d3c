"""Measurements behind ``credit-mpi bench`` and ``benchmarks/``.

One implementation of each measurement, so that every table compares like
with like:

* :func:`raw_allgather` - raw mpi4py ``Allgather`` of the same bytes into
  one contiguous buffer (numpy arrays or torch CPU tensors; mpi4py takes
  torch tensors through DLPack). The floor that any gather can reach.
* :func:`credit_gather` - :func:`credit_mpi.gather_tensor`.
* :func:`gloo_all_gather_cat` - the reference's method: ``torch.distributed``
  (gloo) ``all_gather`` into a list of ``n`` tensors, then ``torch.cat``.
* :func:`credit_shard_batch` and :func:`raw_slice_copy` - sharding a batch
  is a local copy of this rank's band (plus one small agreement
  ``allgather``); its floor is a plain numpy/torch slice copy of the same
  bytes.
* :func:`gather_extra_memory` - memory beyond the output, by ``tracemalloc``
  (numpy reports its data allocations to it; torch does not).
* :func:`halo_exchange_fn` - :func:`credit_mpi.halo_exchange` (with or
  without its collective check, either transport); :func:`raw_halo` - the
  least raw mpi4py code with the same padded result (zero boundary, dim -2);
  :func:`gloo_halo_cat` - the reference's method, ``torch.distributed``
  ``batch_isend_irecv`` of the edge rows, then ``torch.cat``.
* :func:`credit_gather` with ``transport="torch"`` against ``"mpi"``, and
  :func:`raw_torch_allgather` - one raw torch.distributed all-gather of the
  same bytes as :func:`raw_allgather` (the floor of ``transport="torch"``).
* :func:`verify_identical` - every method's result against the expected
  bytes, before anything is timed.

Each measurement returns a zero-argument callable with its set-up done,
whose result is what the method produces, and :func:`time_collective` times
it: every repetition starts after a ``Barrier`` and its time is the slowest
rank's (one ``allreduce(MAX)``), so a table row is what the job as a whole
waits for. torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import math
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from ..halo import halo_exchange
from ..layout import Layout, offsets
from ..manager import DomainParallelManager
from ..partition import band_sizes
from ..sharding import gather_tensor, shard_batch
from ..transport.arrays import host_bytes, release_output_pool

__all__ = [
    "Timing",
    "credit_gather",
    "credit_shard_batch",
    "gather_extra_memory",
    "gloo_all_gather_cat",
    "gloo_group",
    "gloo_halo_cat",
    "halo_exchange_fn",
    "halo_grid_comparison",
    "halo_grid_unavailable",
    "square_grid",
    "local_field",
    "raw_allgather",
    "raw_halo",
    "raw_slice_copy",
    "raw_torch_allgather",
    "reference_extra_memory",
    "time_collective",
    "torch_available",
    "torch_group",
    "verify_identical",
]


@dataclass
class Timing:
    """Times of one measurement, in seconds (slowest rank per repetition)."""

    name: str
    nbytes: int  # bytes of the result on each rank
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def gbps(self) -> float:
        """Result bytes per rank per second, in GB/s (10**9), at the median time."""
        return self.nbytes / self.median / 1e9 if self.median > 0 else math.inf

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(median_s=self.median, best_s=self.best, gbps=self.gbps)
        return d


def time_collective(
    comm: MPI.Comm,
    fn: Callable[[], Any],
    name: str,
    nbytes: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    number: int = 1,
) -> Timing:
    """Time ``fn`` (collective over ``comm``): ``warmup`` untimed calls, then ``repeats`` timed repetitions.

    Each repetition is ``Barrier``, then ``number`` calls of ``fn()`` back to
    back; its time is the mean per call, the maximum over the ranks. (Use
    ``number > 1`` for calls so short that the barrier's skew would count.)
    Returns the same :class:`Timing` on every rank.
    """
    if repeats < 1 or number < 1:
        raise ValueError(f"repeats and number must be >= 1, got {repeats} and {number}")
    for _ in range(warmup):
        fn()
    local = np.empty(repeats)
    for i in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        local[i] = (time.perf_counter() - t0) / number
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    return Timing(name, int(nbytes), slowest.tolist())


def torch_available() -> bool:
    """True when torch can be imported (imports it)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def local_field(shape: Sequence[int], dim: int, comm: MPI.Comm, *, kind: str = "numpy", seed: int = 0) -> Any:
    """This rank's band of a random float32 field of global ``shape`` split along ``dim`` (uneven allowed)."""
    shape = list(shape)
    sizes = band_sizes(shape[dim], comm.Get_size(), uneven=True)
    shape[dim] = sizes[comm.Get_rank()]
    x = np.random.default_rng(seed + comm.Get_rank()).standard_normal(shape, dtype=np.float32)
    if kind == "torch":
        import torch

        return torch.from_numpy(x)
    if kind != "numpy":
        raise ValueError(f"kind must be 'numpy' or 'torch', got {kind!r}")
    return x


def raw_allgather(comm: MPI.Comm, x: Any, *, fresh: bool = False) -> Callable[[], Any]:
    """Raw mpi4py ``Allgather`` of ``x``'s bytes into one buffer of ``size`` times as many.

    The same bytes as gathering ``x`` with :func:`credit_mpi.gather_tensor`,
    but contiguous blocks (dim 0) with the buffer's own MPI datatype:
    nothing to describe, check or lay out. The receive buffer is allocated
    once (the floor), or with ``fresh`` on every call, as a gather that
    returns a new array must (its pages are then first touched by MPI).
    The callable returns the ``(size, *x.shape)`` buffer.

    Bands of different sizes (an uneven field, a rank with no rows) take
    ``Allgatherv`` of the bytes into one flat ``uint8`` buffer instead: an
    ``Allgather`` with different counts on different ranks is an erroneous
    MPI program (it hangs or garbles). The counts are shared once, here
    (collective over ``comm``), not in the timed call.
    """
    counts = comm.allgather(_nbytes(x))
    if len(set(counts)) > 1:
        return _raw_allgatherv(comm, x, counts, fresh)
    if isinstance(x, np.ndarray):
        send = np.ascontiguousarray(x)

        def alloc():
            return np.empty((comm.Get_size(), *send.shape), dtype=send.dtype)
    else:
        send = x.contiguous()

        def alloc():
            return send.new_empty((comm.Get_size(), *send.shape))

    if fresh:
        def run():
            recv = alloc()
            comm.Allgather(send, recv)
            return recv

        return run
    recv = alloc()

    def run():
        comm.Allgather(send, recv)
        return recv

    return run


def _nbytes(x: Any) -> int:
    return int(x.nbytes) if isinstance(x, np.ndarray) else int(x.numel() * x.element_size())


def _raw_allgatherv(comm: MPI.Comm, x: Any, counts: list[int], fresh: bool) -> Callable[[], np.ndarray]:
    """:func:`raw_allgather` of bands of different sizes: one ``Allgatherv`` of the bytes (numpy, torch CPU)."""
    send = host_bytes(np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x.contiguous())
    spec = (counts, offsets(counts))
    buffer = np.empty(sum(counts), dtype=np.uint8)

    def run():
        recv = np.empty(sum(counts), dtype=np.uint8) if fresh else buffer
        comm.Allgatherv([send, MPI.BYTE], [recv, spec, MPI.BYTE])
        return recv

    return run


def credit_gather(
    x: Any,
    manager: DomainParallelManager,
    dim: int = -2,
    *,
    check: bool = True,
    reuse: bool = False,
    transport: str = "mpi",
) -> Callable[[], Any]:
    """:func:`credit_mpi.gather_tensor` of ``x`` along ``dim``.

    With ``reuse``, every call gathers into one output allocated up front
    (``out=``), as :func:`raw_allgather` does: no fresh allocation (and first
    touch of its pages) per call. ``transport="torch"`` needs the manager
    bridged (:func:`torch_group`).
    """
    kw = {"dim": dim, "manager": manager, "check": check, "transport": transport}
    if not reuse:
        return lambda: gather_tensor(x, **kw)
    out = gather_tensor(x, **kw)
    return lambda: gather_tensor(x, out=out, **kw)


def torch_group(manager: DomainParallelManager, backend: str | None = None):
    """The ``torch.distributed`` group that mirrors ``manager``'s domain group.

    Bridges the manager with :func:`credit_mpi.torch_bridge.init_torch_distributed`
    (``backend``; ``None``: nccl with CUDA, else gloo; rendezvous over MPI)
    unless it is bridged already; ``manager.free()`` releases the groups.
    Collective over the manager's parent communicator.
    """
    from .. import torch_bridge

    if not torch_bridge.is_bridged(manager):
        torch_bridge.init_torch_distributed(manager, backend)
    return manager.torch_group("domain")


def gloo_group(manager: DomainParallelManager):
    """:func:`torch_group` with the gloo backend (the reference's CPU baseline)."""
    return torch_group(manager, "gloo")


def gloo_all_gather_cat(x: Any, dim: int = -2, group=None) -> Callable[[], Any]:
    """The reference's gather: ``dist.all_gather`` into a list of ``n`` tensors, then ``torch.cat``.

    ``x`` is a torch CPU tensor (a numpy array is wrapped, sharing memory);
    every rank's shard must have the same shape (the reference's limit).
    """
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    n = dist.get_world_size(group)

    def run():
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    return run


def raw_torch_allgather(x: Any, group=None) -> Callable[[], Any]:
    """One raw torch.distributed all-gather of ``x``'s bytes into one tensor: the floor of ``transport="torch"``.

    ``all_gather_single`` (``all_gather_into_tensor`` in older torch) of the
    contiguous tensor into a ``(size, *x.shape)`` buffer allocated once:
    the same bytes as :func:`raw_allgather`. ``x`` is a tensor on the
    group's device (a numpy array is wrapped, sharing memory).
    """
    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    send = (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).contiguous()
    recv = send.new_empty((dist.get_world_size(group), *send.shape))

    def run():
        gather(recv.view(-1), send.view(-1), group=group)
        return recv

    return run


def credit_shard_batch(batch: dict, manager: DomainParallelManager, *, uneven: bool = True) -> Callable[[], Any]:
    """:func:`credit_mpi.shard_batch` of ``batch`` (spatial dim -2)."""
    return lambda: shard_batch(batch, manager=manager, uneven=uneven)


def raw_slice_copy(batch: dict, comm: MPI.Comm, dim: int = -2) -> Callable[[], Any]:
    """The floor of sharding: copy this rank's band of each 4-D/5-D entry, nothing else."""
    n, rank = comm.Get_size(), comm.Get_rank()
    bands = {}
    for key, x in batch.items():
        if getattr(x, "ndim", 0) in (4, 5):
            sizes = band_sizes(x.shape[dim], n, uneven=True)
            bands[key] = (Layout.bands(sizes).start(rank), sizes[rank])

    def run():
        out = dict(batch)
        for key, (start, length) in bands.items():
            x = batch[key]
            if isinstance(x, np.ndarray):
                out[key] = np.ascontiguousarray(np.moveaxis(np.moveaxis(x, dim, 0)[start : start + length], 0, dim))
            else:
                out[key] = x.narrow(dim, start, length).contiguous()
        return out

    return run


def _traced_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes that ``fn`` allocated through tracemalloc-visible allocators, and its result."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return peak, result


def gather_extra_memory(x: np.ndarray, manager: DomainParallelManager, dim: int = -2) -> tuple[int, int]:
    """``(extra, output)`` bytes of one :func:`credit_mpi.gather_tensor` of numpy ``x``.

    ``extra`` is the tracemalloc peak during the call minus the output's
    bytes: everything the gather allocated beyond its result (temporaries,
    contiguous copies, MPI-side Python objects). The largest value over the
    domain group's ranks. numpy only: numpy reports its data buffers to
    tracemalloc, torch does not (its extra memory follows the same code path).
    """
    release_output_pool()  # the output is allocated inside the measured call, as a first call's is
    peak, out = _traced_peak(lambda: gather_tensor(x, dim=dim, manager=manager))
    extra = manager.domain_group.allreduce(peak - out.nbytes, op=MPI.MAX)
    return int(extra), int(out.nbytes)


def reference_extra_memory(x: np.ndarray, comm: MPI.Comm, dim: int = -2) -> tuple[int, int]:
    """``(extra, output)`` bytes of the reference's method, rebuilt in numpy so tracemalloc sees it.

    A list of ``n`` receive buffers filled by one ``Allgather``, then
    ``numpy.concatenate`` along ``dim`` - what ``dist.all_gather`` + ``torch.cat``
    allocate, measured the same way as :func:`gather_extra_memory`.
    """

    def run():
        parts = np.empty((comm.Get_size(), *x.shape), dtype=x.dtype)
        comm.Allgather(np.ascontiguousarray(x), parts)
        return np.concatenate(list(parts), axis=dim)

    peak, out = _traced_peak(run)
    extra = comm.allreduce(peak - out.nbytes, op=MPI.MAX)
    return int(extra), int(out.nbytes)


def halo_exchange_fn(
    x: Any,
    halo_width: int | tuple[int, int],
    manager: DomainParallelManager,
    dim: int | tuple[int, int] = -2,
    boundary: str | tuple[str, str] = "zero",
    *,
    check: bool = True,
    transport: str = "mpi",
) -> Callable[[], Any]:
    """``credit_mpi.halo_exchange`` of ``x``.

    ``check=False`` leaves out the collective argument check;
    ``transport="torch"`` needs the manager bridged (:func:`torch_group`).
    """
    kw = {"dim": dim, "manager": manager, "boundary": boundary, "check": check, "transport": transport}
    return lambda: halo_exchange(x, halo_width, **kw)


def raw_halo(comm: MPI.Comm, x: np.ndarray, width: int = 1) -> Callable[[], np.ndarray]:
    """The least raw mpi4py code giving :func:`halo_exchange_fn`'s result (zero boundary, dim -2, numpy).

    A new array ``2 * width`` rows longer, the band copied in, the edge rows
    packed contiguously, two ``Sendrecv`` (``MPI.PROC_NULL`` at the outer
    edges, which therefore keep zeros), the received rows copied into place.
    Neighbours are the previous and next rank of ``comm``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    up = rank - 1 if rank > 0 else MPI.PROC_NULL
    down = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    rows = x.shape[-2]
    shape = (*x.shape[:-2], rows + 2 * width, x.shape[-1])

    def run():
        out = np.empty(shape, dtype=x.dtype)
        out[..., width : width + rows, :] = x
        first = np.ascontiguousarray(x[..., :width, :])
        last = np.ascontiguousarray(x[..., rows - width :, :])
        from_up, from_down = np.zeros_like(last), np.zeros_like(first)
        comm.Sendrecv(last, down, 0, from_up, up, 0)
        comm.Sendrecv(first, up, 1, from_down, down, 1)
        out[..., :width, :] = from_up
        out[..., width + rows :, :] = from_down
        return out

    return run


def gloo_halo_cat(x: Any, width: int = 1, group=None) -> Callable[[], Any]:
    """The reference's halo exchange: ``batch_isend_irecv`` of the edge rows, then ``torch.cat`` (zero boundary, dim -2).

    ``x`` is a torch CPU tensor (a numpy array is wrapped, sharing memory);
    neighbours are the previous and next rank of ``group``.
    """
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def peer(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    prev = peer(rank - 1) if rank > 0 else None
    nxt = peer(rank + 1) if rank < size - 1 else None

    def run():
        top = torch.zeros_like(t[..., :width, :])
        bottom = torch.zeros_like(t[..., :width, :])
        ops = []
        if prev is not None:
            ops += [dist.P2POp(dist.isend, t[..., :width, :].contiguous(), prev, group),
                    dist.P2POp(dist.irecv, top, prev, group)]
        if nxt is not None:
            ops += [dist.P2POp(dist.isend, t[..., -width:, :].contiguous(), nxt, group),
                    dist.P2POp(dist.irecv, bottom, nxt, group)]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return torch.cat([top, t, bottom], dim=-2)

    return run


def _as_numpy(result: Any) -> np.ndarray:
    if isinstance(result, np.ndarray):
        return result
    return result.detach().cpu().numpy()


def verify_identical(comm: MPI.Comm, expected: Any, results: dict[str, Any]) -> None:
    """Check that every result has ``expected``'s shape, dtype and bytes, on every rank of ``comm``.

    ``results`` maps a method's name to what it produced (numpy arrays or
    torch tensors, on any device). Collective: raises the same
    ``AssertionError`` on every rank, naming each method that differs on
    some rank, so that no rank goes on to time while another stopped.
    """
    want = _as_numpy(expected)
    bad = []
    for name, result in results.items():
        got = _as_numpy(result)
        same = got.shape == want.shape and got.dtype == want.dtype and np.array_equal(
            np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
        )
        if not same:
            bad.append(name)
    everyone = comm.allgather(bad)
    differ = sorted({name for names in everyone for name in names})
    if differ:
        ranks = [r for r, names in enumerate(everyone) if names]
        raise AssertionError(f"not bit-identical to the expected result: {', '.join(differ)} (on rank(s) {ranks})")


def square_grid(d: int) -> tuple[int, int]:
    """The most nearly square ``(rows, cols)`` grid of ``d`` ranks (rows <= cols): 4 -> 2x2, 6 -> 2x3, 3 -> 1x3."""
    rows = max(r for r in range(1, math.isqrt(d) + 1) if d % r == 0)
    return rows, d // rows


def halo_grid_unavailable(domain_size: int, world_size: int) -> str | None:
    """Why ``--ops halo_grid`` cannot run on this layout (one line), or None when it can."""
    if domain_size != world_size:
        return (f"halo_grid compares the halo of one domain group of all {world_size} ranks on latitude bands and on "
                f"a 2-D grid; leave out --domain-size (got {domain_size})")
    rows, cols = square_grid(domain_size)
    if rows == 1:
        return (f"halo_grid compares latitude bands with a 2-D grid, and {domain_size} rank(s) have no grid but "
                f"1x{cols} (none with several rows and columns): run it on 4, 6, 8 or 9 ranks")
    return None


def halo_grid_comparison(
    comm: MPI.Comm, shape: Sequence[int], width: int = 1, *, boundary: str = "earth", repeats: int = 5, seed: int = 0
) -> dict:
    """The same global ``(c, h, w)`` field's 2-D halo on an ``(n, 1)`` grid (latitude bands) and on a square grid.

    Both go through :func:`credit_mpi.halo_exchange` with ``dim=(-2, -1)``,
    ``halo_width=(width, width)`` and ``boundary=(boundary, "periodic")``
    (on the ``(n, 1)`` grid the longitude halo is a copy within the rank).
    Collective over ``comm`` (every rank is one domain group). Returns a row
    with both grids, the bytes every rank receives from other ranks (total
    and the busiest rank's, from the block layout) and both timings.
    """
    from ..ops.halo import received_elements
    from ..sharding import shard_tensor

    n = comm.Get_size()
    c, h, w = shape
    field = np.random.default_rng(seed).standard_normal((c, h, w), dtype=np.float32)
    row = {"op": "halo_grid", "size": f"{c}x{h}x{w}", "width": width, "boundary": boundary}
    for key, grid in (("1d", (n, 1)), ("2d", square_grid(n))):
        with DomainParallelManager(None, n, comm=comm, domain_grid=grid) as manager:
            block = shard_tensor(field, (-2, -1), manager, uneven=True)
            heights, widths = band_sizes(h, grid[0], True), band_sizes(w, grid[1], True)
            received = [received_elements(grid, heights, widths, r, (width, width), (boundary, "periodic")) * c * 4 for r in range(n)]
            row[f"grid_{key}"] = f"{grid[0]}x{grid[1]}"
            row[f"bytes_{key}"] = sum(received)
            row[f"max_bytes_{key}"] = max(received)
            fn = halo_exchange_fn(block, (width, width), manager, dim=(-2, -1), boundary=(boundary, "periodic"))
            row[f"time_{key}"] = time_collective(manager.domain_group, fn, f"{grid[0]}x{grid[1]} halo", max(received), repeats=repeats, warmup=1)
    return row
