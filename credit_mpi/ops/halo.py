"""The halo exchange: one 1-D phase per split dim, the outer edges filled from the boundary table; differentiable.

A band (1-D) or a block (2-D) is padded with its neighbours' edge rows by
:func:`pad_phase`, once along each split dim of its
:class:`~credit_mpi.layout.Layout`, each phase on the array the phase
before it padded:

* bands (:class:`HaloBands`, ``dim`` one int): one phase along latitude;
* blocks of a 2-D domain grid (:class:`HaloBlocks`, ``dim`` a pair): the
  phase along latitude (within a grid column), then the phase along
  longitude (within a grid row) on the latitude-padded block, whose edge
  columns carry the corners.

A phase is the one edge swap (:func:`credit_mpi.transport.moves.swap_edges`)
with the neighbours :meth:`Layout.neighbors <credit_mpi.layout.Layout.neighbors>`
names, over the plan's transport (MPI, or ``transport="torch"`` over the
mirrored torch group: bands and grids alike). Where a rank has no
neighbour (an outer edge of the domain), the boundary's row of
:data:`credit_mpi.partition.BOUNDARIES` decides: zeros, the other end
(``wraps``: ``periodic``), the edge rows mirrored (``reflect``), or mirrored
and folded across the pole (``earth``: the rows of the longitudes half the
globe away, taken from the ranks that hold them, :func:`_opposite`). Host
numpy arrays over MPI (and torch CPU tensors, through a numpy view) take a
view fast path in each phase (:func:`_host_pad`; the output from the
reuse pool).

The two forms have their own operation codes (a rank that passed a single
dim and one that passed pairs meet in one ``Allgather`` and every rank
raises). The agreement covers the widths, the boundaries, the transport,
the bytes per row, the autograd state (the backward is collective: the halo
gradients go home) and every rank's rows (a halo wider than a band is every
rank's ``ValueError``). Both forms are remembered per call shape by the
engine (device arrays and ``transport="torch"`` are planned each call). The
adjoint (:func:`halo_adjoint`) runs each phase's transpose
(:func:`phase_adjoint`: the halo gradients sent home and added), phase by
phase in reverse. The public function is :func:`credit_mpi.halo_exchange`
(:mod:`credit_mpi.halo`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from ..blocks import block_table, check_line, encode_block, grid_comm, normalize_dims
from ..engine import Op
from ..grid import grid_of, opposite_pieces
from ..layout import Layout
from ..manager import domain_of
from ..partition import BOUNDARIES, Boundary, check_halo_width, halo_edge_rows, normalize_dim
from ..transport import arrays, moves, rowops
from ..transport.limits import TAG_DOWN, TAG_E, TAG_N, TAG_POLE_N, TAG_POLE_S, TAG_S, TAG_UP, TAG_W
from ..validation import Local, check_bands_fit, check_int, check_transport

__all__ = [
    "HaloBands", "HaloBlocks", "BANDS", "BLOCKS", "Phase", "Plan2d", "phases", "pad_phase", "phase_adjoint",
    "halo_kernel", "halo_adjoint", "received_elements", "check_width", "check_widths", "check_boundary_name",
    "check_boundaries", "LON_BOUNDARIES",
]



def _lon_boundaries() -> tuple[str, ...]:
    """The longitude boundaries of a 2-D grid: every row of the table that is not a latitude edge's (the default first)."""
    return tuple(sorted((n for n, b in BOUNDARIES.items() if not b.latitude_only), key=lambda n: n != "periodic"))


LON_BOUNDARIES = _lon_boundaries()
_SIDES = ("before", "after")
_POLE_TAGS = (TAG_POLE_N, TAG_POLE_S)  # the fold's messages at the first (north) and the last (south) edge
_TAGS = {1: ((TAG_UP, TAG_DOWN),), 2: ((TAG_N, TAG_S), (TAG_W, TAG_E))}  # per split dims: each phase's two directions


class _Halos(Op):
    """What both forms share: the cache key, the kernel, the adjoint and its transport."""

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

    # kernel and adjoint: halo_kernel and halo_adjoint themselves (set below: no method in between)


