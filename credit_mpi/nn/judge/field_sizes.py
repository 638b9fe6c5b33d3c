"""Field sizes: inside a converted forward, the sizes read along the sharded dim are the whole field's.

A model is written for the whole field: ``B, C, H, W = x.shape`` then ``assert H == self.img_size[0]``,
``if H % 2``, ``x.sum((2, 3), keepdim=True) / (H * W)``, ``x.view(B, C, H // ws, ws, W)``,
``F.pad(x, (0, 0, 0, (ws - H % ws) % ws))`` and ``x[:, :, :H]``. On a band, each of these must see
the field's ``H``, as DTensor and PhysicsNeMo's ShardTensor give. While a converted forward runs on
latitude bands (and in describe()'s dry run, which sees the field):

* ``x.shape``, ``x.size()``, ``x.size(d)``, ``x.numel()`` and ``len(x)`` of a band give the field's
  size along the sharded dim, an :class:`~credit_mpi.nn.judge.tracker.Extent` (an ``int`` of the
  field's value that also carries every band's): every comparison, branch and number computed from
  it (float arithmetic too) is the one process's, on every rank;
* the ops that take sizes or row indices along the sharded dim map them from the field to the band:
  a reshape is judged and run in the field's coordinates (:func:`reshape_band`: its output sizes
  are the field's, the band's share of the dim that holds the rows is computed from the band
  layout; a split into windows needs every band to hold whole windows), a slice, ``narrow`` and
  ``index_select`` over the sharded dim with field indices keep each band's share of the selected
  rows (:func:`select_rows`), ``F.pad`` pads the field's edges (the first and last band,
  :mod:`credit_mpi.nn.judge.indexing`), ``F.interpolate(size=)`` and the adaptive pools take the
  field's rows.

What it costs. The band layout of a tensor (every rank's rows) is what a size needs: the dry run has
it; at run time it is agreed the first time a forward reads a size of that tensor along the sharded
dim (or passes it sizes): one fixed-size ``Allgather`` (:func:`credit_mpi.ops.reband.agree_rows`)
per read, remembered as making no MPI call after it, so a later forward whose inputs are the last
one's (every training step of one shape) skips it on every rank
(:func:`credit_mpi.agreement.quiet_forward`); a tensor made by a reshape or a selection of a band
whose layout is known has its layout without an agreement. Nothing of it runs outside a converted
forward (the halo exchange and the gather are untouched), nor on a forward that reads no size of a
band.

On a latitude x longitude grid the same holds along both dims at once: each dim's judge (the latitude's
:class:`Tracker`, the longitude's :class:`~credit_mpi.nn.judge.longitude.LongitudeTracker`) replaces its own dim's
size with the field's; an :class:`Extent` then carries every RANK's value (:func:`per_rank`: rank ``r``'s block
height or width), so ``H * W`` is each block's token count rank by rank. Both layouts are agreed over the whole
domain (the grid rows' heights, the grid columns' widths). Ops that take sizes (a reshape, an expand, an
interpolation or adaptive pool size) get the block's values (:func:`block_sizes`) and are judged on the block;
slices, ``narrow`` and ``F.pad`` of the longitude take the field's indices (its first and last block pad). A size
read along a dim that merges a block's rows and columns (tokens) stays the block's, marked (``Extent.block``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ... import watchdog
from ...ops.reband import agree_rows
from .registry import Refusal, op_name
from .tracker import Extent, Sharded, Tracker, tracked_columns

__all__ = ["on_bands", "on_grid", "field_indices", "band_axis", "per_rank", "block_sizes", "band_layout", "field_extent", "field_shape", "reshaped_field", "reshape_band", "select_rows",
           "band_value"]


def on_bands(tr: Tracker) -> bool:
    """True where field sizes hold: latitude bands, an eager forward (a traced one's sizes are plain ints)."""
    return tracked_columns(tr) == 1 and not torch.compiler.is_compiling()


def on_grid(tr: Tracker) -> bool:
    """True at run time on a latitude x longitude grid of more than one column, eager (sizes read are the field's,
    the ops that take sizes get the block's: :func:`block_sizes`)."""
    return tr.manager is not None and tracked_columns(tr) > 1 and not torch.compiler.is_compiling()


def field_indices(tr: Tracker) -> bool:
    """True where indices given along the tracked dim are the field's (a slice, ``narrow``): eager forwards, on latitude
    bands and along both dims of a grid (each judge its own dim)."""
    return not torch.compiler.is_compiling()


def _always(counts: Any) -> bool:
    return True


def band_axis(tr: Tracker) -> tuple[int, int, tuple[int, ...] | None]:
    """At run time: ``(this rank's band along the tracker's dim, this rank's index in an Extent's values, the band of
    every rank of the domain in rank order: None on latitude bands, where it is the rank)``.

    On a latitude x longitude grid the latitude's bands are the grid rows (rank ``r`` holds band ``r // cols``), the
    longitude's the grid columns (``r % cols``: the :class:`~credit_mpi.nn.judge.longitude.LongitudeTracker`'s
    manager is a view of the grid row); an :class:`Extent`'s ``bands`` are then every RANK's value, so that sizes read
    along both dims combine rank by rank (``H * W``: each block's tokens).
    """
    got = tr.__dict__.get("_band_axis")
    if got is None:
        from ...grid import grid_of

        m = tr.manager
        if getattr(m, "grid_rank", None) is not None:  # the longitude's judge: a grid row's view
            (rows, cols), rank = m.grid, m.grid_rank
            got = (rank % cols, rank, tuple(r % cols for r in range(rows * cols)))
        else:
            rows, cols = grid_of(m, m.domain_parallel_size)
            rank = m.domain_rank
            got = (rank, rank, None) if cols == 1 else (rank // cols, rank, tuple(r // cols for r in range(rows * cols)))
        tr._band_axis = got
    return got


def per_rank(tr: Tracker, values: Any) -> tuple[int, ...]:
    """Every rank's value from every band's (the same on latitude bands; on a grid, each rank its band's)."""
    if tr.manager is None:
        return tuple(values)
    of = band_axis(tr)[2]
    return tuple(values) if of is None else tuple(values[b] for b in of)


def band_layout(tr: Tracker, t: torch.Tensor, p: Sharded) -> tuple[int, ...]:
    """Every band's rows of ``t`` (in rows of its placement: ``t.shape[p.dim] // (outer * inner)``), in band order.

    The dry run: the layout a reshape or a selection gave it, else its height's. At run time: known when the forward made ``t``
    from a band of known layout, else agreed (collective over the domain: every rank reads the same
    sizes at the same point of the same forward, as one process does; a repeat of a forward with
    the last one's inputs skips the agreement). On a latitude x longitude grid the bands are the grid's rows (the
    latitude's judge) or columns (the longitude's), agreed over the whole domain: every rank's rows, each band's
    from its first rank.
    """
    rows = t.shape[p.dim] // (p.outer * p.inner)
    if tr.manager is None:  # the layout a reshape or a selection here gave it, else its height's
        rec = tr.record_of(t)
        if rec is not None and rec.bands is not None and sum(rec.bands) == rows:
            return rec.bands
        return tuple(int(s) for s in tr.band_sizes(rows))
    rec = tr.record(t)
    band, _, of = band_axis(tr)
    if rec.bands is not None and rec.bands[band] == rows:
        return rec.bands
    tr.field_reads += 1
    path = f"{tr.stack[-1][0]}: the field's size along the sharded dim (read {tr.field_reads})"
    seq = watchdog.STATE.seq
    # over the whole domain on a grid too (the longitude's judge: not its grid row), where a rank that failed alone
    # meets it with its failure (the ForwardGuard's agreement); a grid's blocks differ in their other dims
    comm = getattr(tr.manager, "grid_group", None) or tr.manager.domain_group
    whole = of is None
    with torch._C.DisableTorchFunction():  # the agreement's own tensor calls are not the model's
        (sizes,) = agree_rows([rows], [t] if whole else [], p.dim, comm, path, quiet=_always)
    made = watchdog.STATE.seq - seq  # moves no data (a module running a phantom window may make it)
    tr.size_agreements += made
    owner = getattr(tr, "_owner", None)
    if owner is not None:  # the longitude's agreements, inside the latitude's module rules too
        owner.size_agreements += made
    if not whole:  # every rank's rows: each grid row's, from its first rank
        sizes = [sizes[of.index(b)] for b in range(max(of) + 1)]
    rec.bands = tuple(int(s) for s in sizes)
    return rec.bands


def keep_bands(tr: Tracker, t: torch.Tensor, q: Sharded, sizes: tuple[int, ...]) -> None:
    """``t`` (placed at ``q``) has the band layout ``sizes``: remembered (at run time: no agreement when a size of it
    is read); in the dry run also its own layout (:meth:`Tracker.keep_layout`)."""
    sizes = tuple(int(s) for s in sizes)
    tr.record(t).bands = sizes
    if tr.manager is not None:
        return
    # the dry run: its own layout, also where it is its height's here (inside a module re-banded to whole windows the
    # layers' rows are planned from a tensor's own layout, else from the layout of its height outside the module)
    tr.keep_layout(t, list(sizes))


def field_shape(t: torch.Tensor, p: Sharded, sizes: tuple[int, ...]) -> list[int]:
    """``t``'s shape on the whole field (the band's dim holds every band's rows)."""
    shape = [int(v) for v in t.shape]
    shape[p.dim] = p.outer * sum(sizes) * p.inner
    return shape


def field_extent(tr: Tracker, t: torch.Tensor, p: Sharded) -> Extent:
    """The field's size of ``t`` along its band's dim, with every rank's (:func:`per_rank`)."""
    sizes = band_layout(tr, t, p)
    merged = p.outer * p.inner
    if tr.manager is None and merged * sum(sizes) != t.shape[p.dim]:  # phantom windows (see reshape_band)
        return Extent(t.shape[p.dim], [merged * s for s in sizes])
    return Extent(merged * sum(sizes), per_rank(tr, [merged * s for s in sizes]))


def field_numel(tr: Tracker, t: torch.Tensor, p: Sharded, read: int | None = None) -> Extent:
    """The field's element count of ``t``, with every rank's. On a grid at run time ``read`` is the count the judges
    under this one gave (the latitude's, scaled to its field): scaled along this judge's dim too."""
    sizes = band_layout(tr, t, p)
    if read is not None and tr.manager is not None and band_axis(tr)[2] is not None:
        merged, band = p.outer * p.inner, band_axis(tr)[0]
        mine = merged * sizes[band]
        theirs = getattr(read, "bands", None) or (int(read),) * len(band_axis(tr)[2])
        if mine:
            return Extent(int(read) // mine * merged * sum(sizes),
                          [v // mine * merged * s for v, s in zip(theirs, per_rank(tr, sizes), strict=True)])
    rest = math.prod(v for i, v in enumerate(t.shape) if i != p.dim) * p.outer * p.inner
    return Extent(rest * sum(sizes), per_rank(tr, [rest * s for s in sizes]))


def band_value(tr: Tracker, size: Any) -> int:
    """This rank's value of a size read along a band (an :class:`Extent`; a plain int is itself)."""
    bands = getattr(size, "bands", None)
    if bands is None or tr.manager is None:
        return int(size)
    return int(bands[band_axis(tr)[1]])


def block_sizes(tr: Tracker, tree: Any) -> Any:
    """On a latitude x longitude grid at run time: the sizes in ``tree`` read from the field (:class:`Extent`) as this
    rank's block's, still marked (a reshape, an expand, an interpolation's size are then judged on the block, as
    before sizes were the field's). A size of the field whose block value is not known is refused."""
    def local(v: Extent) -> Extent:
        if v.bands is None:
            if v.block:
                return v
            raise Refusal(f"it is given a size {int(v)} computed from the field's sizes whose share on each block of the "
                          f"latitude x longitude grid is not known (an empty block divided?)")
        out = Extent(v.bands[band_axis(tr)[1]], v.bands)
        out.block = v.block
        return out

    return tree_map_only(Extent, local, tree)


def reshaped_field(shape_in: list[int], p: Sharded, shape_out: list[int],
                   sizes: tuple[int, ...]) -> tuple[Sharded, tuple[int, ...]]:
    """Where the band's rows go when the FIELD of shape ``shape_in`` (bands ``sizes`` along ``p``) is reshaped to
    ``shape_out``: ``(placement, the output's band layout)``, or :class:`Refusal`.

    In flat-index terms the field's rows are the digits of strides ``[after, after * rows)``. The
    output dim ``j`` that holds the top digit either holds every row digit (merged with whole
    neighbours: ``Sharded(j, outer, inner)``, the same layout) or holds windows of ``w`` rows whose
    rows lie in the dims after it (``Sharded(j, outer, 1)`` of the window counts: every band must
    be a whole number of windows). Anything else splits the rows so that no band keeps its own.
    """
    rows = sum(sizes)
    after = p.inner * math.prod(shape_in[p.dim + 1:])
    top = after * rows
    for j, size in enumerate(shape_out):
        stride = math.prod(shape_out[j + 1:])
        if not stride < top <= stride * size:
            continue
        if (stride * size) % top == 0:
            outer = stride * size // top
            if after % stride == 0:
                return Sharded(j, outer, after // stride), tuple(sizes)
            if stride % after == 0 and rows % (stride // after) == 0:
                window = stride // after
                if any(s % window for s in sizes):
                    raise Refusal(f"it splits the sharded dim into windows of {window} rows, and not every band is a "
                                  f"whole number of windows (bands of {list(sizes)} rows of the field's {rows}): "
                                  f"choose band sizes that are multiples of {window}, or give the module a "
                                  f"window_size attribute (its input is then re-banded to whole windows)")
                return Sharded(j, outer, 1), tuple(s // window for s in sizes)
        break
    raise Refusal(f"a reshape of the field {tuple(shape_in)} (bands along {p.describe()}) to {tuple(shape_out)} mixes "
                  f"the rows of the sharded dim with other dims so that no band keeps its own rows whole")


def reshape_band(tr: Tracker, func, args: tuple, kwargs: dict, x: torch.Tensor, p: Sharded) -> torch.Tensor:
    """A reshape of band ``x`` judged and run in the field's coordinates (the sizes it was given are the field's)."""
    sizes = band_layout(tr, x, p)
    if sum(sizes) <= 1 or (tr.manager is None and p.outer * sum(sizes) * p.inner != x.shape[p.dim]):
        # a field of one row (no band holds more than it), or the dry run inside a module whose bands without a
        # window run a phantom one (its layout holds more rows than the field): the band's own reshape
        return None
    key = _reshape_key(func, x, p, sizes, args, kwargs) if tr.manager is not None else None
    if key is not None and (known := _RESHAPES.get(key)) is not None:  # a repeat: the field's arithmetic is done
        q, out_sizes, band_out, view = known
        out = x.view(band_out) if view else x.reshape(band_out)
        tr.set(out, q)
        keep_bands(tr, out, q, out_sizes)
        return out
    shape_in = field_shape(x, p, sizes)
    if tr.manager is None:
        field_in = x
    else:
        field_in = torch.empty(shape_in, device="meta", dtype=x.dtype)
    try:
        field_out = func(field_in, *args[1:], **kwargs)
    except RuntimeError as exc:
        raise Refusal(f"the reshape does not fit the field ({exc})") from None
    shape_out = [int(v) for v in field_out.shape]
    q, out_sizes = reshaped_field(shape_in, p, shape_out, sizes)
    if tr.manager is None:
        out = field_out
    else:
        band_out = list(shape_out)
        band_out[q.dim] = shape_out[q.dim] * (x.shape[p.dim] // (p.outer * p.inner)) // sum(sizes)
        view = op_name(func) in ("view",)
        out = x.view(band_out) if view else x.reshape(band_out)
        if key is not None:
            if len(_RESHAPES) >= 1024:
                _RESHAPES.clear()
            _RESHAPES[key] = (q, tuple(out_sizes), tuple(band_out), view)
    tr.set(out, q)
    keep_bands(tr, out, q, out_sizes)
    return out


# a run-time reshape's answer by what decides it (the function, the band's shape, placement and layout, the sizes
# asked for): a model's forward reshapes the same bands step after step (WXFormer: ~110 a step)
_RESHAPES: dict[tuple, tuple] = {}


def _reshape_key(func, x: torch.Tensor, p: Sharded, sizes: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """The key of :data:`_RESHAPES` for this call, None when an argument is not plain ints (then nothing is kept)."""
    try:
        return (func, tuple(x.shape), p, tuple(sizes), _plain_ints(args[1:]), _plain_ints(tuple(sorted(kwargs.items()))))
    except (TypeError, ValueError):
        return None


def _plain_ints(v: Any) -> Any:
    """``v`` (ints, strs and nested tuples / lists / sizes of them) as a hashable tuple of plain ints; TypeError otherwise."""
    if isinstance(v, (tuple, list)):
        return tuple(_plain_ints(e) for e in v)
    if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
        return v if isinstance(v, str) else int(v)
    raise TypeError(type(v).__name__)


def _row_range(index: Any, rows: int) -> tuple[int, int] | None:
    """``(start, stop)`` of a slice of step one over ``rows`` rows (None: another step)."""
    start, stop, step = slice(*(None if v is None else int(v) for v in (index.start, index.stop, index.step))).indices(rows)
    if step != 1:
        return None
    return start, max(start, stop)


def select_rows(tr: Tracker, x: torch.Tensor, p: Sharded, wanted: Any, what: str) -> tuple[Any, tuple[int, ...]]:
    """The band's share of the field's rows ``wanted`` (a slice of step one, or a sorted 1-D index tensor of field
    rows): ``(local index: a slice or an index tensor, every band's rows after)``; Refusal otherwise. Rows merged
    with whole inner ones (``Sharded(dim, 1, inner)``) are a block of the dim: the output is a plain band
    (``Sharded(dim)``) of those."""
    if p.outer != 1:
        raise Refusal(f"{what} selects rows of a dim that holds the bands' rows merged with another ({p.describe()})")
    sizes = tuple(p.inner * s for s in band_layout(tr, x, p))  # rows merged with whole inner ones: a block of the dim
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    rank = 0 if tr.manager is None else band_axis(tr)[0]
    if isinstance(wanted, slice):
        got = _row_range(wanted, sum(sizes))
        if got is None:
            raise Refusal(f"{what} selects every n-th row of the sharded dim (a slice step): no rule on bands")
        a, b = got
        after = tuple(max(0, min(b, o + s) - max(a, o)) for o, s in zip(starts, sizes, strict=True))
        if tr.manager is None:
            return slice(a, b), after
        lo = min(max(a - starts[rank], 0), sizes[rank])
        return slice(lo, lo + after[rank]), after
    idx = wanted
    with torch._C.DisableTorchFunction():
        if idx.ndim != 1 or idx.dtype in (torch.bool,) or idx.is_floating_point():
            raise Refusal(f"{what} indexes the sharded dim with a tensor that is not a 1-D index of rows")
        idx = torch.where(idx < 0, idx + sum(sizes), idx)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= sum(sizes)):
            raise Refusal(f"{what} indexes rows outside the field's {sum(sizes)}")
        if idx.numel() > 1 and not bool((idx[1:] >= idx[:-1]).all()):
            raise Refusal(f"{what} takes the field's rows out of order (a permutation of the sharded dim: no rule on "
                          f"bands; a sorted index keeps each band's rows)")
        after = tuple(int(((idx >= o) & (idx < o + s)).sum()) for o, s in zip(starts, sizes, strict=True))
        if tr.manager is None:
            return wanted, after
        o, s = starts[rank], sizes[rank]
        local = idx[(idx >= o) & (idx < o + s)] - o
    return local, after
