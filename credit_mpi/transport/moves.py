"""One transport protocol, and the edge swap and the gather written once against it.

A transport (a *moves* object) does these things on whole arrays of bytes:

* ``post(ops)``: post every point-to-point message of ``ops`` (each
  ``(SEND or RECV, array, peer, tag)``, peers are ranks of the domain
  group) and return a handle whose ``wait()`` completes them (the caller
  may compute in between: the ring attention); ``exchange(ops)`` is both at
  once. The order of ``ops`` is the same on every rank for the same
  algorithm, which is what a transport that matches messages in issue
  order (NCCL) needs; MPI matches by tag.
* ``allgatherv(send, recv, counts, displs)``: every rank's ``send`` bytes at
  ``displs[r]`` of every rank's ``recv``;
* ``alltoallv(send, send_counts, recv, recv_counts)``: ``send_counts[r]``
  bytes to rank ``r`` and ``recv_counts[r]`` from it, both packed in rank
  order (the all-to-all of heads, the row moves of re-banding, the roll and
  the group layout);
* ``allgather_slices(send, recv, outer)``: the gather of equal bands
  straight into place (False: not this way);
* ``allreduce(send, recv)``: every rank's typed ``send`` summed into
  ``recv`` (the one reduction: the sum over the ranks).

:class:`MpiMoves` moves over an MPI communicator: host memory as numpy byte
views in place (the fast path: no staging, packed copies of strided views
in buffers it keeps), device memory through :mod:`~credit_mpi.transport.staging`
(or straight from device pointers with a CUDA-aware MPI).
:class:`credit_mpi.transport.torch_moves.TorchMoves` moves over a
torch.distributed group. An algorithm written against the protocol, such
as :func:`swap_edges` (the halo exchange's edge rows, forward and backward,
1-D and 2-D), :func:`gather_blocks` (the 2-D gather, and the bands' over
torch) or the ops that take a communicator (:func:`transport_name`,
:func:`transport_of`), works over both.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import arrays, rowops, staging
from .limits import SLICE_BYTES, TAG_DOWN, TAG_UP

__all__ = ["SEND", "RECV", "MpiMoves", "Posted", "transport_name", "transport_of", "swap_edges", "post_edges", "gather_blocks"]

SEND, RECV = "send", "recv"


class MpiMoves:
    """The protocol over the MPI communicator ``comm`` (see the module docstring).

    Packed copies of strided host views live in buffers this object keeps
    (one set, taken under a lock: a second thread using the same object at
    the same time gets new ones), so a plan that keeps its ``MpiMoves``
    reuses them call after call.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self._scratch: dict = {}
        self._lock = threading.Lock()

    def exchange(self, ops: Sequence[tuple[str, Any, int, int]]) -> None:
        """Post every receive, then every send of ``ops`` (``Irecv``/``Isend``), and one ``Waitall``."""
        if ops:
            _finish(*self._start(ops))  # (no Posted in between: the halo's per-call path)

    def post(self, ops: Sequence[tuple[str, Any, int, int]]) -> Posted:
        """Post every receive, then every send of ``ops``; the returned :class:`Posted` waits for them.

        Between the two the caller may compute (the ring attends one band
        while the next travels); it must not write a sent array or read a
        received one before ``wait()``.
        """
        return Posted(self._start(ops))

    def _start(self, ops: Sequence[tuple[str, Any, int, int]]) -> tuple:
        """Post ``ops``: ``(requests, unpack, staging contexts or None, the kept buffers' lock or None)`` for :func:`_finish`."""
        mine = self._lock.acquire(blocking=False)
        scratch = self._scratch if mine else {}
        stack = wait = None  # staging contexts of device arrays (host arrays need none); the exchange's one wait
        comm, byte = self.comm, MPI.BYTE
        requests, sends, unpack = [], [], []  # unpack: (target, kept buffer), strided host receives
        try:
            for i, (kind, x, peer, tag) in enumerate(ops):
                if type(x) is np.ndarray:  # the fast path: host memory, in place or through a kept buffer
                    if x.flags.c_contiguous:
                        buf = x
                    else:
                        buf = scratch.get(i)
                        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                            buf = scratch[i] = np.empty(x.shape, x.dtype)
                        if kind == SEND:
                            buf[...] = x
                        else:
                            unpack.append((x, buf))
                else:  # its adapter looked up once for its questions
                    adapter = arrays.adapter(x)
                    data = adapter.contiguous(x) if kind == SEND else x
                    buf = arrays.host_bytes(data, adapter)  # a torch CPU tensor's bytes, in place
                    if buf is None:  # device memory
                        if stack is None:
                            stack, wait = contextlib.ExitStack(), staging.Wait()
                        move = staging.send_buffer if kind == SEND else staging.recv_buffer
                        buf = stack.enter_context(move(data, comm, adapter=adapter, wait=wait))
                if kind == RECV:
                    requests.append(comm.Irecv([buf, byte], peer, tag))
                else:
                    sends.append((buf, peer, tag))
            for buf, peer, tag in sends:
                requests.append(comm.Isend([buf, byte], peer, tag))
        except BaseException:
            _finish([], [], stack, self._lock if mine else None)  # the release alone
            raise
        return requests, unpack, stack, self._lock if mine else None

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        """``Allgatherv`` of byte buffers (host or device, as staging routes them)."""
        if type(send) is np.ndarray and type(recv) is np.ndarray and send.flags.c_contiguous and recv.flags.c_contiguous:
            self.comm.Allgatherv([send, MPI.BYTE], [recv, (list(counts), list(displs)), MPI.BYTE])  # host: as they are
            return
        with self._buffers(send, recv) as (s, r):
            self.comm.Allgatherv([s, MPI.BYTE], [r, (list(counts), list(displs)), MPI.BYTE])

    def alltoallv(self, send: Any, send_counts: Sequence[int], recv: Any, recv_counts: Sequence[int]) -> None:
        """``send_counts[r]`` bytes of contiguous ``send`` to rank ``r``, packed in rank order; from rank ``r``
        ``recv_counts[r]`` bytes into ``recv``, packed likewise (one ``Alltoallv``; host, staged or CUDA-aware)."""
        with self._buffers(send, recv) as (s, r):  # (no displacements: mpi4py packs the parts in rank order)
            self.comm.Alltoallv([s, list(send_counts), MPI.BYTE], [r, list(recv_counts), MPI.BYTE])

    def allgather_slices(self, send: Any, recv: Any, outer: int) -> bool:
        """Slice ``p`` of every rank's ``send`` (viewed as ``outer`` equal slices of bytes) into slice ``p`` of ``recv``, rank after rank.

        All slices in flight at once (``Iallgather``; blocking ``Allgather``
        calls for device memory, which CUDA-aware Open MPI takes in blocking
        collectives only). Returns True (MPI can always land them in place).
        """
        with self._buffers(send, recv) as (s, r):
            mine, whole = len(s) // outer, len(r) // outer
            slices = [([s[p * mine : (p + 1) * mine], MPI.BYTE], [r[p * whole : (p + 1) * whole], MPI.BYTE]) for p in range(outer)]
            if arrays.in_device_memory(r):
                for args in slices:
                    self.comm.Allgather(*args)
            else:
                MPI.Request.Waitall([self.comm.Iallgather(*args) for args in slices])
        return True

    @contextlib.contextmanager
    def _buffers(self, send: Any, recv: Any) -> Iterator[tuple[Any, Any]]:
        """The byte buffers MPI reads ``send`` from and writes ``recv`` through (each array's adapter looked up once).

        Host memory: numpy byte views in place (no staging); device memory
        through :mod:`~credit_mpi.transport.staging` (staged or CUDA-aware).
        """
        a, b = arrays.adapter(send), arrays.adapter(recv)
        send = a.contiguous(send)
        s, r = arrays.host_bytes(send, a), arrays.host_bytes(recv, b)
        if s is not None and r is not None:
            yield s, r
            return
        wait = staging.Wait()  # one wait for the producing stream, for both buffers
        with staging.send_buffer(send, self.comm, a, wait) as s, staging.recv_buffer(recv, self.comm, adapter=b, wait=wait) as r:
            yield s, r

    def allreduce(self, send: Any, recv: Any) -> None:
        """``recv`` = every rank's ``send`` summed (one ``Allreduce``; the same shape and dtype on every rank).

        Host numpy arrays go to MPI as they are; other arrays as the byte
        buffers of :meth:`_buffers` (host views, device pointers to a
        CUDA-aware MPI, or staged) typed with the arrays' MPI datatype: the
        sum needs it. The order of the additions is MPI's.
        """
        if type(send) is np.ndarray and type(recv) is np.ndarray and send.flags.c_contiguous:
            self.comm.Allreduce(send, recv)
            return
        datatype = arrays.mpi_datatype(send)
        with self._buffers(send, recv) as (s, r):
            self.comm.Allreduce([s, datatype], [r, datatype])


