"""scatter_tensor (credit_mpi.ops.scatter), bands and blocks: the conformance checks, inherited."""

from __future__ import annotations

import numpy as np

import credit_mpi

from .conformance import Conformance


class TestScatter(Conformance):
    forms = ("bands", "blocks")

    def part(self, field, manager, form):
        return field if manager.domain_rank == 0 else None  # only the root holds the field

    def call(self, part, manager, form, **change):
        args = {"dim": (-2, -1) if form == "blocks" else -2, "uneven": True, **change}
        return credit_mpi.scatter_tensor(part, manager=manager, **args)

    def expected(self, field, manager, form):
        return credit_mpi.shard_tensor(field, (-2, -1) if form == "blocks" else -2, manager, uneven=True)

    perturbations = {  # the root's field is the only array: the arguments are what a rank can get wrong
        "root": ({"root": 1}, None),
        "root out of range": ({"root": 99}, None),
        "uneven": ({"uneven": False}, None),
        "dim": ({"dim": 0}, lambda part: np.zeros(3)),
    }
