"""Convolution, pooling and resampling functionals: the layers' own band code, through their layer rules.

``F.conv1d/2d/3d``, ``F.conv_transpose1d/2d/3d``, ``F.max_pool*``,
``F.avg_pool*`` and ``F.adaptive_avg_pool*`` in a custom forward run what
the converted layers run: the call's arguments make the torch module of the
same settings (on the meta device: no memory), its layer rule
(:data:`credit_mpi.nn.rules.RULES`, the one place a module type's rule lives)
gives the ``DomainParallel*`` layer, which adopts it with the call's own
weight and bias (no copy) and runs under the tracker's module hooks: the
halo or overlap-add of the layer, its agreement, its plan row in
``describe()``. Whatever the layer rule refuses (``return_indices``, a
latitude x longitude grid for a bands-only layer) is refused by name, on
every rank; functions with no layer (``lp_pool*``, ``adaptive_max_pool*``)
pass only when their window along the sharded dim is one row.

A window of one row along the sharded dim (kernel 1, stride 1, no padding)
passes as it is: no agreement, no halo. Bands in the batch dim (windows
moved there) are whole samples: the call is local.

``F.interpolate`` along the sharded dim by a whole factor, to a band's size
or to a size stored for the whole field runs the exact
:class:`~credit_mpi.nn.DomainParallelInterpolate` layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...transport import paths
from ..base import adopt
from ..rules import BANDS_ONLY, RULES, refusal_of
from .field_sizes import band_layout, band_value, block_sizes, field_extent, on_bands, on_grid
from .registry import Refusal, argument, op_name, rule
from .tracker import Sharded, Tracker, follows_band, grid_columns, tracked_columns

# each function's positional arguments after the input, as torch names them
_CONV_ARGS = ("weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_ARGS = ("weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
_ADAPTIVE_ARGS = ("output_size",)
_LP_ARGS = ("norm_type", "kernel_size", "stride", "ceil_mode")


def _bound(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    """The call's arguments after the input, by name (positional ones named as torch names them)."""
    return {**dict(zip(names, args[1:], strict=False)), **{k: v for k, v in kwargs.items() if k != "input"}}


def _conv_module(nd: int, given: dict) -> nn.Module:
    weight, bias = given["weight"], given.get("bias")
    groups = int(given.get("groups", 1))
    module = getattr(nn, f"Conv{nd}d")(weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]),
                                       stride=given.get("stride", 1), padding=given.get("padding", 0),
                                       dilation=given.get("dilation", 1), groups=groups, bias=bias is not None,
                                       device="meta")
    module._parameters.update(weight=weight, bias=bias)  # the call's own tensors (no copy)
    return module


def _conv_transpose_module(nd: int, given: dict) -> nn.Module:
    weight, bias = given["weight"], given.get("bias")
    groups = int(given.get("groups", 1))
    module = getattr(nn, f"ConvTranspose{nd}d")(weight.shape[0], weight.shape[1] * groups, tuple(weight.shape[2:]),
                                                stride=given.get("stride", 1), padding=given.get("padding", 0),
                                                output_padding=given.get("output_padding", 0), groups=groups,
                                                bias=bias is not None, dilation=given.get("dilation", 1), device="meta")
    module._parameters.update(weight=weight, bias=bias)
    return module


def _max_pool_module(nd: int, given: dict) -> nn.Module:
    return getattr(nn, f"MaxPool{nd}d")(**given)


def _avg_pool_module(nd: int, given: dict) -> nn.Module:
    return getattr(nn, f"AvgPool{nd}d")(**given)


def _adaptive_module(nd: int, given: dict) -> nn.Module:
    return getattr(nn, f"AdaptiveAvgPool{nd}d")(**given)


#: function family -> (its arguments after the input, the torch module of the call's settings)
_FAMILIES = {
    "conv": (_CONV_ARGS, _conv_module),
    "conv_transpose": (_CONV_T_ARGS, _conv_transpose_module),
    "max_pool": (_MAX_ARGS, _max_pool_module),
    "avg_pool": (_AVG_ARGS, _avg_pool_module),
    "adaptive_avg_pool": (_ADAPTIVE_ARGS, _adaptive_module),
}


