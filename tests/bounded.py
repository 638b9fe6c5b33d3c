"""A per-test bound for MPI tests of hangs: a test that still runs after ``seconds`` ends the whole job.

A regression that makes some ranks wait for ever then fails CI in seconds
with the test's name (status 124), instead of holding the job until the
launcher's MPIEXEC_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading

from mpi4py import MPI

BOUND_S = 120  # generous for a loaded 2-core CI machine; the tests take well under a second


@contextlib.contextmanager
def bounded(what: str, seconds: float = BOUND_S):
    """Run the body; past ``seconds`` print ``what`` and every thread's stack, then exit this rank with 124."""

    def expire() -> None:
        print(f"rank {MPI.COMM_WORLD.Get_rank()}: HANG: {what} still running after {seconds} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr)
        os._exit(124)  # the launcher ends the other ranks

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
