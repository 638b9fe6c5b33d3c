"""Exact full attention across bands: the function rules of :mod:`credit_mpi.nn.judge` for attention.

Full attention over tokens flattened from (lat, lon) mixes every band with
every other. These rules make it exact, whichever way a forward spells it:

* ``q k^T`` by ``matmul``/``@``/``bmm``/``einsum`` with the queries' and the
  keys' tokens both on bands: the keys are gathered
  (:func:`~credit_mpi.ops.allgather_along.allgather_along`, backward the
  reduce-scatter), so the scores hold this band's query rows and *every*
  key column, in the field's order. Such a dim is marked **global** (it
  holds the whole field's tokens, the same on every rank as on one process);
  the mark follows pointwise ops (a scale, a mask in global coordinates),
  softmax, permutes and reshapes that keep the dim whole. A product that
  contracts a band's tokens with a global dim (``a v``) gathers that band
  first. A product that contracts a band's tokens with anything else (a
  weight) is still refused.
* ``F.scaled_dot_product_attention`` with the tokens (dim -2) of q, k, v on
  bands, three exact layouts, chosen from the shapes (the same on every
  rank): the all-to-all to a head-sharded layout when the heads divide among
  the ranks (:func:`~credit_mpi.ops.alltoall.alltoall`, Ulysses), else a ring
  of K/V bands with an online softmax
  (:func:`~credit_mpi.ops.ring.ring_attention`), else (broadcast batch dims,
  ``enable_gqa``) the K/V gather; keys and values without bands (a global
  memory, the same on every rank) are attended locally. ``attn_mask`` in the
  field's coordinates and ``is_causal`` (global token indices) are exact on
  every path.
  ``SDPA_PATH`` forces one (``"alltoall"``, ``"ring"``, ``"gather"``).
* ``nn.MultiheadAttention`` (its ``F.multi_head_attention_forward``,
  ``batch_first`` either way): key and value gathered (the projection is per
  token, so gathering the inputs is gathering K and V), this band's queries
  attended to them; ``attn_mask`` (its rows sliced to this band's queries),
  ``key_padding_mask`` and ``is_causal`` in the field's coordinates; the
  weights (``need_weights``) are a band of query rows with global key columns.

Refused on every rank, naming the module and the op: a mask that holds bands
(made from the band: build it for every token), dropout in training (each
band would draw its own), a band of merged windows (``outer > 1``) where the
tokens would have to be gathered (their concatenation is not the field's
order), a mask or ``is_causal`` with such queries.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from ...layout import Layout
from ...transport import paths
from .pointwise import POINTWISE
from .registry import Refusal, argument, op_name, rule, tensors_in, wraps
from .shapes import PERMUTES, RESHAPES
from .tracker import Sharded

__all__ = ["SDPA_PATH", "global_dims", "sdpa_path"]

SDPA_PATH = "auto"  # "auto" | "alltoall" | "ring" | "gather": the same on every rank
_PATHS = ("auto", "alltoall", "ring", "gather")

# -- global dims: a dim that holds every band's tokens in the field's order ----------------------


def global_dims(tr, t: Any) -> frozenset[int]:
    """The dims of ``t`` that hold the whole field's tokens (gathered keys' columns of the scores)."""
    rec = tr.record_of(t)
    return rec.global_dims if rec is not None else frozenset()


def _mark(tr, t: torch.Tensor, dims) -> None:
    dims = frozenset(d for d in dims if 0 <= d < t.ndim)
    if dims:
        tr.record(t).global_dims = dims
    elif (rec := tr.record_of(t)) is not None:
        rec.global_dims = frozenset()


def _carry_aligned(tr, func, args, kwargs, out) -> None:
    """Pointwise and softmax: a global dim stays global (dims aligned from the right, size kept)."""
    ins = [(t, global_dims(tr, t)) for t in tensors_in((args, kwargs))]
    for o in tensors_in(out):
        dims = set()
        for t, g in ins:
            for d in g:
                od = d + o.ndim - t.ndim
                if 0 <= od < o.ndim and o.shape[od] == t.shape[d]:
                    dims.add(od)
        _mark(tr, o, dims)


def _carry_permute(tr, func, args, kwargs, out) -> None:
    x = args[0]
    g = global_dims(tr, x)
    if not g or not isinstance(out, torch.Tensor):
        return
    probe = torch.empty(tuple(range(2, x.ndim + 2)), device="meta")
    moved = list(func(probe, *args[1:], **kwargs).shape)
    _mark(tr, out, {moved.index(d + 2) for d in g})


def _carry_reshape(tr, func, args, kwargs, out) -> None:
    """A global dim kept whole by a reshape: the output dim of its size with the same elements after it."""
    x = args[0]
    g = global_dims(tr, x)
    if not g or not isinstance(out, torch.Tensor):
        return
    dims = set()
    for d in g:
        size, after = x.shape[d], math.prod(x.shape[d + 1 :])
        for j, s in enumerate(out.shape):
            if s == size and size > 1 and math.prod(out.shape[j + 1 :]) == after:
                dims.add(j)
                break
    _mark(tr, out, dims)


def _carrying(carry):
    """A wrapper of a rule whose outputs keep the global dims of its inputs (``carry`` marks them)."""
    def wrapper(base, tr, func, args, kwargs, held):
        try:
            out = base(tr, func, args, kwargs, held)
        except Refusal as why:
            if any(global_dims(tr, t) for t in tensors_in((args, kwargs))):
                raise Refusal(f"{why}; the scores' rows are this band's queries: a mask in the field's coordinates "
                              f"is exact as attn_mask= of F.scaled_dot_product_attention") from None
            raise
        carry(tr, func, args, kwargs, out)
        return out

    return wrapper


wraps(*POINTWISE, "softmax", "log_softmax", "softmin", "dropout")(_carrying(_carry_aligned))
wraps(*PERMUTES)(_carrying(_carry_permute))
wraps(*RESHAPES)(_carrying(_carry_reshape))


@wraps("__setitem__")
def _forget_on_write(base, tr, func, args, kwargs, held):
    """A write into part of a global dim (``__setitem__``) is not known to be the field's: its mark is dropped."""
    out = base(tr, func, args, kwargs, held)
    _mark(tr, args[0], ())
    return out


