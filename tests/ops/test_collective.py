"""allgather_or_raise (credit_mpi.ops.collective): the conformance checks, inherited.

A rank's "part" is a ``compute`` that returns its band; the result is every rank's band, gathered
in rank order and joined (what gather_tensor returns, through pickles).
"""

from __future__ import annotations

import numpy as np

import credit_mpi

from .conformance import Conformance, to_numpy, torch


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickles")


class TestAllgatherOrRaise(Conformance):
    def part(self, field, manager, form):
        band = credit_mpi.shard_tensor(field, -2, manager, uneven=True)
        return lambda: band

    def call(self, part, manager, form, **change):
        results = credit_mpi.allgather_or_raise(manager.domain_group, change.get("compute", part))
        joined = np.concatenate([to_numpy(r) for r in results], axis=-2)
        return joined if isinstance(results[0], np.ndarray) else torch.from_numpy(joined)

    def expected(self, field, manager, form):
        return to_numpy(field)

    perturbations = {
        "compute raises": ({"compute": lambda: 1 / 0}, None),
        "an unpicklable result": ({"compute": lambda: _Unpicklable()}, None),
        "a ValueError": ({"compute": lambda: (_ for _ in ()).throw(ValueError("bad on one rank"))}, None),
    }
