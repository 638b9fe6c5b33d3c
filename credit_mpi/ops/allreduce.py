"""The fused sums of the training helpers: one in-place ``Allreduce`` (sum) of a small numpy buffer.

An op of :mod:`credit_mpi.engine` (operation ``"allreduce"``): the loss
shares of :func:`credit_mpi.nn.global_loss` (a slot per domain group and
two counters that carry the ranks' errors and flags) and the sufficient
statistics of :func:`credit_mpi.nn.latitude_weighted_metrics`, each one
``Allreduce`` of float64. The callers' own agreement covers the buffer
(its length is the manager's, or agreed before), so they run it with
:func:`credit_mpi.engine.run_agreed`; standalone (:func:`allreduce_sum`) it
agrees first on the buffer's shape and dtype, which decide the byte count.
Not differentiable (numpy in, numpy out: the sums are for logging).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..agreement import Local
from ..engine import Op, run, run_agreed

__all__ = ["Allreduce", "ALLREDUCE", "allreduce_sum", "allreduce_agreed"]


class Allreduce(Op):
    """``x`` is a C-contiguous numpy array of numbers, summed over the ranks in place (and returned)."""

    name = "allreduce"

    def key(self, x: Any, args: dict) -> Hashable:
        return (type(x), getattr(x, "shape", None), str(getattr(x, "dtype", None)))

    def local(self, x: Any, args: dict) -> Local:
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous or x.dtype.kind not in "iuf":
            raise TypeError(f"allreduce: expected a C-contiguous numpy array of numbers, got {type(x).__name__} {getattr(x, 'dtype', '')}")
        return Local(None, (x.shape, x.dtype.str))  # the byte count of the Allreduce: agreed whatever check says

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: shape {loc.calls[0]}, dtype {loc.calls[1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"allreduce: every rank must pass a buffer of the same shape and dtype ({detail})")

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> MPI.Comm:
        return comm

    def kernel(self, x: np.ndarray, comm: MPI.Comm) -> np.ndarray:
        if comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        return x


ALLREDUCE = Allreduce()


def allreduce_sum(x: np.ndarray, comm: MPI.Comm) -> np.ndarray:
    """``x`` summed over ``comm``, in place (agreed first: another shape or dtype on one rank raises on every rank)."""
    return run(ALLREDUCE, x, comm)


def allreduce_agreed(x: np.ndarray, comm: MPI.Comm) -> np.ndarray:
    """:func:`allreduce_sum` for a caller whose agreement covers ``x``'s shape and dtype (no agreement of its own)."""
    return run_agreed(ALLREDUCE, x, comm, ())
