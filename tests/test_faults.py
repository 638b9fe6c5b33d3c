"""Fault tests: a rank that fails mid-sequence ends the whole job, promptly.

Serial tests that launch their own MPI jobs (tests/fault_job.py) under
``mpiexec`` as subprocesses, each bounded by a timeout from the test: the
job must end with a non-zero status within the bound when
``credit_mpi.abort_on_exception()`` is on, instead of hanging in the next
collective. The launcher is ``$MPIEXEC`` (with ``$MPIEXEC_FLAGS``) when set,
else the ``mpiexec`` next to the running Python (the MPI that mpi4py uses).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, child_env

JOB = ROOT / "tests" / "fault_job.py"
RANKS = 3
# Generous for a loaded 2-core CI machine; a job that aborts takes 1-3 s.
BOUND_S = 90
POLL_S = 1.0
# After every rank has ended, the launcher gets this long to exit on its own (see _run_job_once).
LAUNCHER_GRACE_S = 20


def launcher() -> list[str]:
    mpiexec = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    if not (Path(mpiexec).is_file() and os.access(mpiexec, os.X_OK)):
        pytest.skip(f"no MPI launcher: {mpiexec} (set MPIEXEC)")
    return [mpiexec, *shlex.split(os.environ.get("MPIEXEC_FLAGS", ""))]


def run_job(mode: str, *args: str, ranks: int = RANKS, job: Path = JOB, **env: str) -> tuple[int, str, float]:
    """Run ``job`` (default tests/fault_job.py) with ``mode`` and ``args`` on ``ranks`` ranks, ``env`` added: (status, output, seconds)."""
    rc, out, took = _run_job_once(mode, *args, ranks=ranks, job=job, env=env)
    if rc != 0 and not out:
        # The launcher printed nothing at all: it never started the job (seen once
        # on a machine loaded with other MPI jobs: status 1, no output). Once more;
        # a job that really fails prints what the test looks for.
        rc, out, took = _run_job_once(mode, *args, ranks=ranks, job=job, env=env)
    return rc, out, took


def _run_job_once(mode: str, *args: str, ranks: int, job: Path, env: dict) -> tuple[int, str, float]:
    env = child_env(MPIEXEC_TIMEOUT=str(BOUND_S), **env)  # MPICH's hydra ends the job itself too
    cmd = [*launcher(), "-n", str(ranks), sys.executable, str(job), mode, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    deadline = start + BOUND_S
    ranks_seen, ranks_gone_at = False, None
    while True:
        try:
            out, _ = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        alive = _ranks_alive(proc.pid, job)
        ranks_seen = ranks_seen or alive
        if ranks_seen and not alive:
            ranks_gone_at = ranks_gone_at or now
            if now - ranks_gone_at > LAUNCHER_GRACE_S:
                # Every rank has ended, only the launcher is left: Open MPI 4.1's mpiexec can hang (or
                # crash: seen as a segfault in PMIx_server_finalize) in its own teardown after an
                # MPI_Abort while another rank was in MPI_Finalize. The job's ranks did end; what is
                # left is the launcher's bug, reported as the non-zero status it would have had.
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                note = f"\n[test_faults: every rank had ended; the launcher did not exit within {LAUNCHER_GRACE_S} s: killed]"
                return -signal.SIGKILL, out + note, time.monotonic() - start
        if now > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
            out, _ = proc.communicate()
            pytest.fail(f"{mode}: the job still ran after {BOUND_S} s (hang)\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def _ranks_alive(session: int, job: Path) -> bool:
    """Whether a process of the launcher's session still runs ``job`` (True where /proc cannot tell)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) == session:  # the launcher itself names the job too
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
            if int(fields[3]) != session or fields[0] == "Z":
                continue
            if str(job) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


FAILURES = [
    # (mode, extra args, text the output must show)
    ("raise", ["--rank", "1", "--step", "4"], "injected failure on rank 1"),
    ("raise", ["--rank", "0", "--step", "0"], "injected failure on rank 0"),
    ("raise", ["--rank", "2", "--step", "9"], "injected failure on rank 2"),
    ("raise-all", ["--step", "3"], "injected failure"),
    ("thread", ["--rank", "1"], "ZeroDivisionError"),
    ("library-error", ["--rank", "2"], "Cannot shard dim -2 of size"),
    ("sys-exit", ["--rank", "1"], "rank 1: failing with sys-exit"),
    ("os-exit", ["--rank", "1"], "rank 1: failing with os-exit"),
    ("kill", ["--rank", "2"], "rank 2: failing with kill"),
]


@pytest.mark.parametrize("mode,args,shows", FAILURES, ids=[f"{m}-{'-'.join(a)}" for m, a, _ in FAILURES])
def test_failing_rank_ends_the_job(mode, args, shows):
    rc, out, took = run_job(mode, *args)
    assert rc != 0, f"{mode}: the job ended with status 0 after {took:.1f} s\n{out[-4000:]}"
    assert shows in out, out[-4000:]
    assert "done" not in out, out[-4000:]


@pytest.mark.parametrize("mode", ["none", "caught"])
def test_helper_leaves_good_jobs_alone(mode):
    """A clean run, and one whose agreed error is caught, end normally on every rank."""
    rc, out, _ = run_job(mode)
    assert rc == 0, out[-4000:]
    # (the launcher may interleave the ranks' lines, so look for each one)
    assert all(f"rank {r}: done" in out for r in range(RANKS)), out[-4000:]
    assert ("caught the agreed error" in out) == (mode == "caught"), out[-4000:]


def test_on_two_ranks_too():
    rc, out, _ = run_job("raise", "--rank", "1", "--step", "2", ranks=2)
    assert rc != 0 and "injected failure on rank 1" in out, out[-4000:]
