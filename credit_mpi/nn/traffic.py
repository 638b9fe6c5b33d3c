"""What each rank sends in one call of a converted layer (issue 26, item 3): the numbers behind ``describe()``.

Computed from a layer's global input and output shapes and every band's rows
(the dry run of :func:`credit_mpi.nn.describe`), by the rules the layers
run: a halo is one message per neighbour (none past a zero / reflect edge;
the first and last bands exchange with ``circular`` padding) of
``width x (the dims before the sharded one) x (the dims after it) x itemsize``
bytes, forward and, when the input requires grad, backward (the halo
gradients sent home); a transposed convolution's overlap-add the same of its
output rows (backward whenever its weight requires grad); a norm's
statistics one ``Allgather`` forward and one backward (Group / Instance /
LayerNorm) or a reduce-scatter backward (BatchNorm, a global mean: each rank's
row of the stacked gradient; BatchNorm's over the domain group, as in a job
without data-parallel ranks); attention
over every band's tokens as the layout it runs in (:func:`gather_traffic`:
K and V gathered, and the operand a hand-written ``q k^T`` or ``a v`` gathers;
:func:`alltoall_traffic`: heads; :func:`ring_traffic`); a row move
(:func:`move_traffic`: re-banding to whole windows, ``torch.roll`` across
bands, the group layout) one ``Alltoallv`` of the rows that leave the band.

Bytes of a collective are the bytes of this rank's data that the other ranks
receive (an ``Allgather`` of ``b`` bytes: ``b x (n - 1)``; an ``Allreduce``:
its buffer ``x (n - 1)``), what a direct delivery moves, whatever tree or
ring the MPI library uses; one collective call is one message. Agreements
(one fixed-size ``Allgather`` of :data:`AGREEMENT_BYTES` per rank at the
start of each layer call, and one at the end of the forward) are counted
apart: their count is the fixed cost per layer that a latency-bound step
pays. The numbers are those of a step after the first (the first call of a
layer shape also exchanges its band table once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..partition import BOUNDARIES, halo_neighbors

__all__ = ["Traffic", "AGREEMENT_BYTES", "layer_traffic", "gather_traffic", "alltoall_traffic", "ring_traffic",
           "halo_traffic", "move_traffic", "domain_sum_traffic", "join_traffic", "halo_rule", "stats_rule", "row_bytes", "acc_itemsize"]

#: The bytes each rank contributes to one agreement (:func:`credit_mpi.validation.agree`: five int64).
AGREEMENT_BYTES = 40


@dataclass(frozen=True)
class Traffic:
    """What one rank sends in one layer call (or a whole step): bytes and messages forward and backward, agreements."""

    forward_bytes: int = 0
    forward_messages: int = 0
    backward_bytes: int = 0
    backward_messages: int = 0
    agreements: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.forward_bytes, self.forward_messages, self.backward_bytes, self.backward_messages, self.agreements)


def _halo(rank: int, n: int, width: int, rows_bytes: int, boundary: str | None) -> tuple[int, int]:
    """``(bytes, messages)`` one band sends in one halo exchange (or its adjoint) of ``rows_bytes`` per row.

    The first and last bands exchange only when ``boundary`` wraps (:data:`credit_mpi.partition.BOUNDARIES`).
    """
    if not width or not rows_bytes:
        return 0, 0
    wraps = getattr(BOUNDARIES.get(boundary or ""), "wraps", False)
    messages = sum(nb is not None for nb in halo_neighbors(rank, n, wraps))
    return messages * width * rows_bytes, messages


def row_bytes(shape: tuple[int, ...], axis: int, itemsize: int) -> int:
    """Bytes of one row along ``axis`` (all the dims before it times all the dims after it)."""
    return math.prod(shape[:axis]) * math.prod(shape[axis + 1 :]) * itemsize


def acc_itemsize(dtype: torch.dtype) -> int:
    """The statistics' itemsize: float64 for float64 input, float32 otherwise (:mod:`credit_mpi.nn.norm`)."""
    return 8 if dtype == torch.float64 else 4