# -- gathering the operand of a product ------------------------------------------------------------


def _path(tr) -> str:
    return tr.stack[-1][0]


def _gather(tr, t: torch.Tensor, dim: int, path: str | None = None) -> torch.Tensor:
    """``t`` (a band along ``dim``) joined with every other band: the field's tensor (the dry run: already it);
    ``path`` names the call in the agreement (attention's carries its masking: agreed with the gather)."""
    if tr.manager is None:
        _report_gather(tr, t, dim)
        return t.view(t.shape)  # global shapes already; a new tensor object, not a band
    from ...ops.allgather_along import allgather_along

    comm = tr.manager.domain_group
    return allgather_along(t, dim, comm, path or _path(tr), transport=paths.current().transport(comm))


def _report_gather(tr, t: torch.Tensor, dim: int) -> None:
    """In the dry run: the gather of a product's operand (a hand-written ``q k^T``, ``a v``, nn.MultiheadAttention's
    key and value) as a row of describe()'s plan, with its traffic (``tr.on_move``, set by describe)."""
    on_move, p = tr.on_move, tr.get(t)
    if on_move is None or p is None:
        return
    from ..traffic import gather_traffic
    from .rows import dim_sizes

    counts = dim_sizes(tr, t, p)
    on_move(_path(tr), "allgather_along()", t.shape[dim], counts, [sum(counts)] * len(counts),
            gather_traffic((t,), counts, len(counts), dim))


def _report_counts(tr, ranks: int) -> None:
    """In the dry run: :func:`_counts`' gather of every rank's token count (the offsets of a mask in the field's
    coordinates), one float64 per rank, as a row of describe()'s plan."""
    on_move = tr.on_move
    if on_move is None or ranks <= 1:
        return
    from ..traffic import gather_traffic

    counts = [1] * ranks
    on_move(_path(tr), "allgather_along(counts)", ranks, counts, [ranks] * ranks,
            gather_traffic((torch.empty(ranks, dtype=torch.float64, device="meta"),), counts, ranks, 0))


