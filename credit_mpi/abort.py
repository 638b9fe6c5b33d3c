"""Fail fast: an uncaught exception on any rank ends the whole MPI job.

Without this, a rank that dies of an exception leaves every other rank
waiting in its next collective until the batch system kills the job, which
burns the whole allocation. :func:`abort_on_exception` replaces
``sys.excepthook`` (and ``threading.excepthook``) with a hook that prints the
traceback, tagged with the rank, and then calls ``MPI.COMM_WORLD.Abort``,
which ends every process of the job with a non-zero status.

An error that credit_mpi raised on every rank of a group (an agreement that
failed) is printed once per group: the group's first rank prints the
traceback, every other rank one line naming it. Chained causes are named,
not printed; ``CREDIT_MPI_TRACEBACK=all`` prints every rank's whole
traceback.

It is opt-in: importing credit_mpi changes nothing. (Without it, an error
that credit_mpi raises on every rank of a group is still printed once, where
``sys.excepthook`` is Python's own, and the ranks exit as usual.) Use it at the top of a
batch script::

    import credit_mpi
    credit_mpi.abort_on_exception()

A rank that leaves through ``sys.exit(status)`` with a non-zero status also
aborts the job (with that status) instead of waiting forever in
``MPI_Finalize`` while the others wait in a collective: the helper wraps
``sys.exit`` and uses mpi4py's own mechanism for it, the one behind
``python -m mpi4py script.py`` (which gives the same guarantees from the
command line; this helper is for programs whose launch line you do not
control).

Only *uncaught* exceptions abort. Exceptions that credit_mpi raises on every
rank (see :mod:`credit_mpi.validation`) can still be caught and handled as
usual, and interactive sessions and test runners that catch exceptions
themselves are unaffected.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from .printing import TRACEBACK_VARIABLE, agreed_printer, last_traceback, message_first, one_line

__all__ = ["abort_on_exception", "abort_on_exception_enabled"]

# The hooks that were in place before we installed ours (None: not installed).
_saved: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None
_errorcode = 1

# How long a rank that leaves the traceback to another waits before aborting.
_PRINTER_GRACE_S = 1.0
# How long a rank that printed waits before aborting, so that the launcher forwards what it printed (an
# immediate Abort can lose the last lines of stderr: seen as a job that showed no traceback at all).
_FORWARD_GRACE_S = 0.3


def abort_on_exception(enable: bool = True, *, errorcode: int = 1) -> None:
    """Make any uncaught exception on this rank abort the whole MPI job.

    Call it on every rank (it is local: no communication). With it on, an
    exception that reaches the top level of the main thread or of any
    ``threading.Thread`` prints its traceback to stderr, prefixed with this
    rank's number in ``MPI.COMM_WORLD``, and then calls
    ``MPI.COMM_WORLD.Abort(errorcode)``: every process of the job ends
    promptly with a non-zero status instead of hanging in a collective.
    An error that credit_mpi raised on every rank of a group is printed
    once for the group (its first rank's traceback, one line from each other
    rank); set ``CREDIT_MPI_TRACEBACK=all`` for every rank's whole traceback.

    Idempotent: calling it again only updates ``errorcode``; the hooks are
    installed once. ``abort_on_exception(False)`` restores the hooks that
    were in place before the first call.

    ``sys.exit`` with a non-zero (or non-integer) status aborts the job at
    Python exit with that status. Not covered: ``raise SystemExit(...)``
    written out by hand (use ``python -m mpi4py``). A rank that is killed or
    crashes needs no help: the MPI launcher ends the job then.

    Args:
        enable: ``True`` to install the hooks, ``False`` to remove them.
        errorcode: The status passed to ``Abort`` (must be a non-zero int).

    Raises:
        ValueError: ``errorcode`` is not a non-zero integer.
    """
    global _saved, _errorcode
    if not enable:
        if _saved is not None:
            sys.excepthook, threading.excepthook, sys.exit = _saved
            _saved = None
        return
    if isinstance(errorcode, bool) or not isinstance(errorcode, int) or errorcode == 0:
        raise ValueError(f"errorcode must be a non-zero integer, got {errorcode!r}")
    _errorcode = errorcode
    if _saved is None:
        _saved = (sys.excepthook, threading.excepthook, sys.exit)
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook
        sys.exit = _exit


def abort_on_exception_enabled() -> bool:
    """True while :func:`abort_on_exception` is in effect."""
    return _saved is not None


def _abort(exc_type, exc_value, exc_tb, where: str) -> None:
    if not MPI.Is_initialized() or MPI.Is_finalized():
        # Nothing to abort: let Python report the error the usual way.
        assert _saved is not None
        _saved[0](exc_type, exc_value, exc_tb)
        return
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        head = f"[credit_mpi rank {rank}/{size}] uncaught exception{where}; aborting all {size} rank(s) of MPI.COMM_WORLD with status {_errorcode}"
        printer = agreed_printer(exc_tb, exc_value)
        if os.environ.get(TRACEBACK_VARIABLE) == "all":
            text = f"{head}\n" + "".join(traceback.format_exception(exc_type, exc_value, exc_tb))
        elif printer is not None and printer != rank:
            # The same error is on every rank of a group: its first rank prints the traceback and aborts
            # the job; this rank waits for that, and says one line only if the job is still there.
            sys.stdout.flush()
            time.sleep(_PRINTER_GRACE_S)
            text = f"[credit_mpi rank {rank}/{size}] {one_line(exc_type, exc_value)} (the same error as rank {printer})\n"
        elif printer is None:  # this rank's own error: the whole traceback
            text = f"{head}\n" + last_traceback(exc_type, exc_value, exc_tb)
        else:  # the message and the user's line first
            text = message_first(
                exc_type, exc_value, exc_tb, f"raised alike on every rank of its group: printed once; uncaught exception{where}: "
                f"aborting all {size} rank(s) of MPI.COMM_WORLD with status {_errorcode}", prefix=f"[credit_mpi rank {rank}/{size}] ")
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(_FORWARD_GRACE_S)
    finally:
        world.Abort(_errorcode)


def _excepthook(exc_type, exc_value, exc_tb) -> None:
    _abort(exc_type, exc_value, exc_tb, "")


def _exit(status: Any = None) -> None:
    """``sys.exit`` that makes a non-zero status abort the job at Python exit."""
    if threading.current_thread() is threading.main_thread() and MPI.Is_initialized() and not MPI.Is_finalized():
        from mpi4py.run import set_abort_status

        set_abort_status(SystemExit(status))
    assert _saved is not None
    _saved[2](status)


def _threading_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # threading ignores SystemExit; so do we
        return
    name = getattr(args.thread, "name", "?")
    _abort(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name!r}")
