"""All-gather of a tensor along one dim over the domain (the K/V tokens of attention across bands), differentiable.

Exact global attention with the queries on bands: every rank gathers the
keys and values of every band (one ``allgatherv`` of the transport protocol,
:mod:`credit_mpi.transport.moves`, uneven bands included) and attends its
own queries to all of them. The backward of the gather is the
reduce-scatter of the gradient: one ``alltoallv`` brings every rank the
part of every rank's gradient that belongs to its own tokens, summed in
rank order (so MPI and torch.distributed give the same bits). Per rank and per gathered
tensor of ``N`` tokens of ``d`` elements the forward receives
``N d (P - 1) / P`` elements (K and V together: ``2 N d (P - 1) / P``, what a
ring of K/V bands moves), the backward sends as many.

An op of :mod:`credit_mpi.engine`: the agreement (the shapes other than the
gathered dim, the dtype, the autograd state, every rank's token count) comes
first, so a bad input on one rank is the same exception on every rank.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from mpi4py import MPI

from ..engine import Counter, Op, run
from ..layout import offsets
from ..transport.moves import transport_of
from ..validation import Local
from .along import check_band, transport_key

__all__ = ["allgather_along", "received_elements"]

_RECEIVED = Counter()


def received_elements(reset: bool = False) -> int:
    """Elements this thread received in :func:`allgather_along` forwards since the last reset (the communication volume)."""
    return _RECEIVED.received(reset)


class _Plan(NamedTuple):
    dim: int
    comm: MPI.Comm
    counts: tuple[int, ...]
    transfer: Any  # the transport the tokens move on


class AllgatherAlong(Op):
    """Every rank's tensor joined along one dim in rank order; adjoint: the reduce-scatter of the gradient."""

    name = "allgather_along"

    def key(self, t: Any, args: dict) -> Any:
        return transport_key(t, args, args["path"], args["dim"])

    def local(self, t: Any, args: dict) -> Local:
        axis, rest, transport = check_band(t, args, "gathers")
        return Local(axis, (args["path"], axis, t.ndim, rest, str(t.dtype), transport), (), t.shape[axis])

    def plan(self, axis: int, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        return _Plan(axis, comm, tuple(int(c) for c in counts), transport_of(args["transport"], comm))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        moved = t.detach().movedim(p.dim, 0).contiguous()
        inner = math.prod(moved.shape[1:])
        recv = torch.empty((sum(p.counts),) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
        row = inner * t.element_size()
        p.transfer.allgatherv(moved, recv, [c * row for c in p.counts], [o * row for o in offsets(p.counts)])
        _RECEIVED.add((sum(p.counts) - p.counts[p.comm.Get_rank()]) * inner)
        return recv.movedim(0, p.dim)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        """Each rank's tokens of every rank's gradient (one ``alltoallv``), summed in rank order."""
        g = grad.detach().movedim(p.dim, 0).contiguous()
        rest, mine = tuple(g.shape[1:]), p.counts[p.comm.Get_rank()]
        row = math.prod(rest) * g.element_size()
        parts = torch.empty((len(p.counts), mine) + rest, dtype=g.dtype, device=g.device)
        p.transfer.alltoallv(g, [c * row for c in p.counts], parts, [mine * row] * len(p.counts))
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.movedim(0, p.dim)


_OP = AllgatherAlong()


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def allgather_along(t: torch.Tensor, dim: int, comm: MPI.Comm, path: str = "allgather_along", *,
                    transport: Any = "mpi") -> torch.Tensor:
    """Every rank's ``t`` joined along ``dim`` in rank order (collective; differentiable).

    Args:
        t: This rank's part (float32 or float64); the other dims equal on every rank.
        dim: The dim to join along (its size may differ between ranks).
        comm: The domain's communicator.
        path: Named in errors (the module that gathers).
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``, ``transport`` not a transport; or the ranks' other dims,
            dtypes, transports or autograd states differ.
    """
    return run(_OP, t, comm, dim=dim, path=path, transport=transport)
