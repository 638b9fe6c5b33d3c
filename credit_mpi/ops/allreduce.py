"""The sum over the ranks: every rank's array added (one Allreduce); differentiable (its own adjoint).

One op of :mod:`credit_mpi.engine` (operation ``"allreduce"``) for the two
uses that add arrays over a communicator:

* the training helpers' fused sums (numpy, not differentiable): the loss
  shares of :func:`credit_mpi.nn.global_loss` (a slot per domain group and
  two counters that carry the ranks' errors and flags) and the sufficient
  statistics of :func:`credit_mpi.nn.latitude_weighted_metrics`. Their own
  agreement covers the buffer, so they run :func:`allreduce_agreed`;
  standalone, :func:`allreduce_sum` agrees first;
* the sum over the domain of a band's partial contraction (torch,
  differentiable): NCAR CREDIT's nextgen WXFormer pools its bottleneck with
  ``einsum("bcn,kn->bck", x, agg_w)``, ``agg_w`` a weight over the field's
  ``H * W`` tokens; on bands each rank contracts its own tokens with its
  slice of the weight (its rows ``[start, stop)`` of the field) and the
  partial sums are added over the domain: the result is the same on every
  rank (:class:`~credit_mpi.nn.replicated.Replicated`). The weight is cut
  before the partial sum exists, so the agreement comes first
  (:func:`agree_domain_sum`, which returns the :class:`AllreducePlan` whose
  :meth:`~AllreducePlan.rows` are this band's), then :func:`domain_sum`.

The adjoint of the sum is the same sum of the gradients: the replicated
result is used by every rank for its own band downstream, so each rank's
gradient of it is that band's part of the total, and every rank's input
feeds all of them (the adjoint of the adjoint is the sum again: double
backward through the engine).

The kernel is one ``allreduce`` of the transport protocol
(:mod:`credit_mpi.transport.moves`): ``comm.Allreduce`` on host arrays and
on device memory with a CUDA-aware MPI (staged otherwise), ``all_reduce``
with ``transport=TorchMoves(group)``; so the sum costs what the raw call
on the same bytes costs. The order of the additions is the library's: the
ranks get the same bits in practice (MPICH and Open MPI do, as the MPI
standard recommends: tests/ops/test_domain_sum.py checks it), but not
necessarily the bits of a sum in rank order, nor those of another
transport. :func:`reduce_scatter` (an ``alltoallv``, then the slices
added in rank order) is the adjoint of the layers' statistics.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ..agreement import Local, agree_cached
from ..engine import Counter, Op, apply_agreed, records_grad, run, run_agreed
from ..transport import arrays
from ..transport.moves import transport_name, transport_of

__all__ = ["Allreduce", "ALLREDUCE", "AllreducePlan", "DomainSumPlan", "allreduce_sum", "allreduce_agreed",
           "agree_domain_sum", "domain_sum", "reduce_scatter", "received_elements"]

_RECEIVED = Counter()
_TORCH_DTYPES = (torch.float32, torch.float64)


def received_elements(reset: bool = False) -> int:
    """Elements this thread's sums reduced in their forwards since the last reset (the communication volume)."""
    return _RECEIVED.received(reset)


class Described(NamedTuple):
    """What is agreed of a sum (before its array exists, for the domain sum): named in errors, kind, shape, dtype,
    this rank's band rows (0 outside the domain sum), the autograd state, the transport's name."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: Any
    rows: int
    grad: bool
    transport: str


class AllreducePlan(NamedTuple):
    """The agreed plan: the communicator, every rank's band rows, this rank, the array's shape, dtype and autograd
    state, and the transport the sum moves on."""

    comm: MPI.Comm
    counts: tuple[int, ...]
    rank: int
    shape: tuple[int, ...]
    dtype: Any
    grad: bool
    moves: Any

    def rows(self) -> tuple[int, int]:
        """This band's rows ``[start, stop)`` of the field (the slice of a weight over the field's rows)."""
        start = sum(self.counts[: self.rank])
        return start, start + self.counts[self.rank]

    @property
    def total(self) -> int:
        """The field's rows."""
        return sum(self.counts)


