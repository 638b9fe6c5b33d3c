"""The halo exchange: a band (1-D) or a block (2-D) padded with its neighbours' edge rows, differentiable.

One op of :mod:`credit_mpi.engine` in two forms with their own operation
codes (a rank that passed a single dim and one that passed pairs meet in
one ``Allgather`` and every rank raises):

* :class:`HaloBands` (``dim`` one int): the one edge swap
  (:func:`credit_mpi.transport.moves.swap_edges`) between latitude
  neighbours, the outer edges filled by the boundary (``zero``,
  ``periodic``, ``reflect``, ``earth``); host numpy bands over MPI take a
  byte-view fast path (:func:`_host_halo`, the pooled output);
* :class:`HaloBlocks` (``dim`` a pair): the two phases of
  :mod:`credit_mpi.halo2d` (latitude within a grid column, with the pole
  fold for ``earth``, then longitude within a grid row, carrying the corners).

The agreement covers the widths, the boundaries, the transport, the bytes
per row, the autograd state (the backward is collective: the halo
gradients go home) and every rank's rows (a halo wider than a band is every
rank's ``ValueError``). Both forms are remembered per call shape by the
engine (device arrays and ``transport="torch"`` are planned each call). The
adjoint (:func:`halo_adjoint`, :func:`credit_mpi.halo2d.halo2d_adjoint`)
sends the halo gradients home and adds them there. The public function is
:func:`credit_mpi.halo_exchange` (:mod:`credit_mpi.halo`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from ..blocks import block_table, check_line, encode_block, grid_comm, normalize_dims
from ..engine import Op
from ..grid import grid_coords, grid_of
from ..halo2d import Plan2d, check_boundaries, check_widths, halo2d_adjoint, halo2d_kernel
from ..manager import domain_of
from ..partition import HALO_BOUNDARIES, check_halo_width, halo_edge_rows, normalize_dim
from ..transport import arrays, moves, rowops
from ..validation import Local, check_bands_fit, check_int, check_transport

__all__ = ["HaloBands", "HaloBlocks", "BANDS", "BLOCKS", "halo_kernel", "halo_adjoint", "check_width", "check_boundary_name"]


class _Halos(Op):
    """What both forms share: the cache key, the adjoint's transport."""

    def key(self, x: Any, args: dict) -> tuple | None:
        """What decides ``local()`` on this rank, or None (not remembered: device arrays, torch transport)."""
        array = arrays.cache_key(x)
        if array is None or args["transport"] != "mpi":
            return None
        w, dim, boundary = args["halo_width"], args["dim"], args["boundary"]
        key = (array, type(w), w, type(dim), dim, type(boundary), boundary)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def backward_calls_mpi(self, plan: Any) -> bool:
        return plan.torch_group is None  # transport="torch" calls no MPI in backward


