"""shard_tensor / shard_batch with check="collective" (credit_mpi.ops.shard), bands and blocks: the conformance checks.

A rank's "part" is the global field (every rank passes the same); the result is its band or block
(numpy.array_split along each split dim), checked against the slices of the field itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

from .conformance import PART_PERTURBATIONS, Conformance, agreed_failure, as_kind, grid_for, to_numpy


def _piece(field: np.ndarray, manager, form: str) -> np.ndarray:
    """This rank's numpy.array_split piece of ``field`` (the one-process reference)."""
    rows, cols = manager.domain_grid if form == "blocks" else (manager.domain_parallel_size, 1)
    row, col = divmod(manager.domain_rank, cols)
    band = np.array_split(to_numpy(field), rows, axis=-2)[row]
    return np.array_split(band, cols, axis=-1)[col] if form == "blocks" else band


class TestShardTensor(Conformance):
    forms = ("bands", "blocks")

    def part(self, field, manager, form):
        return field

    def call(self, part, manager, form, **change):
        args = {"dim": (-2, -1) if form == "blocks" else -2, "uneven": True, **change}
        return credit_mpi.shard_tensor(part, manager=manager, check="collective", **args)

    def expected(self, field, manager, form):
        return _piece(field, manager, form)

    perturbations = {
        **PART_PERTURBATIONS,
        "uneven": ({"uneven": False}, None),
        "dim": ({"dim": 0}, None),
    }


class TestShardBatch(Conformance):
    forms = ("bands", "blocks")

    def part(self, field, manager, form):
        return field

    def call(self, part, manager, form, **change):
        dims = (-2, -1) if form == "blocks" else -2
        args = {"spatial_dims_4d": dims, "spatial_dims_5d": dims, "uneven": True, **change}
        return credit_mpi.shard_batch({"x": part, "step": 3}, manager=manager, check="collective", **args)["x"]

    def expected(self, field, manager, form):
        return _piece(field, manager, form)

    perturbations = {
        **PART_PERTURBATIONS,
        "uneven": ({"uneven": False}, None),
        "transport": ({"transport": "nccl"}, None),
    }


@pytest.mark.mpi(min_size=2)
def test_a_single_dim_on_a_grid_of_columns_raises_on_every_rank(make_manager):
    size = MPI.COMM_WORLD.Get_size()
    if grid_for(size)[1] < 2:
        pytest.skip("needs a grid of more than one column")
    manager = make_manager(size, domain_grid=grid_for(size))
    field = as_kind(np.zeros((1, 2, 4, 8)), "numpy")
    dim = -2 if manager.domain_rank == size - 1 else (-2, -1)
    kind, message = agreed_failure(lambda: credit_mpi.shard_tensor(field, dim, manager, check="collective"), MPI.COMM_WORLD)
    assert kind == "ValueError" and "dim must be a pair" in message, message
