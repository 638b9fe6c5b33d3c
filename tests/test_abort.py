"""abort_on_exception(): installs once, switches off, validates its argument.

What it does when an exception really escapes is tested end to end, under
mpiexec, in tests/test_faults.py.
"""

from __future__ import annotations

import sys
import threading

import pytest

import credit_mpi
from credit_mpi import _printing, abort


@pytest.fixture(autouse=True)
def restore():
    before = (sys.excepthook, threading.excepthook, sys.exit)
    yield
    credit_mpi.abort_on_exception(False)
    if sys.excepthook is _printing.print_once_hook:  # an agreed error raised in this process installed it
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


AGREED_JOB = """
import numpy as np
import credit_mpi as cm
{hook}
m = cm.initialize_domain_parallel(None, {n})
x = np.zeros((1, 2, 8 + (m.domain_rank == 1), 4))
cm.halo_exchange(x, 1, dim=-1)
"""


@pytest.mark.parametrize("hook", [True, False], ids=["abort_on_exception", "no-hook"])
@pytest.mark.parametrize("variable", [None, "all"])
def test_one_traceback_for_an_error_every_rank_raises(variable, hook, tmp_path):
    """3 ranks, one wrong band: the agreed ValueError is one traceback (every rank's with CREDIT_MPI_TRACEBACK=all).

    With abort_on_exception the first rank prints it and aborts the job; without it (a plain script) the
    first agreed error installs the print-once hook (Python's own hook was in place), every rank exits.
    """
    import subprocess
    from pathlib import Path

    from mpi4py import MPI

    from .conftest import child_env

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own mpiexec")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"no {mpiexec}")
    script = tmp_path / "job.py"
    script.write_text(AGREED_JOB.format(n=3, hook="cm.abort_on_exception()" if hook else ""))
    env = child_env(MPIEXEC_TIMEOUT="120", **({"CREDIT_MPI_TRACEBACK": variable} if variable else {}))
    for _ in range(2):  # a launch that printed nothing at all is tried once more (as in test_faults.run_job)
        result = subprocess.run([str(mpiexec), "-n", "3", sys.executable, str(script)], env=env, cwd=tmp_path,
                                capture_output=True, text=True, timeout=150)
        out = result.stdout + result.stderr
        if out:
            break
    assert result.returncode != 0, out
    assert "bands do not fit together" in out, out
    if variable is None:
        assert out.count("Traceback (most recent call last)") == 1, out
        head = "[credit_mpi rank 0/3] uncaught exception" if hook else "[credit_mpi rank 0/3] raised alike"
        assert head in out and "printed once" in out, out
        if not hook:  # the others say one line each
            assert all(f"[credit_mpi rank {r}/3] ValueError:" in out and "(the same error as rank 0" in out
                       for r in (1, 2)), out
    else:
        assert out.count("Traceback (most recent call last)") >= 2, out  # the chain too (on every rank that got to print)
