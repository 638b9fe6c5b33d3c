"""Tensor sharding and gathering utilities for domain parallelism.

Provides functions to split tensors along a spatial dimension across
domain-parallel ranks, and to gather them back for metrics/output.

CREDIT's ``credit.domain_parallel.sharding`` API on MPI. Which calls
communicate:

* :func:`shard_tensor` and :func:`shard_batch` are **local**, as in the
  reference: each rank validates its own arguments and slices its band; no
  MPI call (the ops of :mod:`credit_mpi.ops.shard`, run locally).
  ``check="collective"`` runs them through the engine, which agrees across
  the domain group first (one small ``Allgather``), so that ranks that passed different
  arrays get the same exception instead of silently different bands. They
  work with any manager-like object that has ``domain_parallel_size`` and
  ``domain_rank`` (the reference's unit tests use plain objects and mocks).
* :func:`gather_tensor` and :func:`scatter_tensor` move data, so they are
  collective over the domain group. Each starts with
  :func:`credit_mpi.validation.agree`: one ``Allgather`` of a few integers
  per rank (the operation, the check mode, a digest of the arrays'
  metadata and arguments, the band rows), so a mistake on one rank is the
  same exception on every rank, never a hang or garbage.

Additions to the reference, all keyword-only with defaults that keep its
behaviour: ``uneven=True`` splits like :func:`numpy.array_split` (the first
``size % n`` ranks get one extra row), and :func:`gather_tensor`
reassembles uneven shards by itself; ``out=`` and ``transport=`` for the
gather; :func:`scatter_tensor`.

With no manager, or a domain of size 1, the input comes back unchanged and
nothing is communicated. Arrays are numpy arrays, torch tensors (CPU or
CUDA) or CuPy arrays; results have the kind, dtype and device of the input
(device arrays move as :mod:`credit_mpi.transport.staging` describes).

Gradients (torch tensors that require grad): a shard is a slice, so its
gradient is the slice's (this rank's rows, zeros elsewhere; no
communication), for :func:`shard_tensor` and :func:`shard_batch` alike; the
gradient of a gather is this rank's rows of the gathered gradient (see
:mod:`credit_mpi.autograd`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import blocks
from .engine import run, run_args
from .manager import Domain, DomainParallelManager, domain_of, live_domain_comm
from .ops import gather, scatter, shard
from .ops.gather import check_out
from .partition import normalize_dim
from .transport import arrays, rowops
from .validation import check_transport

__all__ = ["shard_tensor", "gather_tensor", "shard_batch", "scatter_tensor"]

CHECK_MODES = ("local", "collective")


def shard_tensor(
    x: Any,
    dim: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    uneven: bool = False,
    check: str | bool = "local",
) -> Any:
    """Shard a tensor along the given dimension across domain-parallel ranks.

    Splits the tensor into equal chunks and returns only this rank's chunk.
    Every rank of the domain group passes the same global tensor. Local (no
    communication), as in the reference.

    Args:
        x: Input tensor (numpy array, torch tensor or CuPy array).
        dim: Dimension to shard along (default: -2 for H in BCHW or BCTHW),
            or a pair ``(lat_dim, lon_dim)`` such as ``(-2, -1)`` for this
            rank's block of a 2-D ``domain_grid`` (:mod:`credit_mpi.blocks`).
        manager: DomainParallelManager instance (uses global singleton if None),
            or any object with ``domain_parallel_size`` and ``domain_rank``.
        uneven: Allow a size that the domain size does not divide
            (``numpy.array_split`` layout: the first ``size % n`` ranks get
            one extra row).
        check: ``"local"`` (default): validate this rank's arguments only.
            ``"collective"``: also agree across the domain group that every
            rank passed the same shape, dtype, kind and arguments (one small
            ``Allgather``; needs a real manager, and every rank of the group
            must call). ``True``/``False`` mean ``"collective"``/``"local"``.

    Returns:
        Local shard of the tensor (contiguous; it shares memory with ``x``
        when the band is contiguous already). For torch tensors that require
        grad it is differentiable like a slice.

    Raises:
        ValueError: ``dim`` out of range, or the size is not divisible and
            ``uneven`` is false (``"Cannot shard dim ..."``, as the reference).
        TypeError: unsupported array type.
    """
    collective = _collective(check)
    if _grid_call(manager, dim):  # a (lat, lon) pair: this rank's block of the 2-D domain grid
        domain = domain_of(manager)
        out = _shard(shard.TENSOR_2D, x, domain, {"dim": dim, "uneven": uneven}, collective)
    else:
        domain = domain_of(manager)
        if domain.size <= 1:
            return x
        out = _shard(shard.TENSOR, x, domain, {"dim": dim, "uneven": uneven}, collective)
    for made in BAND_MADE:
        made(out, dim, domain)
    return out


#: ``fn(band, dim, domain)`` called with every band :func:`shard_tensor` returns (on a domain of more than one
#: rank): :mod:`credit_mpi.nn.outside` remembers torch bands (weakly) to refuse one fed to a model never converted.
BAND_MADE: list = []


def gather_tensor(
    x: Any,
    dim: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    check: bool = True,
    out: Any = None,
    transport: str = "mpi",
) -> Any:
    """Gather sharded tensor from all domain-parallel ranks.

    All-gathers the tensor along the sharding dimension. Each rank's shard
    lands in its place in one output buffer: host arrays on domains of up
    to 8 ranks point to point, each band received straight into place (no
    scratch at all); otherwise a contiguous ``Iallgather(v)`` per outer
    slice for large fields and packed groups of at most 8 MiB copied into
    place for small ones. No list of shards and no concatenate, so the only
    memory beyond the output is at most 8 MiB of scratch and a contiguous
    copy of a non-contiguous input. A new host output comes from a reuse
    pool (:func:`release_output_pool`). Shards may have different sizes
    along ``dim`` (uneven splits). Collective over the domain group.

    Args:
        x: Local shard tensor.
        dim: Dimension that was sharded (default: -2), or a ``(lat_dim,
            lon_dim)`` pair for the blocks of a 2-D ``domain_grid``.
        manager: DomainParallelManager instance (uses global singleton if None).
        check: Agree first that the shards fit together (same kind, dtype,
            ndim and every dimension but ``dim``); a mismatch raises the same
            exception on every rank, naming each rank's shape. With
            ``False`` the ranks still agree on what decides the MPI calls
            (the band rows, the bytes per row, ``out`` and ``transport``),
            so nothing hangs, but not on dtypes of the same size or the
            dimensions' split. Either way one ``Allgather`` of a few integers.
        out: Optional C-contiguous, writable array of the global shape, kind
            and dtype to gather into (reused across calls, it saves
            allocating and first-touching the output each time); agreed on
            every rank. ``x`` may be a view into ``out`` (an in-place gather).
        transport: ``"mpi"`` (default) moves the data with MPI; ``"torch"``
            with a torch.distributed collective over the mirrored group
            ``manager.torch_domain_group`` (NCCL on GPUs, for MPIs that are
            not CUDA-aware; see :func:`credit_mpi.init_torch_distributed`).
            The result is bit-identical; the agreement uses MPI either way.

    Returns:
        Full (gathered) tensor, identical on every rank of the domain group
        (``out`` when given).
    """
    if getattr(x, "_credit_mpi_band", False):  # a converted model's output (credit_mpi.nn.Band): its plain alias
        x = x.as_plain()
    if isinstance(dim, (tuple, list)):  # a (lat, lon) pair: gather the blocks of the 2-D domain grid
        return run(gather.BLOCKS, x, domain_of(manager).comm, check=check, dim=dim, out=out, transport=transport, manager=manager)
    comm = live_domain_comm(manager)  # a live manager's communicator: the per-call fast path asks nothing else
    if comm is None or comm.Get_size() <= 1:
        domain = domain_of(manager)  # raises for a freed manager or a bad stand-in
        if domain.size <= 1:
            check_transport(transport)
            return x if out is None else _copy_into(out, x, dim)
        comm = domain.comm
    return run_args(gather.BANDS, x, comm, {"dim": dim, "out": out, "transport": transport, "manager": manager}, check)


def shard_batch(
    batch: Mapping[str, Any],
    spatial_dims_5d: int = -2,
    spatial_dims_4d: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    uneven: bool = False,
    check: str | bool = "local",
    transport: str = "mpi",
) -> dict:
    """Shard all spatial tensors in a training batch dictionary.

    Handles both 5D (B, C, T, H, W) and 4D (B, C, H, W) tensors.
    Non-tensor entries and 1D/2D/3D tensors are left unchanged. Local (no
    communication), as in the reference.

    Args:
        batch: Dictionary of batch data (from dataloader).
        spatial_dims_5d: Dimension to shard in 5D tensors (default: -2 for H).
        spatial_dims_4d: Dimension to shard in 4D tensors (default: -2 for H).
        manager: DomainParallelManager instance (uses global singleton if None),
            or any object with ``domain_parallel_size`` and ``domain_rank``.
        uneven: As in :func:`shard_tensor`.
        check: As in :func:`shard_tensor`; ``"collective"`` agrees on the
            whole batch with one ``Allgather``.
        transport: ``"mpi"`` or ``"torch"``, as in :func:`gather_tensor`.
            Sharding moves no array data, so the result is the same either
            way; ``"torch"`` checks that the torch bridge is initialised, so
            a training loop can pass one transport everywhere.

    Returns:
        New dict with sharded tensors (each differentiable like a slice).
    """
    collective = _collective(check)
    dims = {5: spatial_dims_5d, 4: spatial_dims_4d}
    args = {"dims": dims, "uneven": uneven, "transport": transport}
    if _grid_call(manager, spatial_dims_5d, spatial_dims_4d):  # (lat, lon) pairs: blocks of the 2-D grid
        return _shard(shard.BATCH_2D, batch, domain_of(manager), args, collective)
    domain = domain_of(manager)
    if domain.size <= 1:
        check_transport(transport)
        return batch
    return _shard(shard.BATCH, batch, domain, args, collective)


def scatter_tensor(
    x: Any,
    dim: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    root: int = 0,
    uneven: bool = False,
) -> Any:
    """Scatter a tensor held by one rank of the domain group into bands.

    Like :func:`shard_tensor`, but only ``root`` (a domain rank) needs the
    global tensor; the other ranks pass ``None`` (their argument is ignored)
    and receive their band with one ``Scatterv``, without ever holding the
    global field. Collective over the domain group. Not in the reference.

    Returns:
        This rank's band, of the root's kind and dtype (numpy on ranks other
        than the root when the root holds numpy; the root's device type).
        Not differentiable.
    """
    domain = domain_of(manager)
    if domain.size <= 1:
        return x
    op = scatter.BLOCKS if _grid_call(manager, dim) else scatter.BANDS  # a (lat, lon) pair: blocks of the 2-D grid
    return run(op, x, domain.comm, dim=dim, root=root, uneven=uneven, manager=manager)


def _grid_call(manager: Any, *dims: Any) -> bool:
    """True for the 2-D grid path (a ``dim`` pair); a single dim on a grid of several columns is refused by
    the 1-D path's agreement (:func:`credit_mpi.blocks.check_line`)."""
    return blocks.is_grid_call(manager, *dims)


def _collective(check: Any) -> bool:
    """shard_tensor/shard_batch's ``check``: True for ``"collective"``/True, False for ``"local"``/False."""
    if check is True or check == "collective":
        return True
    if check is False or check == "local":
        return False
    raise ValueError(f"check must be 'local' or 'collective' (or True / False), got {check!r}")


def _shard(op: Any, x: Any, domain: Domain, args: dict, collective: bool) -> Any:
    """A sharding op (:mod:`credit_mpi.ops.shard`) on ``x``: agreed first with ``check="collective"`` (and ranks), else local."""
    args["domain"] = domain
    if collective and domain.size > 1:
        return _agree(op, x, domain, args)
    return shard.local_run(op, x, args)


def _agree(op: Any, x: Any, domain: Domain, args: dict) -> Any:
    """The collective check: the op through the engine, its agreement on the domain group."""
    return run_args(op, x, domain.comm, args)


def _copy_into(out: Any, x: Any, dim: int) -> Any:
    """The one-rank gather into ``out``: a checked copy."""
    info = arrays.describe(x)
    axis = normalize_dim(dim, len(info.shape))
    check_out(out, info, axis, info.shape[axis])
    if not arrays.shares_memory(x, out) or x.shape != out.shape:
        rowops.copy_rows(out, 0, 0, x)
    arrays.mark_written(out)
    return out
