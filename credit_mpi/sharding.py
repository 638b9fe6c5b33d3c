"""Tensor sharding and gathering utilities for domain parallelism.

Provides functions to split tensors along a spatial dimension across
domain-parallel ranks, and to gather them back for metrics/output.

CREDIT's ``credit.domain_parallel.sharding`` API on MPI. Which calls
communicate:

* :func:`shard_tensor` and :func:`shard_batch` are **local**, as in the
  reference: each rank validates its own arguments and slices its band; no
  MPI call. ``check="collective"`` makes them agree across the domain group
  first (one small ``Allgather``), so that ranks that passed different
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

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from . import blocks
from .layout import Layout
from .manager import Domain, DomainParallelManager, domain_of, live_domain_comm
from .partition import band_offsets, band_sizes, normalize_dim, row_datatypes
from .transport import arrays, limits, moves, rowops, staging
from .validation import Local, agree, agree_cached, check_bands_fit, check_root, check_transport, repeat_remembered

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
        return blocks.shard_tensor_2d(x, dim, manager, uneven, collective)
    domain = domain_of(manager)
    if domain.size <= 1:
        return x

    def local() -> Local:
        blocks.check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        info = arrays.describe(x)
        axis = normalize_dim(dim, len(info.shape))
        sizes = band_sizes(info.shape[axis], domain.size, uneven, dim=dim)
        return Local((info, axis, sizes), (axis, uneven), (info.kind, info.shape, info.dtype, info.device_type))

    plan = _agree(domain, "shard_tensor", local, _different_arrays("shard_tensor")) if collective else local().plan
    _, axis, sizes = plan
    return arrays.narrow(x, axis, Layout.bands(sizes).start(domain.rank), sizes[domain.rank])


class _Gather(NamedTuple):
    """What every rank agreed on before a gather moves data."""

    comm: MPI.Comm
    info: arrays.ArrayInfo
    axis: int
    sizes: list  # every rank's rows along axis
    rank: int
    out: Any  # the output array, or None (allocated by the gather)
    transport: str
    manager: Any

    def apply(self, x: Any) -> Any:
        """The gather (:func:`gather_kernel`)."""
        return gather_kernel(x, self)

    def own(self, grad: Any) -> Any:
        """This rank's rows of the gathered (replicated) gradient: the gather's backward, no communication."""
        return grad.narrow(self.axis, Layout.bands(self.sizes).start(self.rank), self.sizes[self.rank])


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
    # A repeat of a remembered call: its agreement is one Allgather, nothing else to check or plan.
    plan, table = repeat_remembered(live_domain_comm(manager), "gather_tensor", _call_key(x, dim, out, transport), check)
    if plan is None:
        domain = blocks.line_domain(manager, dim)
        if domain is None:  # a (lat, lon) pair: gather the blocks of the 2-D domain grid
            return blocks.gather_tensor_2d(x, dim, manager, check, out, transport)
        if domain.size <= 1:
            check_transport(transport)
            return x if out is None else _copy_into(out, x, dim)
        plan = _gather_plan(x, dim, domain, check, out, transport, received=table)
    if out is not None:  # plans are remembered without out: this call's goes in
        plan = plan._replace(out=out)
    if arrays.requires_grad(x):  # differentiable: the same MPI calls, inside an autograd.Function
        from .autograd import gather_autograd  # imports torch

        return gather_autograd(x, plan)
    return gather_kernel(x, plan)


def _gather_plan(x: Any, dim: int, domain: Domain, check: bool, out: Any, transport: str, received: Any = None) -> _Gather:
    comm = domain.comm

    def local() -> Local:
        blocks.check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)
        info = arrays.describe(x)
        axis = normalize_dim(dim, len(info.shape))
        rest = info.shape[:axis] + info.shape[axis + 1 :]
        out_rows = None if out is None else _check_out(out, info, axis)
        if transport == "torch":
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        calls = (transport, math.prod(info.shape[:axis]), math.prod(info.shape[axis + 1 :]) * info.itemsize, out_rows)
        outs = None if out is None else arrays.describe(out)
        return Local((info, axis, outs), calls, (info.kind, info.dtype, info.device_type, len(info.shape), rest, axis), info.shape[axis])

    def explain(locals_: list[Local]) -> None:  # name each rank's shard (and out) when they do not fit
        check_bands_fit("gather_tensor", [loc.plan[:2] for loc in locals_], ("dim",), comm)
        outs = [loc.plan[2] for loc in locals_]
        if any((o is None) != (outs[0] is None) or (o is not None and o.shape != outs[0].shape) for o in outs):
            detail = ", ".join(f"rank {r}: " + ("None" if o is None else f"{o.kind} {o.dtype} {o.shape}") for r, o in enumerate(outs))
            raise ValueError(f"gather_tensor: out must have the gathered shape on every rank (or None on every rank); got {detail}")

    def finish(plan: tuple, sizes: list[int]) -> _Gather:
        info, axis, _ = plan
        if out is not None:  # out's rows are agreed (a call argument): every rank raises alike
            _check_out(out, info, axis, sum(sizes))
        # remembered without out (the cache must not keep a caller's array alive): gather_tensor puts it in
        return _Gather(comm, info, axis, sizes, domain.rank, None, transport, domain.manager)

    # The same call shape as last time skips the local checks and the planning, never the agreement.
    key = _call_key(x, dim, out, transport)
    return agree_cached(comm, "gather_tensor", key, local, finish, check=check, explain=explain, received=received)


def _call_key(x: Any, dim: Any, out: Any, transport: Any) -> tuple | None:
    """What decides ``_gather_plan``'s local part on this rank, or None (not remembered: device arrays, torch transport).

    With ``out=``, the output's description, contiguity and writability are
    part of the key: another output that passes the same checks reuses the plan.
    """
    array = arrays.cache_key(x)
    if array is None or transport != "mpi":
        return None
    target = None if out is None else arrays.out_cache_key(out)
    if out is not None and target is None:
        return None
    key = (array, type(dim), dim, target)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def gather_kernel(x: Any, p: _Gather) -> Any:
    """Move the bands of an agreed gather (no checks, no autograd): returns the output."""
    shape = _gathered_shape(p.info.shape, p.axis, sum(p.sizes))
    # A new output each call, from memory no live array uses (a loop does not first-touch fresh pages every step).
    out = arrays.pooled_empty(x, shape) if p.out is None else p.out
    if math.prod(shape) == 0:
        return out
    if p.out is not None and arrays.shares_memory(x, out):
        x = rowops.clone(x)  # an in-place gather: MPI forbids aliased send and receive buffers
    if p.transport == "torch":
        from .transport.torch_moves import TorchMoves  # imports torch

        moves.gather_blocks(TorchMoves(p.manager.torch_group("domain")), x, out, Layout.bands(p.sizes), (p.axis,))
    else:
        outer = math.prod(shape[: p.axis])
        row_bytes = math.prod(shape[p.axis + 1 :]) * p.info.itemsize
        x = arrays.contiguous(x)
        send, recv = arrays.host_bytes(x), arrays.host_bytes(out)
        if send is not None and recv is not None:  # host memory: numpy byte views, no staging
            _allgather_rows(p.comm, send, recv, outer, p.sizes, row_bytes)
        else:
            with staging.send_buffer(x, p.comm) as send, staging.recv_buffer(out, p.comm) as recv:
                _allgather_rows(p.comm, send, recv, outer, p.sizes, row_bytes)
    if p.out is not None:
        arrays.mark_written(out)  # autograd sees the write (a tensor it saved is now stale)
    return out




def _allgather_rows(comm: MPI.Comm, send: Any, recv: Any, outer: int, sizes: list[int], row_bytes: int) -> None:
    """All-gather bands of rows: ``send`` is ``(outer, mine, row)``, ``recv`` is ``(outer, total, row)`` bytes.

    Host memory on a domain of at most :data:`~credit_mpi.transport.limits.P2P_RANKS`
    ranks goes point to point (:func:`_gather_p2p`). Otherwise two
    strategies, chosen by the size of one outer slice of the output (in
    one slice the bands of all ranks are contiguous, in rank order):

    * large slices (or a single one): a plain ``Iallgather(v)`` per slice
      lands every band straight in its place, at the speed of the raw call,
      with no extra memory (blocking ``Allgather(v)`` calls when the buffers
      are device memory: CUDA-aware Open MPI does not take device pointers
      in non-blocking collectives);
    * small slices: groups of slices (at most :data:`~credit_mpi.transport.limits.PACK_BYTES`) are
      all-gathered rank-major into a scratch buffer with one contiguous
      ``Allgatherv``, then each rank's part is copied into place. Extra
      memory: one group, at most ``PACK_BYTES``.

    A derived datatype in the collective itself (``Allgather`` into a
    resized vector type) places the bands too, but MPICH 5 took 1.1-2.3 x
    the raw call with it; point to point with the same type, 0.7-1.04 x.
    """
    rank, total = comm.Get_rank(), sum(sizes)
    mine, even = sizes[rank], len(set(sizes)) == 1
    slice_bytes = total * row_bytes
    on_device = arrays.in_device_memory(recv)  # a CUDA-aware MPI gets device pointers
    if not on_device and len(sizes) <= limits.P2P_RANKS:
        _gather_p2p(comm, send, recv, outer, sizes, row_bytes)
        return
    if outer == 1 or slice_bytes >= limits.SLICE_BYTES:
        row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            counts = mine if even else (sizes, band_offsets(sizes))
            send_slice = mine * row_bytes
            slices = [
                ([send[p * send_slice : (p + 1) * send_slice], mine, row], [recv[p * slice_bytes : (p + 1) * slice_bytes], counts, row])
                for p in range(outer)
            ]
            if on_device:
                # CUDA-aware Open MPI takes device pointers in blocking collectives only.
                gather = comm.Allgather if even else comm.Allgatherv
                for args in slices:
                    gather(*args)
            else:
                gather = comm.Iallgather if even else comm.Iallgatherv
                MPI.Request.Waitall([gather(*args) for args in slices])
        finally:
            row.Free()
        return
    group = max(1, min(outer, limits.PACK_BYTES // slice_bytes))
    host = isinstance(recv, np.ndarray) and not on_device
    with _scratch(recv, group * slice_bytes, host) as scratch:
        offsets = band_offsets(sizes)
        for first in range(0, outer, group):
            k = min(group, outer - first)
            counts = [k * size * row_bytes for size in sizes]
            displs = [k * offset * row_bytes for offset in offsets]
            mine_bytes = k * mine * row_bytes
            if first and on_device:
                arrays.sync_stream(scratch)  # the copies out of the last group have read scratch
            send_part = [send[first * mine * row_bytes : first * mine * row_bytes + mine_bytes], mine_bytes, MPI.BYTE]
            if even:
                comm.Allgather(send_part, [scratch[: len(sizes) * mine_bytes], mine_bytes, MPI.BYTE])
            else:
                comm.Allgatherv(send_part, [scratch, (counts, displs), MPI.BYTE])
            target = recv[first * slice_bytes : (first + k) * slice_bytes].reshape(k, slice_bytes)
            if even and host:  # one strided copy: rank-major (n, k, band) into slice-major (k, n, band)
                band = mine * row_bytes
                target.reshape(k, len(sizes), band)[...] = scratch[: len(sizes) * k * band].reshape(len(sizes), k, band).transpose(1, 0, 2)
                continue
            for size, offset, displ, count in zip(sizes, offsets, displs, counts, strict=True):
                if count:
                    target[:, offset * row_bytes : (offset + size) * row_bytes] = scratch[displ : displ + count].reshape(k, size * row_bytes)


def _gather_p2p(comm: MPI.Comm, send: Any, recv: Any, outer: int, sizes: list[int], row_bytes: int) -> None:
    """:func:`_allgather_rows` point to point: every band lands straight in its place, no scratch.

    Each rank sends its band to every other rank and receives theirs
    straight into the output; its own band is one strided copy. A band's
    ``outer`` blocks (one per outer slice) travel as one message (a vector
    datatype on the receiving side) when they are small, and as one
    contiguous message each from :data:`~credit_mpi.transport.limits.SLICE_BYTES`
    up (Open MPI moves large contiguous blocks in a single copy, strided
    types through a bounce buffer: 1.3 x slower at 66 MB). Every message
    is posted before one ``Waitall``. Ranks with no rows send and receive
    nothing (every rank knows the agreed ``sizes``, so both sides choose alike).
    """
    rank, n, total = comm.Get_rank(), len(sizes), sum(sizes)
    offsets = band_offsets(sizes)
    slice_bytes = total * row_bytes
    mine = sizes[rank] * row_bytes
    at = offsets[rank] * row_bytes
    recv.reshape(outer, slice_bytes)[:, at : at + mine] = send.reshape(outer, mine)
    if n == 1:
        return
    row = MPI.BYTE.Create_contiguous(row_bytes).Commit()  # counts in rows: far from the 2**31 limit of int counts
    bands: dict[int, MPI.Datatype] = {}
    try:
        requests = []
        for peer, size in enumerate(sizes):
            if peer == rank or not size:
                continue
            first = offsets[peer] * row_bytes
            if _block_messages(outer, size * row_bytes):
                block = size * row_bytes
                requests += [
                    comm.Irecv([recv[first + p * slice_bytes : first + p * slice_bytes + block], size, row], peer, limits.TAG_GATHER)
                    for p in range(outer)
                ]
                continue
            if size not in bands:
                bands[size] = row.Create_vector(outer, size, total).Commit()
            requests.append(comm.Irecv([recv[first:], 1, bands[size]], peer, limits.TAG_GATHER))
        if mine:
            if _block_messages(outer, mine):  # as every receiver of my band expects it
                messages = [[send[p * mine : (p + 1) * mine], sizes[rank], row] for p in range(outer)]
            else:
                messages = [[send, outer * sizes[rank], row]]
            requests += [comm.Isend(message, peer, limits.TAG_GATHER) for peer in range(n) if peer != rank for message in messages]
        MPI.Request.Waitall(requests)
    finally:
        for band in bands.values():
            band.Free()
        row.Free()


def _block_messages(outer: int, block_bytes: int) -> bool:
    """A band moves as one contiguous message per outer slice (else as one message): the sender's and every receiver's rule."""
    return outer > 1 and block_bytes >= limits.SLICE_BYTES


_SCRATCH: dict = {}  # "bytes": one host scratch buffer of the packed gathers, grown as needed
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _scratch(like: Any, nbytes: int, host: bool) -> Iterator[Any]:
    """``nbytes`` of scratch of ``like``'s kind: on the host one buffer kept across calls (a second thread gets a new one)."""
    if not host or not _SCRATCH_LOCK.acquire(blocking=False):
        yield arrays.empty(like, (nbytes,))
        return
    try:
        buf = _SCRATCH.get("bytes")
        if buf is None or buf.size < nbytes:
            _SCRATCH.pop("bytes", None)
            buf = _SCRATCH["bytes"] = np.empty(nbytes, dtype=np.uint8)
        yield buf[:nbytes]
    finally:
        _SCRATCH_LOCK.release()


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
    if _grid_call(manager, spatial_dims_5d, spatial_dims_4d):  # (lat, lon) pairs: blocks of the 2-D grid
        return blocks.shard_batch_2d(batch, dims, manager, uneven, collective, transport)
    domain = domain_of(manager)
    if domain.size <= 1:
        check_transport(transport)
        return batch

    def local() -> Local:
        blocks.check_line(domain, spatial_dims_5d)  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)  # inside the agreement: a bad transport on one rank is every rank's error
        if transport == "torch":
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        bands = {}
        for key, value in batch.items():
            if arrays.is_array(value) and value.ndim in dims:
                try:
                    info = arrays.describe(value)
                    axis = normalize_dim(dims[value.ndim], value.ndim)
                    bands[key] = (info, axis, band_sizes(info.shape[axis], domain.size, uneven, dim=dims[value.ndim]))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{exc} (in batch[{key!r}])") from None
        same = tuple((key, info.kind, info.shape, info.dtype, info.device_type, axis) for key, (info, axis, _) in bands.items())
        return Local(bands, (uneven, transport), same)

    bands = _agree(domain, "shard_batch", local, _different_arrays("shard_batch")) if collective else local().plan
    sharded = dict(batch)
    for key, (_, axis, sizes) in bands.items():
        sharded[key] = arrays.narrow(batch[key], axis, Layout.bands(sizes).start(domain.rank), sizes[domain.rank])
    return sharded


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
    if _grid_call(manager, dim):  # a (lat, lon) pair: blocks of the 2-D domain grid
        return blocks.scatter_tensor_2d(x, dim, manager, root, uneven)
    domain = domain_of(manager)
    if domain.size <= 1:
        return x
    comm, n, rank = domain.comm, domain.size, domain.rank

    def local() -> Local:
        blocks.check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        check_root(root, n)
        plan = None
        if rank == root:
            info = arrays.describe(x)
            axis = normalize_dim(dim, len(info.shape))
            plan = (info, arrays.dtype_of(x), axis, band_sizes(info.shape[axis], n, uneven, dim=dim))
        return Local(plan, (root, uneven))

    def explain(locals_: list[Local]) -> None:
        detail = ", ".join(f"rank {r}: root={loc.calls[0]}, uneven={loc.calls[1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"scatter_tensor: ranks of the domain group passed different roots or uneven ({detail})")

    plan = _agree(domain, "scatter_tensor", local, explain)
    # Every rank agreed on the root, which described the array: it tells the
    # others (the dtype itself travels, so record dtypes work on every rank).
    info, dtype, axis, sizes = comm.bcast(plan, root=root)
    shape = list(info.shape)
    shape[axis] = sizes[rank]
    out = arrays.empty(x, shape) if rank == root else arrays.empty_described(info, shape, dtype)
    outer = math.prod(shape[:axis])
    row_bytes = math.prod(shape[axis + 1 :]) * info.itemsize
    if outer * row_bytes * info.shape[axis] == 0:
        return out
    recv_type, send_type = row_datatypes(outer, sizes[rank], info.shape[axis], row_bytes)
    try:
        with staging.recv_buffer(out, comm) as recv:
            if rank == root:
                with staging.send_buffer(arrays.contiguous(x), comm) as send:
                    comm.Scatterv([send, (sizes, band_offsets(sizes)), send_type], [recv, sizes[rank], recv_type], root)
            else:
                comm.Scatterv(None, [recv, sizes[rank], recv_type], root)
    finally:
        send_type.Free()
        recv_type.Free()
    return out


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


def _agree(domain: Domain, operation: str, local, explain):
    """The plan this rank agreed on with the rest of its domain group."""
    return agree(domain.comm, operation, local, explain=explain)[0]


def _different_arrays(what: str):
    """``explain`` for the sharding calls: name each rank's array(s)."""

    def explain(locals_: list[Local]) -> None:
        summaries = [_summary(loc.plan) for loc in locals_]
        if len(set(summaries)) == 1:
            return  # the same arrays and dims, different calls (uneven, transport): agree's DomainParallelError names them
        detail = "; ".join(f"rank {r}: {summary}" for r, summary in enumerate(summaries))
        raise ValueError(f"{what}: ranks of the domain group passed different arrays ({detail})")

    return explain


def _summary(plan) -> str:
    if isinstance(plan, dict):
        return "{" + ", ".join(f"{k!r}: {_summary(v)}" for k, v in plan.items()) + "}"
    info, axis = plan[0], plan[1]
    return f"{info.kind} {info.dtype} {info.shape} on {info.device} dim {axis}"


def _gathered_shape(shape: tuple, axis: int, total: int) -> tuple:
    return shape[:axis] + (total,) + shape[axis + 1 :]


def _check_out(out: Any, info: arrays.ArrayInfo, axis: int, total: int | str = "all the bands' rows") -> int:
    """This rank's ``out`` must fit the gather (every dim but ``axis``, and ``total`` rows when known); its rows."""
    o = arrays.describe(out)
    rest = info.shape[:axis] + info.shape[axis + 1 :]
    fits = o.same_kind(info) and len(o.shape) == len(info.shape) and o.shape[:axis] + o.shape[axis + 1 :] == rest
    if not fits or not arrays.is_contiguous(out) or (isinstance(total, int) and o.shape[axis] != total):
        raise ValueError(
            f"gather_tensor: out must be a C-contiguous {info.kind} {info.dtype} array of shape "
            f"{_gathered_shape(info.shape, axis, total)} on {info.device_type}, got {o.kind} {o.dtype} "
            f"{o.shape} on {o.device}" + ("" if arrays.is_contiguous(out) else " (non-contiguous)")
        )
    arrays.check_writable(out, "gather_tensor's out")
    return o.shape[axis]


def _copy_into(out: Any, x: Any, dim: int) -> Any:
    """The one-rank gather into ``out``: a checked copy."""
    info = arrays.describe(x)
    axis = normalize_dim(dim, len(info.shape))
    _check_out(out, info, axis, info.shape[axis])
    if not arrays.shares_memory(x, out) or x.shape != out.shape:
        rowops.copy_rows(out, 0, 0, x)
    arrays.mark_written(out)
    return out
