"""The reuse pool of host outputs: a collective that returns a new array each call does not first-touch fresh pages.

Used by :func:`credit_mpi.transport.arrays.pooled_empty` (through each
library's adapter, :mod:`credit_mpi.transport.adapters`) and emptied by
:func:`credit_mpi.release_output_pool`.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

import numpy as np

__all__ = ["POOL"]


class _OutputPool:
    """Host buffers for outputs a collective returns new each call, reused once no array uses them.

    A loop that gathers the same shape every step would otherwise get fresh
    memory every call and pay for first touching its pages. The pool keeps
    at most :attr:`per_key` buffers per (kind, dtype, shape) and
    :attr:`max_bytes` in all (least recently used keys go first). A buffer
    is handed out again only when nothing but the pool refers to it: every
    numpy view of it and every torch tensor made from it holds a reference
    (torch keeps the numpy array alive), so a live array keeps its memory.
    """

    per_key = 2
    max_bytes = 1 << 30

    def __init__(self) -> None:
        self.buffers: collections.OrderedDict = collections.OrderedDict()  # key -> list of arrays (numpy: typed; torch: uint8 bases)
        self.reused = 0
        self.allocated = 0

    def take(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        """A pooled array for ``key`` that nothing else refers to, or a new one from ``make()`` (kept if there is room)."""
        free = self.buffers.pop(key, None)
        if free is None:
            free = []
        self.buffers[key] = free  # most recently used last
        for i in range(len(free)):
            # references: the list, and getrefcount's argument (nothing else: no live view)
            if sys.getrefcount(free[i]) == 2:
                self.reused += 1
                return free[i]
        base = make()
        self.allocated += 1
        if len(free) < self.per_key and base.nbytes <= self.max_bytes:
            free.append(base)
            self._trim()
        return base

    def _trim(self) -> None:
        total = sum(b.nbytes for bases in self.buffers.values() for b in bases)
        while total > self.max_bytes and self.buffers:
            _, bases = self.buffers.popitem(last=False)
            total -= sum(b.nbytes for b in bases)

    def clear(self) -> None:
        self.buffers.clear()


POOL = _OutputPool()