class HaloBands(_Halos):
    """The exchange of latitude bands along one dim: one phase."""

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
        group = domain.manager.torch_group("domain") if args["transport"] == "torch" and domain.size > 1 else None
        shape = tuple(info.shape)
        steps = phases(Layout.bands(sizes), domain.rank, (axis,), (width,), (boundary,), shape, (len(shape) - 1, None))
        return _Plan(comm, steps, group, moves.MpiMoves(comm) if group is None else _torch_moves().TorchMoves(group))


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
        if BOUNDARIES[lat].fold and sum(widths) % 2:
            raise ValueError(f"boundary {lat!r} shifts the pole halo by half the longitudes, so the number of longitudes "
                             f"(dim {ax}) must be even, got {sum(widths)} (blocks: {widths})")
        group = domain.manager.torch_group("domain") if args["transport"] == "torch" and domain.size > 1 else None
        data = grid_comm(domain)
        transfer = moves.MpiMoves(data) if group is None else _torch_moves().TorchMoves(group)
        row, col = Layout((tuple(heights), tuple(widths))).coords(domain.rank)
        return Plan2d(data, grid, row, col, ay, ax, hy, hx, lat, lon, info.shape, tuple(heights), tuple(widths),
                      group, transfer)


# --------------------------------------------------------------------------- the plans: phases


@dataclass(frozen=True)
class Fold:
    """Where the longitudes half the globe away from a rank's own live (``earth``'s pole fold).

    ``local``: ``(mine, theirs, length)``: ``length`` longitudes at local
    column ``mine`` come from this rank's own column ``theirs``; ``remote``:
    ``(peer, mine, length)``: they come from rank ``peer``, which needs this
    rank's columns ``[mine, mine + length)`` in turn (the relation is
    symmetric, :func:`credit_mpi.grid.opposite_pieces`). Where the whole
    longitude is on this rank (bands, a grid of one column) every piece is
    local: a roll by half the globe, ``half``.
    """

    axis: int  # the longitude axis
    local: tuple
    remote: tuple
    half: int | None = None  # the whole longitude is here: roll by this (half of it) instead of the pieces


@dataclass(frozen=True)
class Phase:
    """One split dim's exchange, as every rank agreed it: pad ``shape`` by ``width`` rows on both sides of ``axis``."""

    axis: int
    width: int
    rule: Boundary  # what the halo holds past an outer edge (a row of partition.BOUNDARIES)
    shape: tuple  # the array this phase pads (padded already along the earlier phases' axes)
    prev: int | None  # the rank whose last rows become my halo before (None: an outer edge, the rule's)
    next: int | None  # the rank whose first rows become my halo after
    tags: tuple[int, int]  # the two directions' message tags
    fold: Fold | None = None  # the rule folds across the pole: where the opposite longitudes live
    # what the kernels read each call, worked out once
    rows: int = field(init=False, repr=False)  # shape[axis]
    padded: tuple = field(init=False, repr=False)  # the output: 2 * width more rows along axis
    outer: int = field(init=False, repr=False)  # product of the dimensions before axis
    inner: int = field(init=False, repr=False)  # elements of one row of one outer slice

    def __post_init__(self) -> None:
        shape, axis, put = self.shape, self.axis, object.__setattr__
        put(self, "rows", shape[axis])
        put(self, "padded", _padded(shape, axis, self.width))
        put(self, "outer", math.prod(shape[:axis]))
        put(self, "inner", math.prod(shape[axis + 1 :]))


@functools.lru_cache(maxsize=256)
def phases(layout: Layout, rank: int, axes: tuple, widths: tuple, boundaries: tuple, shape: tuple,
           lon: tuple[int, int | None]) -> tuple[Phase, ...]:
    """The phases of ``rank``'s exchange: one per split dim of ``layout``, in order (pure arithmetic, no MPI).

    Remembered (a call planned again, as on a domain of one rank, asks the
    layout nothing); the arguments are hashable tuples.

    ``axes[d]``, ``widths[d]`` and ``boundaries[d]`` (names in the table) are
    split dim ``d``'s array axis, halo width and boundary; ``shape`` is
    ``rank``'s part. ``lon = (axis, split dim or None)`` is where the
    longitude lives for a rule that folds across the pole: a split dim of
    ``layout``, or whole on every rank (None).
    """
    coords, out, shape = layout.coords(rank), [], tuple(shape)
    tags = _TAGS[len(coords)]
    for d, (axis, width, name) in enumerate(zip(axes, widths, boundaries, strict=True)):
        rule = BOUNDARIES[name]
        prev, nxt = layout.neighbors(coords[d], d, rule.wraps)  # parts along d: the ranks beside mine
        if len(coords) > 1:
            prev, nxt = (None if c is None else layout.rank(coords[:d] + (c,) + coords[d + 1 :]) for c in (prev, nxt))
        fold = _fold(layout, coords, shape, lon) if rule.fold and width else None
        out.append(Phase(axis, width, rule, shape, prev, nxt, tags[d], fold))
        shape = _padded(shape, axis, width)
    return tuple(out)


