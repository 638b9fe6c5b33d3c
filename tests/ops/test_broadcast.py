"""Rank 0's numbers on every rank (credit_mpi.ops.broadcast): the conformance checks, inherited.

A rank's "part" is the first row of its band (bands) or first element of its block (blocks), the
same shape on every rank; the result is rank 0's part.
"""

from __future__ import annotations

import numpy as np
import pytest

from credit_mpi.ops.broadcast import broadcast, broadcast_agreed

from .conformance import Conformance, agreed_failure, other_dtype, other_kind
from .test_statistics import first_of, pieces_of


class TestBroadcast(Conformance):
    forms = ("bands", "blocks")
    kinds = ("numpy",)

    def part(self, field, manager, form):
        return first_of(super().part(field, manager, form), form).copy()

    def call(self, part, manager, form, **change):
        return broadcast(part.copy() if isinstance(part, np.ndarray) else part, manager.domain_group, **change)

    def expected(self, field, manager, form):
        return pieces_of(field, manager, form)[0]

    perturbations = {
        "dtype": ({}, other_dtype),
        "kind": ({}, other_kind),
        "shape": ({}, lambda part: part[:, :-1].copy()),
        "root": ({"root": 1}, None),
    }


@pytest.mark.mpi
def test_a_root_out_of_range_raises_on_every_rank(make_manager):
    manager = make_manager()
    kind, message = agreed_failure(lambda: broadcast(np.zeros(2), manager.domain_group, root=99), manager.domain_group)
    assert kind == "ValueError" and "root must be a domain rank in 0.." in message, message


def test_agreed_is_rank_0s(make_manager):
    manager = make_manager()
    got = broadcast_agreed(np.full(2, float(manager.domain_rank)), manager.domain_group)
    np.testing.assert_array_equal(got, np.zeros(2))
