"""The gather: every rank's band (1-D) or block (2-D) joined into the global field, on every rank.

One op of :mod:`credit_mpi.engine` in two forms, each with its own
operation code (so that a rank that passed a single dim and one that passed
a pair meet in one ``Allgather`` and every rank raises):

* bands (``dim`` one int), :class:`GatherBands`: host arrays on domains of
  up to :data:`~credit_mpi.transport.limits.P2P_RANKS` ranks point to
  point, every band received straight into place; otherwise a contiguous
  ``Iallgather(v)`` per outer slice for large fields and packed groups of
  at most :data:`~credit_mpi.transport.limits.PACK_BYTES` copied into place
  for small ones (strategies of one kernel, chosen from the agreed plan);
  ``transport="torch"``: :func:`credit_mpi.transport.moves.gather_blocks`;
* blocks of the 2-D domain grid (``dim`` a pair), :class:`GatherBlocks`:
  :func:`~credit_mpi.transport.moves.gather_blocks` over MPI or torch (one
  ``Allgatherv`` of the contiguous blocks into a pooled buffer, then each
  copied into place: on MPICH an ``Alltoallw`` of subarray types landing
  every block in place moved the same bytes 1.3-1.6 times slower, see
  ``benchmarks/bench_percall.py``'s ``gather 2d``).

Both are differentiable with a local adjoint (``Shard -> Replicate``: the
gradient of the gathered field is taken to be replicated, the backward is
this rank's slice of it, no communication), take ``out=`` (marked dirty
for autograd) and are remembered per call shape by the engine. The public
function is :func:`credit_mpi.gather_tensor` (:mod:`credit_mpi.sharding`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import layout
from ..blocks import block_table, check_line, encode_block, grid_comm, normalize_dims
from ..engine import Op
from ..grid import grid_coords, grid_of
from ..layout import Layout
from ..manager import domain_of
from ..partition import normalize_dim
from ..transport import arrays, limits, moves, rowops, staging
from ..validation import Local, check_bands_fit, check_transport

__all__ = ["GatherBands", "GatherBlocks", "BANDS", "BLOCKS", "gather_kernel", "gather2d_kernel", "check_out", "allgather_rows"]


class _Gather(NamedTuple):
    """What every rank agreed on before a gather of bands moves data."""

    comm: MPI.Comm
    info: arrays.ArrayInfo
    axis: int
    sizes: list  # every rank's rows along axis
    rank: int
    out: Any  # the output array, or None (allocated by the gather)
    transport: str
    manager: Any
    # what the kernel reads each call, worked out once from the agreed values above
    shape: tuple  # the gathered array's
    outer: int  # product of the dimensions before axis
    row_bytes: int  # bytes of one row along axis
    offsets: list  # every rank's first row along axis


class _Gathers(Op):
    """What both forms share: ``out=`` bound per call and marked dirty, the local adjoint, the cache key."""

    local_adjoint = True  # Shard <- Replicate: this rank's part of the replicated gradient

    def key(self, x: Any, args: dict) -> tuple | None:
        """What decides ``local()`` on this rank, or None (not remembered: device arrays, torch transport).

        With ``out=``, the output's description, contiguity and writability are
        part of the key: another output that passes the same checks reuses the plan.
        """
        array = arrays.cache_key(x)
        out, dim = args["out"], args["dim"]
        if array is None or args["transport"] != "mpi":
            return None
        target = None if out is None else arrays.out_cache_key(out)
        if out is not None and target is None:
            return None
        key = (array, type(dim), dim if not isinstance(dim, list) else tuple(dim), target)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def bind(self, plan: Any, args: dict) -> Any:
        # remembered without out (the cache must not keep a caller's array alive): this call's goes in
        return plan if args["out"] is None else plan._replace(out=args["out"])

    def written(self, plan: Any) -> Any:
        return plan.out


class GatherBands(_Gathers):
    """The gather of latitude bands along one dim."""

    name = "gather_tensor"

    def local(self, x: Any, args: dict) -> Local:
        dim, out, transport = args["dim"], args["out"], args["transport"]
        domain = domain_of(args["manager"])
        check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)
        info = arrays.describe(x)
        axis = normalize_dim(dim, len(info.shape))
        rest = info.shape[:axis] + info.shape[axis + 1 :]
        out_rows = None if out is None else check_out(out, info, axis)
        if transport == "torch":
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        calls = (transport, math.prod(info.shape[:axis]), math.prod(info.shape[axis + 1 :]) * info.itemsize, out_rows)
        outs = None if out is None else arrays.describe(out)
        same = (info.kind, info.dtype, info.device_type, len(info.shape), rest, axis)
        return Local((info, axis, outs), calls, same, info.shape[axis])

    def explain_on(self, locals_: list[Local], comm: MPI.Comm) -> None:  # name each rank's shard (and out) when they do not fit
        check_bands_fit("gather_tensor", [loc.plan[:2] for loc in locals_], ("dim",), comm)
        outs = [loc.plan[2] for loc in locals_]
        if any((o is None) != (outs[0] is None) or (o is not None and o.shape != outs[0].shape) for o in outs):
            detail = ", ".join(f"rank {r}: " + ("None" if o is None else f"{o.kind} {o.dtype} {o.shape}") for r, o in enumerate(outs))
            raise ValueError(f"gather_tensor: out must have the gathered shape on every rank (or None on every rank); got {detail}")

    def plan(self, mine: tuple, sizes: list[int], comm: MPI.Comm, args: dict) -> _Gather:
        info, axis, _ = mine
        domain = domain_of(args["manager"])
        if args["out"] is not None:  # out's rows are agreed (a call argument): every rank raises alike
            check_out(args["out"], info, axis, sum(sizes))
        shape = _gathered_shape(info.shape, axis, sum(sizes))
        return _Gather(comm, info, axis, sizes, domain.rank, None, args["transport"], domain.manager, shape,
                       math.prod(shape[:axis]), math.prod(shape[axis + 1 :]) * info.itemsize, layout.offsets(sizes))

    def adjoint(self, grad: Any, p: _Gather) -> Any:
        """This rank's rows of the gathered (replicated) gradient: no communication."""
        return grad.narrow(p.axis, Layout.bands(p.sizes).start(p.rank), p.sizes[p.rank])


