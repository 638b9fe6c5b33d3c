"""Reductions, statistics and products: over other dims they pass; a sum or mean (or a product that
contracts a band's tokens with a tensor over the field's) over the sharded dim is one sum over the domain.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...partition import normalize_dim
from ...transport import paths
from ..replicated import is_replicated, replicated
from .field_values import field_partner
from .longitude import along_longitude
from .pointwise import _pointwise
from .registry import Refusal, argument, conversion_error, dims_of, op_name, rule, without_bands
from .tracker import Sharded, Tracker, tracked_columns


@rule("batch_norm")
def _batch_norm(tr, func, args, kwargs, held):
    """Running statistics (eval): pointwise. Batch statistics: the exact layer's (global over every band).

    A subclass of ``nn.BatchNorm2d`` with its own forward (timm's ``BatchNormAct2d``, which the type
    table does not replace) calls ``F.batch_norm`` itself: the statistics are taken by a
    :class:`~credit_mpi.nn.DomainParallelBatchNorm2d` that shares the caller's buffers and parameters.
    """
    x, p = args[0], tr.get(args[0])
    running_mean, running_var = argument(args, kwargs, 1, "running_mean"), argument(args, kwargs, 2, "running_var")
    weight, bias = argument(args, kwargs, 3, "weight"), argument(args, kwargs, 4, "bias")
    training = argument(args, kwargs, 5, "training", False)
    if not training and running_mean is not None:
        return tr.run(func, args, kwargs, held[0][1])
    if p is None or p.dim < 2 or p.outer * p.inner != 1 or x.ndim > 5:
        raise Refusal("batch statistics of a tensor whose bands are not along a spatial dim (use nn.BatchNorm*)")
    layer = _batch_norm_layer(x, running_mean, running_var, weight, bias, float(argument(args, kwargs, 6, "momentum", 0.1)),
                              float(argument(args, kwargs, 7, "eps", 1e-5)), p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: batch_norm"
    return layer(x)  # the tracker's module hooks: a layer of the plan, its output a band


def _batch_norm_layer(x, running_mean, running_var, weight, bias, momentum: float, eps: float, shard_dim: int):
    """A DomainParallelBatchNorm{1,2,3}d in training mode over ``F.batch_norm``'s own tensors (no copy)."""
    from .. import norm

    cls = {2: norm.DomainParallelBatchNorm1d, 3: norm.DomainParallelBatchNorm1d, 4: norm.DomainParallelBatchNorm2d,
           5: norm.DomainParallelBatchNorm3d}[x.ndim]
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.num_features, layer.eps, layer.momentum = x.shape[1], eps, momentum
    layer.affine, layer.track_running_stats = weight is not None, running_mean is not None
    layer._parameters.update(weight=weight, bias=bias)
    counter = torch.zeros((), dtype=torch.long, device=x.device) if running_mean is not None else None
    layer._buffers.update(running_mean=running_mean, running_var=running_var, num_batches_tracked=counter)
    layer.dp_shard_dim = shard_dim
    return layer