def _family(op: str) -> tuple[str, int]:
    """``"conv_transpose2d"`` -> ``("conv_transpose", 2)``."""
    return op[:-2], int(op[-2])


def layer_of_call(op: str, args: tuple, kwargs: dict) -> nn.Module:
    """The torch module whose forward is the call ``op(*args, **kwargs)`` (its settings; a conv's own weight and bias)."""
    family, nd = _family(op)
    names, make = _FAMILIES[family]
    return make(nd, _bound(names, args, kwargs))


def _window_along(module: nn.Module, sd: int, rows: int, field: bool = False) -> tuple[int, int, Any]:
    """``(kernel, stride, padding)`` of ``module`` along spatial dim ``sd`` (an adaptive pool: its output rows)."""
    if isinstance(module, nn.modules.pooling._AdaptiveAvgPoolNd):
        size = _per_dim(module.output_size, sd + 1)[sd]
        return (1, 1, 0) if _keeps_rows(size, rows, field) else (0, 0, 0)
    kernel = _per_dim(module.kernel_size, sd + 1)[sd]
    stride = _per_dim(module.stride or module.kernel_size, sd + 1)[sd]
    padding = module.padding if isinstance(module.padding, str) else _per_dim(module.padding, sd + 1)[sd]
    if getattr(module, "transposed", False):
        return kernel, stride, (padding, module.output_padding[sd])
    return kernel, stride, 0 if padding == "valid" or (padding == "same" and kernel == 1) else padding


def _keeps_rows(size: Any, rows: int, field: bool = False) -> bool:
    """True when an adaptive pool's output ``size`` along the sharded dim keeps the rows: None, or ``rows``. With
    ``field`` (latitude bands: :mod:`credit_mpi.nn.judge.field_sizes`) ``rows`` and every size are the field's; else
    (a grid's blocks) only a size read from the block's shape is its own rows (a plain int: the layer decides)."""
    return size is None or ((field or follows_band(size)) and size == rows)


def _pooled_rows(tr: Tracker, module: nn.Module, x: torch.Tensor, p: Sharded) -> tuple[int, bool]:
    """``(rows, field)`` an adaptive pool's output size is compared with: the field's rows on latitude bands (agreed
    only where an output size is given), else the band's own."""
    if on_bands(tr) and getattr(module, "output_size", None) is not None:
        return int(field_extent(tr, x, p)), True
    return x.shape[p.dim], False


def _check_output_size(module: nn.Module, sd: int, rows: int) -> None:
    """An adaptive pool's output rows read from a band's shape (``x.shape[-2] // 2``) are the band's, not the field's:
    refused (unless they are the band's own rows: nothing pools along the sharded dim)."""
    size = _per_dim(getattr(module, "output_size", None), sd + 1)[sd]
    if size is not None and follows_band(size) and size != rows:
        raise Refusal(f"its output size {size} along the sharded dim is read from a band's shape (each band would pool "
                      f"to its own rows' share); give the field's output rows as a plain int")


def _per_dim(value: Any, n: int) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value] * n