class Posted:
    """Messages :meth:`MpiMoves.post` put in flight: :meth:`wait` completes them (received data then in place)."""

    __slots__ = ("_state",)

    def __init__(self, state: tuple) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for every message, then copy the received data into place (staged device data after the wait)."""
        _finish(*self._state)


def _finish(requests: list, unpack: list, stack: contextlib.ExitStack | None, lock: threading.Lock | None) -> None:
    """Wait for posted messages (none: only the release), unpack strided host receives, close the staging
    (copies back) and release the lock."""
    try:
        if requests:
            MPI.Request.Waitall(requests)
        for dst, src in unpack:
            dst[...] = src
    finally:
        if stack is not None:
            stack.close()  # received device data copied back (after Waitall)
        if lock is not None:
            lock.release()


_PROTOCOL = ("post", "exchange", "allgatherv", "alltoallv", "allreduce")


def transport_name(transport: Any, path: str) -> str:
    """``"mpi"``, or the class name of a transport object (what the ranks agree on); ValueError for anything else.

    The ops that take a communicator take ``transport="mpi"`` (an
    :class:`MpiMoves` over it) or a transport object whose peers are the
    communicator's ranks, e.g. ``TorchMoves(manager.torch_group("domain"))``.
    """
    if isinstance(transport, str) and transport == "mpi":
        return "mpi"
    if not isinstance(transport, str) and all(callable(getattr(transport, m, None)) for m in _PROTOCOL):
        return type(transport).__name__
    raise ValueError(f"{path}: transport={transport!r} is not a transport; give 'mpi' or a transport object over "
                     f"the same ranks (credit_mpi.transport.torch_moves.TorchMoves(manager.torch_group('domain')))")


def transport_of(transport: Any, comm: MPI.Comm) -> Any:
    """The moves object of an agreed ``transport`` (:func:`transport_name`): ``"mpi"`` -> an :class:`MpiMoves` over ``comm``."""
    return MpiMoves(comm) if isinstance(transport, str) else transport


def swap_edges(moves: Any, up: Any, down: Any, prev: int | None, nxt: int | None,
               tags: tuple[int, int] = (TAG_UP, TAG_DOWN), into: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:
    """Send ``up`` to rank ``prev`` and ``down`` to ``nxt``; return ``(from_next, from_prev)``.

    The one edge swap of the halo exchange (1-D bands, each phase of the 2-D
    grid, forward and backward). ``up`` is None exactly when ``prev`` is,
    ``down`` when ``nxt`` is (None: no neighbour on that side). What ``nxt``
    sent up and what ``prev`` sent down land in ``into`` (arrays of the
    edges' shape, e.g. views of the output) or in new arrays of the edges'
    kind and shape, and are returned (None without that neighbour). The
    four messages go in one round, in the same order on every rank; the
    tags tell the two directions apart when ``prev`` and ``nxt`` are the
    same rank (two ranks with a periodic boundary).
    """
    ops, from_next, from_prev = _edge_ops(up, down, prev, nxt, tags, into)
    moves.exchange(ops)
    return from_next, from_prev


def post_edges(moves: Any, up: Any, down: Any, prev: int | None, nxt: int | None,
               tags: tuple[int, int] = (TAG_UP, TAG_DOWN), into: tuple[Any, Any] = (None, None)) -> tuple[Posted, Any, Any]:
    """:func:`swap_edges` in flight: ``(posted, from_next, from_prev)``; the received edges hold their data once
    ``posted.wait()`` returns (compute in between, neither writing ``up`` / ``down`` nor reading the others)."""
    ops, from_next, from_prev = _edge_ops(up, down, prev, nxt, tags, into)
    return moves.post(ops), from_next, from_prev


def _edge_ops(up: Any, down: Any, prev: int | None, nxt: int | None, tags: tuple[int, int], into: tuple[Any, Any]):
    """The messages of one edge swap (in the same order on every rank) and the arrays the edges land in."""
    like = up if up is not None else down
    from_next = from_prev = None
    ops = []
    if prev is not None:
        ops.append((SEND, up, prev, tags[0]))
    if nxt is not None:
        from_next = into[0] if into[0] is not None else arrays.empty(like, like.shape)
        ops += [(RECV, from_next, nxt, tags[0]), (SEND, down, nxt, tags[1])]
    if prev is not None:
        from_prev = into[1] if into[1] is not None else arrays.empty(like, like.shape)
        ops.append((RECV, from_prev, prev, tags[1]))
    return ops, from_next, from_prev


def gather_blocks(moves: Any, x: Any, out: Any, layout: Any, axes: tuple[int, ...]) -> Any:
    """Fill ``out`` with every rank's block of ``x`` (its part of ``layout`` along ``axes``); returns ``out``.

    The gather written against the protocol. Bands of equal rows land
    straight in place, one outer slice (the dimensions before the axis) at a
    time, all in flight (``allgather_slices``: in one slice of ``out`` the
    bands of all ranks are contiguous, in rank order), when there is one
    slice or the slices are large (:data:`~credit_mpi.transport.limits.SLICE_BYTES`).
    Otherwise one ``allgatherv`` of every rank's contiguous block bytes into
    a rank-major buffer, then each block copied into its place (one extra
    copy of the field). Bands are a layout of one split axis, blocks of two.
    ``out`` has the global shape.
    """
    adapter = arrays.adapter(x)
    x = adapter.contiguous(x)
    itemsize = adapter.describe(x).itemsize
    if len(axes) == 1 and _straight(moves, x, out, layout.sizes[0], axes[0], itemsize):
        return out
    pieces, total = _pieces(layout, tuple(x.shape), tuple(axes))
    packed = arrays.pooled_empty(x, (total,), adapter)  # dropped below: its pages serve the next call
    moves.allgatherv(x, packed, [c * itemsize for _, _, c, _ in pieces], [s * itemsize for _, s, c, _ in pieces])
    for shape, start, count, place in pieces:
        if not count:
            continue
        target = out
        for axis, first, size in place[:-1]:
            target = rowops.band(target, axis, first, size)
        rowops.copy_rows(target, place[-1][0], place[-1][1], adapter.narrow(packed, 0, start, count).reshape(shape))
    return out


@functools.lru_cache(maxsize=256)
def _pieces(layout: Any, shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[tuple, int]:
    """Every rank's block of :func:`gather_blocks`: ``(shape, start, count, ((axis, first, size), ...))`` in the packed buffer, and its length.

    From the layout alone (remembered: a repeated gather asks the layout nothing).
    """
    pieces, start = [], 0
    for rank in range(math.prod(layout.grid)):
        block = layout.block(rank)
        piece = list(shape)
        for axis, (_, size) in zip(axes, block, strict=True):
            piece[axis] = size
        count = math.prod(piece)
        place = tuple((axis, first, size) for axis, (first, size) in zip(axes, block, strict=True))
        pieces.append((tuple(piece), start, count, place))
        start += count
    return tuple(pieces), start


def _straight(moves: Any, x: Any, out: Any, sizes: tuple[int, ...], axis: int, itemsize: int) -> bool:
    """Gather equal bands straight into ``out``, slice by slice (see :func:`gather_blocks`); False: not this way."""
    shape = tuple(out.shape)
    outer = math.prod(shape[:axis])
    if len(set(sizes)) != 1 or not (outer == 1 or math.prod(shape[axis:]) * itemsize >= SLICE_BYTES):
        return False
    return moves.allgather_slices(x, out, outer)