DomainSumPlan = AllreducePlan  # the domain sum's name for it


def _described(x: Any, args: dict) -> Described:
    """The description of an array given to :func:`allreduce_sum` (TypeError for anything it cannot add)."""
    path, transport = args["path"], transport_name(args["transport"], args["path"])
    if isinstance(x, torch.Tensor):
        return Described(path, "torch", tuple(x.shape), x.dtype, 0, records_grad(x), transport)
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iuf":
        raise TypeError(f"{path}: expected a numpy array of numbers or a float32/float64 torch tensor, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    return Described(path, "numpy", x.shape, x.dtype, 0, False, transport)


class Allreduce(Op):
    """``x`` (or its :class:`Described`) is this rank's array; the kernel its sum over the ranks, the adjoint the same."""

    name = "allreduce"

    def key(self, x: Any, args: dict) -> Hashable | None:
        transport = args["transport"]
        if not (isinstance(transport, str) and transport == "mpi"):
            return None  # a transport object: agreed and planned every call (the plan holds it)
        if isinstance(x, Described):
            return x
        return (args["path"], type(x), tuple(getattr(x, "shape", ())), getattr(x, "dtype", None))

    def local(self, x: Any, args: dict) -> Local:
        d = x if isinstance(x, Described) else _described(x, args)
        if d.kind == "torch" and d.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{d.path}: a sum over the ranks of float32/float64 tensors, got {d.dtype}")
        if d.rows < 0:
            raise ValueError(f"{d.path}: a band of {d.rows} rows")
        # kind, shape and dtype decide the byte counts, the autograd state whether backward sums too
        return Local(d, (d.path, d.kind, d.shape, str(d.dtype), d.transport, ("autograd", d.grad)), (), d.rows)

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: {loc.calls[1]} {loc.calls[2]} {loc.calls[3]} over {loc.calls[4]}, "
                           f"autograd {loc.calls[5][1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"{locals_[0].calls[0]}: the ranks' partial sums differ in kind, shape, dtype, transport or "
                         f"autograd state ({detail}); run the same model and batch on every rank")

    def plan(self, d: Described, counts: list[int], comm: MPI.Comm, args: dict) -> AllreducePlan:
        return AllreducePlan(comm, tuple(int(c) for c in counts), comm.Get_rank(), d.shape, d.dtype, d.grad,
                             transport_of(args["transport"], comm))

    def kernel(self, x: Any, p: AllreducePlan) -> Any:
        if p.comm.Get_size() > 1:
            _RECEIVED.add(math.prod(p.shape))
        return _summed(x, p)

    def adjoint(self, grad: Any, p: AllreducePlan) -> Any:
        return _summed(grad, p)


def _summed(x: Any, p: AllreducePlan) -> Any:
    """``x`` summed over ``p.comm``, a new array of ``x``'s kind and device: one ``allreduce`` of the transport."""
    x = x.detach() if isinstance(x, torch.Tensor) else x
    flat = arrays.contiguous(x).reshape(-1)
    if p.comm.Get_size() == 1 or flat.shape[0] == 0:
        return flat.reshape(p.shape) + 0  # a new array (the caller's stays its own)
    out = arrays.pooled_empty(flat, (flat.shape[0],))  # host memory reused: no fresh pages to fault in per call
    p.moves.allreduce(flat, out)
    return out.reshape(p.shape)


