"""gather_tensor (credit_mpi.ops.gather), bands and blocks: the conformance checks, inherited."""

from __future__ import annotations

import numpy as np

import credit_mpi

from .conformance import PART_PERTURBATIONS, Conformance


class TestGather(Conformance):
    forms = ("bands", "blocks")

    def call(self, part, manager, form, **change):
        args = {"dim": (-2, -1) if form == "blocks" else -2, **change}
        return credit_mpi.gather_tensor(part, manager=manager, **args)

    def expected(self, field, manager, form):
        return field

    perturbations = {
        **PART_PERTURBATIONS,
        "dim": ({"dim": 0}, None),
        "transport": ({"transport": "nccl"}, None),
        "check mode": ({"check": False}, None),
        "out": ({"out": np.empty((1, 1, 1, 1))}, None),
    }