def _gathers(tr, specs: list[str], operands: list, out: str) -> tuple[list[tuple[int, int]], set[int]]:
    """Which operands of a product to gather (``(index, dim)``) and the output's global dims.

    An operand whose band letter is global in another operand is gathered (``a v``: the scores'
    key columns are global). Of bands along different letters, those of the first letter the
    output keeps stay (the queries) and the others are gathered (``q k^T``: the keys).
    """
    band = {}
    for i, (spec, t) in enumerate(zip(specs, operands, strict=True)):
        p = tr.get(t)
        if p is not None and p.dim < len(spec):
            band[i] = (spec[p.dim], p)
    glob = {spec[d] for spec, t in zip(specs, operands, strict=True) for d in global_dims(tr, t) if d < len(spec)}
    gather = {i for i, (letter, _) in band.items() if letter in glob}
    letters = list(dict.fromkeys(letter for i, (letter, _) in band.items() if i not in gather))
    if len(letters) > 1:
        kept = next((letter for letter in letters if letter in out), None)
        if kept is not None:
            gather |= {i for i, (letter, _) in band.items() if i not in gather and letter != kept}
    for i in sorted(gather):
        if band[i][1].outer != 1:
            raise Refusal("the tokens to gather are merged windows (their bands' concatenation is not the field's "
                       "order): attention across bands needs the tokens of whole rows")
    global_letters = glob | {band[i][0] for i in gather}
    return [(i, specs[i].index(band[i][0])) for i in sorted(gather)], {out.index(c) for c in global_letters if c in out}


def _product(tr, func, args, kwargs, positions, specs, out_spec, base):
    """Gather what :func:`_gathers` says, run the product (``base``'s rule while bands remain), mark the output."""
    operands = [args[i] for i in positions]
    todo, marks = _gathers(tr, specs, operands, out_spec)
    new = list(args)
    for i, dim in todo:
        new[positions[i]] = _gather(tr, operands[i], dim)
    held = [(t, p) for t in tensors_in((new, kwargs)) if (p := tr.get(t)) is not None]
    out = base(tr, func, tuple(new), kwargs, held) if held else func(*new, **kwargs)
    if isinstance(out, torch.Tensor):
        _mark(tr, out, marks)
    return out


@wraps("matmul", "__matmul__", "__rmatmul__", "bmm", "mm")
def _matmul(base, tr, func, args, kwargs, held):
    """``a @ b``: keys' tokens gathered for ``q k^T``, values' for ``a v``; else the product's own rule (:mod:`credit_mpi.nn.judge.reductions`)."""
    a_at, b_at = (1, 0) if op_name(func) == "__rmatmul__" else (0, 1)
    a, b = args[a_at], args[b_at]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.ndim < 2 or b.ndim < 2:
        return base(tr, func, args, kwargs, held)
    batch = "ABCDEFGHIJ"[: max(a.ndim, b.ndim) - 2]
    specs = [batch[len(batch) - (a.ndim - 2):] + "mk", batch[len(batch) - (b.ndim - 2):] + "kn"]
    return _product(tr, func, args, kwargs, [a_at, b_at], specs, batch + "mn", base)


@wraps("einsum")
def _einsum(base, tr, func, args, kwargs, held):
    """The same for ``einsum`` (``"bqd,bkd->bqk"``, ``"bqk,bkd->bqd"``): an equation without ``...``."""
    equation = args[0]
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return base(tr, func, args, kwargs, held)
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = (equation, *args[1])
    ins, out = equation.replace(" ", "").split("->")
    specs = ins.split(",")
    return _product(tr, func, args, kwargs, list(range(1, len(args))), specs, out, base)


# -- scaled_dot_product_attention --------------------------------------------------------------------


def _counts(tr, n: int) -> list[int]:
    """Every rank's token count along a band (one small agreed all-gather: the offsets of global masks)."""
    from ...ops.allgather_along import allgather_along

    mine = torch.tensor([float(n)], dtype=torch.float64)
    comm = tr.manager.domain_group
    return [int(c) for c in allgather_along(mine, 0, comm, _path(tr), transport=paths.current().transport(comm)).tolist()]


def _on(mask: Any, like: torch.Tensor) -> Any:
    """A mask on ``like``'s device (the dry run's meta device: a mask the forward made on the host)."""
    return mask.to(like.device) if isinstance(mask, torch.Tensor) and mask.device != like.device else mask


def _check_mask(tr, mask: Any) -> None:
    if isinstance(mask, torch.Tensor) and tr.get(mask) is not None:
        raise Refusal("its attention mask holds bands (made from the band's rows): build the mask in the field's "
                   "coordinates, over every token, the same on every rank")


