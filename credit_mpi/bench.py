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

Each ``*`` function returns a zero-argument callable with its set-up done,
and :func:`time_collective` times it: every repetition starts after a
``Barrier`` and its time is the slowest rank's (one ``allreduce(MAX)``), so
a table row is what the job as a whole waits for. torch is imported only
inside the functions that need it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from .manager import DomainParallelManager
from .partition import band_sizes
from .sharding import gather_tensor, shard_batch

__all__ = [
    "Timing",
    "credit_gather",
    "credit_shard_batch",
    "gather_extra_memory",
    "gloo_all_gather_cat",
    "gloo_group",
    "local_field",
    "raw_allgather",
    "raw_slice_copy",
    "reference_extra_memory",
    "time_collective",
    "torch_available",
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
    comm: MPI.Comm, fn: Callable[[], Any], name: str, nbytes: int, *, repeats: int = 5, warmup: int = 1
) -> Timing:
    """Time ``fn`` (collective over ``comm``): ``warmup`` untimed calls, then ``repeats`` timed ones.

    Each repetition is ``Barrier``, ``fn()``, and its time is the maximum
    over the ranks. Returns the same :class:`Timing` on every rank.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    local = np.empty(repeats)
    for i in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        local[i] = time.perf_counter() - t0
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
    """
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
    return lambda: comm.Allgather(send, recv)


def credit_gather(
    x: Any, manager: DomainParallelManager, dim: int = -2, *, check: bool = True, reuse: bool = False
) -> Callable[[], Any]:
    """:func:`credit_mpi.gather_tensor` of ``x`` along ``dim``.

    With ``reuse``, every call gathers into one output allocated up front
    (``out=``), as :func:`raw_allgather` does: no fresh allocation (and first
    touch of its pages) per call.
    """
    if not reuse:
        return lambda: gather_tensor(x, dim=dim, manager=manager, check=check)
    out = gather_tensor(x, dim=dim, manager=manager, check=check)
    return lambda: gather_tensor(x, dim=dim, manager=manager, check=check, out=out)


def gloo_group(manager: DomainParallelManager):
    """The gloo ``torch.distributed`` group that mirrors ``manager``'s domain group.

    Bridges the manager with :func:`credit_mpi.torch_bridge.init_torch_distributed`
    (backend gloo; rendezvous over MPI) unless it is bridged already;
    ``manager.free()`` releases the groups. Collective over the manager's
    parent communicator.
    """
    from . import torch_bridge

    if not torch_bridge.is_bridged(manager):
        torch_bridge.init_torch_distributed(manager, "gloo")
    return manager.torch_domain_group


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
            bands[key] = (sum(sizes[:rank]), sizes[rank])

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


def halo_exchange_fn(x: Any, halo_width: int, manager: DomainParallelManager, dim: int = -2, boundary: str = "zero") -> Callable[[], Any] | None:
    """``credit_mpi.halo_exchange`` of ``x``, or ``None`` when this build has no halo exchange."""
    if importlib.util.find_spec(f"{__package__}.halo") is None:
        return None
    halo_exchange = importlib.import_module(f"{__package__}.halo").halo_exchange
    return lambda: halo_exchange(x, halo_width, dim=dim, manager=manager, boundary=boundary)
