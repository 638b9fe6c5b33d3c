"""halo_exchange (credit_mpi.ops.halo), bands and blocks: the conformance checks, inherited."""

from __future__ import annotations

import numpy as np

import credit_mpi

from ..halo_reference import pad_numpy
from .conformance import PART_PERTURBATIONS, Conformance, grid_for


class TestHalo(Conformance):
    forms = ("bands", "blocks")

    def call(self, part, manager, form, **change):
        args = {"dim": (-2, -1) if form == "blocks" else -2, "halo_width": 1, "boundary": "reflect", **change}
        return credit_mpi.halo_exchange(part, manager=manager, **args)

    def expected(self, field, manager, form):
        rank = manager.domain_rank
        if form == "bands":
            padded = pad_numpy(field, 1, field.ndim - 2, "reflect")
            sizes = credit_mpi.partition.band_sizes(field.shape[-2], manager.domain_parallel_size, True)
            start = credit_mpi.layout.offsets(sizes)[rank]
            return padded[..., start : start + sizes[rank] + 2, :]
        # blocks: latitude reflect, then longitude periodic (a single boundary string: the globe)
        padded = np.pad(pad_numpy(field, 1, field.ndim - 2, "reflect"), [(0, 0)] * (field.ndim - 1) + [(1, 1)], mode="wrap")
        rows, cols = grid_for(manager.domain_parallel_size)
        hs = credit_mpi.partition.band_sizes(field.shape[-2], rows, True)
        ws = credit_mpi.partition.band_sizes(field.shape[-1], cols, True)
        i, j = divmod(rank, cols)
        y0, x0 = credit_mpi.layout.offsets(hs)[i], credit_mpi.layout.offsets(ws)[j]
        return padded[..., y0 : y0 + hs[i] + 2, x0 : x0 + ws[j] + 2]

    perturbations = {
        **PART_PERTURBATIONS,
        "halo_width": ({"halo_width": 2}, None),
        "boundary": ({"boundary": "zero"}, None),
        "transport": ({"transport": "nccl"}, None),
        "check mode": ({"check": False}, None),
    }
