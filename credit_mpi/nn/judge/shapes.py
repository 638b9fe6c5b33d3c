"""Shape rules: views, reshapes, permutes, expands, joins and pixel (un)shuffles, judged by where the band's rows go.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_map_only

from ...partition import normalize_dim
from ...transport import paths
from ..replicated import is_replicated
from .field_sizes import (
    band_axis,
    band_layout,
    block_sizes,
    field_extent,
    field_numel,
    field_shape,
    on_bands,
    on_grid,
    reshape_band,
)
from .field_values import field_partner, join_replicated
from .registry import MISS, Refusal, argument, op_name, rule
from .tracker import Extent, Sharded, Tracker, follows_band, grid_columns, tracked_columns

RESHAPES = "reshape view view_as reshape_as flatten unflatten squeeze unsqueeze ravel".split()


def _reshaped(tr: Tracker, shape_in: tuple, p: Sharded, shape_out: tuple, requested: list | None = None) -> Sharded:
    """The placement after a reshape, or Refusal when the band's rows do not stay whole.

    In flat-index terms the band's rows are the digits of strides ``[after, after * rows)``. A split
    into windows (an output dim of stride ``after * window``, ``1 < window <= rows``, holding the
    window count) is looked for first. ``requested`` (the sizes the forward asked for, when it gave
    them) tells a window count that follows the band (``H // w`` read from ``x.shape``, or ``-1``:
    an :class:`Extent`) over a window size fixed in the model (``w``): only such a count may be one window per
    band (a count dim of size one is otherwise indistinguishable from a dim of whole rows, so
    without ``requested`` every band must hold two windows). Otherwise an output dim that holds
    those digits whole carries the band (merged with its neighbours); a size the forward gave for
    it must follow the band too, else it was stored for the whole field, which the bands do not fit.
    """
    rows = shape_in[p.dim] // (p.outer * p.inner)
    before = math.prod(shape_in[: p.dim]) * p.outer  # blocks outside the rows
    after = p.inner * math.prod(shape_in[p.dim + 1 :])  # elements inside one row
    for j, size in enumerate(shape_out):  # rows split into windows: whole windows on every band
        stride = math.prod(shape_out[j + 1 :])
        # a count read from the band (H // w) over a window size fixed in the model (w)
        follows = (requested is not None and j + 1 < len(shape_out) and follows_band(requested[j])
                   and not follows_band(requested[j + 1]))
        if stride % after or not 1 < stride // after <= rows or (stride // after == rows and not follows):
            continue
        window = stride // after
        if rows % window == 0 and (size * stride) % (after * rows) == 0 and size * window % rows == 0:
            _check_follows(requested, j, shape_in, shape_out)
            least = 1 if follows else 2
            if not tr.rows_ok(rows, window, least):
                many = "" if least == 1 else " (at least two: the window count is not read from x.shape)"
                raise Refusal(f"it splits the sharded dim into windows of {window} rows, and not every band is a "
                           f"whole number{many} of windows (choose band sizes that are multiples of {window})")
            return Sharded(j, size * window // rows, 1)
    found = []
    for j, size in enumerate(shape_out):
        pj, sj = math.prod(shape_out[:j]), math.prod(shape_out[j + 1 :])
        if before % pj == 0 and after % sj == 0 and size == (before // pj) * rows * (after // sj) and (size != 1 or rows == 1):
            found.append(Sharded(j, before // pj, after // sj))
    if found:  # a band of one row fits several dims: the one whose size the forward read from the band
        best = next((f for f in found if requested is not None and follows_band(requested[f.dim])), found[0])
        _check_follows(requested, best.dim, shape_in, shape_out)
        return best
    raise Refusal(f"a reshape of {tuple(shape_in)} (bands along {p.describe()}) to {tuple(shape_out)} does not keep "
               f"the band's rows whole (a band of one window, or a size stored for the whole field?)")


def _check_follows(requested: list | None, j: int, shape_in: tuple, shape_out: tuple) -> None:
    """The size the forward asked for along the band's dim ``j`` must follow the band (-1 or read from its shape)."""
    if requested is None or follows_band(requested[j]):
        return
    raise Refusal(f"it reshapes {tuple(shape_in)} to {tuple(int(v) for v in requested)}, and the size {int(requested[j])} "
               f"along the dim that holds the bands (dim {j}) is not computed from the band's shape: a size stored "
               f"for the whole field (e.g. set in __init__ from the image size), which no band has. Compute it "
               f"from x.shape in the forward (or pass -1)")


