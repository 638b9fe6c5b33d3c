"""The watchdog (credit_mpi.watchdog) and the communicator leak, on real MPI jobs.

Serial tests that launch tests/watchdog_job.py under mpiexec on 2 and 3
ranks with ``CREDIT_MPI_TIMEOUT=3``, each bounded by the launcher's timeout
of tests/test_faults.py (a hang kills the job's process group and fails).
A collective that one rank calls alone must end the job with a non-zero
status and the watchdog's report (which operation, who has not arrived,
what those last did); a healthy job must end with 0.
"""

from __future__ import annotations

import math

import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import watchdog

from .conftest import ROOT
from .test_faults import run_job

JOB = ROOT / "tests" / "watchdog_job.py"
DEADLINE = {"CREDIT_MPI_TIMEOUT": "3"}


def watch(mode: str, ranks: int) -> tuple[int, str]:
    rc, out, _ = run_job(mode, ranks=ranks, job=JOB, **DEADLINE)
    return rc, out


@pytest.mark.parametrize("mode,ranks", [("alone-sleep", 2), ("alone-barrier", 3)])
def test_a_collective_on_one_rank_ends_the_job_with_a_report(mode, ranks):
    rc, out = watch(mode, ranks)
    odd = ranks - 1
    assert rc != 0, out[-4000:]
    assert f"credit_mpi watchdog: rank {odd} of credit_mpi.domain[0] (world rank {odd}) waited" in out, out[-4000:]
    assert "in gather_tensor #" in out and "past its deadline of 3 s" in out, out[-4000:]
    for peer in range(odd):  # each other rank answered: it finished the halo exchange, and is not in a collective
        assert f"rank {peer} (world rank {peer}): not in a credit_mpi collective; last entered halo_exchange #" in out, out[-4000:]
    assert f"not arrived in gather_tensor on credit_mpi.domain[0]: rank(s) {', '.join(map(str, range(odd)))}" in out, out[-4000:]
    assert "done" not in out, out[-4000:]


def test_below_thread_multiple_the_watchdog_still_aborts():
    rc, out = watch("alone-sleep-funneled", 2)
    assert rc != 0 and "credit_mpi watchdog: rank 1 of credit_mpi.domain[0]" in out, out[-4000:]
    assert "MPI thread level below MPI_THREAD_MULTIPLE" in out and "done" not in out, out[-4000:]


def test_an_exception_without_abort_on_exception_ends_the_job():
    """The dead rank gives no answer; the waiting ones say so, and abort.

    (Where the launcher ends a job whose rank exited with an error by itself,
    as Open MPI's may when MPI_Finalize does not wait, it can come first:
    the job must end non-zero either way.)
    """
    rc, out = watch("raise", 3)
    assert rc != 0 and "injected failure on rank 2" in out and "rank 0: done" not in out, out[-4000:]
    if "credit_mpi watchdog" in out or MPI.Get_library_version().startswith("MPICH"):
        assert "credit_mpi watchdog: rank" in out and "rank 2 (world rank 2): no answer" in out, out[-4000:]
        assert "not arrived in gather_tensor on credit_mpi.domain[0]: rank(s) 2" in out, out[-4000:]


def test_an_exception_in_backward_ends_the_job():
    """A rank that raises in backward before a layer's exchange and lives on: the others wait in the adjoint's, watched too."""
    pytest.importorskip("torch")
    rc, out = watch("backward-raise", 2)
    assert rc != 0 and "injected failure in backward on rank 1" in out and "rank 0: done" not in out, out[-4000:]
    if "credit_mpi watchdog" in out or MPI.Get_library_version().startswith("MPICH"):
        assert "credit_mpi watchdog: rank 0 of credit_mpi.domain[0] (world rank 0) waited" in out, out[-4000:]
        assert "in halo_exchange: backward #" in out and "(the backward's exchange)" in out, out[-4000:]


def test_a_healthy_job_is_left_alone_and_exits():
    """Stragglers within the deadline: no report, every rank done, status 0 (the thread stops at exit)."""
    ranks = 3
    rc, out = watch("clean", ranks)
    assert rc == 0 and "watchdog" not in out, out[-4000:]
    assert all(f"rank {r}: done" in out for r in range(ranks)), out[-4000:]


@pytest.mark.skipif(not MPI.Get_library_version().startswith("MPICH"), reason="MPICH's limit (2048 context ids) is the known one")
def test_leaked_managers_are_named_when_mpi_runs_out_of_communicators():
    rc, out = watch("leak", 2)
    assert rc == 0 and all(f"rank {r}: done" in out for r in range(2)), out[-4000:]
    if "no communicator limit" in out:
        pytest.skip("this MPI allows more than 6000 managers' communicators")
    assert "MPI could not create this DomainParallelManager's communicators" in out, out[-4000:]
    assert "1 manager(s) of this process are live (never freed)" in out and "garbage-collected without free()" in out
    assert "Call manager.free()" in out, out[-4000:]


def test_timeouts_are_checked(monkeypatch):
    assert watchdog.check_timeout(0) == 0 and watchdog.check_timeout("2.5") == 2.5
    for bad in (-1, "soon", None, True, math.nan):
        with pytest.raises(ValueError, match="must be a number of seconds >= 0"):
            watchdog.check_timeout(bad)
    monkeypatch.delenv("CREDIT_MPI_TIMEOUT", raising=False)
    assert watchdog.default_timeout() == watchdog.DEFAULT_TIMEOUT == 1800
    monkeypatch.setenv("CREDIT_MPI_TIMEOUT", "7")
    assert watchdog.default_timeout() == 7
    with credit_mpi.DomainParallelManager(None, 1) as m:
        assert m.timeout == 7 and watchdog.timeout_of(m.domain_group) == 7
    with credit_mpi.DomainParallelManager(None, 1, timeout=0) as m:
        assert m.timeout == 0 and watchdog.timeout_of(m.domain_group) == 0
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        credit_mpi.DomainParallelManager(None, 1, timeout=-3)
    monkeypatch.setenv("CREDIT_MPI_TIMEOUT", "never")
    with pytest.raises(ValueError, match="CREDIT_MPI_TIMEOUT must be a number of seconds"):
        credit_mpi.DomainParallelManager(None, 1)


def test_arming_is_attribute_writes_only():
    """The per-call fast path's deadline: the state the thread reads, written on entry, cleared on exit."""
    import numpy as np

    with credit_mpi.DomainParallelManager(None, 1) as m:
        before = watchdog.STATE.seq
        credit_mpi.gather_tensor(np.zeros((2, 3)), -2, m)  # one rank: no agreement, nothing armed
        assert watchdog.STATE.seq == before and watchdog.STATE.since == 0.0
    credit_mpi.validation.allgather_or_raise(credit_mpi.manager.MPI.COMM_SELF, lambda: 1)
    # the agreement (#before + 1), then its data phase under the same number
    assert watchdog.STATE.seq == before + 1 and watchdog.STATE.op == "collective: data" and watchdog.STATE.since == 0.0
