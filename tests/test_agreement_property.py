"""The agreement rule as a property: random one-rank perturbations of every public collective.

Serial tests that launch tests/agreement_job.py (latitude bands) and
tests/grid_agreement_job.py (the 2-D grid) under mpiexec on 2, 3 and 4
ranks, each bounded by a timeout (a hang kills the launcher's process group
and fails). The job requires, per trial, the same exception type on every
rank or the single-process result on every rank, and that the group is in
step afterwards; it prints a summary line and exits non-zero on a violation.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, child_env
from .test_faults import launcher

JOB = ROOT / "tests" / "agreement_job.py"
GRID_JOB = ROOT / "tests" / "grid_agreement_job.py"
GRID_TRIALS = 100
BOUND_S = 150  # ~20 s per 150 trials on 4 ranks of a loaded 2-core machine
TRIALS = 150
SUMMARY = re.compile(r"(?:grid_)?agreement_job: (\d+) ranks, seed (\d+), (\d+) trials: (.*); violations=(\d+)")


def run_job(ranks: int, seed: int, trials: int = TRIALS, job=JOB, *extra: str) -> tuple[int, str, float]:
    """Run ``job`` (a property job: ``--seed``, ``--trials``, then ``extra``) on ``ranks`` ranks, bounded by BOUND_S."""
    env = child_env(MPIEXEC_TIMEOUT=str(BOUND_S))  # MPICH's hydra ends the job itself too
    cmd = [*launcher(), "-n", str(ranks), sys.executable, str(job), "--seed", str(seed), "--trials", str(trials), *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"{ranks} ranks, seed {seed}: the job still ran after {BOUND_S} s (hang)\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_one_rank_differs_same_error_or_right_result(ranks):
    check_summary(*run_job(ranks, 17 + ranks))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_one_rank_differs_on_the_2d_grid(ranks):
    """tests/grid_agreement_job.py: every grid of the world size (and none), the 1-D/2-D decision, widths, boundaries."""
    check_summary(*run_job(ranks, 30 + ranks, GRID_TRIALS, GRID_JOB))


def check_summary(rc: int, out: str, took: float) -> None:
    """The job's summary line: no violation, controls that succeed, perturbations that raise alike."""
    summary = SUMMARY.search(out)
    assert summary is not None, out[-4000:]
    assert rc == 0 and summary.group(5) == "0", f"exit {rc} after {took:.1f} s\n{out[-4000:]}"
    counts = dict(item.split("=") for item in summary.group(4).split(", "))
    # the job exercised both sides of the rule: controls that succeed, perturbations that raise alike
    assert int(counts.get("control-ok", 0)) > 0 and int(counts.get("perturbed-error", 0)) > 0, summary.group(0)
    assert "control-error" not in counts and "mixed" not in counts, summary.group(0)
    print(summary.group(0))


def test_the_job_reports_a_violation():
    """The job can fail: a trial whose correct result is replaced by a wrong one is reported, with a non-zero exit."""
    env = child_env(AGREEMENT_JOB_BREAK="1", MPIEXEC_TIMEOUT=str(BOUND_S))
    cmd = [*launcher(), "-n", "2", sys.executable, str(JOB), "--seed", "5", "--trials", "10"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=BOUND_S, start_new_session=True)
    assert result.returncode != 0, result.stdout[-4000:]
    assert "VIOLATION" in result.stdout and "wrong result" in result.stdout, result.stdout[-4000:]