def reduce_scatter(flat: Any, sizes: list[int], rank: int, moves: Any) -> Any:
    """Slice ``rank`` of every rank's flat ``flat`` (cut in slices of ``sizes`` elements), added in rank order.

    One ``alltoallv`` of the transport protocol (slice ``r`` to rank ``r``),
    then the sum: the same order on every rank and transport, so the same
    bits. A new 1-D array of ``flat``'s kind and device. Also the adjoint of
    the layers' statistics (each rank's row of the stacked gradient).
    """
    n, mine, item = len(sizes), sizes[rank], arrays.describe(flat).itemsize
    parts = arrays.empty(flat, (n, mine))
    moves.alltoallv(flat, [s * item for s in sizes], parts, [mine * item] * n)
    total = parts[0] + 0
    for part in parts[1:]:
        total += part
    return total


ALLREDUCE = Allreduce()


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def allreduce_sum(x: Any, comm: MPI.Comm, *, transport: Any = "mpi", path: str = "allreduce") -> Any:
    """``x`` summed over ``comm``, a new array (collective; agreed first; differentiable for torch tensors).

    Args:
        x: A numpy array of numbers or a float32/float64 torch tensor, the same shape and dtype on every rank.
        comm: The communicator.
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).
        path: Named in errors.

    Raises:
        TypeError: ``x`` is neither (on every rank alike).
        ValueError: ``transport`` is not a transport; or the ranks' kinds, shapes, dtypes, transports or
            autograd states differ.
    """
    return run(ALLREDUCE, x, comm, transport=transport, path=path)


@torch.compiler.disable(recursive=True)
def allreduce_agreed(x: Any, comm: MPI.Comm) -> Any:
    """:func:`allreduce_sum` for a caller whose agreement covers ``x``'s kind, shape and dtype (no agreement of its own)."""
    return run_agreed(ALLREDUCE, x, comm, (), transport="mpi", path="allreduce")


@torch.compiler.disable(recursive=True)
def agree_domain_sum(shape: tuple[int, ...], dtype: torch.dtype, rows: int, grad: bool, comm: MPI.Comm,
                     path: str = "domain_sum", *, transport: Any = "mpi") -> AllreducePlan:
    """The agreement of a sum over the domain (collective): every rank's band rows, before the partial sum is made.

    Args:
        shape: The partial sum's shape (the same on every rank).
        dtype: Its dtype (float32 or float64).
        rows: This rank's band rows (the plan's :meth:`~AllreducePlan.rows` are its slice of the field).
        grad: Whether autograd will record the sum (the same on every rank: backward sums too).
        comm: The domain's communicator.
        path: Named in errors (the module that sums).
        transport: ``"mpi"``, or a transport object over the same ranks.

    Raises:
        TypeError: a dtype other than float32/float64 (on every rank alike).
        ValueError: ``transport`` is not a transport; or the ranks' shapes, dtypes, transports or autograd
            states differ.
    """
    args = {"path": path, "transport": transport}
    d = Described(path, "torch", tuple(int(s) for s in shape), dtype, int(rows), bool(grad), transport_name(transport, path))
    return agree_cached(comm, ALLREDUCE.name, ALLREDUCE.key(d, args), lambda: ALLREDUCE.local(d, args),
                        lambda mine, counts: ALLREDUCE.plan(mine, counts, comm, args), explain=ALLREDUCE.explain)


@torch.compiler.disable(recursive=True)
def domain_sum(partial: torch.Tensor, plan: AllreducePlan) -> torch.Tensor:
    """``partial`` summed over the domain with an agreed ``plan`` (differentiable: backward sums the gradient too).

    Raises:
        ValueError: ``partial`` is not what was agreed (a programming error of the caller: the same on every rank).
    """
    if tuple(partial.shape) != plan.shape or partial.dtype != plan.dtype or records_grad(partial) != plan.grad:
        raise ValueError(f"domain_sum: a partial sum of {tuple(partial.shape)} {partial.dtype} (autograd "
                         f"{records_grad(partial)}) where {plan.shape} {plan.dtype} (autograd {plan.grad}) was agreed")
    return apply_agreed(ALLREDUCE, partial, plan)