class HaloBands(_Halos):
    """The exchange of latitude bands along one dim."""

    name = "halo_exchange"

    def local(self, x: Any, args: dict) -> Local:
        halo_width, dim, boundary, transport = args["halo_width"], args["dim"], args["boundary"], args["transport"]
        domain = domain_of(args["manager"])
        check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)
        info = arrays.describe(x)
        width = check_width(halo_width)
        axis = normalize_dim(dim, len(info.shape))
        _check_boundary(boundary, info.shape, axis)
        if transport == "torch" and domain.size > 1:
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        rest = info.shape[:axis] + info.shape[axis + 1 :]
        calls = (width, boundary, transport, arrays.requires_grad(x), math.prod(info.shape[:axis]),
                 math.prod(info.shape[axis + 1 :]) * info.itemsize)
        same = (info.kind, info.dtype, info.device_type, len(info.shape), rest, axis)
        return Local((info, axis, width, boundary), calls, same, info.shape[axis])

    def explain_on(self, locals_: list[Local], comm: MPI.Comm) -> None:  # name each rank's band when they do not fit
        check_bands_fit("halo_exchange", [loc.plan for loc in locals_], ("dim", "halo_width", "boundary"), comm,
                        note="; for 'earth' the whole longitude on every rank")

    def plan(self, mine: tuple, sizes: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        info, axis, width, boundary = mine
        check_halo_width(sizes, width, boundary, axis)  # every rank's rows are agreed: every rank raises alike
        domain = domain_of(args["manager"])
        prev, nxt = domain.neighbors(boundary == "periodic")
        shape = info.shape
        group = domain.manager.torch_group("domain") if args["transport"] == "torch" and domain.size > 1 else None
        return _Plan(
            comm=comm,
            axis=axis,
            width=width,
            boundary=boundary,
            rows=shape[axis],
            prev=prev,
            next=nxt,
            outer=math.prod(shape[:axis]),
            row_bytes=math.prod(shape[axis + 1 :]) * info.itemsize,
            lon_axis=len(shape) - 1,
            lon=shape[-1],
            shape=shape,
            padded=shape[:axis] + (shape[axis] + 2 * width,) + shape[axis + 1 :],
            torch_group=group,
            moves=moves.MpiMoves(comm) if group is None else _torch_moves().TorchMoves(group),
        )

    # kernel and adjoint: halo_kernel and halo_adjoint themselves (set below: no method in between)


class HaloBlocks(_Halos):
    """The exchange of the blocks of a 2-D domain grid, corners included; agreed on the domain communicator."""

    name = "halo_exchange/2d"

    def local(self, x: Any, args: dict) -> Local:
        halo_width, dim, boundary, transport = args["halo_width"], args["dim"], args["boundary"], args["transport"]
        domain = domain_of(args["manager"])
        check_transport(transport)
        if transport == "torch" and domain.size > 1:
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        hy, hx = check_widths(halo_width)
        lat, lon = check_boundaries(boundary)
        info = arrays.describe(x)
        ay, ax = normalize_dims(dim if isinstance(dim, (tuple, list)) else (dim, -1), len(info.shape))
        rest = tuple(s for i, s in enumerate(info.shape) if i not in (ay, ax))
        calls = ("2d", hy, hx, lat, lon, ay, ax, len(info.shape), rest, info.itemsize, transport, arrays.requires_grad(x))
        return Local((info, ay, ax, hy, hx, lat, lon), calls, (info.kind, info.dtype, info.device_type),
                     encode_block(info.shape, ay, ax))

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: {loc.plan[0].kind} {loc.plan[0].dtype} {loc.plan[0].shape}, halo_width="
                           f"{loc.calls[1:3]}, boundary={loc.calls[3:5]}, dims {loc.calls[5:7]}, requires_grad="
                           f"{loc.calls[-1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"halo_exchange: ranks of the domain grid made different calls (every rank needs the same "
                         f"halo_width, boundary, dims, dtype and every dim but the two grid dims): {detail}")

    def plan(self, mine: tuple, counts: list[int], comm: MPI.Comm, args: dict) -> Plan2d:
        info, ay, ax, hy, hx, lat, lon = mine
        domain = domain_of(args["manager"])
        grid = grid_of(domain.manager, domain.size)
        heights, widths = block_table(counts, grid, "halo_exchange", ay, ax)
        check_halo_width(heights, hy, lat, ay)  # agreed table: every rank raises alike
        check_halo_width(widths, hx, lon, ax)
        if lat == "earth" and sum(widths) % 2:
            raise ValueError(f"boundary 'earth' shifts the pole halo by half the longitudes, so the number of longitudes "
                             f"(dim {ax}) must be even, got {sum(widths)} (blocks: {widths})")
        group = domain.manager.torch_group("domain") if args["transport"] == "torch" and domain.size > 1 else None
        data = grid_comm(domain)
        transfer = moves.MpiMoves(data) if group is None else _torch_moves().TorchMoves(group)
        row, col = grid_coords(domain.rank, grid)
        return Plan2d(data, grid, row, col, ay, ax, hy, hx, lat, lon, info.shape, tuple(heights), tuple(widths),
                      group, transfer)

    def kernel(self, x: Any, plan: Plan2d) -> Any:
        return halo2d_kernel(x, plan)

    def adjoint(self, grad: Any, plan: Plan2d) -> Any:
        return halo2d_adjoint(grad, plan)


@dataclass(frozen=True)
class _Plan:
    comm: MPI.Comm
    axis: int
    width: int
    boundary: str
    rows: int  # this rank's band along axis
    prev: int | None
    next: int | None
    outer: int  # product of the dimensions before axis
    row_bytes: int  # bytes of one row of one outer slice
    lon_axis: int  # last dimension (earth only)
    lon: int
    shape: tuple  # this rank's band
    padded: tuple  # the output: the band with 2 * width more rows along axis
    torch_group: Any = None  # transport="torch": the mirrored torch domain group
    # the transport (MpiMoves keeps packed edge rows call after call: a plan is remembered per call shape)
    moves: Any = field(default=None, compare=False, repr=False)


def halo_kernel(x: Any, p: _Plan) -> Any:
    """The padded band of an agreed exchange (plain arrays, no autograd)."""
    host = arrays.host_numpy(x) if p.torch_group is None else None
    if host is not None:  # numpy, or a torch CPU tensor through a numpy view of it
        out = _host_halo(np.ascontiguousarray(host), p)
        return out if host is x else arrays.from_host_numpy(x, out)
    w, rows, axis = p.width, p.rows, p.axis
    x = arrays.contiguous(x)  # detached; lazy conjugate / negative views resolved (DLPack cannot carry them)
    out = arrays.empty(x, p.padded)
    rowops.copy_rows(out, axis, w, x)
    if w == 0:
        return out
    if p.prev is not None or p.next is not None:
        # my first w rows go up and my last w rows go down; the neighbours' land below and above my band
        from_next, from_prev = _edges(lambda: arrays.narrow(x, axis, 0, w), lambda: arrays.narrow(x, axis, rows - w, w), p)
        if from_prev is not None:
            rowops.copy_rows(out, axis, 0, from_prev)
        if from_next is not None:
            rowops.copy_rows(out, axis, w + rows, from_next)
    for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
        if neighbour is None:
            _fill_edge(out, x, p, side, at)
    return out


def _host_halo(x: np.ndarray, p: _Plan) -> np.ndarray:
    """:func:`halo_kernel` of a contiguous numpy band over MPI: byte views, one round of non-blocking messages.

    The output comes from the reuse pool (:func:`~credit_mpi.transport.arrays.pooled_empty`):
    a loop that drops last step's padded band does not first-touch new pages every call.
    """
    w, rows = p.width, p.rows
    out = arrays.pooled_empty(x, p.padded)
    ob, xb = _host_rows(out, p, rows + 2 * w), _host_rows(x, p, rows)
    ob[:, w : w + rows] = xb
    if w == 0:
        return out
    if (p.prev is not None or p.next is not None) and p.outer * p.row_bytes:
        # the edges' byte views straight to the one edge swap (the per-call fast path: no closures)
        moves.swap_edges(p.moves, xb[:, :w], xb[:, rows - w :], p.prev, p.next, into=(ob[:, w + rows :], ob[:, :w]))
    for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
        if neighbour is None:
            if p.boundary == "zero":
                ob[:, at : at + w] = 0  # all-zero bytes are zero in every dtype credit_mpi moves
            else:
                _fill_edge(out, x, p, side, at)
    return out


def _host_rows(x: Any, p: _Plan, rows: int) -> Any:
    """Contiguous host ``x`` as a ``(outer, rows, row_bytes)`` uint8 numpy view, or None (device arrays)."""
    flat = arrays.host_bytes(x)
    return None if flat is None else flat.reshape(p.outer, rows, p.row_bytes)


def _edges(up: Callable[[], Any], down: Callable[[], Any], p: _Plan, into: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:
    """The plan's edge swap (:func:`~credit_mpi.transport.moves.swap_edges`): ``(from_next, from_prev)``.

    ``up()`` goes to the previous rank, ``down()`` to the next; they make the
    edge arrays and are called only when that neighbour exists. The halo
    exchange does this forward (a band's edge rows) and backward (the halo
    rows' gradients, sent home), over the plan's transport. The edge rows
    travel packed contiguously: a derived datatype could send them in place,
    but MPICH moves such strided types several times slower than the same
    contiguous bytes, and packing ``2 * width`` rows costs little.
    """
    if p.prev is None and p.next is None or p.outer * p.row_bytes == 0:
        return None, None
    up_edge = up() if p.prev is not None else None
    down_edge = down() if p.next is not None else None
    return moves.swap_edges(p.moves, up_edge, down_edge, p.prev, p.next, into=into)


def _fill_edge(out: Any, x: Any, p: _Plan, side: str, at: int) -> None:
    if p.boundary == "zero":
        rowops.fill_rows(out, p.axis, at, p.width, 0)
        return
    start = halo_edge_rows(p.boundary, p.rows, p.width, side)
    halo = rowops.flipped_rows(x, p.axis, start, p.width)
    if p.boundary == "earth":
        halo = rowops.roll(halo, p.lon // 2, p.lon_axis)
    rowops.copy_rows(out, p.axis, at, halo)


def halo_adjoint(grad: Any, p: _Plan) -> Any:
    """The adjoint of :func:`halo_kernel`: the band's gradient, with halo gradients sent home and added.

    ``grad`` has the padded shape. Every halo row of the forward pass is a
    copy of some band row (or a constant); its gradient is added to that
    row on the rank that owns it.
    """
    host = arrays.host_numpy(grad) if p.torch_group is None else None
    if host is not None and host is not grad:  # a torch CPU tensor: the numpy code on a view of it
        return arrays.from_host_numpy(grad, halo_adjoint(host, p))
    w, rows, axis = p.width, p.rows, p.axis
    grad = arrays.contiguous(grad)
    gx = rowops.clone_rows(grad, axis, w, rows)
    if w == 0:
        return gx
    # the halo above came from the previous rank's last rows, the halo below from the next rank's first rows
    if host is not None:  # numpy over MPI: the halo rows go home from byte views, in one round
        from_next, from_prev = _host_edges_home(grad, p)
    else:
        from_next, from_prev = _edges(lambda: arrays.narrow(grad, axis, 0, w), lambda: arrays.narrow(grad, axis, w + rows, w), p)
    if from_next is not None:
        rowops.add_rows(gx, axis, rows - w, from_next)
    if from_prev is not None:
        rowops.add_rows(gx, axis, 0, from_prev)
    if p.boundary in ("reflect", "earth"):
        for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
            if neighbour is None:
                back = rowops.flipped_rows(grad, axis, at, w)
                if p.boundary == "earth":
                    back = rowops.roll(back, -(p.lon // 2), p.lon_axis)
                rowops.add_rows(gx, axis, halo_edge_rows(p.boundary, rows, w, side), back)
    return gx


def _host_edges_home(grad: np.ndarray, p: _Plan) -> tuple[Any, Any]:
    """:func:`_edges` of the adjoint for a contiguous numpy ``grad``: ``(from_next, from_prev)`` as new arrays."""
    w = p.width
    gb = _host_rows(grad, p, p.rows + 2 * w)
    edge = p.shape[: p.axis] + (w,) + p.shape[p.axis + 1 :]
    from_next = np.empty(edge, grad.dtype) if p.next is not None else None
    from_prev = np.empty(edge, grad.dtype) if p.prev is not None else None
    into = [None if e is None else _host_rows(e, p, w) for e in (from_next, from_prev)]
    _edges(lambda: gb[:, :w], lambda: gb[:, w + p.rows :], p, into=(into[0], into[1]))
    return from_next, from_prev


def check_width(width: Any) -> int:
    return check_int("halo_width", width, minimum=0)


def check_boundary_name(boundary: Any) -> str:
    if boundary not in HALO_BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; valid: {', '.join(map(repr, HALO_BOUNDARIES))}")
    return boundary


def _check_boundary(boundary: Any, shape: tuple, axis: int) -> None:
    if check_boundary_name(boundary) != "earth":
        return
    if axis == len(shape) - 1:
        raise ValueError(
            f"boundary='earth' needs the full longitude (the last dimension) on every rank, "
            f"but dim={axis} is the last dimension of a {len(shape)}-dimensional array; "
            f"shard along latitude (e.g. dim=-2)"
        )
    lon = shape[-1]
    if lon % 2:
        raise ValueError(
            f"boundary='earth' rolls the halo by half the longitudes, so the longitude count "
            f"(last dimension) must be even, got {lon}"
        )


HaloBands.kernel = staticmethod(halo_kernel)  # the per-call fast path calls the kernel directly
HaloBands.adjoint = staticmethod(halo_adjoint)
BANDS, BLOCKS = HaloBands(), HaloBlocks()


def _torch_moves() -> Any:
    """:mod:`credit_mpi.transport.torch_moves` (imports torch: only for ``transport="torch"``)."""
    from ..transport import torch_moves

    return torch_moves
