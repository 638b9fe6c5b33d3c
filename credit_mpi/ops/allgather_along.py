"""All-gather of a tensor along one dim over the domain (the K/V tokens of attention across bands), differentiable.

Exact global attention with the queries on bands: every rank gathers the
keys and values of every band (``Allgatherv``, uneven bands included) and
attends its own queries to all of them. The backward of the gather is the
reduce-scatter of the gradient (``Reduce_scatter``: each rank gets the sum,
over the ranks, of the gradient of its own tokens). Per rank and per gathered
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

import numpy as np
import torch
from mpi4py import MPI

from ..engine import Counter, Op, run
from ..partition import normalize_dim
from ..validation import Local

__all__ = ["allgather_along", "received_elements"]

_RECEIVED = Counter()
_DTYPES = (torch.float32, torch.float64)


def received_elements(reset: bool = False) -> int:
    """Elements this thread received in :func:`allgather_along` forwards since the last reset (the communication volume)."""
    return _RECEIVED.received(reset)


class _Plan(NamedTuple):
    dim: int
    comm: MPI.Comm
    counts: tuple[int, ...]


class AllgatherAlong(Op):
    """Every rank's tensor joined along one dim in rank order; adjoint: the reduce-scatter of the gradient."""

    name = "allgather_along"

    def key(self, t: Any, args: dict) -> Any:
        if not isinstance(t, torch.Tensor):
            return None
        return (args["path"], args["dim"], tuple(t.shape), t.dtype)

    def local(self, t: Any, args: dict) -> Local:
        path = args["path"]
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            raise TypeError(f"{path}: gathers float32/float64 tensors, got {getattr(t, 'dtype', type(t).__name__)}")
        axis = normalize_dim(args["dim"], t.ndim)
        rest = tuple(t.shape[:axis]) + tuple(t.shape[axis + 1 :])
        return Local(axis, (path, axis, t.ndim, rest, str(t.dtype)), (), t.shape[axis])

    def plan(self, axis: int, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        return _Plan(axis, comm, tuple(int(c) for c in counts))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        moved = np.ascontiguousarray(t.detach().movedim(p.dim, 0).cpu().numpy())
        inner = math.prod(moved.shape[1:])
        recv = np.empty((sum(p.counts),) + moved.shape[1:], moved.dtype)
        p.comm.Allgatherv(moved, [recv, [c * inner for c in p.counts]])
        _RECEIVED.add((sum(p.counts) - p.counts[p.comm.Get_rank()]) * inner)
        return torch.from_numpy(recv).to(t.device).movedim(0, p.dim)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        g = np.ascontiguousarray(grad.detach().movedim(p.dim, 0).cpu().numpy())
        inner = math.prod(g.shape[1:])
        mine = np.empty((p.counts[p.comm.Get_rank()],) + g.shape[1:], g.dtype)
        p.comm.Reduce_scatter(g, mine, [c * inner for c in p.counts], op=MPI.SUM)
        return torch.from_numpy(mine).to(grad.device).movedim(0, p.dim)


_OP = AllgatherAlong()


def allgather_along(t: torch.Tensor, dim: int, comm: MPI.Comm, path: str = "allgather_along") -> torch.Tensor:
    """Every rank's ``t`` joined along ``dim`` in rank order (collective; differentiable).

    Args:
        t: This rank's part (float32 or float64); the other dims equal on every rank.
        dim: The dim to join along (its size may differ between ranks).
        comm: The domain's communicator.
        path: Named in errors (the module that gathers).

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``; or the ranks' other dims, dtypes or autograd states differ.
    """
    return run(_OP, t, comm, dim=dim, path=path)
