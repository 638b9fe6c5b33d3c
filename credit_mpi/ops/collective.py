"""``allgather_or_raise``: every rank's ``compute()`` result on every rank, or every rank's same exception.

An op of :mod:`credit_mpi.engine` (operation ``"collective"``): each rank
runs ``compute()`` and pickles its result inside the agreement (the byte
count is the agreed count), so a ``compute()`` that raises, or a result
that cannot be pickled, on one rank is the same exception on every rank,
not a rank that fails while the others wait. The kernel is one
``Allgatherv`` of the pickled results. Not remembered (``compute`` runs
every call). The public function is
:func:`credit_mpi.validation.allgather_or_raise`.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..agreement import Local
from ..engine import Op
from ..layout import offsets

__all__ = ["AllgatherOrRaise", "COLLECTIVE"]


class _Pickled(NamedTuple):
    comm: MPI.Comm
    data: bytes
    sizes: list


class AllgatherOrRaise(Op):
    """``x`` is ``compute``; the plan holds this rank's pickled result and every rank's byte count."""

    name = "collective"

    def local(self, compute: Any, args: dict) -> Local:
        data = _pickled(compute())  # inside the agreement: a value that cannot be pickled is every rank's error
        return Local(data, (), (), len(data))

    def plan(self, data: bytes, sizes: list[int], comm: MPI.Comm, args: dict) -> _Pickled:
        return _Pickled(comm, data, sizes)

    def kernel(self, compute: Any, p: _Pickled) -> list:
        if p.comm.Get_size() == 1:
            return [pickle.loads(p.data)]
        table = np.empty(sum(p.sizes), dtype=np.uint8)
        starts = offsets(p.sizes)
        p.comm.Allgatherv([np.frombuffer(p.data, dtype=np.uint8), len(p.data), MPI.BYTE], [table, (p.sizes, starts), MPI.BYTE])
        return [pickle.loads(table[start : start + size].tobytes()) for start, size in zip(starts, p.sizes, strict=True)]


def _pickled(value: Any) -> bytes:
    """``value`` pickled; a TypeError that names it when it cannot be."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - TypeError, PicklingError, AttributeError (local objects) ...
        raise TypeError(f"allgather_or_raise: compute() returned a {type(value).__name__}, which cannot be pickled ({exc})") from None


COLLECTIVE = AllgatherOrRaise()