def _global_mask(mask, causal: bool, q0: int, nq: int, lq: int, s: int, like: torch.Tensor, path: str):
    """This band's rows of a mask in the field's coordinates, and of ``is_causal`` (key ``j`` for query ``i`` when ``j <= i``)."""
    if mask is not None:
        if mask.ndim < 2 or mask.shape[-2] not in (1, lq) or mask.shape[-1] not in (1, s):
            raise ValueError(f"{path}: attn_mask of shape {tuple(mask.shape)} is not in the field's coordinates: its "
                             f"last two dims must be (1 or {lq} query tokens, 1 or {s} key tokens)")
        if mask.shape[-2] != 1:
            mask = mask.narrow(-2, q0, nq)
    if not causal:
        return mask
    allowed = torch.arange(s, device=like.device) <= torch.arange(q0, q0 + nq, device=like.device).unsqueeze(-1)
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask + torch.zeros(allowed.shape, dtype=mask.dtype, device=like.device).masked_fill(~allowed, float("-inf"))


def learned_mask(mask) -> bool:
    """A mask that takes a gradient (a learned relative-position bias): the ring cannot carry it."""
    return isinstance(mask, torch.Tensor) and mask.requires_grad and torch.is_grad_enabled()


def sdpa_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: int, gqa: bool, forced: str = "auto",
              mask_grad: bool = False) -> str:
    """The layout of attention across bands, from the shapes alone (the same decision on every rank).

    ``alltoall`` when the heads (dim -3) divide among the ranks, ``ring`` when q, k, v have the same
    batch dims (and the mask takes no gradient, ``mask_grad``: :func:`learned_mask`), else ``gather``;
    ``forced`` (``SDPA_PATH``) picks one where it applies.
    """
    if forced not in _PATHS:
        raise ValueError(f"credit_mpi.nn.judge.attention.SDPA_PATH={forced!r}; valid: {', '.join(_PATHS)}")
    same = not gqa and q.ndim >= 3 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1]
    heads = same and q.shape[-3] % ranks == 0
    if forced == "alltoall" and heads or forced == "auto" and heads:
        return "alltoall"
    if forced in ("auto", "ring") and same and not mask_grad:
        return "ring"
    return "gather"


@rule("scaled_dot_product_attention")
def _sdpa(tr, func, args, kwargs, held):
    """Attention: windows in the batch dim pass; queries on token bands attend to every band's keys.

    The tokens of q, k, v (dim -2) on bands: one of three exact layouts (:func:`sdpa_path`), the
    output a band of this rank's query tokens. ``attn_mask`` in the field's coordinates and
    ``is_causal`` are exact; dropout in training and a mask that holds bands are refused.
    """
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    q, k, v, mask, dropout, causal, scale, gqa = (argument(args, kwargs, i, n, dflt) for i, (n, dflt) in enumerate(zip(names, defaults, strict=True)))
    places = [tr.get(t) for t in (q, k, v)]
    _check_mask(tr, mask)
    if all(p is not None and p.dim < t.ndim - 2 for t, p in zip((q, k, v), places, strict=True)) and len(set(places)) == 1:
        return tr.run(func, args, kwargs, places[0])  # windows (or samples) in the batch dim: each is whole
    memory = places[1] is None and places[2] is None  # keys and values without bands: the same on every rank
    if places[0] is None or places[0].dim != q.ndim - 2 or not memory and any(
            p is None or p.dim != t.ndim - 2 for t, p in zip((k, v), places[1:], strict=True)):
        raise Refusal("attention with bands in some of q, k, v only, or along their features, has no rule (the "
                   "tokens, dim -2, of q and of k and v must hold the bands; or k and v none: a global memory)")
    if dropout:
        raise Refusal(f"dropout_p={dropout} draws its own mask on every band (not one process's draw)")
    if any(p is not None and p.outer != 1 for p in places) and (memory is False and (places[1].outer != 1 or places[2].outer != 1)
                                                              or mask is not None or causal):
        raise Refusal("attention across bands of merged windows (outer > 1) has no rule: the tokens of whole rows are needed")
    rest = {"scale": scale} if scale is not None else {}
    if gqa:
        rest["enable_gqa"] = True
    if tr.manager is None:  # the dry run: global shapes, every layout gives the one-process result
        ranks = len(tr.band_sizes(q.shape[-2]))
        if (mask is not None or causal) and (memory or sdpa_path(q, k, v, ranks, gqa, SDPA_PATH, learned_mask(mask)) == "gather"):
            _report_counts(tr, ranks)  # the run's offsets of the global mask (_attend)
        out = func(q, k, v, attn_mask=_on(mask, q), is_causal=causal, **rest)
    else:
        out = _attend(tr, func, q, k, v, mask, bool(causal), rest, memory)
    tr.set(out, places[0])
    return out