@rule(*(f"{f}{n}d" for f in _FAMILIES for n in (1, 2, 3)))
def _layer_call(tr: Tracker, func, args, kwargs, held):
    """A convolution or pooling function: the layer of its settings on bands (the module docstring)."""
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    if p is None or len(held) > 1:
        raise Refusal("a band as its weight or bias (only its input may hold bands)")
    nd = _family(op)[1]
    if p.dim < x.ndim - nd - 1:
        return tr.run(func, args, kwargs, p)  # bands (windows) in the batch dim: each sample is whole
    sd = p.dim - (x.ndim - nd)
    if sd < 0:
        raise Refusal("it mixes the channels, which hold the bands")
    module = layer_of_call(op, args, kwargs)
    rows, field = _pooled_rows(tr, module, x, p)
    if not field:
        _check_output_size(module, sd, rows)
    window = _window_along(module, sd, rows, field)
    if window in ((1, 1, 0), (1, 1, (0, 0))):
        return tr.run(func, args, kwargs, p)  # one row of the band per output row: local
    if p.outer * p.inner != 1:
        raise Refusal(f"its window along the sharded dim (kernel, stride, padding {window}) reads the neighbours' rows "
                   f"of a dim that holds the bands' rows merged with another ({p.describe()})")
    refused = refusal_of(module)
    if refused:
        raise Refusal(refused)
    if type(module) in BANDS_ONLY and tracked_columns(tr) > 1:
        raise Refusal(f"{type(module).__name__}'s layer has no rule on a latitude x longitude domain grid yet")
    layer = adopt(RULES[type(module)], module, tr.manager, p.dim - x.ndim, f"{tr.stack[-1][0]}: {op}")
    return layer(x)  # the tracker's module hooks: a layer of the plan (its halo, its agreement), its output a band


@rule(*(f"{f}{n}d" for f in ("lp_pool", "adaptive_max_pool") for n in (1, 2, 3)))
def _no_layer(tr: Tracker, func, args, kwargs, held):
    """Pooling with no layer on bands: passes when its window along the sharded dim is one row, else refused."""
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    nd = _family(op)[1]
    if p is None or p.dim < x.ndim - nd - 1:
        if p is None:
            raise Refusal("a band as its argument other than the input")
        return tr.run(func, args, kwargs, p)
    sd = p.dim - (x.ndim - nd)
    if sd < 0:
        raise Refusal("it mixes the channels, which hold the bands")
    if op.startswith("adaptive"):
        if on_grid(tr):  # the field's sizes given on a grid: the block's, judged on the block
            args, kwargs = block_sizes(tr, (args, kwargs))
        size = _per_dim(_bound(_ADAPTIVE_ARGS, args, kwargs)["output_size"], nd)[sd]
        field = on_bands(tr) and size is not None
        trivial = _keeps_rows(size, int(field_extent(tr, x, p)) if field else x.shape[p.dim], field)
    else:
        given = _bound(_LP_ARGS, args, kwargs)
        kernel = _per_dim(given["kernel_size"], nd)[sd]
        trivial = kernel == 1 and _per_dim(given.get("stride") or kernel, nd)[sd] == 1
    if not trivial:
        raise Refusal("it pools along the sharded dim and has no exact rule on bands (max over windows that cross "
                   "bands: use F.max_pool* or adaptive_avg_pool*, whose layers run on bands)")
    return tr.run(func, args, kwargs, p)



