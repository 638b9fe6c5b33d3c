"""Test harness shared by the serial and the MPI suites.

Under MPI a failing assertion on one rank would leave the other ranks waiting
in the next collective, so a failure (or an error in a fixture) prints its
report and aborts the whole job through ``MPI.COMM_WORLD.Abort``: the job
ends promptly with a non-zero status instead of hanging until the timeout.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

SEED = 20261129


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    world = MPI.COMM_WORLD
    if report.failed and world.Get_size() > 1 and item.get_closest_marker("mpi") is not None:
        sys.stderr.write(
            f"\n[rank {world.Get_rank()}] {item.nodeid} failed in {report.when}; "
            f"aborting all {world.Get_size()} ranks\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        world.Abort(1)


@pytest.fixture
def world():
    return MPI.COMM_WORLD


@pytest.fixture
def self_comm():
    """A fresh single-rank communicator (nothing cached on it yet, e.g. no CUDA-aware verdict)."""
    comm = MPI.COMM_SELF.Dup()
    yield comm
    comm.Free()


@pytest.fixture
def rng():
    """The same random stream on every rank, so every rank can build the reference."""
    return np.random.default_rng(SEED)


@pytest.fixture
def make_manager():
    """Build managers over COMM_WORLD (or a given comm); all are freed after the test."""
    made = []

    def make(domain_parallel_size=None, comm=None, **kwargs):
        comm = MPI.COMM_WORLD if comm is None else comm
        d = comm.Get_size() if domain_parallel_size is None else domain_parallel_size
        manager = credit_mpi.DomainParallelManager(None, d, comm=comm, **kwargs)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.free()
    credit_mpi.destroy_domain_parallel()


def domain_sizes(world_size: int) -> list[int]:
    """Every domain size that divides the world size."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]
