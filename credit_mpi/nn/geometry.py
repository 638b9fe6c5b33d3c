"""Band geometry of the model-side layers: pure index arithmetic, no MPI, no torch.

A global extent of ``H`` rows along the sharded dimension is cut into
consecutive bands ``sizes`` (one per domain rank, in rank order). For each
layer family this module answers, for every rank at once (so that every rank
derives the same answer from the same agreed ``sizes``):

* which global OUTPUT rows the rank computes (its output band), and
* which global INPUT rows it needs for that (possibly beyond its own band:
  the halo rows before/after, or padding rows outside ``[0, H)``).

Ownership rules (the output bands are contiguous, in rank order, and cover
the output exactly once):

Windows (convolution, pooling)
    Output row ``i`` reads input rows ``[s*i - p, s*i - p + d*(k-1)]``
    (``k`` kernel, ``s`` stride, ``d`` dilation, ``p`` padding before). Its
    *anchor* is input row ``s*i``: output row ``i`` belongs to the rank that
    owns input row ``s*i``; the first rank also takes nothing before row 0
    (there is none) and the last rank takes every output row whose anchor
    lies at or beyond ``H`` (right padding, ``ceil_mode``). So a band
    ``[a, b)`` computes ``[ceil(a/s), ceil(b/s))``. With stride 1 the output
    band is the input band (``"same"`` padding keeps the layout). When every
    band offset is a multiple of ``s`` ("stride-aligned") the output offsets
    are ``a/s``, which a matching transposed layer maps back to ``a``: that is
    what keeps the bands of a UNet's skip connections equal.
Transposed convolution
    Output row ``j`` belongs to the rank that owns input row ``j // s``: a band
    ``[a, b)`` owns ``[s*a, s*b)`` (the first from 0, the last up to the
    output size, ``output_padding`` included). Each band computes the full
    transposed convolution of its rows (output rows ``[s*a - p, s*(b-1) - p
    + d*(k-1) + 1)``); the rows beyond its own are added to the neighbours'
    (overlap-add).
Resampling (interpolation, adaptive pooling)
    Output row ``j`` belongs to the rank that owns input row
    ``(j * H) // H_out`` (the input row under the output row's start); the
    input rows needed are those with a non-zero weight.

A layout is refused (before any data moves) when a rank would compute no
output row, or when a rank needs more rows from a neighbour than the
neighbour holds (halos come from the immediate neighbour only): see
:func:`min_band_rows` and :class:`LayerBands`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import offsets

__all__ = [
    "Band",
    "LayerBands",
    "ceil_div",
    "conv_out_size",
    "conv_layout",
    "transposed_out_size",
    "transposed_layout",
    "resample_layout",
]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``)."""
    return -(-a // b)


def conv_out_size(size: int, kernel: int, stride: int, dilation: int, before: int, after: int, ceil_mode: bool = False) -> int:
    """torch's output size of a convolution / pooling window along one dimension.

    ``before``/``after`` are the paddings on the two sides; ``ceil_mode`` is
    pooling's rule (the last window must start inside the input or the
    padding before it).
    """
    span = size + before + after - dilation * (kernel - 1) - 1
    if span < 0:
        return 0
    if ceil_mode:
        out = ceil_div(span, stride) + 1
        if (out - 1) * stride >= size + before:
            out -= 1
        return out
    return span // stride + 1


def transposed_out_size(size: int, kernel: int, stride: int, dilation: int, padding: int, output_padding: int) -> int:
    """torch's output size of a transposed convolution along one dimension."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


@dataclass(frozen=True)
class Band:
    """One rank's part of a layer, in global rows of the sharded dimension.

    ``out_start:out_stop`` are the output rows it computes; ``in_lo:in_hi``
    the input rows it reads (``in_lo < 0`` or ``in_hi > H`` reach into the
    padding); ``start:stop`` its own input band.
    """

    start: int
    stop: int
    out_start: int
    out_stop: int
    in_lo: int
    in_hi: int

    @property
    def before(self) -> int:
        """Rows needed before the own band (negative: the band's first rows are not read)."""
        return self.start - self.in_lo

    @property
    def after(self) -> int:
        """Rows needed after the own band."""
        return self.in_hi - self.stop

    @property
    def out_rows(self) -> int:
        return self.out_stop - self.out_start


@dataclass(frozen=True)
class LayerBands:
    """Every rank's :class:`Band` of one layer, plus the agreed halo width.

    ``width`` is the symmetric halo every rank exchanges (the largest need of
    any rank on either side); ``problem`` is ``None`` when the layout runs
    exactly, else why it does not (and ``min_rows``, the band height every
    rank needs).
    """

    size: int
    out_size: int
    bands: tuple[Band, ...]
    width: int
    min_rows: int
    problem: str | None

    @property
    def out_sizes(self) -> list[int]:
        return [b.out_rows for b in self.bands]


def _finish(size: int, out_size: int, bands: list[Band], step: int = 1, what: str = "input") -> LayerBands:
    n = len(bands)
    width = max([0] + [max(b.before, b.after, 0) for b in bands])
    problem = None
    for r, b in enumerate(bands):
        if b.out_rows <= 0:
            problem = f"domain rank {r} (rows {b.start}:{b.stop}) would compute no output row (of {out_size})"
            break
    if problem is None and n > 1:
        for r, b in enumerate(bands):
            if b.stop - b.start < width:
                problem = (
                    f"a halo of {width} row(s) comes from the neighbouring band only, but domain rank {r} "
                    f"holds {b.stop - b.start} {what} row(s)"
                )
                break
    # every band must supply the halo, and hold at least one stride's worth of rows to own an output row
    min_rows = max(width, step, 1)
    return LayerBands(size, out_size, tuple(bands), width, min_rows, problem)


def conv_layout(
    sizes: list[int],
    kernel: int,
    stride: int = 1,
    dilation: int = 1,
    before: int = 0,
    after: int = 0,
    ceil_mode: bool = False,
) -> LayerBands:
    """The window rule (see the module docstring) for bands ``sizes``."""
    size = sum(sizes)
    out_size = conv_out_size(size, kernel, stride, dilation, before, after, ceil_mode)
    starts = offsets(sizes)
    n = len(sizes)
    bands = []
    for r, (a, rows) in enumerate(zip(starts, sizes, strict=True)):
        b = a + rows
        o0 = 0 if r == 0 else min(ceil_div(a, stride), out_size)
        o1 = out_size if r == n - 1 else min(ceil_div(b, stride), out_size)
        o1 = max(o1, o0)
        lo = stride * o0 - before
        hi = stride * (o1 - 1) - before + dilation * (kernel - 1) + 1 if o1 > o0 else lo
        bands.append(Band(a, b, o0, o1, lo, hi))
    return _finish(size, out_size, bands, step=stride)


def transposed_layout(
    sizes: list[int], kernel: int, stride: int = 1, dilation: int = 1, padding: int = 0, output_padding: int = 0
) -> LayerBands:
    """The transposed rule (see the module docstring).

    ``in_lo:in_hi`` of each band are here the OUTPUT rows its own rows
    contribute to (before the overlap-add), and ``width`` the overlap that
    the neighbours exchange; the band sizes that must hold the overlap are
    the OUTPUT bands.
    """
    size = sum(sizes)
    out_size = transposed_out_size(size, kernel, stride, dilation, padding, output_padding)
    starts = offsets(sizes)
    n = len(sizes)
    bands = []
    for r, (a, rows) in enumerate(zip(starts, sizes, strict=True)):
        b = a + rows
        o0 = 0 if r == 0 else min(stride * a, out_size)
        o1 = out_size if r == n - 1 else min(stride * b, out_size)
        o1 = max(o1, o0)
        lo = stride * a - padding
        hi = stride * (b - 1) - padding + dilation * (kernel - 1) + 1 if rows else lo
        # expressed against the OUTPUT band: before/after are the overlaps into the neighbours
        bands.append(Band(o0, o1, o0, o1, lo, hi))
    lay = _finish(size, out_size, bands, what="output")
    if lay.problem is None and any(rows == 0 for rows in sizes):
        lay = LayerBands(lay.size, lay.out_size, lay.bands, lay.width, lay.min_rows, "a band holds no input row")
    return lay


def resample_layout(sizes: list[int], out_size: int, support: list[tuple[int, int]],
                    out_sizes: list[int] | None = None) -> LayerBands:
    """The resampling rule: ``support[j]`` is the input row range ``(lo, hi)`` with non-zero weight for output row j.

    ``out_sizes``: the output bands given (a size stored for the whole field: its partition over
    the domain, as the model's other tensors of that many rows have it) instead of the rule's.
    """
    size = sum(sizes)
    starts = offsets(sizes)
    n = len(sizes)
    out_offsets = None if out_sizes is None else offsets(out_sizes)
    bands = []
    for r, (a, rows) in enumerate(zip(starts, sizes, strict=True)):
        b = a + rows
        if out_offsets is not None:
            o0, o1 = out_offsets[r], out_offsets[r] + out_sizes[r]
        else:
            o0 = 0 if r == 0 else min(ceil_div(a * out_size, size), out_size)
            o1 = out_size if r == n - 1 else min(ceil_div(b * out_size, size), out_size)
        o1 = max(o1, o0)
        if o1 > o0:
            lo = min(support[j][0] for j in range(o0, o1))
            hi = max(support[j][1] for j in range(o0, o1))
        else:
            lo = hi = a
        bands.append(Band(a, b, o0, o1, lo, hi))
    return _finish(size, out_size, bands)


@dataclass(frozen=True)
class RowGeometry:
    """What one layer call does to the rows of the sharded dim: the one answer its forward, ``describe()`` and the
    traffic count read (each layer class says it once, in ``dp_geometry``).

    ``layout`` is ``None`` for a layer whose output keeps the input's bands
    (pointwise, or statistics over every band); ``stride`` is the one skip
    connections must respect; ``boundary`` the halo's outer edge (a
    :data:`credit_mpi.partition.BOUNDARIES` name, ``"replicate"``, or ``None``
    for an overlap-add, which has no halo check); ``note`` what ``describe()``
    says of it.
    """

    layout: LayerBands | None = None
    stride: int = 1
    boundary: str | None = "zero"
    note: str = ""