class Gather2d(NamedTuple):
    """What every rank agreed on before a 2-D gather moves data."""

    comm: MPI.Comm
    info: arrays.ArrayInfo
    ay: int
    ax: int
    grid: tuple[int, int]
    heights: list  # rows of each grid row
    widths: list  # columns of each grid column
    rank: int
    out: Any
    moves: Any = None  # the transport the blocks move on (MpiMoves, or TorchMoves for transport="torch")

    @property
    def shape(self) -> tuple:
        shape = list(self.info.shape)
        shape[self.ay], shape[self.ax] = sum(self.heights), sum(self.widths)
        return tuple(shape)

    @property
    def start(self) -> tuple[int, int]:
        """This rank's first (row, column) in the global field."""
        (y0, _), (x0, _) = Layout((tuple(self.heights), tuple(self.widths))).block(self.rank)
        return y0, x0



class GatherBlocks(_Gathers):
    """The gather of the blocks of a 2-D domain grid (``dim`` a pair); agreed on the domain communicator."""

    name = "gather_tensor/2d"

    def local(self, x: Any, args: dict) -> Local:
        dim, out, transport = args["dim"], args["out"], args["transport"]
        domain = domain_of(args["manager"])
        check_transport(transport)
        if transport == "torch" and domain.size > 1:
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        info = arrays.describe(x)
        ay, ax = normalize_dims(dim, len(info.shape))
        out_shape = None
        if out is not None:
            o = arrays.describe(out)
            if not o.same_kind(info) or len(o.shape) != len(info.shape) or not arrays.is_contiguous(out):
                raise ValueError(f"gather_tensor: out must be a C-contiguous {info.kind} {info.dtype} array with "
                                 f"{len(info.shape)} dims on {info.device_type}, got {o.kind} {o.dtype} {o.shape} on {o.device}")
            arrays.check_writable(out, "gather_tensor's out")
            out_shape = o.shape
        rest = tuple(s for i, s in enumerate(info.shape) if i not in (ay, ax))
        calls = ("2d", ay, ax, len(info.shape), rest, info.itemsize, transport, out_shape)
        return Local((info, ay, ax), calls, (info.kind, info.dtype, info.device_type), encode_block(info.shape, ay, ax))

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: {loc.plan[0].kind} {loc.plan[0].dtype} {loc.plan[0].shape} dims {loc.calls[1:3]}, "
                           f"out {loc.calls[-1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"gather_tensor: the blocks do not fit together (same kind, dtype, dims, every dim but the "
                         f"two grid dims, and out's shape on every rank): {detail}")

    def plan(self, mine: tuple, counts: list[int], comm: MPI.Comm, args: dict) -> Gather2d:
        info, ay, ax = mine
        domain = domain_of(args["manager"])
        grid = grid_of(domain.manager, domain.size)
        heights, widths = block_table(counts, grid, "gather_tensor", ay, ax)
        comm = grid_comm(domain)
        if args["transport"] == "torch" and domain.size > 1:
            from ..transport.torch_moves import TorchMoves  # imports torch

            transfer = TorchMoves(domain.manager.torch_group("domain"))
        else:  # packed: one Allgatherv of the contiguous blocks, then each copied into place (MPICH's subarray
            transfer = moves.MpiMoves(comm)  # Alltoallw moved the same bytes 2-3 times slower: bench_percall 'gather 2d')
        plan = Gather2d(comm, info, ay, ax, grid, heights, widths, domain.rank, None, transfer)
        out = args["out"]
        if out is not None and tuple(out.shape) != plan.shape:  # out's shape is agreed: every rank raises alike
            raise ValueError(f"gather_tensor: out has shape {tuple(out.shape)}, the gathered field {plan.shape}")
        return plan

    def kernel(self, x: Any, plan: Gather2d) -> Any:
        return gather2d_kernel(x, plan)

    def adjoint(self, grad: Any, p: Gather2d) -> Any:
        """This rank's block of the gathered (replicated) gradient: no communication."""
        (y0, x0), (row, col) = p.start, grid_coords(p.rank, p.grid)
        return grad.narrow(p.ay, y0, p.heights[row]).narrow(p.ax, x0, p.widths[col])




