"""Ring attention: the K/V bands passed around the ring of ranks, an online softmax, an exact backward.

Exact global attention with the queries on token bands when the heads do
not divide among the ranks: at step ``j`` rank ``r`` attends its queries to
the keys and values of rank ``r - j`` (the band it received from its left
neighbour while computing on the previous one: the shift is posted on the
transport, :mod:`credit_mpi.transport.moves`, before the step's compute and
waited for after it) and folds the scores into a
running maximum, sum and output (the online softmax of flash attention), so
a rank never holds more than two K/V bands. Masks are given in the field's
coordinates (``attn_mask`` of shape ``(..., L, S)`` over every token, or
``is_causal``): each step uses the block of this rank's query rows and the
visiting band's key columns.

The backward passes the K/V bands around again with their gradients
(``dK``, ``dV`` accumulate on the travelling band and go home after the last
step); ``dQ`` stays. Per rank the forward receives every other band's K and
V: ``(S - s_rank) (d_k + d_v)`` elements per batch row and head, ``2 N d
(P - 1) / P`` on even bands (what the K/V all-gather moves, with two bands of
memory instead of all of them). :func:`received_elements` counts it.

An op of :mod:`credit_mpi.engine`: the agreement (q, k, v's shapes other than
the tokens, the dtype, the mask's shape, ``is_causal``, the scale, whether
autograd records the call, every rank's query and key token counts) comes
first, so a bad input on one rank is the same exception on every rank.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable

from ..autograd import check_backward_thread
from ..engine import Counter, Op, run
from ..layout import Layout
from ..transport.limits import TAG_RING
from ..transport.moves import RECV, SEND, MpiMoves, transport_name, transport_of
from ..validation import Local
from .along import check_float

__all__ = ["ring_attention", "received_elements"]

_RECEIVED = Counter()
_SHIFT = 31  # a rank's count is its query tokens << _SHIFT | its key tokens (one agreed integer)

received_elements = _RECEIVED.received  # elements of ring_attention forwards received from other ranks (this thread; reset=True)


class _Plan(NamedTuple):
    comm: MPI.Comm
    q_counts: tuple[int, ...]  # query tokens of every rank
    k_counts: tuple[int, ...]  # key (and value) tokens of every rank
    scale: float
    causal: bool
    transfer: Any  # the transport the bands travel on


class RingAttention(Op):
    """``softmax(q k^T scale + mask) v`` over the tokens of every band, K/V passed around the ring."""

    name = "ring_attention"

    def local(self, x: Any, args: dict) -> Local:
        q, k, v = x
        path, mask = args["path"], args["mask"]
        for name, t in (("query", q), ("key", k), ("value", v)):
            check_float(t, path, "ring attention of", f"{name} ")
        transport = transport_name(args["transport"], path)
        if q.ndim < 2 or not (q.ndim == k.ndim == v.ndim) or q.dtype != k.dtype or q.dtype != v.dtype:
            raise ValueError(f"{path}: q, k, v must have the same dtype and ndim >= 2, got {tuple(q.shape)} "
                             f"{tuple(k.shape)} {tuple(v.shape)}")
        if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"{path}: ring attention needs q (..., L, E), k (..., S, E), v (..., S, Ev) with the "
                             f"same batch dims, got {tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)}")
        if q.shape[-2] >= 1 << _SHIFT or k.shape[-2] >= 1 << _SHIFT:
            raise ValueError(f"{path}: more than 2**{_SHIFT} tokens on one rank")
        if mask is not None and (mask.requires_grad or mask.ndim < 2):
            raise ValueError(f"{path}: attn_mask must be a (..., L, S) tensor that does not require grad")
        scale = args["scale"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        records = torch.is_grad_enabled() and any(t.requires_grad for t in x)
        mask_spec = None if mask is None else (tuple(mask.shape), str(mask.dtype))
        calls = (path, tuple(q.shape[:-2]), q.shape[-1], v.shape[-1], str(q.dtype), mask_spec, bool(args["causal"]),
                 scale, ("ring_records", records), transport)
        return Local(scale, calls, (), (q.shape[-2] << _SHIFT) | k.shape[-2])

    def plan(self, scale: float, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        q_counts = tuple(int(c) >> _SHIFT for c in counts)
        k_counts = tuple(int(c) & ((1 << _SHIFT) - 1) for c in counts)
        mask, path = args["mask"], args["path"]
        if mask is not None:
            rows, cols = mask.shape[-2], mask.shape[-1]
            if rows not in (1, sum(q_counts)) or cols not in (1, sum(k_counts)):
                raise ValueError(f"{path}: attn_mask of shape {tuple(mask.shape)} is not in the field's coordinates: "
                                 f"its last two dims must be (1 or {sum(q_counts)} query tokens, 1 or "
                                 f"{sum(k_counts)} key tokens)")
        return _Plan(comm, q_counts, k_counts, scale, bool(args["causal"]), transport_of(args["transport"], comm))

    def kernel(self, x: Any, p: _Plan) -> torch.Tensor:
        q, k, v = x
        return _Ring.apply(q, k, v, p, _MaskHolder(self._mask))

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        self._mask = mask


class _MaskHolder:
    """The mask, out of autograd's sight (a constant of the attention)."""

    def __init__(self, mask: torch.Tensor | None) -> None:
        self.mask = mask


