"""Test harness shared by the serial and the MPI suites.

Under MPI a failing assertion on one rank would leave the other ranks waiting
in the next collective, so a failure (or an error in a fixture) prints its
report and aborts the whole job through ``MPI.COMM_WORLD.Abort``: the job
ends promptly with a non-zero status instead of hanging until the timeout.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

SEED = 20261129


def pytest_runtest_setup(item):
    """``@pytest.mark.world_sizes(2, 3)``: an expensive MPI test runs on those world sizes only (CI's time).

    The suite runs on 1, 2, 3 and 4 ranks; a test whose point does not change
    with the rank count past some size (a soak, a compile) need not pay for
    4 ranks oversubscribed on 2 cores. Every rank sees the same world size,
    so every rank skips alike.
    """
    marker = item.get_closest_marker("world_sizes")
    if marker is not None and MPI.COMM_WORLD.Get_size() not in marker.args:
        pytest.skip(f"runs on {', '.join(map(str, marker.args))} rank(s) only (CI time), not {MPI.COMM_WORLD.Get_size()}")


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
def shared_dir():
    """One temporary directory, the same path on every rank (rank 0 makes it and removes it after the test)."""
    import shutil
    import tempfile

    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="credit_mpi_test_") if world.Get_rank() == 0 else None)
    yield path
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rng():
    """The same random stream on every rank, so every rank can build the reference."""
    return np.random.default_rng(SEED)


def domain_sizes_of(node) -> tuple[int, ...]:
    """The domain sizes ``prefix_managers`` gives a test in this job: 1..world size, or the world size only.

    ``@pytest.mark.one_domain_size``: d = the world size only, so each domain size
    runs once over the 1..4-rank jobs (d bands in the d-rank job, no rank left
    busy-waiting outside the domain), not d = 1..W again in every W-rank job. For
    tests whose point is the bands, not a domain smaller than the world (the
    manager and layer tests keep those).
    """
    n = MPI.COMM_WORLD.Get_size()
    return (n,) if node.get_closest_marker("one_domain_size") is not None else tuple(range(1, n + 1))


@pytest.fixture
def make_manager(request):
    """Build managers over COMM_WORLD (or a given comm); all are freed after the test.

    ``make.domain_sizes``: the domain sizes of ``prefix_managers`` (see :func:`domain_sizes_of`).
    """
    made = []

    def make(domain_parallel_size=None, comm=None, **kwargs):
        comm = MPI.COMM_WORLD if comm is None else comm
        d = comm.Get_size() if domain_parallel_size is None else domain_parallel_size
        manager = credit_mpi.DomainParallelManager(None, d, comm=comm, **kwargs)
        made.append(manager)
        return manager

    make.domain_sizes = domain_sizes_of(request.node)
    yield make
    for manager in made:
        manager.free()
    credit_mpi.destroy_domain_parallel()


def domain_sizes(world_size: int) -> list[int]:
    """Every domain size that divides the world size."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


def reset_torch_distributed() -> None:
    """Destroy torch's default group and forget the torch bridge's state: no test leaves them to the next."""
    import torch.distributed as dist

    from credit_mpi import torch_bridge

    if dist.is_initialized():
        dist.destroy_process_group()
    torch_bridge._BRIDGED.clear()
    torch_bridge._OWNS_DEFAULT_GROUP = False


ROOT = Path(__file__).resolve().parent.parent


def load_example(name: str):
    """``examples/<name>.py`` imported as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# What a launcher puts in a rank's environment (MPICH's hydra, Open MPI's
# prte, Slurm's PMI): a child process that keeps it would try to join the
# job. The user's MCA settings (OMPI_MCA_*, PRTE_MCA_*, PMIX_MCA_*) stay.
_LAUNCHER_VARS = re.compile(r"^(PMI_|PMIX_(?!MCA_)|HYDI_|MPI_LOCAL|OMPI_(?!MCA_|ALLOW_)|PRTE_(?!MCA_)|OPAL_USER_PARAMS_GIVEN$)")


def child_env(**extra: str) -> dict:
    """The environment for a fresh Python process started from a test, also from inside an MPI job.

    The launcher's variables are dropped (the child is a singleton MPI
    process, not a rank of this job), and the repository is on PYTHONPATH.
    """
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python -c code`` in a fresh process (see :func:`child_env`); raises if it fails."""
    kwargs.setdefault("env", child_env())
    kwargs.setdefault("timeout", 120)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"python -c {code!r} exited {result.returncode}:\n{result.stderr}"
    return result