def _fold(layout: Layout, coords: tuple, shape: tuple, lon: tuple[int, int | None]) -> Fold:
    axis, d = lon
    sizes = (shape[axis],) if d is None else layout.sizes[d]
    if len(sizes) == 1:  # the whole longitude on this rank: a roll by half of it
        return Fold(axis, (), (), sizes[0] // 2)
    col = coords[d]
    peers = tuple(layout.rank(coords[:d] + (j,) + coords[d + 1 :]) for j in range(len(sizes)))
    pieces = opposite_pieces(col, list(sizes)) if sum(sizes) else []
    return Fold(axis, tuple((mine, theirs, length) for other, mine, theirs, length in pieces if other == col),
                tuple((peers[other], mine, length) for other, mine, _, length in pieces if other != col))


def _padded(shape: tuple, axis: int, width: int) -> tuple:
    return shape[:axis] + (shape[axis] + 2 * width,) + shape[axis + 1 :]


@dataclass(frozen=True)
class _Plan:
    """A band exchange's plan: its one phase and the transport."""

    comm: MPI.Comm
    phases: tuple
    torch_group: Any = None  # transport="torch": the mirrored torch domain group
    # the transport (MpiMoves keeps packed edge rows call after call: a plan is remembered per call shape)
    moves: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Plan2d:
    """What every rank agreed on before a 2-D halo exchange moves data; its two phases follow from it."""

    comm: Any  # the grid's MPI communicator
    grid: tuple[int, int]
    row: int
    col: int
    ay: int
    ax: int
    hy: int
    hx: int
    lat: str
    lon: str
    shape: tuple  # this rank's block
    heights: tuple
    widths: tuple
    torch_group: Any = None  # transport="torch": the mirrored torch domain group (autograd: no MPI in backward)
    moves: Any = field(default=None, compare=False, repr=False)  # the transport the exchange moves data on
    phases: tuple = field(init=False, compare=False, repr=False)  # latitude, then longitude

    def __post_init__(self) -> None:
        layout = Layout((tuple(self.heights), tuple(self.widths)))
        steps = phases(layout, layout.rank((self.row, self.col)), (self.ay, self.ax), (self.hy, self.hx),
                       (self.lat, self.lon), tuple(self.shape), (self.ax, 1))
        object.__setattr__(self, "phases", steps)


def received_elements(grid: tuple[int, int], heights: list[int], widths: list[int], rank: int,
                      halo_width: tuple[int, int], boundary: tuple[str, str]) -> int:
    """Elements (per outer slice) that ``rank`` of a grid receives from *other* ranks in one 2-D exchange.

    Pure arithmetic over the phases, for the bench's "bytes moved": latitude
    rows from the north / south neighbours (or the opposite-longitude pieces
    at an ``"earth"`` pole), then longitude columns of the latitude-padded
    block (which carry the corners); what a rank takes from itself (one
    column, one row with ``periodic``) is not counted.
    """
    layout = Layout((tuple(heights), tuple(widths)))
    row, col = layout.coords(rank)
    plan = Plan2d(None, grid, row, col, 0, 1, *halo_width, *boundary, (heights[row], widths[col]), tuple(heights),
                  tuple(widths))
    count = 0
    for ph in plan.phases:
        per_row = ph.outer * ph.inner  # elements of one row along the phase's axis
        for neighbour in (ph.prev, ph.next):
            if neighbour is not None and neighbour != rank:
                count += ph.width * per_row
            elif neighbour is None and ph.fold is not None:
                count += ph.width * sum(length for _, _, length in ph.fold.remote)
    return count


# --------------------------------------------------------------------------- kernels


def halo_kernel(x: Any, p: Any) -> Any:
    """The padded array of an agreed exchange, phase after phase (plain arrays, no autograd)."""
    host = arrays.host_numpy(x) if p.torch_group is None else None
    if host is not None:  # numpy, or a torch CPU tensor through a numpy view of it
        out = np.ascontiguousarray(host)
        for ph in p.phases:
            out = _host_pad(out, ph, p.moves)
        return out if host is x else arrays.from_host_numpy(x, out)
    x = arrays.contiguous(x)  # detached; lazy conjugate / negative views resolved (DLPack cannot carry them)
    for ph in p.phases:
        x = pad_phase(x, ph, p.moves)
    return x


def pad_phase(x: Any, ph: Phase, transfer: Any) -> Any:
    """Contiguous ``x`` padded along ``ph.axis``: the neighbours' edge rows, or the boundary's at an outer edge."""
    w, rows, axis = ph.width, ph.rows, ph.axis
    out = arrays.empty(x, ph.padded)
    rowops.copy_rows(out, axis, w, x)
    if w == 0:
        return out
    # my first w rows go to prev and my last w rows to next; theirs land before and after my rows
    from_next, from_prev = _swap(x, ph, transfer, 0, rows - w)
    if from_prev is not None:
        rowops.copy_rows(out, axis, 0, from_prev)
    if from_next is not None:
        rowops.copy_rows(out, axis, w + rows, from_next)
    for side, neighbour, at in ((0, ph.prev, 0), (1, ph.next, w + rows)):
        if neighbour is None:
            _edge(out, x, ph, transfer, side, at)
    return out


def _host_pad(x: np.ndarray, ph: Phase, transfer: Any) -> np.ndarray:
    """:func:`pad_phase` of a contiguous numpy array over MPI: 3-D views, one round of non-blocking messages.

    The output comes from the reuse pool (:func:`~credit_mpi.transport.arrays.pooled_empty`):
    a loop that drops last step's padded band does not first-touch new pages every call.
    """
    w, rows, outer, inner = ph.width, ph.rows, ph.outer, ph.inner
    out = arrays.pooled_empty(x, ph.padded)
    ob, xb = out.reshape(outer, rows + 2 * w, inner), x.reshape(outer, rows, inner)  # _HOST_ROWS views
    ob[:, w : w + rows] = xb
    if w == 0:
        return out
    if (ph.prev is not None or ph.next is not None) and outer * inner:
        # the edges' views straight to the one edge swap (the per-call fast path: no closures)
        moves.swap_edges(transfer, xb[:, :w], xb[:, rows - w :], ph.prev, ph.next, ph.tags,
                         into=(ob[:, w + rows :], ob[:, :w]))
    for side, neighbour, at in ((0, ph.prev, 0), (1, ph.next, w + rows)):
        if neighbour is None:
            if ph.rule.mirror is None:
                ob[:, at : at + w] = 0
            else:
                _edge(out, x, ph, transfer, side, at)
    return out


# _HOST_ROWS: the host paths see a contiguous numpy array as an ``(outer, rows, inner)`` view of its own
# dtype (``x.reshape``, written inline: the per-call path), rows along the phase's axis. Typed, not bytes:
# a phase along the last dim has rows of one element, which numpy copies several times slower as single bytes.


def _swap(a: Any, ph: Phase, transfer: Any, lo: int, hi: int) -> tuple[Any, Any]:
    """Rows ``[lo, lo + width)`` of ``a`` to ``ph.prev``, ``[hi, hi + width)`` to ``ph.next``: ``(from_next, from_prev)``.

    The phase's edge swap (:func:`~credit_mpi.transport.moves.swap_edges`),
    forward (a part's edge rows) and backward (the halo rows' gradients,
    sent home), over the plan's transport; None where there is no
    neighbour. The edge rows travel packed contiguously: a derived datatype
    could send them in place, but MPICH moves such strided types several
    times slower than the same contiguous bytes, and packing ``2 * width``
    rows costs little.
    """
    if ph.prev is None and ph.next is None or ph.outer * ph.inner == 0:
        return None, None
    up = arrays.narrow(a, ph.axis, lo, ph.width) if ph.prev is not None else None
    down = arrays.narrow(a, ph.axis, hi, ph.width) if ph.next is not None else None
    return moves.swap_edges(transfer, up, down, ph.prev, ph.next, ph.tags)


def _edge(out: Any, x: Any, ph: Phase, transfer: Any, side: int, at: int) -> None:
    """The halo at an outer edge (``side`` 0: before, 1: after) from the boundary's rule, at row ``at`` of ``out``."""
    if ph.rule.mirror is None:
        rowops.fill_rows(out, ph.axis, at, ph.width, 0)
        return
    halo = rowops.flipped_rows(x, ph.axis, halo_edge_rows(ph.rule.name, ph.rows, ph.width, _SIDES[side]), ph.width)
    if ph.fold is not None:
        halo = _opposite(halo, ph.fold, transfer, _POLE_TAGS[side])
    rowops.copy_rows(out, ph.axis, at, halo)


def _opposite(src: Any, fold: Fold, transfer: Any, tag: int) -> Any:
    """``src`` (edge rows) at the opposite longitudes: column ``k`` of the result is global column ``k + L/2``.

    Taken from the ranks of the fold that hold them (one or two; this rank
    itself when the longitude is whole here). Its own transpose: the
    adjoint sends the pole gradients back the same way.
    """
    ax = fold.axis
    if fold.half is not None:
        return rowops.roll(src, fold.half, ax)
    src = arrays.contiguous(src)
    result = arrays.empty(src, src.shape)
    for mine, theirs, length in fold.local:
        rowops.copy_rows(result, ax, mine, arrays.narrow(src, ax, theirs, length))
    if fold.remote and math.prod(src.shape):
        ops, recvs = [], []
        for peer, mine, length in fold.remote:
            shape = list(src.shape)
            shape[ax] = length
            buf = arrays.empty(src, shape)
            recvs.append((mine, buf))
            ops.append((moves.RECV, buf, peer, tag))
        for peer, mine, length in fold.remote:
            ops.append((moves.SEND, arrays.narrow(src, ax, mine, length), peer, tag))
        transfer.exchange(ops)
        for mine, buf in recvs:
            rowops.copy_rows(result, ax, mine, buf)
    return result


def halo_adjoint(grad: Any, p: Any) -> Any:
    """The adjoint of :func:`halo_kernel`: each phase's transpose, in reverse order.

    ``grad`` has the padded shape. Every halo row of the forward pass is a
    copy of some row (or a constant); its gradient is added to that row on
    the rank that owns it.
    """
    host = arrays.host_numpy(grad) if p.torch_group is None else None
    if host is None:
        return _adjoint_phases(arrays.contiguous(grad), p, False)
    gx = _adjoint_phases(np.ascontiguousarray(host), p, True)  # numpy, or a torch CPU tensor's numpy view
    return gx if host is grad else arrays.from_host_numpy(grad, gx)


def _adjoint_phases(grad: Any, p: Any, host: bool) -> Any:
    """Contiguous ``grad`` through each phase's transpose, last phase first (``host``: numpy over MPI)."""
    for ph in reversed(p.phases):
        grad = phase_adjoint(grad, ph, p.moves, host)
    return grad


def phase_adjoint(grad: Any, ph: Phase, transfer: Any, host: bool = False) -> Any:
    """The transpose of :func:`pad_phase`: contiguous ``grad`` (padded along ``ph.axis``) to the gradient of its input.

    ``host``: ``grad`` is a numpy array over MPI (the halo rows go home from views of it).
    """
    w, rows, axis = ph.width, ph.rows, ph.axis
    if w == 0:
        return rowops.clone_rows(grad, axis, w, rows)
    # the halo before came from prev's last rows, the halo after from next's first rows
    if host:
        gx = _host_rows_home(grad, ph, transfer)
    else:
        gx = rowops.clone_rows(grad, axis, w, rows)
        from_next, from_prev = _swap(grad, ph, transfer, 0, w + rows)
        if from_next is not None:
            rowops.add_rows(gx, axis, rows - w, from_next)
        if from_prev is not None:
            rowops.add_rows(gx, axis, 0, from_prev)
    if ph.rule.mirror is not None:
        for side, neighbour, at in ((0, ph.prev, 0), (1, ph.next, w + rows)):
            if neighbour is None:
                back = rowops.flipped_rows(grad, axis, at, w)
                if ph.fold is not None:
                    back = _opposite(back, ph.fold, transfer, _POLE_TAGS[side])
                rowops.add_rows(gx, axis, halo_edge_rows(ph.rule.name, rows, w, _SIDES[side]), back)
    return gx


def _host_rows_home(grad: np.ndarray, ph: Phase, transfer: Any) -> np.ndarray:
    """The adjoint's rows of a contiguous numpy ``grad`` over MPI: its band's rows, the neighbours' halo gradients added.

    :func:`phase_adjoint`'s clone, :func:`_swap` and sums on ``(outer, rows, inner)``
    views (_HOST_ROWS), as :func:`_host_pad` is the forward's: the same
    arithmetic in the same order (from next, then from prev).
    """
    w, rows, outer, inner = ph.width, ph.rows, ph.outer, ph.inner
    gb = grad.reshape(outer, rows + 2 * w, inner)
    gx = gb[:, w : w + rows].copy()  # C-contiguous
    if (ph.prev is not None or ph.next is not None) and outer * inner:
        edge = (outer, w, inner)
        from_next = np.empty(edge, grad.dtype) if ph.next is not None else None
        from_prev = np.empty(edge, grad.dtype) if ph.prev is not None else None
        moves.swap_edges(transfer, gb[:, :w], gb[:, w + rows :], ph.prev, ph.next, ph.tags, into=(from_next, from_prev))
        if from_next is not None:
            gx[:, rows - w :] += from_next
        if from_prev is not None:
            gx[:, :w] += from_prev
    return gx.reshape(ph.shape)


# --------------------------------------------------------------------------- argument checks


def check_width(width: Any) -> int:
    return check_int("halo_width", width, minimum=0)


def check_boundary_name(boundary: Any) -> str:
    if not isinstance(boundary, str) or boundary not in BOUNDARIES:  # the table itself: a new row is valid at once
        raise ValueError(f"unknown boundary {boundary!r}; valid: {', '.join(map(repr, BOUNDARIES))}")
    return boundary


def _check_boundary(boundary: Any, shape: tuple, axis: int) -> None:
    if not BOUNDARIES[check_boundary_name(boundary)].fold:
        return
    if axis == len(shape) - 1:
        raise ValueError(
            f"boundary={boundary!r} needs the full longitude (the last dimension) on every rank, "
            f"but dim={axis} is the last dimension of a {len(shape)}-dimensional array; "
            f"shard along latitude (e.g. dim=-2)"
        )
    lon = shape[-1]
    if lon % 2:
        raise ValueError(
            f"boundary={boundary!r} rolls the halo by half the longitudes, so the longitude count "
            f"(last dimension) must be even, got {lon}"
        )


def _pair(value: Any, name: str) -> tuple:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be one value or a pair (latitude, longitude), got {value!r}")
        return tuple(value)
    return (value, value)


def check_widths(halo_width: Any) -> tuple[int, int]:
    """``(hy, hx)`` from an int or a pair of non-negative ints."""
    hy, hx = _pair(halo_width, "halo_width")
    return check_int("halo_width[0] (latitude)", hy, minimum=0), check_int("halo_width[1] (longitude)", hx, minimum=0)


def check_boundaries(boundary: Any) -> tuple[str, str]:
    """``(lat, lon)`` boundaries; a single string is the latitude boundary with a periodic longitude (the globe)."""
    lat, lon = (boundary, "periodic") if isinstance(boundary, str) else _pair(boundary, "boundary")
    if not isinstance(lat, str) or lat not in BOUNDARIES:
        raise ValueError(f"unknown latitude boundary {lat!r}; valid: {', '.join(map(repr, BOUNDARIES))}")
    if lon not in (valid := _lon_boundaries()):
        raise ValueError(f"unknown longitude boundary {lon!r}; valid: {', '.join(map(repr, valid))}"
                         + (f" ({lon!r} folds across a pole, a latitude edge)" if lon in BOUNDARIES else ""))
    return lat, lon


_Halos.kernel = staticmethod(halo_kernel)  # the per-call fast path calls the kernel directly
_Halos.adjoint = staticmethod(halo_adjoint)
BANDS, BLOCKS = HaloBands(), HaloBlocks()


def _torch_moves() -> Any:
    """:mod:`credit_mpi.transport.torch_moves` (imports torch: only for ``transport="torch"``)."""
    from ..transport import torch_moves

    return torch_moves
