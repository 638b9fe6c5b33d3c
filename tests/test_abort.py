"""abort_on_exception(): installs once, switches off, validates its argument.

What it does when an exception really escapes is tested end to end, under
mpiexec, in tests/test_faults.py.
"""

from __future__ import annotations

import sys
import threading

import pytest

import credit_mpi
from credit_mpi import abort, printing


@pytest.fixture(autouse=True)
def restore():
    before = (sys.excepthook, threading.excepthook, sys.exit)
    yield
    credit_mpi.abort_on_exception(False)
    if sys.excepthook is printing.print_once_hook:  # an agreed error raised in this process installed it
        sys.excepthook = sys.__excepthook__
    assert (sys.excepthook, threading.excepthook, sys.exit) == before


def test_installs_and_removes_the_hooks():
    before = (sys.excepthook, threading.excepthook, sys.exit)
    assert not abort.abort_on_exception_enabled()
    credit_mpi.abort_on_exception()
    assert abort.abort_on_exception_enabled()
    assert sys.excepthook is abort._excepthook
    assert threading.excepthook is abort._threading_excepthook
    assert sys.exit is abort._exit
    credit_mpi.abort_on_exception(False)
    assert not abort.abort_on_exception_enabled()
    assert (sys.excepthook, threading.excepthook, sys.exit) == before


def test_idempotent():
    before = sys.excepthook
    credit_mpi.abort_on_exception()
    credit_mpi.abort_on_exception(errorcode=7)
    assert abort._errorcode == 7
    credit_mpi.abort_on_exception(False)
    assert sys.excepthook is before  # not our own hook, saved by the second call
    credit_mpi.abort_on_exception(False)  # off twice is fine too
    assert sys.excepthook is before


@pytest.mark.parametrize("code", [0, True, 1.5, "1", None])
def test_errorcode_must_be_a_nonzero_int(code):
    with pytest.raises(ValueError, match=f"errorcode must be a non-zero integer, got {code!r}"):
        credit_mpi.abort_on_exception(errorcode=code)
    assert not abort.abort_on_exception_enabled()


def test_sys_exit_still_exits():
    credit_mpi.abort_on_exception()
    with pytest.raises(SystemExit) as info:
        sys.exit(0)  # status 0: no abort is armed
    assert info.value.code == 0


def test_exported():
    assert "abort_on_exception" in credit_mpi.__all__


# -- what the hook prints ----------------------------------------------------------------------------

