"""The 2-D latitude x longitude domain grid: who owns which block, and who is next to whom.

A domain group of ``rows * cols`` ranks can be laid out as a row-major grid
(``DomainParallelManager(..., domain_grid=(rows, cols))``): domain rank ``r``
sits at grid coordinates ``(r // cols, r % cols)``, grid row ``i`` holds
latitude band ``i`` and grid column ``j`` longitude band ``j``, each cut like
:func:`numpy.array_split` (a :class:`credit_mpi.layout.Layout` of two split
dims). Latitude is not periodic (its edges are the poles, handled by the halo
``boundary``), longitude is (the globe): the manager's Cartesian
communicator has ``periods=(False, True)``.

Pure index arithmetic, no MPI calls: every rank computes the same answers
from the same agreed inputs. A manager without ``domain_grid`` is an
``(n, 1)`` grid (latitude bands, as before).
"""

from __future__ import annotations

import operator
from typing import Any

from .layout import Layout

__all__ = [
    "DIRECTIONS",
    "check_grid",
    "grid_of",
    "grid_coords",
    "grid_rank",
    "grid_neighbors",
    "block_sizes",
    "opposite_pieces",
    "format_grid",
]

# The 8 neighbours, as (row step, column step); north is row - 1 (towards the first latitude).
DIRECTIONS = {
    "north": (-1, 0),
    "south": (1, 0),
    "west": (0, -1),
    "east": (0, 1),
    "northwest": (-1, -1),
    "northeast": (-1, 1),
    "southwest": (1, -1),
    "southeast": (1, 1),
}


def check_grid(domain_grid: Any, domain_parallel_size: int) -> tuple[int, int] | None:
    """``domain_grid`` as ``(rows, cols)`` (or None), checked against the domain size.

    Raises:
        ValueError: not a pair of positive integers, or ``rows * cols`` is
            not ``domain_parallel_size`` (the message lists the grids that fit).
    """
    if domain_grid is None:
        return None
    try:
        rows, cols = domain_grid
        rows, cols = (operator.index(v) for v in (rows, cols))
        if isinstance(domain_grid[0], bool) or isinstance(domain_grid[1], bool):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"domain_grid must be a pair of positive integers (rows, cols), got {domain_grid!r}") from None
    if rows < 1 or cols < 1 or rows * cols != domain_parallel_size:
        fits = [(r, domain_parallel_size // r) for r in range(1, domain_parallel_size + 1) if domain_parallel_size % r == 0]
        raise ValueError(
            f"domain_grid={domain_grid!r}: rows * cols must equal domain_parallel_size={domain_parallel_size} "
            f"(got {rows} * {cols} = {rows * cols}); grids that fit: {', '.join(f'{r}x{c}' for r, c in fits)}"
        )
    return rows, cols


def grid_of(manager: Any, size: int) -> tuple[int, int]:
    """The manager's ``(rows, cols)``; ``(size, 1)`` for a manager (or stand-in) without a grid."""
    grid = getattr(manager, "domain_grid", None)
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2):  # none, or a stand-in's (a MagicMock's) attribute
        return (size, 1)
    rows, cols = grid
    if rows * cols != size:
        raise ValueError(f"the manager's domain_grid {grid!r} does not hold its {size} domain ranks")
    return int(rows), int(cols)


def grid_coords(rank: int, grid: tuple[int, int]) -> tuple[int, int]:
    """``(row, col)`` of domain rank ``rank`` (row-major)."""
    rows, cols = grid
    if not 0 <= rank < rows * cols:
        raise ValueError(f"rank {rank} is out of range for a {rows}x{cols} grid (valid: 0 to {rows * cols - 1})")
    return Layout.of((0, 0), grid, True).coords(rank)


def grid_rank(row: int, col: int, grid: tuple[int, int]) -> int | None:
    """Domain rank at ``(row, col)``: longitude wraps around, latitude does not (None past a pole)."""
    rows, cols = grid
    if not 0 <= row < rows:
        return None
    return row * cols + col % cols


def grid_neighbors(rank: int, grid: tuple[int, int]) -> dict[str, int | None]:
    """Domain ranks of the 8 neighbours of ``rank``: ``{"north": ..., "southeast": ...}``.

    Longitude is periodic (on a grid of one column a rank is its own east and
    west neighbour); latitude is not (None north of the first grid row and
    south of the last). What the halo exchange does at the poles is its
    ``boundary``'s business.
    """
    row, col = grid_coords(rank, grid)
    return {name: grid_rank(row + dr, col + dc, grid) for name, (dr, dc) in DIRECTIONS.items()}


def block_sizes(shape: tuple[int, int], grid: tuple[int, int], uneven: bool, dims: tuple = (None, None)) -> tuple[list[int], list[int]]:
    """``(heights, widths)``: rows of each grid row and columns of each grid column.

    ``shape`` is the global ``(latitudes, longitudes)``. Raises the
    ``band_sizes`` ValueError when a dim does not split evenly and ``uneven`` is false.
    """
    heights, widths = Layout.of(tuple(shape), tuple(grid), uneven, tuple(dims)).sizes
    return list(heights), list(widths)


def opposite_pieces(col: int, widths: list[int]) -> list[tuple[int, int, int, int]]:
    """Where the longitudes opposite grid column ``col``'s (longitude + 180 degrees) live.

    For ``L = sum(widths)`` longitudes (even), column ``col`` holds
    ``[x0, x0 + w)``; the ``"earth"`` pole halo of its block at longitude
    ``x`` is the edge rows at ``(x + L / 2) % L``. Returns
    ``[(other_col, my_start, other_start, length)]``: ``length`` longitudes
    starting at local column ``my_start`` of ``col`` come from local column
    ``other_start`` of ``other_col``. The relation is symmetric (column A
    needs B's longitudes exactly where B needs A's), so the same list tells
    a rank what to send. With uneven columns a block's opposite can span
    two columns; with one column it is the block itself.
    """
    total = sum(widths)
    if total % 2:
        raise ValueError(f"the opposite longitudes need an even number of longitudes, got {total}")
    offsets = Layout.bands(widths).starts()
    x0, w = offsets[col], widths[col]
    pieces = []
    # the opposite range [x0 + L/2, x0 + L/2 + w) mod L, split where it wraps
    start = (x0 + total // 2) % total
    segments = [(start, min(w, total - start), 0)]
    if segments[0][1] < w:
        segments.append((0, w - segments[0][1], segments[0][1]))
    for seg_start, seg_len, my_start in segments:
        for other, (o0, ow) in enumerate(zip(offsets, widths, strict=True)):
            lo, hi = max(seg_start, o0), min(seg_start + seg_len, o0 + ow)
            if lo < hi:
                pieces.append((other, my_start + lo - seg_start, lo - o0, hi - lo))
    return pieces


def format_grid(grid: tuple[int, int], shape: tuple[int, int] | None = None) -> list[str]:
    """Lines that draw the grid: each cell a domain rank (with its block's rows x cols for ``shape``)."""
    rows, cols = grid
    heights, widths = (None, None) if shape is None else block_sizes(shape, grid, True)
    cells = []
    for i in range(rows):
        line = []
        for j in range(cols):
            text = f"r{i * cols + j}"
            if shape is not None:
                text += f" {heights[i]}x{widths[j]}"
            line.append(text)
        cells.append(line)
    width = max(len(c) for line in cells for c in line)
    out = [f"domain grid {rows}x{cols} (rows: latitude bands, north first; columns: longitude bands, periodic)"]
    for line in cells:
        out.append("  " + " | ".join(c.ljust(width) for c in line))
    return out
