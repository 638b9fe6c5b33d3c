"""The sum over the ranks (credit_mpi.ops.allreduce), as the training helpers use it: the conformance checks, inherited.

A rank's "part" is the first row of its band (bands) or first element of its block (blocks), the
same shape on every rank; the result is every rank's part summed (integer values: exact in any order),
for numpy arrays (the training helpers' sums) and torch tensors alike. The domain sum's use of the
same op (its two steps, its adjoint, the transports) is tests/ops/test_domain_sum.py.
"""

from __future__ import annotations

import numpy as np

from credit_mpi.ops.allreduce import allreduce_agreed, allreduce_sum

from .conformance import Conformance, other_dtype, other_kind
from .test_statistics import first_of, pieces_of


class TestAllreduce(Conformance):
    forms = ("bands", "blocks")
    kinds = ("numpy", "torch")

    def values(self, rng, shape):
        return rng.integers(-8, 8, shape).astype(np.float64)

    def part(self, field, manager, form):
        piece = first_of(super().part(field, manager, form), form)
        return piece.copy() if isinstance(piece, np.ndarray) else piece.clone()

    def call(self, part, manager, form, **change):
        return allreduce_sum(part, manager.domain_group)

    def expected(self, field, manager, form):
        return np.sum(pieces_of(field, manager, form), axis=0)

    perturbations = {
        "dtype": ({}, other_dtype),
        "kind": ({}, other_kind),
        "shape": ({}, lambda part: part[:, :-1].copy()),
    }


def test_agreed_is_the_same_sum(make_manager):
    manager = make_manager()
    part = np.full(3, manager.domain_rank + 1.0)
    n = manager.domain_parallel_size
    np.testing.assert_array_equal(allreduce_agreed(part, manager.domain_group), np.full(3, n * (n + 1) / 2))
