"""How an error that credit_mpi raised alike on every rank of a group is printed: once.

An agreement that fails (:mod:`credit_mpi.validation`) raises the same
exception on every rank of the communicator, so a job of n ranks would print
n copies of one traceback, each with the failing rank's own error chained
in. Instead the group's first rank prints the traceback (its chained cause
named in one line) and every other rank prints one line naming that rank;
``CREDIT_MPI_TRACEBACK=all`` prints every rank's whole traceback.

:func:`credit_mpi.abort_on_exception`'s hook prints this way before it
aborts the job. Without that hook, the first agreed error that credit_mpi
raises installs :func:`print_once_hook` as ``sys.excepthook``, but only
where the hook is still Python's own (a hook the user or a framework set is
left alone); every other exception goes on to Python's hook unchanged.
"""

from __future__ import annotations

import os
import sys
import traceback

from mpi4py import MPI

__all__ = ["TRACEBACK_VARIABLE", "agreed_printer", "install_print_once", "last_traceback", "one_line", "print_once_hook",
           "settled_comm"]

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


def agreed_printer(tb) -> int | None:
    """The COMM_WORLD rank that prints an error agreed on by a group of ranks (its rank 0), else None."""
    comm = settled_comm(tb)
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
    cause = exc_value.__cause__ or (None if exc_value.__suppress_context__ else exc_value.__context__)
    if cause is not None and not str(exc_value).startswith(str(cause)):  # an agreed error repeats its cause's text
        text += (f"(raised while handling {type(cause).__name__}: {str(cause).strip()[:200]}; "
                 f"{TRACEBACK_VARIABLE}=all prints the whole chain on every rank)\n")
    return text


def install_print_once() -> None:
    """Print agreed errors once per group from now on, unless someone else owns ``sys.excepthook``."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = print_once_hook


def print_once_hook(exc_type, exc_value, exc_tb) -> None:
    """``sys.excepthook``: an agreed error printed by its group's first rank, one line elsewhere."""
    printer = agreed_printer(exc_tb) if MPI.Is_initialized() and not MPI.Is_finalized() else None
    if printer is None or os.environ.get(TRACEBACK_VARIABLE) == "all":
        sys.__excepthook__(exc_type, exc_value, exc_tb)
        return
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if printer == rank:
        text = (f"[credit_mpi rank {rank}/{size}] raised alike on every rank of its group: printed once\n"
                + last_traceback(exc_type, exc_value, exc_tb))
    else:
        text = (f"[credit_mpi rank {rank}/{size}] {one_line(exc_type, exc_value)} (the same error as rank {printer}; "
                f"{TRACEBACK_VARIABLE}=all prints every rank's traceback)\n")
    sys.stderr.write(text)
    sys.stderr.flush()
