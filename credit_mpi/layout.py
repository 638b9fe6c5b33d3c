"""Who owns which rows and columns: every rank's extent in every split dimension.

A :class:`Layout` holds, per split dimension, the size of every part of a
grid of ranks: latitude bands are a ``(n, 1)`` grid (one dimension split),
the 2-D latitude x longitude blocks a ``(rows, cols)`` grid. Domain rank
``r`` of a grid sits at coordinates ``(r // cols, r % cols)`` (row-major).

Every question about who owns what is answered here and nowhere else:
where a part starts and stops (:meth:`Layout.start`, :meth:`Layout.stop`,
:meth:`Layout.starts`), who owns a global index (:meth:`Layout.owner`), who
is next to whom along a dimension (:meth:`Layout.neighbors`), and how a
rank's extent travels in the agreement (:meth:`Layout.encode`,
:meth:`Layout.decode`: one integer per rank). Pure arithmetic, no MPI.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["Layout", "split", "offsets", "neighbors"]

_SHIFT = 32  # a block's (rows, cols) travel as one agreed count: rows << 32 | cols


def split(total: int, n: int, uneven: bool = False, *, dim: int | None = None) -> list[int]:
    """Parts of ``total`` for ``n`` ranks: ``total // n`` each, the first ``total % n`` one more (``uneven``).

    Raises:
        ValueError: ``n < 1``, ``total < 0``, or ``total`` is not divisible by
            ``n`` and ``uneven`` is false (the reference's words:
            ``Cannot shard dim {dim} ...``).
    """
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"size must be >= 0, got {total}")
    base, extra = divmod(total, n)
    if extra and not uneven:
        what = "a dimension" if dim is None else f"dim {dim}"
        raise ValueError(
            f"Cannot shard {what} of size {total} evenly across {n} "
            f"domain-parallel ranks ({total} % {n} = {extra}); pass uneven=True "
            f"to split it like numpy.array_split (the first {extra} rank(s) get "
            f"{base + 1} rows, the others {base})"
        )
    return [base + 1 if r < extra else base for r in range(n)]


def offsets(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """Start of each part, given the part sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(start)
        start += size
    return out


def neighbors(i: int, n: int, periodic: bool = False) -> tuple[int | None, int | None]:
    """``(prev, next)`` of part ``i`` of ``n`` along one dim; None past an edge unless ``periodic``.

    (With ``periodic``, a single part is its own neighbour.)
    """
    if not 0 <= i < n:
        raise ValueError(f"rank {i} is out of range for {n} ranks (valid: 0 to {n - 1})")
    prev = i - 1 if i > 0 else (n - 1 if periodic else None)
    nxt = i + 1 if i < n - 1 else (0 if periodic else None)
    return prev, nxt


@dataclass(frozen=True)
class Layout:
    """The sizes of every part in every split dimension: ``sizes[d][i]`` is part ``i`` along dim ``d``."""

    sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def bands(cls, sizes: list[int] | tuple[int, ...]) -> Layout:
        """Latitude bands: one split dimension (an ``(n, 1)`` grid)."""
        return cls((tuple(sizes),))

    @classmethod
    def of(cls, shape: tuple[int, ...], grid: tuple[int, ...], uneven: bool, dims: tuple = ()) -> Layout:
        """``shape[d]`` cut into ``grid[d]`` parts (:func:`split`); ``dims`` name the dims in messages."""
        names = tuple(dims) + (None,) * (len(shape) - len(dims))
        return cls(tuple(tuple(split(s, g, uneven, dim=name)) for s, g, name in zip(shape, grid, names, strict=True)))

    @property
    def grid(self) -> tuple[int, ...]:
        """Parts per dimension."""
        return tuple(len(s) for s in self.sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The global extent of every split dimension."""
        return tuple(sum(s) for s in self.sizes)

    def starts(self, d: int = 0) -> list[int]:
        """Start of every part along dim ``d``."""
        return offsets(self.sizes[d])

    def start(self, i: int, d: int = 0) -> int:
        """First index of part ``i`` along dim ``d``."""
        return sum(self.sizes[d][:i])

    def stop(self, i: int, d: int = 0) -> int:
        """One past the last index of part ``i`` along dim ``d``."""
        return self.start(i, d) + self.sizes[d][i]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Grid coordinates of ``rank`` (row-major)."""
        out = []
        for parts in reversed(self.grid):
            rank, c = divmod(rank, parts)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        """The rank at grid ``coords`` (row-major: the inverse of :meth:`coords`)."""
        rank = 0
        for c, parts in zip(coords, self.grid, strict=True):
            rank = rank * parts + c
        return rank

    def block(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(start, size)`` of ``rank``'s part in every split dimension."""
        return tuple((self.start(c, d), self.sizes[d][c]) for d, c in enumerate(self.coords(rank)))

    def owner(self, index: int, d: int = 0) -> int:
        """The part along dim ``d`` that holds global ``index`` (the last of equal starts: empty parts own nothing)."""
        if not 0 <= index < self.shape[d]:
            raise ValueError(f"index {index} is out of range for dim {d} of size {self.shape[d]}")
        return bisect.bisect_right(self.starts(d), index) - 1

    def neighbors(self, i: int, d: int = 0, periodic: bool = False) -> tuple[int | None, int | None]:
        """``(prev, next)`` parts along dim ``d`` next to part ``i``; None past an edge unless ``periodic``."""
        return neighbors(i, len(self.sizes[d]), periodic)

    @staticmethod
    def encode(extent: tuple[int, ...]) -> int:
        """One rank's extent (1 or 2 split dims) as the one count :func:`credit_mpi.validation.agree` shares."""
        if len(extent) == 1:
            return extent[0]
        rows, cols = extent
        if cols >= 1 << _SHIFT:
            raise ValueError(f"a block of {cols} columns is too wide (at most {(1 << _SHIFT) - 1})")
        return rows << _SHIFT | cols

    @staticmethod
    def decode(count: int, ndims: int = 2) -> tuple[int, ...]:
        """The extent that :meth:`encode` made one count of."""
        return (count,) if ndims == 1 else (count >> _SHIFT, count & ((1 << _SHIFT) - 1))