def _masking(mask: Any, causal: bool, **more: Any) -> str:
    """What every rank must agree on of a call's masking: ``is_causal`` and each mask's presence, shape and dtype
    (the values are the model's, in the field's coordinates, as any tensor every rank holds whole)."""
    def spec(m):
        return None if not isinstance(m, torch.Tensor) else (tuple(m.shape), str(m.dtype).removeprefix("torch."))

    parts = [f"is_causal={bool(causal)}", f"attn_mask={spec(mask)}"] + [f"{n}={spec(m)}" for n, m in more.items()]
    return f" [{', '.join(parts)}]"


def _agree_masking(tr, tag: str) -> None:
    """One agreement of the masking ``tag`` over the domain (a path that moves no data otherwise: a global memory):
    ranks that differ raise the same ValueError everywhere, before any of them attends."""
    from ...agreement import agree_values

    def explain(values: list) -> None:
        detail = "; ".join(f"rank {r}:{v}" for r, v in enumerate(values))
        raise ValueError(f"{_path(tr)}: the ranks call attention with different masking ({detail}); is_causal and "
                         f"the masks must be the same on every rank (the field's, as on one process)")

    agree_values(tr.manager.domain_group, "attention masking", lambda: tag, explain)


def _attend(tr, func, q, k, v, mask, causal, rest, memory=False):
    """This band's queries attended to every band's keys (or to a global memory: nothing to move).

    ``is_causal`` and the mask's presence, shape and dtype are agreed with the first collective (its path carries
    them: ranks that differ raise on every rank); the global memory, which moves nothing else, agrees them alone.
    """
    comm, path = tr.manager.domain_group, _path(tr)
    ranks, rank = comm.Get_size(), comm.Get_rank()
    layout = "memory" if memory else sdpa_path(q, k, v, ranks, bool(rest.get("enable_gqa")), SDPA_PATH, learned_mask(mask))
    tagged = path + _masking(mask, causal)
    if layout == "memory" and ranks > 1:
        _agree_masking(tr, _masking(mask, causal))
    if layout == "alltoall":
        from ...ops.alltoall import alltoall

        moves = paths.current().transport(comm)
        qh, kh = alltoall(q, -3, -2, comm, path=tagged, transport=moves), alltoall(k, -3, -2, comm, path=path, transport=moves)
        vh = kh if v is k else alltoall(v, -3, -2, comm, path=path, transport=moves)
        heads = q.shape[-3] // ranks
        if mask is not None and mask.ndim >= 3 and mask.shape[-3] == q.shape[-3] and q.shape[-3] > 1:
            mask = mask.narrow(-3, rank * heads, heads)
        out = func(qh, kh, vh, attn_mask=mask, is_causal=causal, **rest)
        return alltoall(out, -2, -3, comm, keep=q.shape[-2], path=path, transport=moves)
    if layout == "ring":
        from ...ops.ring import ring_attention

        return ring_attention(q, k, v, comm, attn_mask=mask, is_causal=causal, scale=rest.get("scale"), path=tagged,
                              transport=paths.current().transport(comm))
    kg = k if memory else _gather(tr, k, k.ndim - 2, tagged)
    vg = v if memory else kg if v is k else _gather(tr, v, v.ndim - 2)
    if mask is not None or causal:
        counts = _counts(tr, q.shape[-2])
        mask = _global_mask(mask, causal, Layout.bands(counts).start(rank), counts[rank], sum(counts), kg.shape[-2], q, path)
    return func(q, kg, vg, attn_mask=mask, **rest)


# -- nn.MultiheadAttention ------------------------------------------------------------------------