@rule("interpolate")
def _interpolate(tr, func, args, kwargs, held):
    """Along the sharded dim by an integer factor, or to a size stored for the whole field: the exact layer
    (:class:`DomainParallelInterpolate`; a stored size: :func:`_stored_size`)."""
    from ..resample import DomainParallelInterpolate

    if on_grid(tr):  # the field's sizes given on a grid: the block's, judged on the block
        args, kwargs = block_sizes(tr, (args, kwargs))
    x, p = args[0], tr.get(args[0])
    nsp = x.ndim - 2
    sd = p.dim - 2
    size, scale = argument(args, kwargs, 1, "size"), argument(args, kwargs, 2, "scale_factor")
    mode = argument(args, kwargs, 3, "mode", "nearest")
    align = argument(args, kwargs, 4, "align_corners")
    if argument(args, kwargs, 6, "antialias", False):
        raise Refusal("antialias has no rule on bands")
    if sd < 0 or p.outer * p.inner != 1:
        raise Refusal("it resamples a dim that holds merged bands")
    rows = x.shape[p.dim]
    if size is not None:
        target = _per_dim(size, nsp)[sd]
        if not torch.compiler.is_compiling() and (not follows_band(target) or (
                on_bands(tr) and getattr(target, "bands", None) is None)):  # (a traced forward's sizes: plain ints)
            return _stored_size(tr, x, p, args, kwargs, mode, align)  # the field's rows (no band's share known)
        if not torch.compiler.is_compiling() and (tr.manager is None or grid_columns(tr.manager) == 1):
            return _band_size(tr, func, x, p, args, kwargs, size, nsp, mode, align)
        if target == rows:
            return tr.run(func, args, kwargs, p)
        if not tr.ratio_ok(rows, target):
            raise Refusal(f"size={tuple(_per_dim(size, nsp))} asks a band for its rows times a factor that is not one "
                       f"whole number on every band (give scale_factor, or make every band's target a whole multiple "
                       f"of its rows)")
        factor = target // rows
    elif scale is not None:
        factor = _per_dim(scale, nsp)[sd]
        if float(factor) == 1.0:
            return tr.run(func, args, kwargs, p)
    else:
        raise Refusal("give size or scale_factor")
    layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                      mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    rest_size = None if size is None else [y.shape[p.dim] if i == sd else s for i, s in enumerate(_per_dim(size, nsp))]
    rest_scale = None if scale is None else [1.0 if i == sd else s for i, s in enumerate(_per_dim(scale, nsp))]
    if rest_size is not None and list(rest_size) == list(y.shape[2:]):
        return y
    if rest_scale is not None and all(float(s) == 1.0 for s in rest_scale):
        return y
    kw = {"mode": mode}
    if align is not None:
        kw["align_corners"] = align
    return tr.run(func, (y,), {"size": rest_size, "scale_factor": rest_scale, **kw}, p)


def _band_size(tr, func, x, p, args, kwargs, size, nsp, mode, align):
    """``size=`` read from a band's shape (smp's UNet: ``F.interpolate(x, size=skip.shape[-2:])``): the output has the
    field's rows of that band's tensor, in that tensor's layout.

    Every rank's rows of ``x`` and its target are agreed first (one fixed-size agreement,
    :func:`credit_mpi.ops.reband.agree_rows`; the dry run reads them from the layouts): the same
    layouts pass as they are; a target of a whole factor of the field's rows is the exact layer by
    that factor (its output bands ``factor`` times ``x``'s), re-banded to the target's layout where
    that differs (a skip connection's on uneven bands). Where it does not, the layer takes the call's
    own size (the field's rows along the sharded dim), every dim in one call: on bands of whole cells
    (nearest) torch's call on the band. Any other target is refused on every rank.
    """
    from ..resample import DomainParallelInterpolate

    sd, path = p.dim - 2, tr.stack[-1][0]
    target = _per_dim(size, nsp)[sd]
    mine, theirs = _rows_and_target(tr, x, p, target, path)
    if mine == theirs:
        _report_size(tr, path, x, p.dim, list(mine), list(theirs))
        if on_bands(tr) and tr.manager is not None:  # the field's size given: this band's rows of it
            size = [band_value(tr, v) if i == sd else v for i, v in enumerate(_per_dim(size, nsp))]
            kw = {"mode": mode} if align is None else {"mode": mode, "align_corners": align}
            return tr.run(func, (x,), {"size": size, **kw}, p)
        return tr.run(func, args, kwargs, p)
    rows, total = sum(mine), sum(theirs)
    if rows == 0 or total % rows or total < rows:
        raise Refusal(f"size={tuple(_per_dim(size, nsp))} asks for {total} rows of a field of {rows} along the sharded dim, "
                   f"not a whole factor of them (give scale_factor, or a size that is a whole multiple of the rows)")
    factor = total // rows
    moved = [factor * s for s in mine]
    if moved == list(theirs):  # no re-band after: the call's own size, every dim in one call (the field's rows along sd)
        whole = tuple(total if i == sd else int(v) for i, v in enumerate(_per_dim(size, nsp)))
        layer = DomainParallelInterpolate(size=whole, mode=mode, align_corners=align, manager=_NoManager,
                                          shard_dim=p.dim - x.ndim)
    else:
        layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                          mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{path}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    _report_size(tr, path, y, p.dim, moved, list(theirs))
    y = _to_layout(tr, y, p, moved, list(theirs), path)
    rest = [y.shape[p.dim] if i == sd else v for i, v in enumerate(_per_dim(size, nsp))]
    if list(rest) == list(y.shape[2:]):
        return y
    kw = {"mode": mode} if align is None else {"mode": mode, "align_corners": align}
    return tr.run(func, (y,), {"size": rest, **kw}, p)


