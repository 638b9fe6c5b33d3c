"""abort_on_exception(): installs once, switches off, validates its argument.

What it does when an exception really escapes is tested end to end, under
mpiexec, in tests/test_faults.py.
"""

from __future__ import annotations

import sys
import threading

import pytest

import credit_mpi
from credit_mpi import abort


@pytest.fixture(autouse=True)
def restore():
    before = (sys.excepthook, threading.excepthook, sys.exit)
    yield
    credit_mpi.abort_on_exception(False)
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