def _bias(mask: torch.Tensor | None, p: _Plan, src: int, like: torch.Tensor) -> torch.Tensor | None:
    """The additive mask of this rank's query rows and ``src``'s key columns (None: nothing masked)."""
    rank = p.comm.Get_rank()
    q0, nq = Layout.bands(p.q_counts).start(rank), p.q_counts[rank]
    k0, nk = Layout.bands(p.k_counts).start(src), p.k_counts[src]
    out = None
    if mask is not None:
        block = mask
        if block.shape[-2] != 1:
            block = block.narrow(-2, q0, nq)
        if block.shape[-1] != 1:
            block = block.narrow(-1, k0, nk)
        block = block.to(like.device)
        if block.dtype == torch.bool:
            block = torch.zeros(block.shape, dtype=like.dtype, device=like.device).masked_fill(~block, -math.inf)
        out = block.to(like.dtype)
    if p.causal:  # key j (global) attends query i (global) when j <= i, as torch's is_causal
        rows = torch.arange(q0, q0 + nq, device=like.device).unsqueeze(-1)
        cols = torch.arange(k0, k0 + nk, device=like.device)
        causal = torch.zeros((nq, nk), dtype=like.dtype, device=like.device).masked_fill(cols > rows, -math.inf)
        out = causal if out is None else out + causal
    return out


class _Shift:
    """``parts`` on their way to the right neighbour, tensors of ``shapes`` on their way from the left one (posted).

    :meth:`wait` returns what arrived; in between the caller may compute
    (``parts`` were packed into one buffer, kept here until the wait).
    """

    def __init__(self, p: _Plan, parts: tuple[torch.Tensor, ...], shapes: list[tuple[int, ...]], like: torch.Tensor,
                 count: bool = False) -> None:
        size, rank = p.comm.Get_size(), p.comm.Get_rank()
        self._send = torch.cat([t.detach().reshape(-1) for t in parts])
        self.recv = torch.empty(sum(math.prod(s) for s in shapes), dtype=like.dtype, device=like.device)
        self.shapes = shapes
        self.posted = p.transfer.post([(RECV, self.recv, (rank - 1) % size, TAG_RING),
                                       (SEND, self._send, (rank + 1) % size, TAG_RING)])
        if count:
            _RECEIVED.add(self.recv.numel())

    def wait(self) -> list[torch.Tensor]:
        self.posted.wait()
        out, at = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(self.recv[at : at + n].view(shape))
            at += n
        return out


def _shift(p: _Plan, parts: tuple[torch.Tensor, ...], shapes: list[tuple[int, ...]], like: torch.Tensor) -> list[torch.Tensor]:
    """Send ``parts`` to the right neighbour, receive tensors of ``shapes`` from the left one (posted, then waited for)."""
    return _Shift(p, parts, shapes, like).wait()


def _kv_shapes(k: torch.Tensor, v: torch.Tensor, n: int) -> list[tuple[int, ...]]:
    return [tuple(k.shape[:-2]) + (n, k.shape[-1]), tuple(v.shape[:-2]) + (n, v.shape[-1])]