def _rows_and_target(tr, x, p, target, path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every band's rows of ``x`` and of an interpolation's target read from a band: agreed at run time, the layouts in
    the dry run (``x``'s own or its height's; the target's from its :class:`Extent`). On latitude bands the target is
    the field's size of a band and carries every band's (:mod:`credit_mpi.nn.judge.field_sizes`)."""
    if on_bands(tr) and getattr(target, "bands", None) is not None:
        return band_layout(tr, x, p), tuple(target.bands)
    if tr.manager is not None:
        from ...ops.reband import agree_rows, one_layout

        with torch._C.DisableTorchFunction():
            mine, theirs = agree_rows([x.shape[p.dim], int(target)], [x], p.dim, tr.manager.domain_group,
                                      f"{path}: interpolate(size=)", quiet=one_layout)  # moves nothing: skipped
        return mine, theirs
    mine = tuple(tr.band_sizes(x.shape[p.dim]))
    bands = getattr(target, "bands", None)
    return mine, tuple(bands) if bands is not None else tuple(tr.band_sizes(int(target)))


def _report_size(tr, path: str, t: torch.Tensor, dim: int, sizes: list[int], target: list[int]) -> None:
    """The dry run: the agreement of an interpolation to a band's size, and its re-band when ``sizes`` is not ``target``."""
    on_join = tr.on_join if tr.manager is None else None
    if on_join is not None:
        on_join(path, [t], dim, [sizes], target, "interpolate(size=)")


def _to_layout(tr, y: torch.Tensor, p: Sharded, sizes: list[int], target: list[int], path: str) -> torch.Tensor:
    """``y`` (bands ``sizes``, agreed) re-banded to ``target`` (no agreement of its own); the dry run reports it."""
    if sizes == target:
        return y
    if tr.manager is None:
        with torch._C.DisableTorchFunction():
            out = y.view_as(y)
        tr.set(out, p)
        tr.keep_layout(out, target)
        return out
    from ...ops.reband import join_moved

    with torch._C.DisableTorchFunction():
        comm = tr.manager.domain_group
        out = join_moved(y, p.dim, comm, tuple(sizes), tuple(target), f"{path}: interpolate(size=)",
                         transport=paths.current().transport(comm))
    tr.set(out, p)
    return out


def _stored_size(tr, x, p, args, kwargs, mode, align):
    """``size=`` whose entry along the sharded dim is a plain int: a size stored for the whole field, the GLOBAL rows.

    CREDIT's ``F.interpolate(x, size=(self.image_height, self.image_width))``: each output row is
    computed from its source rows in global coordinates (the halo of rows it needs), by
    :class:`~credit_mpi.nn.DomainParallelInterpolate`; the output is a tensor of the field's rows,
    banded as the model's input is (:func:`credit_mpi.nn.resample.stored_size_bands`).
    """
    from ..resample import DomainParallelInterpolate

    nsp = x.ndim - 2
    size = tuple(int(v) for v in _per_dim(argument(args, kwargs, 1, "size"), nsp))
    layer = DomainParallelInterpolate(size=size, mode=mode, align_corners=align,
                                      recompute_scale_factor=argument(args, kwargs, 5, "recompute_scale_factor"),
                                      manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: interpolate"
    layer.__dict__["dp_stored_size"] = True
    return layer(x)  # the tracker's module hooks: a layer of the plan, its output a band


class _NoManagerType:
    domain_parallel_size = 1


_NoManager = _NoManagerType()


@rule("fold", "grid_sample")  # unfold: credit_mpi.nn.judge.rows
def _refused(tr, func, args, kwargs, held):
    raise Refusal("it mixes positions across the sharded dim and has no rule on bands")
