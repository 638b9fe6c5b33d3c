"""Band helpers of the 1-D path: sizes, offsets and the row datatypes.

The arithmetic of who owns what lives in :mod:`credit_mpi.layout`; the
functions here are its band-shaped (one split dimension) face. A global
extent of ``total`` rows along the sharded dimension is cut into ``n``
consecutive bands, one per rank of a domain group. Two layouts:

* even (the reference's default): every rank gets ``total // n`` rows and
  ``total`` must be divisible by ``n``;
* uneven: the layout of :func:`numpy.array_split` / :func:`torch.tensor_split`,
  the first ``total % n`` ranks get one extra row (ERA5's 721 latitudes on
  2, 4 or 8 ranks).

The module also builds the MPI derived datatypes that let a collective land
each rank's band straight in its place in one output buffer, and holds the
halo's boundary table (:data:`BOUNDARIES`: what a halo holds past an outer
edge, along any split dim) with the width check that reads it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from mpi4py import MPI

from .layout import Layout, neighbors, split

__all__ = [
    "normalize_dim",
    "band_sizes",
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


def band_sizes(total: int, n: int, uneven: bool = False, *, dim: int | None = None) -> list[int]:
    """Rows owned by each of ``n`` ranks when ``total`` rows are split (:func:`credit_mpi.layout.split`).

    Args:
        total: Global size of the sharded dimension.
        n: Number of ranks in the domain group.
        uneven: Allow ``total % n != 0`` (``numpy.array_split`` layout).
        dim: The dimension being split, as the caller named it (for the
            message; the reference's words: ``Cannot shard dim {dim} ...``).

    Raises:
        ValueError: ``n < 1``, ``total < 0``, or ``total`` is not divisible by
            ``n`` and ``uneven`` is false.
    """
    return split(total, n, uneven, dim=dim)


def band_range(total: int, n: int, rank: int, uneven: bool = False) -> tuple[int, int]:
    """``(start, stop)`` rows owned by ``rank`` of ``n``."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is out of range for {n} ranks (valid: 0 to {n - 1})")
    layout = Layout.bands(band_sizes(total, n, uneven))
    return layout.start(rank), layout.stop(rank)


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


# -- halo exchange -------------------------------------------------------

@dataclass(frozen=True)
class Boundary:
    """What a halo holds past an outer edge of the domain along one split dim: one row of :data:`BOUNDARIES`.

    The halo exchange (:mod:`credit_mpi.ops.halo`) reads only these fields,
    the same way along every split dim, so a boundary made of them is one
    table entry (and its test).
    """

    name: str
    wraps: bool = False  # the first and the last part are neighbours (the halo comes from the other end)
    mirror: int | None = None  # the halo is the edge rows flipped, the first ``mirror`` edge rows skipped; None: zeros
    fold: bool = False  # across the pole: the mirrored rows come from the longitudes half the globe away
    latitude_only: bool = False  # a latitude edge only (the 2-D grid's longitude boundary may not be it)


BOUNDARIES = {b.name: b for b in (
    Boundary("zero"),  # the reference's behaviour
    Boundary("periodic", wraps=True),  # numpy.pad(mode="wrap"), torch's "circular"
    Boundary("reflect", mirror=1),  # mode="reflect": padded row -k is row k
    Boundary("earth", mirror=0, fold=True, latitude_only=True),  # CREDIT's TensorPadding(mode="earth"): row -k is row k - 1, half the globe away
)}
HALO_BOUNDARIES = tuple(BOUNDARIES)
_UNLISTED = Boundary("", wraps=True)  # check_halo_width of a name not in the table: every band supplies width rows


def halo_neighbors(rank: int, n: int, periodic: bool) -> tuple[int | None, int | None]:
    """``(prev, next)`` domain ranks that exchange halos with ``rank`` of ``n``.

    ``None`` at an outer edge, except with ``periodic`` where the first and
    the last rank are neighbours (a single rank is its own neighbour).
    """
    return neighbors(rank, n, periodic)


def check_halo_width(sizes: list[int], width: int, boundary: str, dim: int) -> None:
    """Raise ``ValueError`` unless a halo of ``width`` rows fits the bands ``sizes``.

    Halos come from the neighbouring band only, so ``width`` may not exceed
    any band that has to supply one; ``"reflect"`` mirrors without the edge
    row, so the outer bands need ``width + 1`` rows (``torch.nn.functional.pad``'s
    rule on one rank); a single ``"zero"`` band accepts any width. ``sizes``
    are agreed across ranks, so every rank raises the same error.
    """
    if width == 0:
        return
    n, rule = len(sizes), BOUNDARIES.get(boundary, _UNLISTED)
    skip = rule.mirror or 0  # the edge rows a mirrored halo steps over
    if n == 1 and rule.mirror is None and not rule.wraps:  # a single band's halo reads no row ("zero")
        return
    for rank, size in enumerate(sizes):
        need = width + skip if rank in (0, n - 1) else width
        if size < need:
            why = (
                f"{boundary} mirrors without repeating the edge row, so an outer band needs halo_width + {skip} rows"
                if need > width
                else "a halo may not be wider than the band that supplies it"
            )
            raise ValueError(
                f"halo_width={width} with boundary={boundary!r} does not fit: domain rank {rank} "
                f"holds {size} row(s) along dim {dim} (bands: {sizes}); {why}. Use halo_width <= "
                f"{max(0, min(sizes) - skip)} or fewer domain ranks"
            )


def halo_edge_rows(boundary: str, rows: int, width: int, side: str) -> int | None:
    """First local row of the ``width`` rows that, flipped, form an outer-edge halo.

    ``side`` is ``"before"`` (row 0 side) or ``"after"``. ``None`` when the
    halo is not built from the band's own rows (``"zero"``; ``"periodic"``
    comes from the other end of the domain). For ``"reflect"`` the edge row
    itself is skipped (padded row ``-k`` is row ``k``); for ``"earth"`` it is
    not (padded row ``-k`` is row ``k - 1``, rolled by half the longitudes).
    """
    if side not in ("before", "after"):
        raise ValueError(f"side must be 'before' or 'after', got {side!r}")
    skip = BOUNDARIES.get(boundary, _UNLISTED).mirror
    if skip is None:
        return None
    return skip if side == "before" else rows - skip - width
