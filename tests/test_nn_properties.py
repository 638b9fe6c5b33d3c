"""The one-rank perturbation property of the model side and band IO (tests/nn_property_job.py) on 2, 3 and 4 ranks.

Serial tests that launch the job under mpiexec, each bounded by a timeout (a
hang kills the launcher's process group and fails). Per trial the job
requires the same exception type on every rank or the single-process result
on every rank, and a group in step afterwards; it prints a summary line
(trials and outcomes) and exits non-zero on a violation.
"""

from __future__ import annotations

import re

import pytest

from .conftest import ROOT
from .test_agreement_property import run_job

pytest.importorskip("torch")
pytest.importorskip("xarray")
pytest.importorskip("zarr")
pytest.importorskip("dask")

JOB = ROOT / "tests" / "nn_property_job.py"
# bounded as the agreement property's jobs: ~10 s per 40 trials on 4 ranks of a loaded 2-core machine
TRIALS = 40
SUMMARY = re.compile(r"nn_property_job: (\d+) ranks, seed (\d+), (\d+) trials: (.*); violations=(\d+)")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_one_rank_differs_same_error_or_right_result(ranks, tmp_path):
    seed = 40 + ranks
    rc, out, took = run_job(ranks, seed, TRIALS, JOB, "--dir", str(tmp_path))
    summary = SUMMARY.search(out)
    assert summary is not None, out[-4000:]
    assert rc == 0 and summary.group(5) == "0", f"exit {rc} after {took:.1f} s\n{out[-4000:]}"
    counts = dict(item.split("=") for item in summary.group(4).split(", "))
    for area in ("nn", "io"):  # both sides of the rule: controls that succeed, perturbations that raise alike
        assert int(counts.get(f"{area}-control-ok", 0)) > 0 and int(counts.get(f"{area}-perturbed-error", 0)) > 0, summary.group(0)
        assert f"{area}-control-error" not in counts, summary.group(0)
    assert not any(k.endswith(":mixed") for k in counts), summary.group(0)
    print(f"{summary.group(0)} ({took:.1f} s)")