def _scores(q, k, p: _Plan, mask, src: int) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * p.scale
    bias = _bias(mask, p, src, q)
    return s if bias is None else s + bias


def _forward(q, k, v, p: _Plan, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the log-sum-exp of every query row (the online softmax over the visiting bands)."""
    size, rank = p.comm.Get_size(), p.comm.Get_rank()
    m = torch.full(q.shape[:-1] + (1,), -math.inf, dtype=q.dtype, device=q.device)
    total = torch.zeros_like(m)
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    kc, vc = k, v
    for step in range(size):
        src = (rank - step) % size
        # the next band travels while this one is attended (kc, vc are only read until the wait)
        shift = _Shift(p, (kc, vc), _kv_shapes(k, v, p.k_counts[(src - 1) % size]), q, count=True) if step < size - 1 else None
        s = _scores(q, kc, p, mask, src)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        e = torch.exp(s - safe)
        alpha = torch.exp(m - safe)
        total = total * alpha + e.sum(-1, keepdim=True)
        acc = acc * alpha + e @ vc
        m = m_new
        if shift is not None:
            kc, vc = shift.wait()
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return acc / total, safe + torch.log(total)


def _backward(q, k, v, out, lse, grad, p: _Plan, mask):
    """dQ, dK, dV: the bands go round again, their gradients with them, and home after the last step."""
    size, rank = p.comm.Get_size(), p.comm.Get_rank()
    delta = (grad * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    kc, vc, dk, dv = k, v, torch.zeros_like(k), torch.zeros_like(v)
    for step in range(size):
        src = (rank - step) % size
        prob = torch.exp(_scores(q, kc, p, mask, src) - lse)
        dv = dv + prob.transpose(-1, -2) @ grad
        ds = prob * (grad @ vc.transpose(-1, -2) - delta)
        dq = dq + (ds @ kc) * p.scale
        dk = dk + (ds.transpose(-1, -2) @ q) * p.scale
        if step < size - 1:
            n = p.k_counts[(src - 1) % size]
            kc, vc, dk, dv = _shift(p, (kc, vc, dk, dv), _kv_shapes(k, v, n) * 2, q)
    if size > 1:  # the band held now is rank + 1's: its gradients go home, ours come from rank - 1
        dk, dv = _shift(p, (dk, dv), _kv_shapes(k, v, p.k_counts[rank]), q)
    return dq, dk, dv


class _Ring(torch.autograd.Function):
    """The ring's forward (output and log-sum-exp saved) and its exact backward (not twice differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, holder):
        out, lse = _forward(q.detach(), k.detach(), v.detach(), plan, holder.mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.mask = plan, holder.mask
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if isinstance(ctx.plan.transfer, MpiMoves):
            check_backward_thread()
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad.contiguous(), ctx.plan, ctx.mask)
        return dq, dk, dv, None, None


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: MPI.Comm, *,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                   path: str = "ring_attention", transport: Any = "mpi") -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries with the keys and values of every rank (collective; differentiable).

    Args:
        q: This rank's queries ``(..., L_rank, E)`` (float32/float64).
        k, v: This rank's keys ``(..., S_rank, E)`` and values ``(..., S_rank, Ev)``, the same batch dims.
        comm: The domain's communicator (the tokens of rank ``r`` come before those of rank ``r + 1``).
        attn_mask: None, or a bool (True: attend) or float (added) mask in the field's coordinates,
            ``(..., 1 or L, 1 or S)`` over every rank's tokens, the same on every rank.
        is_causal: Key ``j`` attends query ``i`` when ``j <= i`` (global token indices).
        scale: The scores' factor (default ``1 / sqrt(E)``).
        path: Named in errors.
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Raises:
        TypeError: q, k or v is not a float32/float64 tensor (on every rank alike).
        ValueError: their shapes do not fit; the mask is not in the field's coordinates; ``transport`` is
            not a transport; the ranks differ.
    """
    return run(RingAttention(attn_mask), (q, k, v), comm, mask=attn_mask, causal=is_causal, scale=scale, path=path,
               transport=transport)
