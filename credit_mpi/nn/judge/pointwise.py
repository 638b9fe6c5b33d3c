"""Pointwise rules: elementwise ops, value reads, dtype and device moves, dropout, per-token products.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..replicated import is_replicated
from .field_values import field_partner
from .registry import MISS, Refusal, argument, leaves_in, op_name, rule, tensors_in
from .tracker import Extent, Sharded, Tracker

POINTWISE = """
abs absolute add acos arccos acosh asin asinh atan atan2 atanh bitwise_and bitwise_not bitwise_or bitwise_xor ceil clamp
clamp_max clamp_min clip copysign cos cosh deg2rad div divide erf erfc erfinv exp exp2 expm1 float_power floor
floor_divide fmod frac hypot isfinite isinf isnan ldexp lerp lgamma log log10 log1p log2 logaddexp logical_and
logical_not logical_or logical_xor logit maximum minimum fmax fmin mul multiply nan_to_num neg negative pow rad2deg
reciprocal remainder round rsqrt sigmoid sign sin sinh sqrt square sub subtract tan tanh true_divide trunc where
masked_fill addcmul addcdiv relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus
softsign tanhshrink threshold logsigmoid prelu hardshrink softshrink eq ne lt le gt ge greater less greater_equal
less_equal not_equal fill zero clone contiguous detach to type float double half bfloat16 int long bool cpu cuda
requires_grad copy zeros_like ones_like empty_like full_like data real imag conj positive sgn
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__
__div__ __rdiv__ __idiv__ __pow__ __rpow__ __ipow__ __neg__ __abs__ __and__ __rand__ __iand__ __or__ __ror__ __ior__
__xor__ __rxor__ __ixor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __floordiv__ __rfloordiv__
__ifloordiv__ __mod__ __rmod__ __imod__
""".split()

# their extra tensor arguments give a dtype or a device, not values
_LIKE = {"to", "type", "type_as", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}


_PLAIN = frozenset({float, int, bool, type(None), str, torch.dtype, torch.device, torch.memory_format})


def _pointwise_fast(tr: Tracker, func, args, kwargs):
    """The common case of :func:`_pointwise`, from the records alone: bands of one placement and height.

    Every band argument has the same placement, dims and rows along it, and no global dims (attention's
    scores); every other tensor has one row (or no dim) along it; the other arguments are plain numbers,
    dtypes, devices (no size read from a band, no list). Then the output is a band of that placement, as
    the rule would place it; anything else is MISS and the rule runs.
    """
    records, p, ndim, rows, partners = tr.records, None, 0, 0, None
    for v in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(v, torch.Tensor):
            rec = records.get(id(v))
            if rec is None or rec.ref() is not v or rec.where is None or is_replicated(v):
                partners = (partners or []) + [v]
                continue
            q = rec.where
            if rec.global_dims:
                return MISS
            if p is None:
                p, ndim, rows = q, v.ndim, v.shape[q.dim]
            elif (q is not p and q != p) or v.ndim != ndim or v.shape[q.dim] != rows:
                return MISS
        elif type(v) not in _PLAIN:
            return MISS
    if p is None:
        return MISS
    for t in partners or ():
        k = p.dim - (ndim - t.ndim)
        if t.ndim > ndim or (k >= 0 and t.shape[k] != 1):
            return MISS
        if (rec := records.get(id(t))) is not None and rec.ref() is t and rec.global_dims:
            return MISS
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        tr.set(out, p if out.ndim == ndim else Sharded(p.dim - (ndim - out.ndim), p.outer, p.inner)
               if out.ndim >= ndim - p.dim else None)
    else:
        for t in tensors_in(out):
            tr.set(t, Sharded(p.dim - (ndim - t.ndim), p.outer, p.inner) if t.ndim >= ndim - p.dim else None)
    return out


@rule(*POINTWISE, fast=_pointwise_fast)
def _pointwise(tr: Tracker, func, args, kwargs, held):
    """Elementwise (with broadcasting): one placement; a partner that is not a band has one row along it."""
    op = op_name(func)
    if any(isinstance(v, Extent) and v.block for v in leaves_in((args, kwargs))):
        raise Refusal("it is given a size read on a latitude x longitude grid along a dim that merges a block's rows "
                      "or columns with another (tokens: the block's own count, not the field's: t.sum(1) / t.shape[1] "
                      "would divide by the block's tokens); read the sizes before merging (H * W from x.shape), or "
                      "use mean()")
    tensors = tensors_in((args, kwargs))
    if op in _LIKE:
        tensors = tensors[:1]
    ndim = max(t.ndim for t in tensors)
    dims = {(p.dim + ndim - t.ndim, p.outer, p.inner) for t, p in held}
    if len(dims) > 1:  # a band and a block of merged rows (windows merged back): the same band when they line up
        bands = {(b.dim + ndim - t.ndim, 1, 1) if (b := tr.as_band(t, p)) else (None,) for t, p in held}
        if len(bands) > 1 or (None,) in bands:
            raise Refusal(f"it combines tensors whose bands are along different dims ({sorted(dims)})")
        dims = bands
    d, outer, inner = dims.pop()
    if len({t.shape[d - (ndim - t.ndim)] for t, _ in held}) > 1:  # else a band of one row would broadcast silently
        raise Refusal(_OTHER_LAYOUTS)
    cut = {}  # a partner of the field's size along the sharded dim: the band's rows of it (credit_mpi.nn.judge.field_values)
    for t in tensors:
        k = d - (ndim - t.ndim)
        if tr.get(t) is None and k >= 0 and t.shape[k] != 1:
            band, p = held[0]
            cut[id(t)] = field_partner(tr, band, Sharded(p.dim, outer, inner), t, k)
    if cut:
        args, kwargs = tree_map_only(torch.Tensor, lambda t: cut.get(id(t), t), (args, kwargs))
    return tr.run(func, args, kwargs, lambda out: Sharded(d - (ndim - out.ndim), outer, inner) if out.ndim >= ndim - d else None)


# Python values read from a tensor (``.item()``, ``bool(t)``, ``t.tolist()``): describe()'s dry run (plan.py)
# answers them for tensors every rank holds whole, which it cannot see on the meta device
VALUE_CALLS = frozenset("item tolist numpy __array__ __bool__ __int__ __float__ __index__ __complex__ is_nonzero equal "
                        "allclose".split())


@rule(*VALUE_CALLS)
def _value(tr, func, args, kwargs, held):
    """A band's values read into Python: each rank reads its own rows, one process the whole field's."""
    raise Refusal("it reads the band's values into Python (a data-dependent check or branch): each rank would see its "
               "own rows where one process sees the whole field's, and the ranks could take different branches; read "
               "a tensor every rank holds whole (a parameter, a global mean such as nn.AdaptiveAvgPool2d(1)'s output)")


@rule("type_as")
def _type_as(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    return tr.run(func, args, kwargs, p)


@rule("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")
def _new(tr, func, args, kwargs, held):
    """A new tensor: a band (its rows) when it has the band's shape, else not one."""
    src, p = args[0], tr.get(args[0])
    return tr.run(func, args, kwargs, lambda out: p if p is not None and out.shape == src.shape else None)


