"""Rules for convolutions and pooling called as functions: the layers' own band code, through their layer rules.

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
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import adopt
from .functions import Tracker, _grid_columns, _op_name, _rule, _Why
from .rules import BANDS_ONLY, RULES, refusal_of

__all__ = ["layer_of_call"]

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


def _window_along(module: nn.Module, sd: int, rows: int) -> tuple[int, int, Any]:
    """``(kernel, stride, padding)`` of ``module`` along spatial dim ``sd`` (an adaptive pool: its output rows)."""
    if isinstance(module, nn.modules.pooling._AdaptiveAvgPoolNd):
        size = _per_dim(module.output_size, sd + 1)[sd]
        return (1, 1, 0) if size is None or size == rows else (0, 0, 0)
    kernel = _per_dim(module.kernel_size, sd + 1)[sd]
    stride = _per_dim(module.stride or module.kernel_size, sd + 1)[sd]
    padding = module.padding if isinstance(module.padding, str) else _per_dim(module.padding, sd + 1)[sd]
    if getattr(module, "transposed", False):
        return kernel, stride, (padding, module.output_padding[sd])
    return kernel, stride, 0 if padding == "valid" or (padding == "same" and kernel == 1) else padding


def _per_dim(value: Any, n: int) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value] * n


@_rule(*(f"{f}{n}d" for f in _FAMILIES for n in (1, 2, 3)))
def _layer_call(tr: Tracker, func, args, kwargs, held):
    """A convolution or pooling function: the layer of its settings on bands (the module docstring)."""
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    if p is None or len(held) > 1:
        raise _Why("a band as its weight or bias (only its input may hold bands)")
    nd = _family(op)[1]
    if p.dim < x.ndim - nd - 1:
        return tr.run(func, args, kwargs, p)  # bands (windows) in the batch dim: each sample is whole
    sd = p.dim - (x.ndim - nd)
    if sd < 0:
        raise _Why("it mixes the channels, which hold the bands")
    module = layer_of_call(op, args, kwargs)
    window = _window_along(module, sd, x.shape[p.dim])
    if window in ((1, 1, 0), (1, 1, (0, 0))):
        return tr.run(func, args, kwargs, p)  # one row of the band per output row: local
    if p.outer * p.inner != 1:
        raise _Why(f"its window along the sharded dim (kernel, stride, padding {window}) reads the neighbours' rows "
                   f"of a dim that holds the bands' rows merged with another ({p.describe()})")
    refused = refusal_of(module)
    if refused:
        raise _Why(refused)
    if type(module) in BANDS_ONLY and _grid_columns(tr) > 1:
        raise _Why(f"{type(module).__name__}'s layer has no rule on a latitude x longitude domain grid yet")
    layer = adopt(RULES[type(module)], module, tr.manager, p.dim - x.ndim, f"{tr.stack[-1][0]}: {op}")
    return layer(x)  # the tracker's module hooks: a layer of the plan (its halo, its agreement), its output a band


@_rule(*(f"{f}{n}d" for f in ("lp_pool", "adaptive_max_pool") for n in (1, 2, 3)))
def _no_layer(tr: Tracker, func, args, kwargs, held):
    """Pooling with no layer on bands: passes when its window along the sharded dim is one row, else refused."""
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    nd = _family(op)[1]
    if p is None or p.dim < x.ndim - nd - 1:
        if p is None:
            raise _Why("a band as its argument other than the input")
        return tr.run(func, args, kwargs, p)
    sd = p.dim - (x.ndim - nd)
    if sd < 0:
        raise _Why("it mixes the channels, which hold the bands")
    if op.startswith("adaptive"):
        size = _per_dim(_bound(_ADAPTIVE_ARGS, args, kwargs)["output_size"], nd)[sd]
        trivial = size is None or size == x.shape[p.dim]
    else:
        given = _bound(_LP_ARGS, args, kwargs)
        kernel = _per_dim(given["kernel_size"], nd)[sd]
        trivial = kernel == 1 and _per_dim(given.get("stride") or kernel, nd)[sd] == 1
    if not trivial:
        raise _Why("it pools along the sharded dim and has no exact rule on bands (max over windows that cross "
                   "bands: use F.max_pool* or adaptive_avg_pool*, whose layers run on bands)")
    return tr.run(func, args, kwargs, p)