def _mha_per_sample(tr, func, a: dict, p: Sharded):
    """Query, key and value with the bands in the batch (dim 1 of ``(L, N, E)``): each sample attends within itself.

    NextGen WXFormer's column attention (over the pressure levels of each grid point: ``(B h w,
    levels, C)``) mixes no rows: local, exact, as long as no mask is indexed by the batch.
    """
    if a["key_padding_mask"] is not None or (a["attn_mask"] is not None and a["attn_mask"].ndim == 3):
        raise Refusal("a key_padding_mask or a per-sample attn_mask with the bands in the batch has no rule (its rows are "
                   "the field's samples, not this band's)")
    if a["training"] and a["dropout_p"]:
        raise Refusal(f"dropout={a['dropout_p']} in training draws its own mask on every band (not one process's draw)")
    if tr.manager is None:  # the dry run (meta): a mask made on the host goes along
        a["attn_mask"] = _on(a["attn_mask"], a["query"])
    out, weights = func(**a)
    tr.set(out, p)
    if weights is not None:  # (N, [H,] L, S): the samples first
        tr.set(weights, p.moved(0))
    return out, weights


@functools.cache
def _mha_signature() -> inspect.Signature:
    """torch's ``multi_head_attention_forward`` signature, read when first needed (not at import: the docs build
    imports this module with torch mocked)."""
    return inspect.signature(torch.nn.functional.multi_head_attention_forward)


@rule("multi_head_attention_forward")
def _mha(tr, func, args, kwargs, held):
    """``nn.MultiheadAttention``: the tokens (dim 0 of ``(L, N, E)``) on bands, key and value gathered."""
    bound = _mha_signature().bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    pq, pk, pv = (tr.get(t) for t in (query, key, value))
    for name in ("attn_mask", "key_padding_mask"):
        _check_mask(tr, a[name])
    if pq is not None and pq.dim == 1 and pq == pk == pv:
        return _mha_per_sample(tr, func, a, pq)
    if pq is None or pq.dim != 0 or (pk is None) != (pv is None) or any(p is not None and p.dim != 0 for p in (pk, pv)):
        raise Refusal("multi-head attention with the bands elsewhere than in the tokens (dim 0 of (L, N, E), the "
                   "query's and, for keys from bands, the key's and value's) or, for all three alike, in the batch "
                   "(dim 1) has no rule: reshape so that the tokens or the batch hold the bands")
    if a["training"] and a["dropout_p"]:
        raise Refusal(f"dropout={a['dropout_p']} in training draws its own mask on every band (not one process's draw)")
    if a["static_k"] is not None or a["static_v"] is not None:
        raise Refusal("static_k / static_v with bands has no rule")
    if any(p is not None and p.outer != 1 for p in (pk, pv)) or (pq.outer != 1 and (a["attn_mask"] is not None or a["is_causal"])):
        raise Refusal("attention across bands of merged windows (outer > 1) has no rule: the tokens of whole rows are needed")
    tag = _masking(a["attn_mask"], a["is_causal"], key_padding_mask=a["key_padding_mask"])
    if tr.manager is not None and pk is None and tr.manager.domain_group.Get_size() > 1:
        _agree_masking(tr, tag)  # keys and values without bands: nothing else moves before the masks are used
    if pk is not None:
        gathered = _gather(tr, key, 0, None if tr.manager is None else _path(tr) + tag)
        a["value"] = gathered if value is key else _gather(tr, value, 0)
        a["key"] = gathered
    if tr.manager is not None and a["attn_mask"] is not None:
        counts, rank = _counts(tr, query.shape[0]), tr.manager.domain_rank
        a["attn_mask"] = _global_mask(a["attn_mask"], False, Layout.bands(counts).start(rank), counts[rank], sum(counts),
                                      a["key"].shape[0], query, _path(tr))
        a["is_causal"] = False  # a hint of the mask's shape: this band's rows of it are not a square causal one
    if tr.manager is None:  # the dry run (meta): a mask made on the host goes along
        if a["attn_mask"] is not None:
            _report_counts(tr, len(tr.band_sizes(query.shape[0])))  # the run's offsets of the global mask
        a["attn_mask"], a["key_padding_mask"] = _on(a["attn_mask"], query), _on(a["key_padding_mask"], query)
    out, weights = func(**a)
    tr.set(out, pq)
    if weights is not None:  # (N, [H,] L, S): this band's query rows, every key
        tr.set(weights, Sharded(weights.ndim - 2, pq.outer, pq.inner))
        _mark(tr, weights, {weights.ndim - 1})
    return out, weights