@rule("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")
def _dropout(tr, func, args, kwargs, held):
    p, training = argument(args, kwargs, 1, "p", 0.5), argument(args, kwargs, 2, "training", True)
    if training and p > 0:
        raise Refusal(f"dropout in training (p={p}) draws its own mask on every band (not one process's draw)")
    return tr.run(func, args, kwargs, held[0][1])


@rule("linear", "bilinear")
def _linear(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None or p.dim == x.ndim - 1 or op_name(func) == "bilinear":
        raise Refusal("it contracts the sharded dim (the last one) with a weight")
    return tr.run(func, args, kwargs, p)


@rule("embedding")
def _embedding(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    if p is None:
        raise Refusal("a band as the embedding table")
    return tr.run(func, args, kwargs, p)


@rule("fill_", "zero_", "requires_grad_", "retain_grad")
def _inplace(tr, func, args, kwargs, held):
    return tr.run(func, args, kwargs, tr.get(args[0]))


# an elementwise op of two bands of other rows (at run time: this rank's rows differ; shared through the ForwardGuard)
_OTHER_LAYOUTS = ("it combines bands that hold other rows of the field (their band layouts differ: a residual "
                  "around a strided and a transposed convolution on uneven bands): only a join (torch.cat) re-bands "
                  "its parts; give every band an offset that is a multiple of the total stride, or join the parts")
