"""CREDIT's own gen-2 trainer (``credit-mpi credit train``, CREDIT's code unchanged) on credit_mpi: exact.

A tiny synthetic ERA5-like dataset and a gen-2 config (tests/credit_trainer_job.py: a WXFormer on a
64 x 64 grid, forecast_len 2, two batches, AdamW) are trained by CREDIT's trainer on one process, on
2 ranks (domain 2) and on 4 ranks (FSDP2 data parallel 2 x domain 2, against one process with batch 2).
Every loss the trainer logs (two forecast steps per batch: the second and the next batch's come after
AdamW steps, so they check the gradients too) equals one process's within RTOL, and the checkpoint
CREDIT writes loads (strict) into the unconverted model.

RTOL = 2e-6: float32 (unit round-off 6e-8). Each rank sums its band's squared errors and CREDIT's
report averages the band means, and the GroupNorm statistics and the windows are summed band by band:
the same numbers added in another order, a few ulps apart (4e-7 measured); CREDIT's own domain
parallel is 2-6 % off one process on this run (docs/credit_trainer.rst).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, child_env

pytest.importorskip("credit")
pytest.importorskip("optuna")  # CREDIT's trainer module imports it (the `credit` extra)

JOB = ROOT / "tests" / "credit_trainer_job.py"
RTOL = 2e-6
BOUND_S = 300  # CREDIT imports slowly: ~30 s a process on a loaded 2-core machine


def launcher() -> list[str]:
    from .test_faults import launcher as mpi_launcher

    return mpi_launcher()


def run(args: list[str], ranks: int | None = None) -> str:
    """Run the job (under the MPI launcher when ``ranks``), bounded by BOUND_S; its output."""
    cmd = [sys.executable, str(JOB), *args]
    if ranks is not None:
        cmd = [*launcher(), "-n", str(ranks), *cmd]
    env = child_env(MPIEXEC_TIMEOUT=str(BOUND_S), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} still ran after {BOUND_S} s\n{out[-4000:]}")
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode} after {time.monotonic() - start:.0f} s\n{out[-6000:]}"
    return out


def train(root, ranks: int | None, domain: int = 1, data: str = "none", batch: int = 1) -> tuple[list[float], str]:
    """CREDIT's trainer on the config for this layout: (every logged loss, the save_loc)."""
    config = run(["write", str(root), "--domain", str(domain), "--data", data, "--batch", str(batch)]).strip()
    losses = root / f"losses_{ranks}_{data}_{domain}_{batch}.json"
    run(["train", config, str(losses)], ranks)
    return json.loads(losses.read_text()), str(root / f"out_{data}_d{domain}_b{batch}")


def loads_into_unconverted_model(save_loc: str, root) -> None:
    """CREDIT's checkpoint, loaded strictly into the WXFormer built from the config (never converted)."""
    import torch

    from credit_mpi.credit import stand_in_gen1_post_block

    from .credit_trainer_job import config

    stand_in_gen1_post_block()
    from credit.models import load_model

    model = load_model(config(root))
    state = torch.load(os.path.join(save_loc, "checkpoint.pt"), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model_state_dict"], strict=True)
    assert not any(type(m).__module__.startswith("credit_mpi") for m in model.modules())


def assert_same_losses(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == 4, (got, want)  # two batches of two forecast steps
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= RTOL * abs(w), f"{what}: loss {step} is {g!r}, one process {w!r} (rtol {RTOL})"


def test_credit_trainer_on_two_ranks_is_one_process(tmp_path):
    """Domain 2 (data none): CREDIT's trainer on credit_mpi's bands gives one process's losses."""
    one, _ = train(tmp_path, None)
    two, save_loc = train(tmp_path, 2, domain=2)
    print(f"\none process: {one}\ncredit_mpi 2 ranks (domain 2): {two}")
    assert_same_losses(two, one, "2 ranks, domain 2")
    loads_into_unconverted_model(save_loc, tmp_path)


@pytest.mark.skipif(os.environ.get("CREDIT_MPI_CREDIT_TRAINER_4") != "1",
                    reason="4 MPI ranks of CREDIT's trainer: set CREDIT_MPI_CREDIT_TRAINER_4=1 (about 2 min on 2 cores)")
def test_credit_trainer_fsdp2_by_domain_is_one_process_batch_two(tmp_path):
    """FSDP2 data parallel 2 x domain 2 on 4 ranks (batch 1 a replica): one process with batch 2."""
    one, _ = train(tmp_path, None, batch=2)
    four, save_loc = train(tmp_path, 4, domain=2, data="fsdp2")
    print(f"\none process, batch 2: {one}\ncredit_mpi 4 ranks (fsdp2 2 x domain 2): {four}")
    assert_same_losses(four, one, "4 ranks, fsdp2 x domain 2")
    loads_into_unconverted_model(save_loc, tmp_path)


def test_credit_command_says_what_is_missing(monkeypatch, capsys):
    """An untested miles-credit is refused (naming the tested one) unless --untested-credit."""
    from credit_mpi import credit as entry

    monkeypatch.setattr(entry, "TESTED_CREDIT_VERSIONS", ("1999.1.0",))
    assert entry.main(["train", "-c", "x.yml"]) == 2
    err = capsys.readouterr().err
    assert "miles-credit 2026.2.0 is installed" in err and "1999.1.0" in err and "--untested-credit" in err


def test_credit_command_when_credit_is_missing(monkeypatch):
    import importlib.metadata

    from credit_mpi import credit as entry

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(entry.CreditUnavailable, match="not installed.*pip install --no-deps miles-credit==2026.2.0"):
        entry.check_credit()


def test_credit_help_says_what_it_does():
    from credit_mpi import credit as entry

    text = " ".join(entry.build_parser().format_help().split())
    assert "CREDIT's own trainer" in text and "mpiexec -n 4 credit-mpi credit train -c config.yml" in text