def _requested(func, x: torch.Tensor, args: tuple, kwargs: dict) -> list | None:
    """The output sizes a reshape was given explicitly (``view``/``reshape``/``unflatten``), None for the others.

    None under ``torch.compile`` too: a traced forward's sizes are plain ints (the marks do not
    survive tracing), so a compiled band is judged without them (a stored size then fails the
    reshape itself on the band).
    """
    if torch.compiler.is_compiling():
        return None
    op = op_name(func)
    if op in ("reshape", "view"):
        shape = list(args[1:]) if len(args) > 1 else list(kwargs.get("shape", kwargs.get("size", ())))
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = list(shape[0])
        return shape if shape and all(isinstance(v, int) for v in shape) else None
    if op == "unflatten":
        dim, sizes = normalize_dim(int(argument(args, kwargs, 1, "dim")), x.ndim), list(argument(args, kwargs, 2, "sizes"))
        return [Extent(v) for v in x.shape[:dim]] + sizes + [Extent(v) for v in x.shape[dim + 1 :]]
    return None


@rule(*RESHAPES)
def _reshape(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise Refusal("a band as the shape of another tensor")
    if on_bands(tr) and op_name(func) not in ("view_as", "reshape_as"):  # the sizes are the field's
        out = reshape_band(tr, func, args, kwargs, x, p)
        if out is not None:
            return out
    layout = None
    if on_grid(tr) and op_name(func) not in ("view_as", "reshape_as"):  # the field's sizes as the block's
        args, kwargs = block_sizes(tr, (args, kwargs))
        layout = _every_block(tr, func, args, kwargs, x, p)
    requested = _requested(func, x, args, kwargs)
    try:
        out = func(*args, **kwargs)
    except RuntimeError as exc:
        raise Refusal(f"the reshape does not fit this band ({exc}); a size stored for the whole field? compute it "
                   f"from x.shape in the forward") from None
    if layout is None:
        tr.set(out, _reshaped(tr, tuple(x.shape), p, tuple(out.shape), requested))
        return out
    rows, before = x.shape[p.dim] // (p.outer * p.inner), tr.band_sizes
    tr.band_sizes = lambda r: list(layout) if r == rows else [r]  # whole windows checked on every block of the dim
    try:
        tr.set(out, _reshaped(tr, tuple(x.shape), p, tuple(out.shape), requested))
    finally:
        tr.band_sizes = before
    return out


def _every_block(tr: Tracker, func, args: tuple, kwargs: dict, x: torch.Tensor, p: Sharded) -> tuple[int, ...] | None:
    """On a grid at run time: the reshape tried on the shape of every block along this judge's dim (of this rank's
    grid row or column: the agreed layout, each block's sizes), so that one it does not fit is refused on every rank
    (a rank that refused alone would leave the others in the next collective of its grid row). Returns the layout."""
    if p.outer * p.inner != 1:
        return None
    sizes = band_layout(tr, x, p)
    _, rank, of = band_axis(tr)
    for b, rows in enumerate(sizes):
        # the rank of block b whose other grid coordinate is this rank's (its other dims are this rank's)
        mate = next(r for r in range(len(of)) if of[r] == b and _other(of, r) == _other(of, rank))
        given = tree_map_only(Extent, lambda v, mate=mate: v if v.bands is None else Extent(v.bands[mate], v.bands),
                              (args[1:], kwargs))
        shape = list(x.shape)
        shape[p.dim] = rows
        with torch._C.DisableTorchFunction():
            try:
                func(torch.empty(shape, device="meta", dtype=x.dtype), *given[0], **given[1])
            except RuntimeError as exc:
                raise Refusal(f"the reshape does not fit the block {b} of {list(sizes)} along the sharded dim ({exc}): "
                              f"choose a field whose blocks it fits (e.g. whole windows on every block)") from None
    return sizes


def _other(of: tuple, r: int) -> int:
    """Rank ``r``'s grid coordinate along the other dim: its position among the ranks of its band."""
    return sum(1 for q in range(r) if of[q] == of[r])


# a run-time field shape by what decides it (the band's shape, its placement, every band's rows): a forward reads the
# shapes of bands of known layout step after step (WXFormer: ~130 a step), each otherwise a dozen small calls
_FIELD_SHAPES: dict[tuple, torch.Size] = {}


def _shape_fast(tr, func, args, kwargs):
    """``x.shape`` / ``x.size()`` of a band on latitude bands whose layout this forward knows: :func:`_shape`'s answer,
    remembered; MISS otherwise (a size along one dim, a grid, the dry run, a layout still to agree)."""
    if kwargs or len(args) != 1 or tr.manager is None or tr.plain_sizes or getattr(tr, "_owner", None) is not None:
        return MISS
    x = args[0]
    rec = tr.records.get(id(x))
    if rec is None or rec.ref() is not x or rec.where is None or rec.bands is None or is_replicated(x):
        return MISS
    p, out = rec.where, func(x)
    band, _, of = band_axis(tr)
    if of is not None or not on_bands(tr) or rec.bands[band] != out[p.dim] // (p.outer * p.inner):
        return MISS
    key = (out, p, rec.bands)
    got = _FIELD_SHAPES.get(key)
    if got is not None:
        return got
    got = torch.Size([field_extent(tr, x, p) if i == p.dim else v for i, v in enumerate(out)])
    if len(_FIELD_SHAPES) >= 1024:
        _FIELD_SHAPES.clear()
    _FIELD_SHAPES[key] = got
    return got


@rule("shape", "size", fast=_shape_fast)
def _shape(tr, func, args, kwargs, held):
    """The size along the band's dim is the field's, an :class:`Extent` (:mod:`credit_mpi.nn.judge.field_sizes`); on a
    latitude x longitude grid along both of its dims (each judge its own), with every rank's value."""
    x, p = args[0], tr.get(args[0])
    out = _read(tr, func, args, kwargs)
    if p is None or tr.plain_sizes:
        return out
    if on_bands(tr) or (on_grid(tr) and p.outer * p.inner == 1):
        if isinstance(out, int):
            return field_extent(tr, x, p) if normalize_dim(int(argument(args, kwargs, 1, "dim")), x.ndim) == p.dim else out
        return torch.Size([field_extent(tr, x, p) if i == p.dim else v for i, v in enumerate(out)])
    if torch.compiler.is_compiling():
        return out
    # a grid's dry run (its tensors are the field), or a block's rows merged with another dim (tokens: the block's own)
    if isinstance(out, int):
        return _extent(tr, out, p) if normalize_dim(int(argument(args, kwargs, 1, "dim")), x.ndim) == p.dim else out
    return torch.Size([_extent(tr, v, p) if i == p.dim else v for i, v in enumerate(out)])


def _read(tr, func, args, kwargs):
    """The forward's own size read, through the judges under this one (on a grid the longitude's judge runs over the
    latitude's, which gives the field's sizes to the forward's reads only, not to the judge's own code)."""
    owner = getattr(tr, "_owner", None)
    if owner is None or not owner.plain_sizes:
        return func(*args, **kwargs)
    held, owner.plain_sizes = owner.plain_sizes, 0
    try:
        return func(*args, **kwargs)
    finally:
        owner.plain_sizes = held


@rule("numel", "nelement", "__len__")
def _numel(tr, func, args, kwargs, held):
    """The field's element count (``len``: the field's rows when the bands are along dim 0)."""
    x, p = args[0], tr.get(args[0])
    out = _read(tr, func, args, kwargs)
    if p is None or tr.plain_sizes:
        return out
    grid = on_grid(tr) and p.outer * p.inner == 1
    if not (on_bands(tr) or grid):  # a grid's dry run (the field's count), or a block of merged rows (its own, marked)
        if torch.compiler.is_compiling() or tracked_columns(tr) == 1:
            return out
        count = Extent(out)
        count.block = p.outer * p.inner > 1
        return count
    if op_name(func) == "__len__":
        return field_extent(tr, x, p) if p.dim == 0 else out
    return field_numel(tr, x, p, out if grid else None)


def _extent(tr: Tracker, size: int, p: Sharded) -> Extent:
    """The band's ``size`` along its dim; in the dry run with every band's value (the layout of its rows). At run time
    on a latitude x longitude grid (rows merged with another dim): the block's own size (:attr:`Extent.block`)."""
    merged = p.outer * p.inner
    if tr.band_sizes is None or size % merged:
        out = Extent(size)
    else:
        out = Extent(size, [merged * s for s in tr.band_sizes(size // merged)])
    out.block = tracked_columns(tr) > 1 and merged > 1
    return out


PERMUTES = "transpose swapaxes swapdims permute movedim moveaxis t adjoint T mT H mH".split()


@rule(*PERMUTES)
def _permute(tr, func, args, kwargs, held):
    """A permutation of dims: found by applying it to a meta tensor of distinct sizes (remembered per call)."""
    x, p = args[0], tr.get(args[0])
    try:
        key = (func, x.ndim, p.dim, args[1:], tuple(kwargs.items()))
        dim = _PERMUTED.get(key)
    except TypeError:  # an unhashable argument (a list of dims): probed every call
        key = dim = None
    if dim is None:
        probe = torch.empty(tuple(range(2, x.ndim + 2)), device="meta")
        dim = list(func(probe, *args[1:], **kwargs).shape).index(p.dim + 2)
        if key is not None and len(_PERMUTED) < 4096:
            _PERMUTED[key] = dim
    return tr.run(func, args, kwargs, p.moved(dim))


_PERMUTED: dict = {}  # (func, ndim, the band's dim, args, kwargs) -> where the band's dim goes


@rule("expand", "expand_as", "broadcast_to", "repeat", "tile")
def _expand(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None:  # expanded to a band's shape: one row along the sharded dim is the band's every row
        q, target = held[0][1], held[0][0]
        k = q.dim - (target.ndim - x.ndim)
        if k >= 0 and x.shape[k] != 1:
            raise Refusal("it expands a tensor that is not a band to a band's shape")
        return tr.run(func, args, kwargs, q)
    if op_name(func) in ("expand", "broadcast_to") and on_bands(tr):
        args, kwargs = _expanded_to_band(tr, x, p, args, kwargs)
    elif on_grid(tr):
        args, kwargs = block_sizes(tr, (args, kwargs))
    out = func(*args, **kwargs)
    d = p.dim + out.ndim - x.ndim
    if out.shape[d] != x.shape[p.dim]:
        raise Refusal("it repeats the sharded dim")
    tr.set(out, p.moved(d))
    return out


def _expanded_to_band(tr, x, p, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``expand``/``broadcast_to`` given the field's size along the band's dim: the band keeps its rows (``-1``)."""
    given = list(args[1:]) if len(args) > 1 else [kwargs.get("size", kwargs.get("shape", ()))]
    if len(given) == 1 and isinstance(given[0], (tuple, list, torch.Size)):
        given = list(given[0])
    if not given or not all(isinstance(v, int) for v in given):
        return args, kwargs
    d = p.dim + len(given) - x.ndim
    if 0 <= d < len(given) and given[d] != -1 and given[d] == field_shape(x, p, band_layout(tr, x, p))[p.dim]:
        given[d] = -1
        return (x, tuple(given)), {k: v for k, v in kwargs.items() if k not in ("size", "shape")}
    return args, kwargs


_LAYOUTS_DIFFER = (
    "it joins bands of one height whose band layouts differ (a band holds other rows of one part than of the "
    "other) and whose rows are merged with another dim, or that lie on a latitude x longitude grid ({what}), which "
    "has no re-band rule yet. On uneven bands a "
    "strided convolution's output bands and a transposed convolution's do not line up: give every band an offset "
    "that is a multiple of the encoder's total stride (even bands of a field whose rows are a multiple of the "
    "domain size times that stride), as describe() shows")


@rule("cat", "concat", "concatenate", "stack", "hstack", "vstack", joins=True)
def _join(tr, func, args, kwargs, held):
    """A join over another dim: every part a band along the same dim (a replicated part would count once per rank).

    Bands of one height whose layouts differ (a UNet's skip connection on uneven bands: the
    encoder's bands and the decoder's upsampled ones) are joined exactly: every part is re-banded
    to the layout of the part the forward made first (:func:`_joined`).
    """
    op = op_name(func)
    parts = list(argument(args, kwargs, 0, "tensors"))
    if op in ("hstack", "vstack"):
        raise Refusal(f"{op} has no rule on bands (use torch.cat with dim)")
    ndim = parts[0].ndim
    dim = normalize_dim(int(argument(args, kwargs, 1, "dim", 0)), ndim + (op == "stack"))
    places = [tr.get(t) for t in parts]
    got = {q for q in places if q is not None}
    if len(got) > 1:  # a band and a block of merged rows: the same band when they line up
        got = {tr.as_band(t, q) for t, q in zip(parts, places, strict=True) if q is not None}
        if len(got) > 1 or None in got:
            raise Refusal(f"it joins tensors whose bands are along different dims ({sorted(map(str, got))})")
    q = got.pop()
    if op != "stack" and dim == q.dim and q == Sharded(dim) and any(pl is None for pl in places):
        return join_replicated(tr, func, args, kwargs, parts, places, dim)  # coordinate attention's pooled rows
    if op != "stack" and dim == q.dim:
        raise Refusal("it joins along the sharded dim: on bands the rows would not follow the field's order "
                   "(a replicated row joined to every band would be counted once per rank)")
    cut = False
    for i, (t, pl) in enumerate(zip(parts, places, strict=True)):
        if pl is None and t.ndim > q.dim and t.shape[q.dim] != 1:  # the field's rows (coordinates): the band's of them
            band = next(u for u, w in zip(parts, places, strict=True) if w is not None)
            parts[i], cut = field_partner(tr, band, q, t, q.dim), True
    if cut:
        args, kwargs = _with_parts(args, kwargs, parts)
    bands = [i for i, (t, pl) in enumerate(zip(parts, places, strict=True)) if pl is not None and t.ndim > q.dim]
    if len(bands) > 1:
        parts, target = _joined(tr, parts, [places[i] for i in bands], bands, q.dim)
        args, kwargs = _with_parts(args, kwargs, parts)
    d = q.dim + (1 if op == "stack" and dim <= q.dim else 0)
    out = tr.run(func, args, kwargs, q.moved(d))
    if len(bands) > 1 and target is not None:
        tr.keep_layout(out, target)  # the dry run: the output's bands are the target's
    return out


def _with_parts(args: tuple, kwargs: dict, parts: list) -> tuple[tuple, dict]:
    if "tensors" in kwargs:
        return args, {**kwargs, "tensors": parts}
    return (parts, *args[1:]), kwargs


def _joined(tr: Tracker, parts: list, places: list, bands: list[int], dim: int) -> tuple[list, list[int] | None]:
    """The band parts of a join in one layout: the layout of the part the forward made first (and, in the dry run,
    that layout).

    At run time every rank's rows of every part are agreed at the join (one fixed-size agreement
    per three parts, :func:`credit_mpi.ops.reband.join_layouts`: every rank then takes the same
    path), and each part whose layout differs from the target is re-banded to it
    (:func:`credit_mpi.ops.reband.join_moved`: one ``Alltoallv``, differentiable), so the output is
    exact on any bands. The first-made part is the encoder's in a UNet's skip connection, so the
    decoder continues on the layout the encoder had at that height. Bands whose rows are merged
    with another dim's (windows in the batch: ``outer > 1``) and a 2-D domain grid keep the local
    check (the ForwardGuard shares it). In the dry run the same, from every part's layout.
    """
    path = tr.stack[-1][0]
    order = sorted(range(len(bands)), key=lambda k: tr.born_at(parts[bands[k]]))
    first = order[0]
    if any(p.outer != 1 for p in places) or (tr.manager is not None and grid_columns(tr.manager) > 1):
        if len({parts[i].shape[dim] for i in bands}) > 1:
            raise Refusal(_LAYOUTS_DIFFER.format(what=", ".join(p.describe() for p in places)))
        return parts, None
    if tr.manager is None:
        return _joined_dry(tr, parts, places, bands, dim, first, path)
    from ...ops.reband import join_layouts, join_moved

    comm = tr.manager.domain_group
    with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's
        counts = join_layouts([parts[i] for i in bands], dim, comm, f"{path}: cat()")
        target, new = counts[first], list(parts)
        for k, i in enumerate(bands):
            if counts[k] != target:
                new[i] = join_moved(parts[i], dim, comm, counts[k], target, f"{path}: cat()",
                                    transport=paths.current().transport(comm))
    for k, i in enumerate(bands):
        tr.set(new[i], places[k])
    return new, None


def _joined_dry(tr: Tracker, parts: list, places: list, bands: list[int], dim: int, first: int,
                path: str) -> tuple[list, list[int]]:
    """The dry run of :func:`_joined`: every part's layout (its own, else its height's), and the move of each that
    differs reported (``tr.on_join``, set by describe(): a plan row with the agreement and the moves' traffic)."""
    sizes, here = [], tr._layouts_in_rule
    tr._layouts_in_rule = {}  # a part without a layout of its own has its height's (not another part's)
    try:
        for k, i in enumerate(bands):
            t, p = parts[i], places[k]
            rows = t.shape[dim] // p.inner
            own = tr.layout_of(t)
            sizes.append([p.inner * s for s in (own if own is not None and sum(own) == rows else tr.band_sizes(rows))])
    finally:
        tr._layouts_in_rule = here
    target = sizes[first]
    on_join = tr.on_join
    if on_join is not None:
        on_join(path, [parts[i] for i in bands], dim, sizes, target)
    return parts, target


@rule("pixel_shuffle", "pixel_unshuffle")
def _pixel(tr, func, args, kwargs, held):
    """Output rows ``[r a, r b)`` come from input rows ``[a, b)`` (shuffle); unshuffle needs whole groups of r rows."""
    x, p = args[0], tr.get(args[0])
    r = int(argument(args, kwargs, 1, "upscale_factor" if op_name(func) == "pixel_shuffle" else "downscale_factor"))
    if p.dim == x.ndim - 3 or (p.dim >= x.ndim - 2 and p.outer * p.inner != 1):
        raise Refusal("it moves channels into rows or rows into channels along the sharded dim")
    if op_name(func) == "pixel_unshuffle" and p.dim >= x.ndim - 2 and not tr.rows_ok(x.shape[p.dim], r):
        raise Refusal(f"pixel_unshuffle({r}) needs every band to be a whole number of {r} rows")
    out = tr.run(func, args, kwargs, p)
    if p.dim >= x.ndim - 2 and tr.band_sizes is not None and tr.adopt_layout is not None:
        _adopt_shuffled(tr, out, op_name(func), x.shape[p.dim], r)
    return out


def _adopt_shuffled(tr: Tracker, out: torch.Tensor, op: str, rows: int, r: int) -> None:
    """In the dry run: the bands after a pixel (un)shuffle are every band's rows times (divided by) ``r``.

    That layout is the output's (as a transposed convolution's is); where an earlier tensor of that
    height (the encoder's, joined to it by a skip connection) has another one on uneven bands, it is
    the output's own (a join re-bands it).
    """
    sizes = [s * r if op == "pixel_shuffle" else s // r for s in tr.band_sizes(rows)]
    height = rows * r if op == "pixel_shuffle" else rows // r
    if not tr.adopt_layout(height, sizes):
        tr.keep_layout(out, sizes)
