"""Who owns which rows: the one place that does index arithmetic.

A global extent of ``total`` rows along the sharded dimension is cut into
``n`` consecutive bands, one per rank of a domain group. Two layouts:

* even (the reference's default): every rank gets ``total // n`` rows and
  ``total`` must be divisible by ``n``;
* uneven: the layout of :func:`numpy.array_split` / :func:`torch.tensor_split`,
  the first ``total % n`` ranks get one extra row (ERA5's 721 latitudes on
  2, 4 or 8 ranks).

The module also builds the MPI derived datatypes that let a collective land
each rank's band straight in its place in one output buffer.
"""

from __future__ import annotations

import operator

from mpi4py import MPI

__all__ = [
    "normalize_dim",
    "band_sizes",
    "band_offsets",
    "band_range",
    "row_datatypes",
]


def normalize_dim(dim: int, ndim: int) -> int:
    """Return ``dim`` as a non-negative axis of an ``ndim``-dimensional array.

    Raises:
        ValueError: ``dim`` is not an integer in ``[-ndim, ndim)``.
    """
    try:
        dim = operator.index(dim)
    except TypeError:
        raise ValueError(f"dim must be an integer, got {dim!r}") from None
    if ndim < 1:
        raise ValueError(f"cannot shard a {ndim}-dimensional (scalar) array; need ndim >= 1")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"dim {dim} is out of range for a {ndim}-dimensional array "
            f"(valid: {-ndim} to {ndim - 1})"
        )
    return dim % ndim


def band_sizes(total: int, n: int, uneven: bool = False) -> list[int]:
    """Rows owned by each of ``n`` ranks when ``total`` rows are split.

    Args:
        total: Global size of the sharded dimension.
        n: Number of ranks in the domain group.
        uneven: Allow ``total % n != 0`` (``numpy.array_split`` layout).

    Raises:
        ValueError: ``n < 1``, ``total < 0``, or ``total`` is not divisible by
            ``n`` and ``uneven`` is false.
    """
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"size must be >= 0, got {total}")
    base, extra = divmod(total, n)
    if extra and not uneven:
        raise ValueError(
            f"cannot shard a dimension of size {total} evenly across {n} "
            f"domain-parallel ranks ({total} % {n} = {extra}); pass uneven=True "
            f"to split it like numpy.array_split (the first {extra} rank(s) get "
            f"{base + 1} rows, the others {base})"
        )
    return [base + 1 if r < extra else base for r in range(n)]


def band_offsets(sizes: list[int]) -> list[int]:
    """Start row of each band, given the band sizes."""
    offsets, start = [], 0
    for size in sizes:
        offsets.append(start)
        start += size
    return offsets


def band_range(total: int, n: int, rank: int, uneven: bool = False) -> tuple[int, int]:
    """``(start, stop)`` rows owned by ``rank`` of ``n``."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is out of range for {n} ranks (valid: 0 to {n - 1})")
    sizes = band_sizes(total, n, uneven)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def row_datatypes(
    outer: int, band_rows: int, total_rows: int, row_bytes: int
) -> tuple[MPI.Datatype, MPI.Datatype]:
    """Datatypes that move one "row" of a band across every outer slice.

    View a C-contiguous array as ``(outer, rows, row_bytes)`` bytes, where
    ``outer`` is the product of the dimensions before the sharded one and
    ``row_bytes`` covers the dimensions after it. One element of either
    returned type is *row j of every outer slice*:

    * the send type walks a band of ``band_rows`` rows (the local shard);
    * the receive type walks the global array of ``total_rows`` rows.

    Both are resized to an extent of one row, so a count of ``k`` moves ``k``
    consecutive rows and a displacement of ``d`` starts at global row ``d``.
    Their type signatures match (``outer * row_bytes`` bytes per element),
    which is what lets ``Allgatherv`` land each band straight in its place.
    The caller frees both.
    """
    send = _row_type(outer, band_rows, row_bytes)
    recv = _row_type(outer, total_rows, row_bytes)
    return send, recv


def _row_type(outer: int, rows: int, row_bytes: int) -> MPI.Datatype:
    if outer == 1:
        dtype = MPI.BYTE.Create_contiguous(row_bytes)
    else:
        vector = MPI.BYTE.Create_vector(outer, row_bytes, rows * row_bytes)
        dtype = vector.Create_resized(0, row_bytes)
        vector.Free()
    return dtype.Commit()
