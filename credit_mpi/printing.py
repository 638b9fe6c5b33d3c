"""How an error that credit_mpi raised alike on every rank of a group is printed: once, the message first.

An agreement that fails (:mod:`credit_mpi.validation`) raises the same
exception on every rank of the communicator, so a job of n ranks would print
n copies of one traceback, each with the failing rank's own error chained
in. Instead the group's first rank prints it and every other rank prints one
line naming that rank; ``CREDIT_MPI_TRACEBACK=all`` prints every rank's whole
traceback. What the first rank prints starts with the message and the
user's own frame (the innermost outside credit_mpi and the installed
libraries: the line that called credit_mpi), then the caller's frames;
credit_mpi's own frames (the agreement's ``_settle`` ...) are left out.

An error is known to be agreed when it was raised while ranks settled an
agreement (``agreement._settle``'s frame is on its traceback) or when the
code that raised it marked it with :func:`raised_alike` (an error every rank
raises from agreed data after the agreement, such as ``load_checkpoint``'s
world size).

:func:`credit_mpi.abort_on_exception`'s hook prints this way before it
aborts the job. Without that hook, the first agreed error that credit_mpi
raises installs :func:`print_once_hook` as ``sys.excepthook``, but only
where the hook is still Python's own (a hook the user or a framework set is
left alone); every other exception goes on to Python's hook unchanged.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import traceback

from mpi4py import MPI

__all__ = ["TRACEBACK_VARIABLE", "agreed_printer", "install_print_once", "last_traceback", "message_first", "one_line",
           "print_once_hook", "raised_alike", "settled_comm"]

#: ``CREDIT_MPI_TRACEBACK=all``: every rank prints its whole traceback (chained exceptions included).
TRACEBACK_VARIABLE = "CREDIT_MPI_TRACEBACK"


def settled_comm(tb) -> MPI.Comm | None:
    """The communicator of the agreement that raised along ``tb`` (``agreement._settle``'s frame), else None.

    An error raised while ranks settle an agreement is the same on every
    rank of that communicator: it needs no sharing, and one rank prints it.
    """
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        if code.co_name == "_settle" and code.co_filename.endswith(os.path.join("credit_mpi", "agreement.py")):
            return frame.f_locals.get("comm")
    return None


_AGREED = "_credit_mpi_raised_alike_on"  # the attribute raised_alike sets: the communicator
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(k))}))
# How long a rank that leaves the traceback to another waits before exiting (under `python -m mpi4py`, the
# first rank to exit aborts the job: the printing rank must have written by then).
_PRINTER_GRACE_S = 1.0


def raised_alike(error: BaseException, comm: MPI.Comm) -> BaseException:
    """Mark ``error`` as raised alike on every rank of ``comm`` (printed once); returns it: ``raise raised_alike(e, comm)``.

    For an error that every rank raises from the agreed result of an
    agreement, after it (where ``_settle`` is no longer on the traceback).
    """
    setattr(error, _AGREED, comm)
    install_print_once()
    return error


def agreed_printer(tb, error: BaseException | None = None) -> int | None:
    """The COMM_WORLD rank that prints an error agreed on by a group of ranks (its rank 0), else None."""
    comm = getattr(error, _AGREED, None) if error is not None else None
    comm = comm if comm is not None else settled_comm(tb)
    if comm is None:
        return None
    try:
        return MPI.Group.Translate_ranks(comm.Get_group(), [0], MPI.COMM_WORLD.Get_group())[0]
    except Exception:  # noqa: BLE001 - a freed communicator: print here
        return None


def one_line(exc_type, exc_value) -> str:
    lines = str(exc_value).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{exc_type.__name__}: {text[:300]}{'...' if len(text) > 300 or len(lines) > 1 else ''}"


def last_traceback(exc_type, exc_value, exc_tb) -> str:
    """The traceback of the exception itself; its chained causes (often the same error a rank raised first) by name only."""
    text = "".join(traceback.format_exception(exc_type, exc_value, exc_tb, chain=False))
    return text + _cause_line(exc_value, f"; {TRACEBACK_VARIABLE}=all prints the whole chain on every rank")


def _cause_line(exc_value, more: str = "") -> str:
    """The chained cause in one line, or '' (also when the error repeats its cause's text, as an agreed error does)."""
    cause = exc_value.__cause__ or (None if exc_value.__suppress_context__ else exc_value.__context__)
    if cause is None or str(exc_value).startswith(str(cause)):
        return ""
    return f"(raised while handling {type(cause).__name__}: {str(cause).strip()[:200]}{more})\n"


def _internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _library(filename: str) -> bool:
    return filename.startswith("<frozen ") or os.path.abspath(filename).startswith(_LIBRARIES)


def message_first(exc_type, exc_value, exc_tb, note: str, prefix: str = "") -> str:
    """An agreed error as its reader wants it: the message, the user's own frame, a note, then the caller's frames.

    credit_mpi's own frames are left out (``CREDIT_MPI_TRACEBACK=all``
    prints them). The user's frame is the innermost frame outside credit_mpi
    and outside the installed libraries and the standard library (through
    torch's ``Module.__call__``, the user's ``forward``), else the innermost
    outside credit_mpi.
    """
    frames = traceback.extract_tb(exc_tb)
    outside = [f for f in frames if not _internal(f.filename)]
    own = [f for f in outside if not _library(f.filename)] or outside
    if own and own is not outside:  # from the user's outermost frame on (not runpy's and mpi4py.run's before it)
        outside = outside[outside.index(own[0]):]
    outside = traceback.StackSummary.from_list(outside)
    hidden = sum(_internal(f.filename) for f in frames)
    text = prefix + "".join(traceback.format_exception_only(exc_type, exc_value))
    if own:
        text += "".join(traceback.format_list([own[-1]]))
    text += (f"({note}; {hidden} frame(s) of credit_mpi left out: {TRACEBACK_VARIABLE}=all prints the whole "
             f"traceback on every rank)\n")
    text += _cause_line(exc_value)
    if len(outside) > 1:
        text += "Traceback (most recent call last), the caller's frames:\n" + "".join(outside.format())
    return text


def install_print_once() -> None:
    """Print agreed errors once per group from now on, unless someone else owns ``sys.excepthook``."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = print_once_hook


def print_once_hook(exc_type, exc_value, exc_tb) -> None:
    """``sys.excepthook``: an agreed error printed by its group's first rank, one line elsewhere."""
    printer = agreed_printer(exc_tb, exc_value) if MPI.Is_initialized() and not MPI.Is_finalized() else None
    if printer is None or os.environ.get(TRACEBACK_VARIABLE) == "all":
        sys.__excepthook__(exc_type, exc_value, exc_tb)
        return
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if printer == rank:
        text = message_first(exc_type, exc_value, exc_tb, "raised alike on every rank of its group: printed once",
                             prefix=f"[credit_mpi rank {rank}/{size}] ")
    else:
        text = (f"[credit_mpi rank {rank}/{size}] {one_line(exc_type, exc_value)} (the same error as rank {printer}; "
                f"{TRACEBACK_VARIABLE}=all prints every rank's traceback)\n")
    sys.stderr.write(text)
    sys.stderr.flush()
    if printer != rank:
        time.sleep(_PRINTER_GRACE_S)  # `python -m mpi4py` aborts the job when this rank exits: let the printer print