def layer_traffic(mod, shape_in: tuple[int, ...], shape_out: tuple[int, ...], dtype: torch.dtype, axis: int,
                  n: int, width: int, grad: bool, weight_grad: bool, local: bool = False) -> list[Traffic] | None:
    """Every rank's :class:`Traffic` of one call of ``mod`` on ``n`` bands (None: a layer this has no rule for).

    ``width`` is the layer's agreed halo (its layout's), ``grad`` whether its
    input requires grad, ``weight_grad`` whether its weight does, ``local``
    a layer that runs on a replicated input (no data; its agreement skipped in a repeated step).
    """
    if n <= 1:
        return [Traffic()] * n
    if local:
        return [Traffic(agreements=mod.dp_local_agreements)] * n
    rule = mod.dp_traffic(shape_in, shape_out, dtype, axis, n, width, grad, weight_grad)
    return None if rule is None else [rule(r) for r in range(n)]


def halo_rule(n: int, width: int, rows_bytes: int, boundary: str | None, backward: bool, quiet: bool = False):
    """``rank -> Traffic`` of a layer that exchanges a halo of ``width`` rows (its own agreement; the same back when
    ``backward``). ``quiet``: the layer skips its agreement in a repeated step when it has no halo (it makes no
    MPI call then: :func:`credit_mpi.agreement.quiet_forward`)."""
    agreements = 0 if quiet and not width else 1

    def at(rank: int) -> Traffic:
        b, m = _halo(rank, n, width, rows_bytes, boundary)
        return Traffic(b, m, *((b, m) if backward else (0, 0)), agreements)

    return at


def stats_rule(n: int, forward: int, backward: int, grad: bool):
    """``rank -> Traffic`` of an Allgather of ``forward`` bytes; backward (``grad``) an Allgather of ``backward`` bytes
    (or the statistics op's reduce-scatter: ``backward`` bytes to each other rank)."""
    back = (backward * (n - 1), 1) if backward and grad else (0, 0)
    t = Traffic(forward * (n - 1), 1, *back, 1)
    return lambda rank: t


def halo_traffic(shape: tuple[int, ...], dtype: torch.dtype, axis: int, n: int, width: int, periodic: bool,
                 grad: bool) -> list[Traffic]:
    """Every rank's :class:`Traffic` of one :func:`credit_mpi.halo_exchange` call (a :class:`~credit_mpi.nn.HaloExchange`
    a trusted module calls itself): its own agreement, a message per neighbour, the same back when ``grad``."""
    rows_bytes = row_bytes(shape, axis, torch.empty((), dtype=dtype).element_size())
    out = []
    for rank in range(n):
        b, m = _halo(rank, n, width, rows_bytes, "periodic" if periodic else "zero")
        out.append(Traffic(b, m, *((b, m) if grad else (0, 0)), 1))
    return out


