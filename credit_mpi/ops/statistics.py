"""The layers' statistics: every rank's small tensor stacked along a new first dim; backward sums over the ranks.

An op of :mod:`credit_mpi.engine` (operation ``"statistics"``): the band
sums of the normalisation layers (count, mean, ``M2`` per group or channel;
the backward's two per-group sums) and the global mean of an adaptive
pooling, one ``allgatherv`` of the transport protocol of a fixed-size
float32/float64 tensor per rank (host tensors in place, device tensors
straight to a CUDA-aware MPI or staged; host memory as numpy views, which
MPI takes with no staging context). Its adjoint is the reduce-scatter
of the gradient of the stack (:func:`credit_mpi.ops.allreduce.reduce_scatter`:
each rank gets its own row of every rank's gradient, added in rank order):
each rank's loss is its share of the global loss, as
:func:`credit_mpi.reduce_gradients` assumes. The adjoint of the adjoint is
the gather again (double backward through the engine).

A converted layer runs it with :func:`credit_mpi.engine.run_agreed`: its one
agreement per call (the band's description, the autograd state, every
dim but the sharded one) covers what this op's would, so the per-call cost
is the ``Allgather`` alone. Standalone (:func:`gather_statistics`) it agrees
first, as every collective does: a rank whose tensor differs in shape,
dtype or device type raises on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ..agreement import Local
from ..engine import Op, run, run_agreed
from ..transport.arrays import host_numpy
from ..transport.moves import transport_of
from .allreduce import reduce_scatter

__all__ = ["Statistics", "STATISTICS", "gather_statistics", "gather_agreed"]

_DTYPES = ("torch.float32", "torch.float64")


class _Plan(NamedTuple):
    comm: MPI.Comm
    size: int
    rank: int
    moves: Any


class Statistics(Op):
    """``x`` is this rank's statistics (a float32/float64 torch tensor of the same shape on every rank)."""

    name = "statistics"

    def key(self, t: Any, args: dict) -> Hashable | None:
        if args:  # under a caller's agreement (gather_agreed): the plan depends on the communicator and transport alone
            transport = args.get("transport", "mpi")
            return () if isinstance(transport, str) else ("transport", id(transport))
        try:  # torch's own hashable shape and dtype, no strings made
            return (t.shape, t.dtype, t.device.type)
        except AttributeError:  # not a tensor: agreed every call (local() raises the TypeError on every rank)
            return None

    def local(self, t: Any, args: dict) -> Local:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"statistics: expected a torch tensor, got {type(t).__name__}")
        if str(t.dtype) not in _DTYPES:
            raise TypeError(f"statistics: expected a float32 or float64 tensor, got {t.dtype}")
        # the shape and dtype decide the Allgather's byte count on every rank: agreed whatever check says
        return Local(None, (tuple(t.shape), str(t.dtype), t.device.type))

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: shape {loc.calls[0]}, {loc.calls[1]} on {loc.calls[2]}" for r, loc in enumerate(locals_))
        raise ValueError(f"statistics: every rank must pass a tensor of the same shape, dtype and device type ({detail})")

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        return _Plan(comm, comm.Get_size(), comm.Get_rank(), transport_of(args.get("transport", "mpi"), comm))

    def kernel(self, t: Any, p: _Plan) -> Any:
        send = t.detach().contiguous()
        # numpy views of host memory (the transport's, which leave a caller's tensor resizable), which the transports
        # take as they are (MPI: no staging context, the per-call path)
        host = host_numpy(send)
        if host is not None:
            send, recv = host, np.empty((p.size,) + host.shape, host.dtype)
        else:
            recv = torch.empty((p.size,) + tuple(send.shape), dtype=send.dtype, device=send.device)
        nbytes = send.nbytes
        p.moves.allgatherv(send, recv, [nbytes] * p.size, [r * nbytes for r in range(p.size)])
        return recv if host is None else torch.from_numpy(recv)

    def adjoint(self, grad: Any, p: _Plan) -> Any:
        g = grad.detach().contiguous()
        row = g[0].numel()
        return reduce_scatter(g.reshape(-1), [row] * p.size, p.rank, p.moves).reshape(g.shape[1:])


STATISTICS = Statistics()


def gather_statistics(t: Any, comm: MPI.Comm) -> Any:
    """Every rank's ``t`` stacked along a new first dim, on every rank (agreed first; differentiable)."""
    return run(STATISTICS, t, comm)


def gather_agreed(t: Any, comm: MPI.Comm, transport: Any = "mpi") -> Any:
    """:func:`gather_statistics` for a caller whose agreement covers ``t``'s shape, dtype, device and autograd state
    (and the transport: ``"mpi"``, or a transport object over ``comm``'s ranks, a converted model's data path)."""
    return run_agreed(STATISTICS, t, comm, (), agreed=True, transport=transport)  # the plan is remembered per (comm, autograd)
