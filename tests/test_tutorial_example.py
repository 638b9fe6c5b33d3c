"""examples/train_tutorial.py, the end state of docs/tutorial.rst: its loss curve is one process's, it resumes bit for bit.

MPI tests (2 ranks; the example's ``train()`` runs on the current
communicator): 2 bands of one sample, then 2 replicas with DDP, each
against the same script on ``COMM_SELF`` (one process, the whole batch);
a run resumed from its checkpoint gives the uninterrupted run's losses,
float for float; ``--output`` is the gathered prediction of one process.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from .conftest import load_example, reset_torch_distributed

pytest.importorskip("torch")


def example():
    return load_example("train_tutorial")


def one_process(module, argv: list[str]) -> list[float]:
    """The same command on COMM_SELF: one process, a domain of one rank, the whole batch (every rank alike)."""
    return module.train(module.parse([*argv, "--domain", "1"]), comm=MPI.COMM_SELF)


def same_curve(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15) for x, y in zip(a, b, strict=True))


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2)
def test_tutorial_bands_and_replicas_train_as_one_process(shared_dir):
    module = example()
    argv = ["--steps", "3", "--lat", "13", "--lon", "16"]
    output = os.path.join(shared_dir, "pred.npy")
    bands = module.train(module.parse([*argv, "--output", output]))  # 2 bands of 7 and 6 rows
    try:
        replicas = module.train(module.parse([*argv, "--domain", "1", "--ddp"]))  # 2 replicas, DDP + the domain sum
    finally:
        reset_torch_distributed()
    rank = MPI.COMM_WORLD.Get_rank()
    alone = one_process(module, [*argv, "--output", os.path.join(shared_dir, f"alone{rank}.npy")])
    assert same_curve(bands, alone), (bands, alone)
    assert same_curve(replicas, alone), (replicas, alone)
    assert alone[-1] < alone[0]
    MPI.COMM_WORLD.Barrier()
    if rank == 0:  # the gathered prediction of the last step is one process's
        np.testing.assert_allclose(np.load(output), np.load(os.path.join(shared_dir, "alone0.npy")), rtol=1e-12, atol=1e-13)


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2)
def test_tutorial_resumes_bit_for_bit(shared_dir):
    module = example()
    argv = ["--lat", "13", "--lon", "16", "--checkpoint", os.path.join(shared_dir, "ckpt.pt")]
    straight = module.train(module.parse([*argv, "--steps", "4"]))
    module.train(module.parse([*argv, "--steps", "2", "--checkpoint-every", "2"]))
    resumed = module.train(module.parse([*argv, "--steps", "4", "--resume"]))
    assert resumed == straight[2:]