def domain_sum_traffic(shape: tuple[int, ...], dtype: torch.dtype, n: int, grad: bool) -> list[Traffic]:
    """Every rank's :class:`Traffic` of one sum over the domain (:func:`credit_mpi.ops.allreduce.domain_sum`, a sum or
    mean over the sharded dim): its agreement, one ``Allreduce`` of the partial sum, the same back when ``grad``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    at = stats_rule(n, nbytes, nbytes, grad)
    return [at(rank) for rank in range(n)]


def move_traffic(moves_of, n: int, row_bytes: int, grad: bool, moves: bool = True) -> list[Traffic]:
    """Every rank's :class:`Traffic` of one row move (:mod:`credit_mpi.ops.rows`: a re-band to whole windows and
    back, ``torch.roll`` across bands, the group layout of long attention and back).

    ``moves_of(rank)`` is that rank's :class:`~credit_mpi.ops.reband.RowMoves`; forward one
    ``Alltoallv`` of the rows it sends to other ranks (what stays is copied) and the op's
    agreement; backward (``grad``) the move back: the rows it received. ``moves=False``: a
    re-band whose target is the layout it has: nothing moves, and a repeated step skips its agreement
    (:func:`credit_mpi.agreement.quiet_forward`).
    """
    if not moves:
        return [Traffic()] * n
    out = []
    for rank in range(n):
        m = moves_of(rank)
        back = (m.inverse().sent_rows(rank) * row_bytes, 1) if grad else (0, 0)
        out.append(Traffic(m.sent_rows(rank) * row_bytes, 1, *back, 1))
    return out


def join_traffic(parts, dim: int, sizes: list[list[int]], target: list[int], n: int) -> list[Traffic]:
    """Every rank's :class:`Traffic` of a join of band parts (``torch.cat``: :func:`credit_mpi.ops.reband.join_layouts`).

    ``parts`` are global (the dry run's), ``sizes`` every part's layout along ``dim``; the join agrees
    every part's rows (one agreement per three parts), then each part whose layout is not ``target``
    moves to it: one ``Alltoallv`` of the rows that leave the band, and back in backward when the
    part requires grad (no agreement of its own: the join's covers it).
    """
    from ..ops.reband import join_agreements
    from ..ops.rows import plan_moves

    # a repeated step: a join that moves nothing skips its agreements (credit_mpi.agreement.quiet_forward)
    still = all(list(layout) == list(target) for layout in sizes)
    out = [Traffic(agreements=0 if still else join_agreements(len(parts)))] * n
    for t, layout in zip(parts, sizes, strict=True):
        if layout == target:
            continue
        size = row_bytes(tuple(t.shape), dim, t.element_size())
        moved = [plan_moves(tuple(layout), tuple(target), lambda j: j, r) for r in range(n)]
        out = [o + Traffic(m.sent_rows(r) * size, 1, *((m.inverse().sent_rows(r) * size, 1) if t.requires_grad else (0, 0)))
               for r, (o, m) in enumerate(zip(out, moved, strict=True))]
    return out


def _token_bytes(x, dim: int = -2) -> int:
    """Bytes of one token (along ``dim``) of the dry run's global ``x``."""
    return math.prod(x.shape) // x.shape[dim] * x.element_size()


def gather_traffic(tensors, counts: list[int], n: int, dim: int = -2) -> list[Traffic]:
    """Every rank's :class:`Traffic` of :func:`credit_mpi.ops.allgather_along.allgather_along` of each of ``tensors`` along ``dim``.

    ``tensors`` are global (the dry run's: ``counts[r]`` of their ``N``
    tokens on rank ``r``); forward one ``Allgatherv`` and one agreement
    each, backward (a tensor that requires grad) one ``Reduce_scatter`` of
    the gradient: the other ranks' tokens go to them.
    """
    out = []
    for rank in range(n):
        t = Traffic()
        for x in tensors:
            token = _token_bytes(x, dim)
            mine, others = counts[rank] * token, (sum(counts) - counts[rank]) * token
            back = (others, 1) if x.requires_grad else (0, 0)
            t = t + Traffic(mine * (n - 1), 1, *back, 1)
        out.append(t)
    return out


def alltoall_traffic(q, k, v, counts: list[int], n: int) -> list[Traffic]:
    """Every rank's :class:`Traffic` of attention by all-to-all to heads (:mod:`credit_mpi.ops.alltoall`).

    q, k (and v unless it is k) go from token bands to a head-sharded layout
    (this rank's tokens of the other ranks' heads: ``n_r T (P - 1) / P``
    bytes), the output comes back (the other ranks' tokens of this rank's
    heads: ``(N - n_r) T_out / P``); one ``Alltoallv`` and one agreement each;
    backward the reverse of each, for what requires grad.
    """
    total = sum(counts)
    grad = any(t.requires_grad for t in (q, k, v))
    inputs = (q, k) if v is k else (q, k, v)
    t_out = _token_bytes(q) // q.shape[-1] * v.shape[-1]
    out = []
    for rank in range(n):
        mine, others = counts[rank], total - counts[rank]
        t = Traffic()
        for x in inputs:
            token = _token_bytes(x)
            back = (others * token // n, 1) if x.requires_grad else (0, 0)
            t = t + Traffic(mine * token * (n - 1) // n, 1, *back, 1)
        back = (mine * t_out * (n - 1) // n, 1) if grad else (0, 0)
        out.append(t + Traffic(others * t_out // n, 1, *back, 1))
    return out


def ring_traffic(q, k, v, counts: list[int], n: int) -> list[Traffic]:
    """Every rank's :class:`Traffic` of ring attention (:mod:`credit_mpi.ops.ring`).

    Forward: ``P - 1`` ``Sendrecv`` to the right neighbour, each the K/V band
    held (every band but the right neighbour's: ``(N - n_{r+1})`` tokens of
    K and V); backward (anything requires grad) the bands go round again with
    their gradients (twice the bytes), then the gradients of the band held
    (the right neighbour's) go home: ``P`` messages. One agreement.
    """
    total, kv = sum(counts), _token_bytes(k) + _token_bytes(v)
    grad = any(t.requires_grad for t in (q, k, v))
    out = []
    for rank in range(n):
        held = total - counts[(rank + 1) % n]
        back = (2 * kv * held + kv * counts[(rank + 1) % n], n) if grad else (0, 0)
        out.append(Traffic(kv * held, n - 1, *back, 1))
    return out
