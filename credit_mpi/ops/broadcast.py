"""Rank 0's numbers on every rank: one ``Bcast`` of a small numpy buffer.

An op of :mod:`credit_mpi.engine` (operation ``"broadcast"``): the global
gradient norm of :func:`credit_mpi.nn.clip_grad_norm_` (the same float on
every rank, whatever the order of MPI's sums did to the last bit). The
caller's agreement covers the buffer, so it runs it with
:func:`credit_mpi.engine.run_agreed`; standalone (:func:`broadcast`) it
agrees first on the buffer's shape and dtype (they decide the byte count)
and on the root. Not differentiable.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..agreement import Local
from ..engine import Op, run, run_agreed
from ..validation import check_root

__all__ = ["Broadcast", "BROADCAST", "broadcast", "broadcast_agreed"]


class _Plan(NamedTuple):
    comm: MPI.Comm
    root: int


class Broadcast(Op):
    """``x`` is a C-contiguous numpy array of numbers, overwritten in place with ``root``'s (and returned)."""

    name = "broadcast"

    def key(self, x: Any, args: dict) -> Hashable:
        return (type(x), getattr(x, "shape", None), str(getattr(x, "dtype", None)), args.get("root", 0))

    def local(self, x: Any, args: dict) -> Local:
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous or x.dtype.kind not in "iuf":
            raise TypeError(f"broadcast: expected a C-contiguous numpy array of numbers, got {type(x).__name__} {getattr(x, 'dtype', '')}")
        root = args.get("root", 0)
        return Local(root, (x.shape, x.dtype.str, root))  # the byte count and the root: agreed whatever check says

    def explain(self, locals_: list[Local]) -> None:
        detail = "; ".join(f"rank {r}: shape {loc.calls[0]}, dtype {loc.calls[1]}, root {loc.calls[2]!r}" for r, loc in enumerate(locals_))
        raise ValueError(f"broadcast: every rank must pass a buffer of the same shape and dtype and the same root ({detail})")

    def plan(self, root: Any, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        return _Plan(comm, check_root(root, comm.Get_size()))  # agreed: every rank raises alike

    def kernel(self, x: np.ndarray, p: _Plan) -> np.ndarray:
        if p.comm.Get_size() > 1:
            p.comm.Bcast(x, root=p.root)
        return x


BROADCAST = Broadcast()


def broadcast(x: np.ndarray, comm: MPI.Comm, root: int = 0) -> np.ndarray:
    """``root``'s ``x`` on every rank of ``comm``, in place (agreed first: another shape, dtype or root raises everywhere)."""
    return run(BROADCAST, x, comm, root=root)


def broadcast_agreed(x: np.ndarray, comm: MPI.Comm, root: int = 0) -> np.ndarray:
    """:func:`broadcast` for a caller whose agreement covers ``x``'s shape, dtype and ``root`` (no agreement of its own)."""
    return run_agreed(BROADCAST, x, comm, (), root=root)
