"""Convolution, pooling and resampling functionals: a window of one row along the sharded dim passes, an
interpolation by a whole factor or to a stored size runs the exact layer, the rest is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import Refusal, argument, op_name, rule
from .tracker import Sharded, follows_band, grid_columns

_CONVS = "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d".split()
_POOLS = "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d lp_pool1d lp_pool2d lp_pool3d".split()


def _tuple(value: Any, n: int) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value] * n


@rule(*_CONVS, *_POOLS)
def _window(tr, func, args, kwargs, held):
    """A convolution or pooling functional passes when its window along the sharded dim is one row, stride one."""
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise Refusal("a band as the weight")
    nsp = int(op[-2])
    sd = p.dim - (x.ndim - nsp)
    if p.dim < x.ndim - nsp - 1:
        return tr.run(func, args, kwargs, p)  # bands (windows) in the batch dim: each sample is whole
    if sd < 0:
        raise Refusal("it mixes the channels, which hold the bands")
    if op in _CONVS:
        kernel = args[1].shape[2 + sd]
        stride = _tuple(argument(args, kwargs, 3, "stride", 1), nsp)[sd]
        padding = argument(args, kwargs, 4, "padding", 0)
        padding = 0 if isinstance(padding, str) else _tuple(padding, nsp)[sd]
    else:
        kernel = _tuple(argument(args, kwargs, 1, "kernel_size"), nsp)[sd]
        stride = _tuple(argument(args, kwargs, 2, "stride") or kernel, nsp)[sd]
        padding = _tuple(argument(args, kwargs, 3, "padding", 0), nsp)[sd]
    if kernel != 1 or stride != 1 or padding != 0 or p.outer * p.inner != 1:
        raise Refusal(f"its window along the sharded dim (kernel {kernel}, stride {stride}, padding {padding}) reads "
                   f"the neighbours' rows (use the nn module, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


@rule("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
       "adaptive_max_pool2d", "adaptive_max_pool3d")
def _adaptive(tr, func, args, kwargs, held):
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    nsp = int(op[-2])
    sd = p.dim - (x.ndim - nsp)
    size = _tuple(argument(args, kwargs, 1, "output_size"), nsp)
    if sd >= 0 and size[sd] is not None and size[sd] != x.shape[p.dim]:
        raise Refusal("it pools along the sharded dim (use nn.AdaptiveAvgPool*, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


@rule("interpolate")
def _interpolate(tr, func, args, kwargs, held):
    """Along the sharded dim by an integer factor, or to a size stored for the whole field: the exact layer
    (:class:`DomainParallelInterpolate`; a stored size: :func:`_stored_size`)."""
    from ..resample import DomainParallelInterpolate

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
        target = _tuple(size, nsp)[sd]
        if not follows_band(target) and not torch.compiler.is_compiling():  # (a traced forward's sizes: plain ints)
            return _stored_size(tr, x, p, args, kwargs, mode, align)
        if not torch.compiler.is_compiling() and (tr.manager is None or grid_columns(tr.manager) == 1):
            return _band_size(tr, func, x, p, args, kwargs, size, nsp, mode, align)
        if target == rows:
            return tr.run(func, args, kwargs, p)
        if not tr.ratio_ok(rows, target):
            raise Refusal(f"size={tuple(_tuple(size, nsp))} asks a band for its rows times a factor that is not one "
                       f"whole number on every band (give scale_factor, or make every band's target a whole multiple "
                       f"of its rows)")
        factor = target // rows
    elif scale is not None:
        factor = _tuple(scale, nsp)[sd]
        if float(factor) == 1.0:
            return tr.run(func, args, kwargs, p)
    else:
        raise Refusal("give size or scale_factor")
    layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                      mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    rest_size = None if size is None else [y.shape[p.dim] if i == sd else s for i, s in enumerate(_tuple(size, nsp))]
    rest_scale = None if scale is None else [1.0 if i == sd else s for i, s in enumerate(_tuple(scale, nsp))]
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
    that differs (a skip connection's on uneven bands). Any other target is refused on every rank.
    """
    from ..resample import DomainParallelInterpolate

    sd, path = p.dim - 2, tr.stack[-1][0]
    target = _tuple(size, nsp)[sd]
    mine, theirs = _rows_and_target(tr, x, p, target, path)
    if mine == theirs:
        _report_size(tr, path, x, p.dim, list(mine), list(theirs))
        return tr.run(func, args, kwargs, p)
    rows, total = sum(mine), sum(theirs)
    if rows == 0 or total % rows or total < rows:
        raise Refusal(f"size={tuple(_tuple(size, nsp))} asks for {total} rows of a field of {rows} along the sharded dim, "
                   f"not a whole factor of them (give scale_factor, or a size that is a whole multiple of the rows)")
    factor = total // rows
    layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                      mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{path}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    moved = [factor * s for s in mine]
    _report_size(tr, path, y, p.dim, moved, list(theirs))
    y = _to_layout(tr, y, p, moved, list(theirs), path)
    rest = [y.shape[p.dim] if i == sd else v for i, v in enumerate(_tuple(size, nsp))]
    if list(rest) == list(y.shape[2:]):
        return y
    kw = {"mode": mode} if align is None else {"mode": mode, "align_corners": align}
    return tr.run(func, (y,), {"size": rest, **kw}, p)


def _rows_and_target(tr, x, p, target, path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every band's rows of ``x`` and of an interpolation's target read from a band: agreed at run time, the layouts in
    the dry run (``x``'s own or its height's; the target's from its :class:`Extent`)."""
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
        out = join_moved(y, p.dim, tr.manager.domain_group, tuple(sizes), tuple(target), f"{path}: interpolate(size=)")
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
    size = tuple(int(v) for v in _tuple(argument(args, kwargs, 1, "size"), nsp))
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
