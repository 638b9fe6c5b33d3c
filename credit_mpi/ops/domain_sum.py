"""The sum over the domain of every band's partial contraction (one ``Allreduce``), differentiable; the result replicated.

A contraction of a band's tokens with a weight stored for the whole field
(NCAR CREDIT's nextgen WXFormer: ``einsum("bcn,kn->bck", x, agg_w)`` with
``agg_w`` of ``(K, H * W)``) is, on one process, a sum over every token of
the field. On bands each rank contracts its own tokens with its slice of
the weight (its rows ``[start, stop)`` of the field, from the layout) and
the partial sums are added over the domain: the result is the same on every
rank (:class:`~credit_mpi.nn.replicated.Replicated`).

The adjoint is the ``Allreduce`` of the gradients: the replicated result is
used by every rank for its own band downstream, so each rank's gradient of
it is that band's part of the total; the partial sum of every rank feeds
all of them.

Two steps, so that the weight can be cut before the local contraction:
:func:`agree_domain_sum` (the agreement, first: every rank's band rows,
the shape and dtype of the partial sum, the autograd state; remembered,
one ``Allgather`` of its header per repeated call) gives a
:class:`DomainSumPlan` (every rank's rows: :meth:`DomainSumPlan.rows` of
this band), then :func:`domain_sum` runs the ``Allreduce`` on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ..agreement import agree_cached
from ..engine import Counter, Op, apply_agreed, records_grad
from ..validation import Local

__all__ = ["DomainSumPlan", "agree_domain_sum", "domain_sum", "received_elements"]

_RECEIVED = Counter()
_DTYPES = (torch.float32, torch.float64)


def received_elements(reset: bool = False) -> int:
    """Elements this thread's :func:`domain_sum` forwards reduced since the last reset (the communication volume)."""
    return _RECEIVED.received(reset)


class _Described(NamedTuple):
    """What is agreed before the partial sum exists: its shape, dtype, this band's rows, the autograd state."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int
    grad: bool


class DomainSumPlan(NamedTuple):
    """The agreed plan: the communicator, every rank's band rows, this rank, the partial sum's shape and dtype."""

    comm: MPI.Comm
    counts: tuple[int, ...]
    rank: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool

    def rows(self) -> tuple[int, int]:
        """This band's rows ``[start, stop)`` of the field (the slice of a weight over the field's rows)."""
        start = sum(self.counts[: self.rank])
        return start, start + self.counts[self.rank]

    @property
    def total(self) -> int:
        """The field's rows."""
        return sum(self.counts)


class DomainSum(Op):
    """``x`` is this rank's partial sum; the kernel is its ``Allreduce`` (sum), the adjoint the gradient's."""

    name = "domain_sum"

    def key(self, d: Any, args: dict) -> Any:
        return (args["path"], d) if isinstance(d, _Described) else None

    def local(self, d: _Described, args: dict) -> Local:
        path = args["path"]
        if d.dtype not in _DTYPES:
            raise TypeError(f"{path}: a sum over the domain of float32/float64 tensors, got {d.dtype}")
        if d.rows < 0:
            raise ValueError(f"{path}: a band of {d.rows} rows")
        # the shape and dtype decide the Allreduce's byte count, the autograd state whether backward reduces too
        return Local(d, (path, d.shape, str(d.dtype), ("autograd", d.grad)), (), d.rows)

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: {loc.calls[1]} {loc.calls[2]}, autograd {loc.calls[3][1]}"
                           for r, loc in enumerate(locals_))
        raise ValueError(f"{locals_[0].calls[0]}: the ranks' partial sums over the domain differ in shape, dtype or "
                         f"autograd state ({detail}); run the same model and batch on every rank")

    def plan(self, d: _Described, counts: list[int], comm: MPI.Comm, args: dict) -> DomainSumPlan:
        return DomainSumPlan(comm, tuple(int(c) for c in counts), comm.Get_rank(), d.shape, d.dtype, d.grad)

    def kernel(self, x: torch.Tensor, p: DomainSumPlan) -> torch.Tensor:
        if p.comm.Get_size() > 1:
            _RECEIVED.add(x.numel())
        return _allreduce(x, p)

    def adjoint(self, grad: torch.Tensor, p: DomainSumPlan) -> torch.Tensor:
        return _allreduce(grad, p)


def _allreduce(x: torch.Tensor, p: DomainSumPlan) -> torch.Tensor:
    """``x`` summed over ``p.comm`` (a new tensor on ``x``'s device)."""
    buf = np.ascontiguousarray(x.detach().cpu().numpy()).copy()
    if p.comm.Get_size() > 1:
        p.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf).to(x.device)


DOMAIN_SUM = DomainSum()


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def agree_domain_sum(shape: tuple[int, ...], dtype: torch.dtype, rows: int, grad: bool, comm: MPI.Comm,
                     path: str = "domain_sum") -> DomainSumPlan:
    """The agreement of a sum over the domain (collective): every rank's band rows, before the partial sum is made.

    Args:
        shape: The partial sum's shape (the same on every rank).
        dtype: Its dtype (float32 or float64).
        rows: This rank's band rows (the plan's :meth:`~DomainSumPlan.rows` are its slice of the field).
        grad: Whether autograd will record the sum (the same on every rank: backward reduces too).
        comm: The domain's communicator.
        path: Named in errors (the module that sums).

    Raises:
        TypeError: a dtype other than float32/float64 (on every rank alike).
        ValueError: the ranks' shapes, dtypes or autograd states differ.
    """
    d = _Described(tuple(int(s) for s in shape), dtype, int(rows), bool(grad))
    args = {"path": path}
    return agree_cached(comm, DOMAIN_SUM.name, DOMAIN_SUM.key(d, args), lambda: DOMAIN_SUM.local(d, args),
                        lambda mine, counts: DOMAIN_SUM.plan(mine, counts, comm, args),
                        explain=DOMAIN_SUM.explain)


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def domain_sum(partial: torch.Tensor, plan: DomainSumPlan) -> torch.Tensor:
    """``partial`` summed over the domain with an agreed ``plan`` (the Allreduce; differentiable: backward reduces too).

    Raises:
        ValueError: ``partial`` is not what was agreed (a programming error of the caller: the same on every rank).
    """
    if tuple(partial.shape) != plan.shape or partial.dtype != plan.dtype or records_grad(partial) != plan.grad:
        raise ValueError(f"domain_sum: a partial sum of {tuple(partial.shape)} {partial.dtype} (autograd "
                         f"{records_grad(partial)}) where {plan.shape} {plan.dtype} (autograd {plan.grad}) was agreed")
    return apply_agreed(DOMAIN_SUM, partial, plan)