def _caught(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no exception")


def test_an_agreed_error_is_printed_by_the_groups_first_rank():
    from mpi4py import MPI

    def bad():
        raise ValueError("nope")

    agreed = _caught(lambda: credit_mpi.allgather_or_raise(MPI.COMM_SELF, bad))
    assert abort.agreed_printer(agreed.__traceback__) == MPI.COMM_WORLD.Get_rank()  # COMM_SELF's rank 0
    assert abort.agreed_printer(_caught(bad).__traceback__) is None  # one rank's own error: it prints it
    text = abort.last_traceback(type(agreed), agreed, agreed.__traceback__)
    assert text.count("Traceback") == 1 and "nope [on rank(s) 0" in text
    assert "raised while handling" not in text  # the cause says what the agreed error says
    assert abort.one_line(ValueError, ValueError("a\nb")) == "ValueError: a..."


def test_an_agreed_error_reads_message_first_without_credit_mpis_frames():
    from mpi4py import MPI

    from credit_mpi import printing

    def bad():
        raise ValueError("nope")

    agreed = _caught(lambda: credit_mpi.allgather_or_raise(MPI.COMM_SELF, bad))
    lines = printing.message_first(type(agreed), agreed, agreed.__traceback__, "a note").splitlines()
    assert lines[0].startswith("ValueError: nope [on rank(s) 0")
    assert lines[1].startswith(f'  File "{__file__}"') and "in <lambda>" in lines[1]  # the line that called credit_mpi
    assert lines[2].strip().startswith("agreed = _caught(lambda: credit_mpi.allgather_or_raise(")
    note = next(line for line in lines if line.startswith("(a note; "))  # after the line (and Python's ^^^ marks)
    assert lines.index(note) <= 4 and "frame(s) of credit_mpi left out" in note
    assert "agreement.py" not in "\n".join(lines) and "validation.py" not in "\n".join(lines)
    marked = printing.raised_alike(ValueError("after"), MPI.COMM_SELF)  # no _settle on its traceback: marked
    assert abort.agreed_printer(None, marked) == MPI.COMM_WORLD.Get_rank()


def test_a_cause_with_other_words_is_named_not_printed():
    try:
        try:
            {}["k"]
        except KeyError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as exc:
        text = abort.last_traceback(RuntimeError, exc, exc.__traceback__)
    assert text.count("Traceback") == 1 and "raised while handling KeyError: 'k'" in text
    assert "CREDIT_MPI_TRACEBACK=all" in text


AGREED_JOBS = {
    # an agreement that fails (raised inside agreement._settle)
    "halo": ("""
import numpy as np
import credit_mpi as cm
{hook}
m = cm.initialize_domain_parallel(None, {n})
x = np.zeros((1, 2, 8 + (m.domain_rank == 1), 4))
cm.halo_exchange(x, 1, dim=-1)
""", "bands do not fit together", "cm.halo_exchange(x, 1, dim=-1)"),
    # an error every rank raises from agreed data after the agreement (the checkpoint's world size)
    "checkpoint": ("""
import torch
from mpi4py import MPI
import credit_mpi as cm
import credit_mpi.nn
{hook}
model = torch.nn.Linear(2, 2)
if MPI.COMM_WORLD.Get_rank() == 0:
    with cm.initialize_domain_parallel(None, 1, comm=MPI.COMM_SELF) as single:
        cm.nn.save_checkpoint("ckpt.pt", model, single)
MPI.COMM_WORLD.Barrier()
m = cm.initialize_domain_parallel(None, {n})
cm.nn.load_checkpoint("ckpt.pt", model, m)
""", "holds the RNG states of 1 ranks, this job has 3", 'cm.nn.load_checkpoint("ckpt.pt", model, m)'),
}
LAUNCHES = {  # how the job ends on an uncaught exception
    "abort_on_exception": ("cm.abort_on_exception()", []),
    "no-hook": ("", []),  # a plain script: the first agreed error installs the print-once hook
    "python -m mpi4py": ("", ["-m", "mpi4py"]),  # mpi4py's own abort at exit
}


def _run_agreed_job(tmp_path, job: str, launch: str, variable: str | None) -> str:
    import subprocess
    from pathlib import Path

    from mpi4py import MPI

    from .conftest import child_env

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own mpiexec")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"no {mpiexec}")
    if job == "checkpoint":
        pytest.importorskip("torch")
    code, hook_args = AGREED_JOBS[job][0], LAUNCHES[launch]
    script = tmp_path / "job.py"
    script.write_text(code.format(n=3, hook=hook_args[0]))
    env = child_env(MPIEXEC_TIMEOUT="120", **({"CREDIT_MPI_TRACEBACK": variable} if variable else {}))
    for _ in range(2):  # a launch that printed nothing at all is tried once more (as in test_faults.run_job)
        result = subprocess.run([str(mpiexec), "-n", "3", sys.executable, *hook_args[1], str(script)], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=150)
        out = result.stdout + result.stderr
        if out:
            break
    assert result.returncode != 0, out
    return out


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("job", list(AGREED_JOBS))
def test_an_error_every_rank_raises_is_printed_once_message_first(job, launch, tmp_path):
    """3 ranks: the agreed error is printed once, its first lines the message and the user's own line.

    With abort_on_exception the first rank prints it and aborts the job; without it (a plain script, or
    ``python -m mpi4py``) the first agreed error installs the print-once hook, where Python's own hook was in
    place; the other ranks say one line each. credit_mpi's frames are left out, Python's traceback is not printed.
    """
    out = _run_agreed_job(tmp_path, job, launch, None)
    _, says, line = AGREED_JOBS[job]
    lines = out.splitlines()
    firsts = [i for i, text in enumerate(lines) if text.startswith("[credit_mpi rank 0/3] ValueError: ")]
    assert len(firsts) == 1, out  # printed once
    first = firsts[0]
    assert says in lines[first], out
    assert lines[first + 1].startswith(f'  File "{tmp_path / "job.py"}"') or lines[first + 1].startswith('  File "job.py"'), out
    assert lines[first + 2].strip() == line, out  # the user's own line
    note = next(text for text in lines[first + 3:] if not text.strip().startswith("^"))  # past Python's ^^^ marks
    assert "printed once" in note and "frame(s) of credit_mpi left out" in note, out
    assert "Traceback (most recent call last):" not in out and "agreement.py" not in out, out  # no whole traceback
    assert "mpi4py/run.py" not in out and "<frozen runpy>" not in out, out  # nor the launcher's frames
    if launch != "abort_on_exception":  # the others say one line each (an aborted job may end before they do)
        assert all(f"[credit_mpi rank {r}/3] ValueError:" in out and "(the same error as rank 0" in out
                   for r in (1, 2)), out


def test_every_rank_prints_the_whole_traceback_when_asked(tmp_path):
    out = _run_agreed_job(tmp_path, "halo", "no-hook", "all")
    assert out.count("Traceback (most recent call last):") >= 3, out  # every rank's, the chain too
    assert "agreement.py" in out and "_settle" in out, out
