"""The 2-D halo exchange: latitude and longitude halos with corners, and the pole fold.

:func:`credit_mpi.halo_exchange` comes here when ``dim`` (or ``halo_width``,
or ``boundary``) is a pair: ``halo_exchange(block, halo_width=(hy, hx),
dim=(-2, -1), boundary=(lat_boundary, lon_boundary))``. The result is this
rank's window of the single-process global field padded first in latitude
(``hy`` rows, ``lat_boundary``), then in longitude (``hx`` columns,
``lon_boundary``), corners included:

* latitude boundary ``"zero"``, ``"periodic"``, ``"reflect"`` or ``"earth"``
  (across the pole: the edge rows flipped and shifted by half the
  longitudes, CREDIT's ``TensorPadding(mode="earth")``);
* longitude boundary ``"periodic"`` (the globe; the default when
  ``boundary`` is a single string), ``"zero"`` or ``"reflect"``.

How: two phases, each like the 1-D exchange (the one edge swap,
:func:`credit_mpi.transport.moves.swap_edges`, over MPI or with
``transport="torch"`` over the mirrored torch group). First every grid
column swaps ``hy`` edge rows between latitude neighbours (no message past
the poles); at the poles, ``"earth"`` takes the edge rows of the ranks that
hold the opposite longitudes (longitude + 180 degrees: one rank, or two for
uneven columns; :func:`credit_mpi.grid.opposite_pieces`), exchanged with
them directly. Then every grid row swaps ``hx``
edge columns of the latitude-padded blocks, which carries the corners. The
backward pass (:func:`halo2d_adjoint`) runs the transpose of each step in
reverse order: halo gradients go home and are added.

Widths: a halo may not be wider than a block that supplies it (``reflect``
needs one more row or column at the outer edges), ``earth`` needs an even
number of longitudes; every rank checks the agreed block table, so every
rank raises the same ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .grid import grid_coords, grid_rank, opposite_pieces
from .partition import HALO_BOUNDARIES
from .transport import arrays, moves, rowops
from .transport.limits import TAG_E, TAG_N, TAG_POLE_N, TAG_POLE_S, TAG_S, TAG_W
from .validation import check_int

__all__ = ["LON_BOUNDARIES", "check_widths", "check_boundaries", "halo2d_kernel", "halo2d_adjoint", "halo2d_elements", "received_elements", "Plan2d"]

LON_BOUNDARIES = ("periodic", "zero", "reflect")


@dataclass(frozen=True)
class Plan2d:
    """What every rank agreed on before a 2-D halo exchange moves data."""

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

    def lat_neighbors(self) -> tuple[int | None, int | None]:
        """(north, south) domain ranks that supply rows; None at a pole (unless ``periodic``)."""
        rows = self.grid[0]
        wrap = self.lat == "periodic"
        north = grid_rank((self.row - 1) % rows if wrap else self.row - 1, self.col, self.grid)
        south = grid_rank((self.row + 1) % rows if wrap else self.row + 1, self.col, self.grid)
        return north, south

    def lon_neighbors(self) -> tuple[int | None, int | None]:
        """(west, east) domain ranks that supply columns; None at an edge unless ``periodic``."""
        cols, wrap = self.grid[1], self.lon == "periodic"
        west = grid_rank(self.row, self.col - 1, self.grid) if wrap or self.col > 0 else None
        east = grid_rank(self.row, self.col + 1, self.grid) if wrap or self.col < cols - 1 else None
        return west, east


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
    if lat not in HALO_BOUNDARIES:
        raise ValueError(f"unknown latitude boundary {lat!r}; valid: {', '.join(map(repr, HALO_BOUNDARIES))}")
    if lon not in LON_BOUNDARIES:
        raise ValueError(f"unknown longitude boundary {lon!r}; valid: {', '.join(map(repr, LON_BOUNDARIES))}"
                         + (" ('earth' folds across a pole, a latitude edge)" if lon == "earth" else ""))
    return lat, lon


def halo2d_elements(p: Plan2d) -> int:
    """Elements this rank receives from other ranks in one exchange (rows, pole pieces, columns with corners)."""
    rest = math.prod(s for i, s in enumerate(p.shape) if i not in (p.ay, p.ax))
    return rest * received_elements(p.grid, list(p.heights), list(p.widths), p.row * p.grid[1] + p.col,
                                    (p.hy, p.hx), (p.lat, p.lon))


def received_elements(grid: tuple[int, int], heights: list[int], widths: list[int], rank: int,
                      halo_width: tuple[int, int], boundary: tuple[str, str]) -> int:
    """Elements (per outer slice) that ``rank`` of a grid receives from *other* ranks in one 2-D exchange.

    Pure arithmetic over the block layout, for the bench's "bytes moved":
    latitude rows from the north / south neighbours (or the opposite-longitude
    pieces at an ``"earth"`` pole), then longitude columns of the
    latitude-padded block (which carry the corners); what a rank takes from
    itself (one column, one row with ``periodic``) is not counted.
    """
    (hy, hx), (lat, lon) = halo_width, boundary
    row, col = grid_coords(rank, grid)
    plan = Plan2d(None, grid, row, col, 0, 1, hy, hx, lat, lon, (heights[row], widths[col]), tuple(heights), tuple(widths))
    h, w = heights[row], widths[col]
    north, south = plan.lat_neighbors()
    west, east = plan.lon_neighbors()
    count = sum(hy * w for nb in (north, south) if nb is not None and nb != rank)
    if lat == "earth" and hy:
        pieces = sum(length for other, _, _, length in opposite_pieces(col, widths) if other != col)
        count += hy * pieces * ((north is None) + (south is None))
    count += sum(hx * (h + 2 * hy) for nb in (west, east) if nb is not None and nb != rank)
    return count


# --------------------------------------------------------------------------- kernels


def _swap(p: Plan2d, a: Any, axis: int, width: int, before: int | None, after: int | None, lo: int, hi: int,
          tags: tuple[int, int]) -> tuple[Any, Any]:
    """Send rows ``[lo, lo+width)`` to ``before`` and ``[hi, hi+width)`` to ``after`` along ``axis``.

    Returns ``(from_after, from_before)``: what ``after`` sent towards me
    (its ``lo`` rows) and what ``before`` sent (its ``hi`` rows); None where
    there is no partner: the one edge swap
    (:func:`~credit_mpi.transport.moves.swap_edges`) over the plan's transport.
    """
    if before is None and after is None:
        return None, None
    up = arrays.narrow(a, axis, lo, width) if before is not None else None
    down = arrays.narrow(a, axis, hi, width) if after is not None else None
    return moves.swap_edges(p.moves, up, down, before, after, tags)


def _pole(p: Plan2d, src: Any, tag: int) -> Any:
    """The ``"earth"`` pole piece: ``src`` (``hy`` flipped edge rows of my block) at the opposite longitudes.

    Returns an array of ``src``'s shape whose column ``k`` is column
    ``k + L/2`` (global) of the edge rows of my grid row, taken from the
    ranks that hold it (one or two; myself on a one-column grid).
    """
    ax = p.ax
    result = arrays.empty(src, src.shape)
    pieces = opposite_pieces(p.col, list(p.widths))
    for other, mine, theirs, length in pieces:
        if other == p.col:
            rowops.copy_rows(result, ax, mine, arrays.narrow(src, ax, theirs, length))
    remote = [piece for piece in pieces if piece[0] != p.col]
    if remote and math.prod(src.shape):
        ops, recvs = [], []
        for other, mine, _, length in remote:
            shape = list(src.shape)
            shape[ax] = length
            buf = arrays.empty(src, shape)
            recvs.append((mine, buf))
            ops.append((moves.RECV, buf, grid_rank(p.row, other, p.grid), tag))
        for other, mine, _, length in remote:
            ops.append((moves.SEND, arrays.narrow(src, ax, mine, length), grid_rank(p.row, other, p.grid), tag))
        p.moves.exchange(ops)
        for mine, buf in recvs:
            rowops.copy_rows(result, ax, mine, buf)
    return result


def halo2d_kernel(x: Any, p: Plan2d) -> Any:
    """The padded block of an agreed 2-D exchange (plain arrays, no autograd)."""
    ay, ax, hy, hx = p.ay, p.ax, p.hy, p.hx
    h, w = p.shape[ay], p.shape[ax]
    x = arrays.contiguous(x)
    # phase 1: latitude (within a grid column)
    shape = list(p.shape)
    shape[ay] = h + 2 * hy
    mid = arrays.empty(x, shape)
    rowops.copy_rows(mid, ay, hy, x)
    if hy:
        north, south = p.lat_neighbors()
        from_south, from_north = _swap(p, x, ay, hy, north, south, 0, h - hy, (TAG_N, TAG_S))
        if from_north is not None:
            rowops.copy_rows(mid, ay, 0, from_north)
        if from_south is not None:
            rowops.copy_rows(mid, ay, hy + h, from_south)
        for side, neighbour, at, tag in (("north", north, 0, TAG_POLE_N), ("south", south, hy + h, TAG_POLE_S)):
            if neighbour is not None:
                continue
            if p.lat == "zero":
                rowops.fill_rows(mid, ay, at, hy, 0)
            elif p.lat == "reflect":
                rowops.copy_rows(mid, ay, at, rowops.flipped_rows(x, ay, 1 if side == "north" else h - 1 - hy, hy))
            else:  # earth
                edge = rowops.flipped_rows(x, ay, 0 if side == "north" else h - hy, hy)
                rowops.copy_rows(mid, ay, at, _pole(p, arrays.contiguous(edge), tag))
    # phase 2: longitude (within a grid row), on the latitude-padded block: corners come along
    shape[ax] = w + 2 * hx
    out = arrays.empty(x, shape)
    rowops.copy_rows(out, ax, hx, mid)
    if hx:
        west, east = p.lon_neighbors()
        from_east, from_west = _swap(p, mid, ax, hx, west, east, 0, w - hx, (TAG_W, TAG_E))
        if from_west is not None:
            rowops.copy_rows(out, ax, 0, from_west)
        if from_east is not None:
            rowops.copy_rows(out, ax, hx + w, from_east)
        for side, neighbour, at in (("west", west, 0), ("east", east, hx + w)):
            if neighbour is None:
                if p.lon == "zero":
                    rowops.fill_rows(out, ax, at, hx, 0)
                else:  # reflect
                    rowops.copy_rows(out, ax, at, rowops.flipped_rows(mid, ax, 1 if side == "west" else w - 1 - hx, hx))
    return out


def halo2d_adjoint(grad: Any, p: Plan2d) -> Any:
    """The adjoint of :func:`halo2d_kernel`: the block's gradient, halo gradients sent home and added."""
    ay, ax, hy, hx = p.ay, p.ax, p.hy, p.hx
    h, w = p.shape[ay], p.shape[ax]
    grad = arrays.contiguous(grad)
    # phase 2 transposed: longitude halo columns (with the corners) go home
    gm = rowops.clone(arrays.narrow(grad, ax, hx, w))
    if hx:
        west, east = p.lon_neighbors()
        # my west halo came from west's last columns, my east halo from east's first columns
        from_east, from_west = _swap(p, grad, ax, hx, west, east, 0, hx + w, (TAG_W, TAG_E))
        if from_east is not None:
            rowops.add_rows(gm, ax, w - hx, from_east)
        if from_west is not None:
            rowops.add_rows(gm, ax, 0, from_west)
        if p.lon == "reflect":
            for side, neighbour, at in (("west", west, 0), ("east", east, hx + w)):
                if neighbour is None:
                    rowops.add_rows(gm, ax, 1 if side == "west" else w - 1 - hx, rowops.flipped_rows(grad, ax, at, hx))
    # phase 1 transposed: latitude halo rows go home
    gx = rowops.clone(arrays.narrow(gm, ay, hy, h))
    if hy:
        north, south = p.lat_neighbors()
        from_south, from_north = _swap(p, gm, ay, hy, north, south, 0, hy + h, (TAG_N, TAG_S))
        if from_south is not None:
            rowops.add_rows(gx, ay, h - hy, from_south)
        if from_north is not None:
            rowops.add_rows(gx, ay, 0, from_north)
        for side, neighbour, at, tag in (("north", north, 0, TAG_POLE_N), ("south", south, hy + h, TAG_POLE_S)):
            if neighbour is not None or p.lat == "zero":
                continue
            back = rowops.flipped_rows(gm, ay, at, hy)
            if p.lat == "reflect":
                rowops.add_rows(gx, ay, 1 if side == "north" else h - 1 - hy, back)
            else:  # earth: the pole pieces go back to the ranks of the opposite longitudes
                rowops.add_rows(gx, ay, 0 if side == "north" else h - hy, _pole(p, arrays.contiguous(back), tag))
    return gx