@rule("layer_norm", "rms_norm")
def _layer_norm(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    shape = argument(args, kwargs, 1, "normalized_shape")
    n = 1 if isinstance(shape, int) else len(shape)
    if p is not None and p.dim >= x.ndim - n:
        raise Refusal(f"it normalises over the last {n} dim(s), the sharded one among them (use nn.LayerNorm)")
    return tr.run(func, args, kwargs, p)


@rule("group_norm", "instance_norm", "local_response_norm")
def _spatial_norm(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    if p is not None and p.dim >= 1:
        raise Refusal("statistics over the band alone (use nn.GroupNorm / nn.InstanceNorm*, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


_REDUCE = """sum mean nansum nanmean prod amax amin max min argmax argmin all any std var std_mean var_mean norm
logsumexp median nanmedian mode count_nonzero aminmax""".split()
_ALONG = """softmax log_softmax softmin cumsum cumprod cummax cummin logcumsumexp sort argsort topk kthvalue normalize
glu diff""".split()


# a reduction over the sharded dim that is exact on bands: the band's partial, one sum over the domain
_DOMAIN_REDUCE = frozenset("sum mean nansum nanmean".split())
# an extreme over the sharded dim: the domain's extreme of the bands' (see _domain_extreme)
_DOMAIN_EXTREME = frozenset("amax amin".split())


@rule(*_REDUCE)
def _reduce(tr, func, args, kwargs, held):
    """A reduction over dims other than the sharded one passes; over it (or every dim) a sum or mean is one domain
    sum (:func:`_domain_reduction`), the others are refused (a max, a median, a variance: no rule on bands)."""
    op = op_name(func)
    x = args[0]
    if op in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _pointwise(tr, func, args, kwargs, held)
    p = tr.get(x)
    if p is None:  # a band as another argument
        raise Refusal("a band as a reduction's extra argument")
    index = 2 if op == "norm" else 1
    dims = dims_of(argument(args, kwargs, index, "dim"), x.ndim)
    if dims is not None and not dims and op in _DOMAIN_REDUCE:
        dims = None  # sum(x, dim=()): every dim, as torch reads it
    if dims is None or p.dim in dims:
        if op in _DOMAIN_REDUCE:
            return _domain_reduction(tr, func, args, kwargs, op, p, dims)
        if op in _DOMAIN_EXTREME:
            return _domain_extreme(tr, func, args, kwargs, op, p, dims)
        raise Refusal(f"it reduces over the sharded dim ({'every dim' if dims is None else 'dim ' + str(p.dim)}): "
                   f"one band's rows are not the field's (sum, mean, nansum, nanmean, amax and amin over it are exact; "
                   f"{op} has no rule on bands)")
    dropped = p.dim - sum(1 for k in dims if k < p.dim)
    return tr.run(func, args, kwargs, lambda out: p if out.ndim == x.ndim else p.moved(dropped))


def _domain_reduction(tr: Tracker, func, args: tuple, kwargs: dict, op: str, p: Sharded, dims: list[int] | None):
    """``sum`` / ``mean`` / ``nansum`` / ``nanmean`` over dims that include the sharded one: exact, replicated.

    The band's partial sum over those dims, added over the domain
    (:func:`credit_mpi.ops.allreduce.domain_sum`, differentiable: its adjoint is the
    same sum, so each rank's gradient of the result is its band's part); a mean
    divides by the field's element count, whose rows come from the agreement (every
    band's rows), never from this band; a nan-mean by the domain sum of the non-NaN
    counts (summed in the same call). The result is
    :class:`~credit_mpi.nn.replicated.Replicated`: the layers after it compute on it
    locally, a band times it (one row along the sharded dim) is pointwise, and the
    parameters of those layers get each rank's partial gradient, added by
    ``reduce_gradients``. Every check before the agreement depends on the model's
    structure only (the same on every rank).
    """
    from ...ops.allreduce import agree_domain_sum, domain_sum

    x = args[0]
    reduced = list(range(x.ndim)) if dims is None else sorted(set(dims))
    keepdim = bool(argument(args, kwargs, 2, "keepdim", False))
    out_dtype = argument(args, kwargs, 3, "dtype", None) or x.dtype
    if out_dtype not in (torch.float32, torch.float64):
        raise Refusal(f"it takes {op}() over the sharded dim in {out_dtype}: the sum over the domain has a rule for float32 "
                   f"and float64")
    nan = op.startswith("nan")

    def partial(t: torch.Tensor) -> torch.Tensor:  # the band's sum (with its non-NaN count for nanmean)
        s = (torch.nansum if nan else torch.sum)(t, reduced, keepdim=keepdim, dtype=out_dtype)
        if op != "nanmean":
            return s
        return torch.stack([s, (~torch.isnan(t)).sum(reduced, keepdim=keepdim).to(out_dtype)])

    if tracked_columns(tr) > 1 and not along_longitude(tr):  # the longitude's: a sum among the blocks of a grid row
        raise Refusal(f"it takes {op}() over the sharded dim on a latitude x longitude domain grid (no rule there yet: a sum "
                   f"over the rows alone is a sum over a column of the grid)")
    if tr.manager is None:  # the dry run: the whole field, one process's result
        out = replicated(func(*args, **kwargs))
        _report_domain_sum(tr, op, x, p, partial(x.detach()).shape, out_dtype)
        return out
    mine = partial(x)
    grad = torch.is_grad_enabled() and x.requires_grad
    comm = tr.manager.domain_group
    with torch._C.DisableTorchFunction():  # the sum's own tensor calls are not the model's (on a grid: the latitude's judge)
        plan = agree_domain_sum(tuple(mine.shape), out_dtype, x.shape[p.dim] // (p.outer * p.inner), grad,
                                comm, tr.stack[-1][0], transport=paths.current().transport(comm))
        total = domain_sum(mine, plan)
    if op == "nanmean":
        return replicated(total[0] / total[1])
    if op == "mean":
        count = math.prod(p.outer * plan.total * p.inner if k == p.dim else x.shape[k] for k in reduced)
        total = total / count
    return replicated(total)


def _domain_extreme(tr: Tracker, func, args: tuple, kwargs: dict, op: str, p: Sharded, dims: list[int] | None):
    """``amax`` / ``amin`` over dims that include the sharded one: exact, replicated.

    The value: the extreme of the bands' extremes (each band's, gathered over the domain: one
    ``allgather_along`` of one row a band; a band of no rows gives -inf / +inf). The gradient as torch
    gives it on the field: shared evenly among the elements equal to the extreme (ties across bands
    too): each band's sum of its tied elements and their count, added over the domain (one domain
    sum, as :func:`_domain_reduction`'s), the result ``extreme + (s - s.detach()) / count`` (the value
    is the extreme's bits). Every check before the agreements depends on the model's structure only.
    """
    from ...ops.allgather_along import allgather_along
    from ...ops.allreduce import agree_domain_sum, domain_sum

    x = args[0]
    reduced = list(range(x.ndim)) if dims is None else sorted(normalize_dim(int(d), x.ndim) for d in set(dims))
    keepdim = bool(argument(args, kwargs, 2, "keepdim", False))
    if x.dtype not in (torch.float32, torch.float64):
        raise Refusal(f"it takes {op}() over the sharded dim of a {x.dtype} tensor: the domain's {op} has a rule for "
                      f"float32 and float64")
    if tracked_columns(tr) > 1 and not along_longitude(tr):
        raise Refusal(f"it takes {op}() over the sharded dim on a latitude x longitude domain grid (no rule there yet)")
    if tr.manager is None:  # the dry run: the whole field, one process's result
        out = replicated(func(*args, **kwargs))
        _report_domain_sum(tr, op, x, p, (2,) + tuple(torch.amax(x.detach(), reduced, keepdim=keepdim).shape), x.dtype,
                           gathered=True)
        return out
    extreme = torch.amax if op == "amax" else torch.amin
    comm, path = tr.manager.domain_group, tr.stack[-1][0]
    transport = paths.current().transport(comm)
    with torch._C.DisableTorchFunction():  # the collectives' own tensor calls are not the model's
        xd = x.detach()
        if xd.shape[p.dim]:
            mine = extreme(xd, reduced, keepdim=True)
        else:  # a band of no rows: the extreme's identity
            shape = [1 if k in reduced else s for k, s in enumerate(xd.shape)]
            mine = xd.new_full(shape, float("-inf") if op == "amax" else float("inf"))
        every = allgather_along(mine, p.dim, comm, f"{path}: {op}() over the domain", transport=transport)
        best = extreme(every, p.dim, keepdim=True)  # the field's extreme (keepdim), the same bits on every rank
        tied = (xd == best).to(x.dtype)
        grad = torch.is_grad_enabled() and x.requires_grad
        plan = agree_domain_sum((2,) + tuple(best.shape), x.dtype, x.shape[p.dim] // (p.outer * p.inner), grad, comm, path, transport=transport)
    with torch._C.DisableTorchFunction():
        part = torch.stack([(x * tied).sum(reduced, keepdim=True), tied.sum(reduced, keepdim=True)])
        total = domain_sum(part, plan)
        s, count = total[0], total[1].detach()
        out = best + (s - s.detach()) / count
        if not keepdim:
            out = out.squeeze(tuple(reduced))
    return replicated(out)


def _report_domain_sum(tr: Tracker, op: str, x: torch.Tensor, p: Sharded, shape: tuple, dtype: torch.dtype,
                       gathered: bool = False) -> None:
    """In the dry run: the domain sum of a reduction as a row of describe()'s plan, with its traffic (``tr.on_move``);
    ``gathered``: an extreme's (the bands' extremes gathered first: one all-gather of ``shape[1:]`` a band)."""
    on_move = tr.on_move
    if on_move is None:
        return
    from ..traffic import Traffic, domain_sum_traffic

    rows = x.shape[p.dim] // (p.outer * p.inner)
    sizes = tr.band_sizes(rows)
    traffic = domain_sum_traffic(tuple(shape), dtype, len(sizes), x.requires_grad and torch.is_grad_enabled())
    if gathered:
        nbytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        traffic = [t + Traffic(nbytes * (len(sizes) - 1), 1, 0, 0, 1) for t in traffic]
    on_move(tr.stack[-1][0], f"domain_sum() of {op}()", rows, sizes, [1] * len(sizes), traffic)


@rule(*_ALONG)
def _along(tr, func, args, kwargs, held):
    """An op along one dim (softmax, cumsum, sort): passes when that dim is not the sharded one."""
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    default = {"glu": -1, "diff": -1, "normalize": 1}.get(op)
    dim = argument(args, kwargs, 2 if op == "normalize" else (2 if op == "diff" else 1), "dim", default)
    if op in ("topk", "kthvalue"):
        dim = argument(args, kwargs, 2, "dim", -1)
    if op in ("sort", "argsort") and dim is None:
        dim = -1
    if p is None or dim is None or normalize_dim(int(dim), x.ndim) == p.dim:
        raise Refusal(f"it works along the sharded dim (dim={dim}): the rows of the other bands are missing")
    return tr.run(func, args, kwargs, p)


@rule("matmul", "__matmul__", "__rmatmul__", "bmm", "mm")
def _matmul(tr, func, args, kwargs, held):
    """``a @ b``: a band in a batch dim or in a's rows / b's columns passes; contracted, or in both operands' rows, not."""
    a, b = (args[1], args[0]) if op_name(func) == "__rmatmul__" else (args[0], args[1])
    if a.ndim < 2 or b.ndim < 2:
        raise Refusal("a matrix-vector product with a band has no rule")
    ndim = max(a.ndim, b.ndim)
    outs = set()
    for t, role in ((a, "a"), (b, "b")):
        q = tr.get(t)
        if q is None:
            continue
        if (role == "a" and q.dim == t.ndim - 1) or (role == "b" and q.dim == t.ndim - 2):  # a sum over the field's tokens
            specs, positions, _ = _product_specs(func, args)
            letter = specs[0 if role == "a" else 1][q.dim]
            return _domain_contraction(tr, func, args, kwargs, specs, [args[k] for k in positions], positions,
                                       (letter, q.outer, q.inner))
        outs.add((q.dim + ndim - t.ndim, q.outer, q.inner))
    for t in (a, b):  # a batch partner that is not a band
        if tr.get(t) is None:
            for d, _, _ in outs:
                k = d - (ndim - t.ndim)
                if d < ndim - 2 and k >= 0 and t.shape[k] != 1:
                    raise Refusal("it pairs a band with a tensor that is not one along the sharded (batch) dim")
    if len(outs) > 1:
        raise Refusal("both operands hold bands in different dims of the product, and neither is the tokens of "
                   "whole rows to gather")
    d, outer, inner = outs.pop()
    return tr.run(func, args, kwargs, Sharded(d, outer, inner))


@rule("einsum")
def _einsum(tr, func, args, kwargs, held):
    """An einsum with one letter on the bands (``...`` spelled out first, :func:`_explicit_specs`): kept in the output,
    local (a partner with the field's entries along that letter, a spectral weight over the modes, is cut to the
    band's: :func:`~credit_mpi.nn.judge.field_values.field_partner`); summed, a sum over the domain."""
    equation = args[0]
    listed = len(args) == 2 and isinstance(args[1], (list, tuple))
    operands = list(args[1]) if listed else list(args[1:])
    specs, out = _explicit_specs(equation, operands)
    letters = set()
    for spec, t in zip(specs, operands, strict=True):
        q = tr.get(t)
        if q is not None:
            letters.add((spec[q.dim], q.outer, q.inner))
    if len(letters) != 1:
        raise Refusal(f"it pairs bands along different letters ({sorted(v[0] for v in letters)}): no rule")
    if next(iter(letters))[0] not in out:
        positions = list(range(1, len(args))) if not listed else None
        return _domain_contraction(tr, func, args, kwargs, specs, operands, positions, next(iter(letters)))
    letter, outer, inner = letters.pop()
    band = next(t for t in operands if tr.get(t) is not None)
    p = tr.get(band)
    cut = list(operands)
    for i, (spec, t) in enumerate(zip(specs, operands, strict=True)):
        if tr.get(t) is None and letter in spec and t.shape[spec.index(letter)] != 1:
            cut[i] = field_partner(tr, band, p, t, spec.index(letter))  # the field's entries: the band's own
    if any(c is not t for c, t in zip(cut, operands, strict=True)):
        args = (equation, cut) if listed else (equation, *cut)
    return tr.run(func, args, kwargs, Sharded(out.index(letter), outer, inner))


def _explicit_specs(equation: Any, operands: list) -> tuple[list[str], str]:
    """An einsum's operand specs and output spec with ``...`` spelled out in letters the equation does not use (each
    operand's ellipsis dims are the last of the output's, as torch broadcasts them)."""
    if not isinstance(equation, str) or "->" not in equation:
        raise Refusal(f"an einsum without '->' ({equation!r}) has no rule on bands: name the output's letters")
    ins, out = equation.replace(" ", "").split("->")
    specs = ins.split(",")
    if len(specs) != len(operands):
        raise Refusal(f"einsum {equation!r} names {len(specs)} operands for {len(operands)}")  # torch's own error
    if "..." not in equation:
        return specs, out
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation]
    counts = [t.ndim - (len(s) - 3) if "..." in s else 0 for s, t in zip(specs, operands, strict=True)]
    n = max(counts)
    ellipsis = "".join(free[:n])
    specs = [s.replace("...", ellipsis[n - k :]) for s, k in zip(specs, counts, strict=True)]
    return specs, out.replace("...", ellipsis)


def _contracted(what: str, letter: str, why: str) -> str:
    """Why a product that sums over the band's rows is refused, and what the model's author changes."""
    return (f"{what} contracts the sharded dim (letter {letter!r}, the band's rows) {why}, which has no rule (a sum "
            f"over the field's tokens is exact with a tensor that every rank holds whole, a parameter, whose "
            f"contracted dim is the field's tokens: rows x the dims merged after them). Change the forward: pool the "
            f"rows with a layer the converter replaces (e.g. nn.AdaptiveAvgPool2d to a fixed grid, then a Linear over "
            f"its cells), or run this block on the whole field")


def _domain_contraction(tr: Tracker, func, args: tuple, kwargs: dict, specs: list[str], operands: list,
                        positions: list[int] | None, band: tuple[str, int, int]):
    """A product that contracts a band's tokens with a tensor over the field's tokens: a sum over the domain.

    NCAR CREDIT's nextgen WXFormer pools its bottleneck with ``einsum("bcn,kn->bck", x, agg_w)``,
    ``agg_w`` a parameter over the field's ``H * W`` tokens. Each band contracts its own tokens
    ``[start * inner, stop * inner)`` (its rows of the field, from the agreed layout) with that
    slice of every partner that is not a band (a parameter, a replicated tensor), and the partial
    sums are added over the domain (:func:`credit_mpi.ops.allreduce.domain_sum`: one
    sum over the ranks, backward the same sum of the gradient). The result is
    :class:`~credit_mpi.nn.replicated.Replicated`; a parameter's gradient is this band's slice,
    added over the domain by ``reduce_gradients``. The field is remembered for the inverse
    (:func:`_spread`). Every check before the agreement depends on the model's structure only
    (the same on every rank); the field's size after it on agreed values.
    """
    from ...ops.allreduce import agree_domain_sum, domain_sum
    from ..replicated import replicated

    letter, outer, inner = band
    what = f"{args[0]!r}" if isinstance(args[0], str) else f"{op_name(func)}()"
    if positions is None:
        raise Refusal(_contracted(what, letter, "with operands given as a list"))
    if outer != 1:
        raise Refusal(_contracted(what, letter, "of merged windows (their tokens are not one block of the field's)"))
    at = [spec.index(letter) if letter in spec else None for spec in specs]
    bands = [i for i, t in enumerate(operands) if tr.get(t) is not None]
    x = operands[bands[0]]
    tokens = x.shape[tr.get(x).dim]  # this band's (the dry run: the field's)
    partners = [i for i, t in enumerate(operands) if i not in bands and at[i] is not None and t.shape[at[i]] != 1]
    if len(bands) != 1 or any(tr.get(operands[i]) != Sharded(at[i], outer, inner) for i in bands):
        raise Refusal(_contracted(what, letter, "with another band (a sum over pairs of every band's tokens)"))
    if not partners:
        raise Refusal(_contracted(what, letter, "alone (no tensor over the field's tokens to weight it)"))
    if tracked_columns(tr) > 1:
        raise Refusal(_contracted(what, letter, "on a latitude x longitude domain grid (a band's tokens are not one block)"))
    if tr.manager is None:  # the dry run: global shapes
        sizes = {operands[i].shape[at[i]] for i in partners}
        if sizes != {tokens}:
            raise Refusal(_contracted(what, letter, f"with a tensor of {sorted(sizes)} along it where the field has {tokens} tokens"))
        out = replicated(func(*args, **kwargs))
        _remember_field(tr, tokens, inner, None)
        return out
    cut = list(operands)
    for i in partners:  # shapes for the agreement: every partner cut to this band's tokens
        cut[i] = torch.empty(tuple(tokens if d == at[i] else s for d, s in enumerate(operands[i].shape)), device="meta",
                             dtype=operands[i].dtype)
    shape = tuple(func(*_placed(args, positions, [c.to("meta") for c in cut]), **kwargs).shape)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in operands)
    comm = tr.manager.domain_group
    plan = agree_domain_sum(shape, x.dtype, tokens // inner, grad, comm, tr.stack[-1][0],
                            transport=paths.current().transport(comm))
    start, stop = plan.rows()
    field = plan.total * inner
    wrong = sorted({operands[i].shape[at[i]] for i in partners} - {field})
    if wrong:  # agreed values and the model's shapes: the same on every rank
        raise Refusal(_contracted(what, letter, f"with a tensor of {wrong} along it where the field has {field} tokens"))
    for i in partners:
        cut[i] = operands[i].narrow(at[i], start * inner, (stop - start) * inner)
    out = replicated(domain_sum(func(*_placed(args, positions, cut), **kwargs), plan))
    _remember_field(tr, field, inner, (start, stop))
    return out


def _placed(args: tuple, positions: list[int], operands: list) -> tuple:
    new = list(args)
    for i, t in zip(positions, operands, strict=True):
        new[i] = t
    return tuple(new)


def _remember_field(tr: Tracker, tokens: int, inner: int, rows: tuple[int, int] | None) -> None:
    """A field of ``tokens`` tokens whose band is ``rows`` (None: the dry run's whole field) for :func:`_spread`;
    two fields of one token count that differ are neither (the inverse is then refused)."""
    fields = tr.fields
    entry = (inner, rows)
    fields[tokens] = entry if fields.get(tokens, entry) == entry else None


@without_bands
def spread_rule(tr: Tracker, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """The inverse of a sum over the domain: a replicated tensor contracted with a tensor over a field's tokens.

    ``einsum("bck,nk->bcn", s, scatter_w)`` with ``s`` replicated (a :func:`_domain_contraction`'s
    result) and ``scatter_w`` a parameter whose free dim ``n`` is the tokens of a field this
    forward contracted: the band's tokens are the product with the parameter's rows cut to the
    band (local, no communication), a band of that field. Returns ``(handled, out)``; not handled
    when no operand is replicated, no field was contracted, or no single output letter is a
    field's tokens (the function then runs as before: nothing of it holds bands).
    """
    fields = tr.fields
    op = op_name(func)
    if not fields or op not in ("einsum", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm"):
        return False, None
    got = _product_specs(func, args)
    if got is None:
        return False, None
    specs, positions, out = got
    operands = [args[i] for i in positions]
    if not any(is_replicated(t) for t in operands):
        return False, None
    found = [(j, c, i) for j, c in enumerate(out) for i, (spec, t) in enumerate(zip(specs, operands, strict=True))
             if c in spec and not is_replicated(t) and t.shape[spec.index(c)] in fields]
    if len({(j, c) for j, c, _ in found}) != 1:
        return False, None
    j, letter, _ = found[0]
    entry = fields[operands[found[0][2]].shape[specs[found[0][2]].index(letter)]]
    if entry is None:
        raise conversion_error(tr.stack[-1][0], f"{op}()", "it spreads a replicated tensor over a field's tokens, and two "
                      "fields of that many tokens differ in their rows: no rule")
    inner, rows = entry
    # plain tensors: a band is not replicated (Replicated would mark a product of replicas and parameters one)
    cut = [t.as_subclass(torch.Tensor) if is_replicated(t) else t for t in operands]
    if rows is not None:
        start, stop = rows
        for i, (spec, t) in enumerate(zip(specs, operands, strict=True)):
            if letter in spec and t.shape[spec.index(letter)] != 1:
                cut[i] = t.narrow(spec.index(letter), start * inner, (stop - start) * inner)
    return True, tr.run(func, _placed(args, positions, cut), kwargs, Sharded(j, 1, inner))


def _product_specs(func, args: tuple) -> tuple[list[str], list[int], str] | None:
    """An einsum's or a matrix product's operand specs, their positions in ``args`` and the output's spec (None: neither)."""
    op = op_name(func)
    if op == "einsum":
        equation = args[0]
        if not isinstance(equation, str) or "..." in equation or "->" not in equation or len(args) < 3:
            return None
        ins, out = equation.replace(" ", "").split("->")
        return ins.split(","), list(range(1, len(args))), out
    a_at, b_at = (1, 0) if op == "__rmatmul__" else (0, 1)
    if len(args) < 2 or not all(isinstance(args[i], torch.Tensor) and args[i].ndim >= 2 for i in (a_at, b_at)):
        return None
    a, b = args[a_at], args[b_at]
    batch = "ABCDEFGHIJ"[: max(a.ndim, b.ndim) - 2]
    return [batch[len(batch) - (a.ndim - 2):] + "mk", batch[len(batch) - (b.ndim - 2):] + "kn"], [a_at, b_at], batch + "mn"


@rule("cross_entropy", "mse_loss", "l1_loss")
def _loss(tr, func, args, kwargs, held):
    raise Refusal("it mixes positions across the sharded dim and has no rule on bands")
