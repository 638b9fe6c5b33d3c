"""2-D blocks: shard, gather and scatter over a latitude x longitude domain grid.

:func:`credit_mpi.shard_tensor`, :func:`~credit_mpi.gather_tensor`,
:func:`~credit_mpi.scatter_tensor` and :func:`~credit_mpi.shard_batch` come
here when their ``dim`` is a pair ``(lat_dim, lon_dim)`` (e.g. ``(-2, -1)``):
grid row ``i`` of the manager's ``domain_grid`` holds latitude band ``i``,
grid column ``j`` longitude band ``j``, each cut like :func:`numpy.array_split`
(``uneven=True``) or evenly. Without ``domain_grid`` the grid is ``(n, 1)``:
latitude bands with the whole longitude, as with ``dim=-2``.

A single ``dim`` on a grid of more than one column is an error that says so:
a block is not a band, and slicing one dim of it would silently give
something else.

* shard, gather and scatter are ops of :mod:`credit_mpi.engine`, in
  :mod:`credit_mpi.ops.shard` (local: a slice in each dim,
  ``check="collective"`` agrees first), :mod:`credit_mpi.ops.gather` and
  :mod:`credit_mpi.ops.scatter` (their 2-D forms), which use the grid's
  helpers here (the block table from the agreed counts, a block's slice, the
  subarray datatypes of every block, the communicator the data moves on).
"""

from __future__ import annotations

import math
from typing import Any

from mpi4py import MPI

from .grid import grid_coords, grid_of
from .layout import Layout
from .manager import Domain, domain_of
from .partition import normalize_dim
from .transport import arrays

__all__ = [
    "is_grid_call",
    "line_domain",
    "check_line",
    "normalize_dims",
    "grid_comm",
    "block_slice",
    "block_table",
    "block_types",
    "encode_block",
]

def is_grid_call(manager: Any, *args: Any) -> bool:
    """True when a public call takes the 2-D path (any of ``args`` is a pair). Local: no check, no MPI call."""
    return any(isinstance(a, (tuple, list)) for a in args)


def line_domain(manager: Any, *args: Any) -> Domain | None:
    """The manager's :class:`~credit_mpi.manager.Domain` for a call along one dimension; None for the 2-D path.

    None when any of ``args`` is a pair. It never refuses a single dim on a
    grid of several columns: that is :func:`check_line`'s job, inside the
    operation's agreement, so that one rank's single dim is every rank's
    error instead of a rank that raises while the others wait.
    """
    return None if is_grid_call(manager, *args) else domain_of(manager)


def check_line(domain: Domain, dim: Any) -> None:
    """Refuse a single ``dim`` on a grid of more than one column (call it inside the agreement).

    Raises:
        ValueError: the manager's ``domain_grid`` has several columns: a
            block is not a band, and slicing one dim of it would silently
            give something else.
    """
    if domain.size > 1:
        rows, cols = grid_of(domain.manager, domain.size)
        if cols > 1:
            raise ValueError(
                f"the manager's domain grid is {rows}x{cols} (latitude x longitude blocks), so dim must be a pair "
                f"(lat_dim, lon_dim) such as dim=(-2, -1); a single dim={dim!r} only fits an (n, 1) grid "
                f"(domain_grid=None): halo_width and boundary may be pairs too"
            )


def normalize_dims(dim: Any, ndim: int) -> tuple[int, int]:
    """``(lat_axis, lon_axis)`` of a ``dim`` pair as non-negative axes.

    Raises:
        ValueError: not a pair of distinct integers in range.
    """
    if not isinstance(dim, (tuple, list)) or len(dim) != 2:
        raise ValueError(f"dim must be a pair (lat_dim, lon_dim) on a 2-D domain grid, e.g. (-2, -1); got {dim!r}")
    ay, ax = (normalize_dim(d, ndim) for d in dim)
    if ay == ax:
        raise ValueError(f"dim={tuple(dim)!r} names the same axis twice (axis {ay} of a {ndim}-dimensional array)")
    return ay, ax


def grid_comm(domain: Domain) -> MPI.Comm:
    """The communicator 2-D operations move data on: the manager's Cartesian one (its ranks are the domain ranks).

    Their agreement runs on ``domain.comm``, as the 1-D operations' does: a
    rank that takes the 1-D path and one that takes the 2-D path meet in
    the same ``Allgather`` (different operation codes: every rank raises).
    """
    cart = getattr(domain.manager, "domain_cart", None) if domain.size > 1 else None
    return cart if isinstance(cart, MPI.Intracomm) else domain.comm


def block_slice(x: Any, ay: int, ax: int, heights: list[int], widths: list[int], coords: tuple[int, int]) -> Any:
    row, col = coords
    layout = Layout((tuple(heights), tuple(widths)))
    band = arrays.narrow(x, ay, layout.start(row, 0), heights[row])
    return arrays.narrow(band, ax, layout.start(col, 1), widths[col])


def block_table(counts: list[int], grid: tuple[int, int], what: str, ay: int, ax: int) -> tuple[list[int], list[int]]:
    """``(heights, widths)`` from every rank's agreed ``rows << 32 | cols``; ValueError if the blocks do not tile a grid."""
    rows, cols = grid
    blocks = [decode_block(c) for c in counts]
    heights = [blocks[i * cols][0] for i in range(rows)]
    widths = [blocks[j][1] for j in range(cols)]
    if any(blocks[i * cols + j] != (heights[i], widths[j]) for i in range(rows) for j in range(cols)):
        detail = "; ".join(f"rank {r} {grid_coords(r, grid)}: {h}x{w}" for r, (h, w) in enumerate(blocks))
        raise ValueError(
            f"{what}: the blocks do not tile the {rows}x{cols} domain grid (every block of a grid row needs the same "
            f"rows along dim {ay}, every block of a grid column the same columns along dim {ax}): {detail}"
        )
    return heights, widths


def decode_block(count: int) -> tuple[int, int]:
    """The ``(rows, cols)`` of a block that :func:`encode_block` made one count of."""
    return Layout.decode(count, 2)


def encode_block(shape: tuple, ay: int, ax: int) -> int:
    """A block's rows and columns as the one count :func:`credit_mpi.validation.agree` shares."""
    return Layout.encode((shape[ay], shape[ax]))


def _rest(shape: tuple, ay: int, ax: int) -> tuple:
    return tuple(s for i, s in enumerate(shape) if i not in (ay, ax))


def _subarray(shape: tuple, sub: tuple, start: tuple, itemsize: int) -> MPI.Datatype:
    """Bytes of the block ``sub`` at ``start`` of a C-contiguous array of ``shape``."""
    return MPI.BYTE.Create_subarray([*shape, itemsize], [*sub, itemsize], [*start, 0]).Commit()


def block_types(p_shape: tuple, ay: int, ax: int, grid: tuple[int, int], heights: list[int], widths: list[int],
                 itemsize: int) -> list[MPI.Datatype | None]:
    """Per domain rank: the subarray type of its block in the global array (None for an empty block)."""
    types: list[MPI.Datatype | None] = []
    layout = Layout((tuple(heights), tuple(widths)))
    ys, xs = layout.starts(0), layout.starts(1)
    for r in range(grid[0] * grid[1]):
        i, j = grid_coords(r, grid)
        sub, start = list(p_shape), [0] * len(p_shape)
        sub[ay], sub[ax], start[ay], start[ax] = heights[i], widths[j], ys[i], xs[j]
        types.append(_subarray(p_shape, tuple(sub), tuple(start), itemsize) if math.prod(sub) else None)
    return types