def gather_kernel(x: Any, p: _Gather) -> Any:
    """Move the bands of an agreed gather (no checks, no autograd): returns the output."""
    shape = p.shape
    adapter = arrays.adapter(x)  # x's library, looked up once (out is of its kind: agreed)
    # A new output each call, from memory no live array uses (a loop does not first-touch fresh pages every step).
    out = arrays.pooled_empty(x, shape, adapter) if p.out is None else p.out
    if math.prod(shape) == 0:
        return out
    if p.out is not None and adapter.shares_memory(x, out):
        x = rowops.clone(x)  # an in-place gather: MPI forbids aliased send and receive buffers
    if p.transport == "torch":
        from ..transport.torch_moves import TorchMoves  # imports torch

        moves.gather_blocks(TorchMoves(p.manager.torch_group("domain")), x, out, Layout.bands(p.sizes), (p.axis,))
    else:
        x = adapter.contiguous(x)
        send, recv = arrays.host_bytes(x, adapter), arrays.host_bytes(out, adapter)
        if send is not None and recv is not None:  # host memory: numpy byte views, no staging
            allgather_rows(p.comm, send, recv, p.outer, p.sizes, p.row_bytes, p.offsets)
        else:
            with staging.send_buffer(x, p.comm, adapter) as send, staging.recv_buffer(out, p.comm, adapter=adapter) as recv:
                allgather_rows(p.comm, send, recv, p.outer, p.sizes, p.row_bytes, p.offsets)
    if p.out is not None:
        adapter.mark_written(out)  # autograd sees the write (a tensor it saved is now stale)
    return out




def allgather_rows(comm: MPI.Comm, send: Any, recv: Any, outer: int, sizes: list[int], row_bytes: int,
                    offsets: list[int] | None = None) -> None:
    """All-gather bands of rows: ``send`` is ``(outer, mine, row)``, ``recv`` is ``(outer, total, row)`` bytes.

    ``offsets``: every rank's first row, ``layout.offsets(sizes)`` (a plan's, worked out once; None: here).

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
    offsets = layout.offsets(sizes) if offsets is None else offsets
    mine, even = sizes[rank], len(set(sizes)) == 1
    slice_bytes = total * row_bytes
    on_device = arrays.in_device_memory(recv)  # a CUDA-aware MPI gets device pointers
    if not on_device and len(sizes) <= limits.P2P_RANKS:
        _gather_p2p(comm, send, recv, outer, sizes, row_bytes, offsets)
        return
    if outer == 1 or slice_bytes >= limits.SLICE_BYTES:
        row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            counts = mine if even else (sizes, offsets)
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


def _gather_p2p(comm: MPI.Comm, send: Any, recv: Any, outer: int, sizes: list[int], row_bytes: int,
                offsets: list[int]) -> None:
    """:func:`allgather_rows` point to point: every band lands straight in its place, no scratch.

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


def gather2d_kernel(x: Any, p: Gather2d) -> Any:
    """Move the blocks of an agreed 2-D gather (no checks, no autograd): returns the global array."""
    shape = p.shape
    out = arrays.pooled_empty(x, shape) if p.out is None else p.out  # as the bands' gather: no first touch per call
    if math.prod(shape) == 0:
        return out
    if p.out is not None and arrays.shares_memory(x, out):
        x = rowops.clone(x)
    moves.gather_blocks(p.moves, x, out, Layout((tuple(p.heights), tuple(p.widths))), (p.ay, p.ax))
    if p.out is not None:
        arrays.mark_written(out)
    return out


def _gathered_shape(shape: tuple, axis: int, total: int) -> tuple:
    return shape[:axis] + (total,) + shape[axis + 1 :]


def check_out(out: Any, info: arrays.ArrayInfo, axis: int, total: int | str = "all the bands' rows") -> int:
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


GatherBands.kernel = staticmethod(gather_kernel)  # the per-call fast path calls the kernel directly
BANDS, BLOCKS = GatherBands(), GatherBlocks()
