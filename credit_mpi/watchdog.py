"""A deadline on every credit_mpi collective: past it, the waiting ranks say where everyone is, and abort.

A collective that one rank never enters (it took another branch, it died of
an exception without :func:`credit_mpi.abort_on_exception`, it waits in a
different communicator) leaves the other ranks waiting until the batch
system kills the job, with nothing in the log. Every credit_mpi collective
starts with the agreement of :mod:`credit_mpi.validation` (one small
``Allgather``), and that is where such a job waits; so the agreement arms a
deadline, like NCCL's watchdog:

* entering the agreement writes this process's state (the operation, the
  communicator, a sequence number, the entry time: a few attribute writes,
  no MPI call), leaving it clears the entry time;
* a daemon thread per process (started by the first agreement) wakes every
  :data:`POLL_S` seconds. When the current agreement has waited longer than
  its deadline, it asks the other ranks of that communicator where they are,
  over a private duplicate of the manager's parent communicator (each
  rank's watchdog thread answers such queries, ``Irecv``/``Test``, never
  blocking; an answer is awaited at most :data:`ANSWER_S` seconds), prints
  one report to stderr and calls ``MPI.COMM_WORLD.Abort``: the job ends with
  a non-zero status. A report reads::

      credit_mpi watchdog: rank 1 of credit_mpi.domain[0] (world rank 1) waited 3 s in gather_tensor #12 ...
        rank 0 (world rank 0): not in a credit_mpi collective; last entered halo_exchange #11
        rank 2 (world rank 2): in gather_tensor #12 on credit_mpi.domain[0] since 3 s
        not arrived: rank(s) 0

The deadline is ``CREDIT_MPI_TIMEOUT`` seconds (default
:data:`DEFAULT_TIMEOUT`, 30 minutes: a healthy job's ranks meet well within
it, even around a checkpoint), or the ``timeout=`` of the
:class:`~credit_mpi.DomainParallelManager` whose communicators the
collective runs on; ``0`` turns it off. The deadline covers the agreement,
where most waits on a missing rank happen, and the engine's data phase and
backward exchange (``<op>: data``, ``<op>: backward``,
:func:`credit_mpi.engine._watched`): after the agreement every rank knows
that every other rank is in the same operation, but one may still fail
there (out of memory on one rank) or raise in backward before the exchange
(a hook, a loss computed on one rank), and the others would wait in it.

Queries need ``MPI_THREAD_MULTIPLE`` (mpi4py's default). Below it the
watchdog still fires, but reports its own state only (its thread makes no
MPI call but ``Abort``). At interpreter exit the thread is stopped and
joined before mpi4py finalizes MPI (an ``atexit`` hook registered after
MPI's import), so a healthy job exits promptly.
"""

from __future__ import annotations

import atexit
import os
import struct
import sys
import threading
import time
from typing import Any

from mpi4py import MPI

__all__ = ["DEFAULT_TIMEOUT", "STATE", "arm", "disarm", "set_timeout", "forget_timeout", "watch_parent", "timeout_of"]

DEFAULT_TIMEOUT = 1800.0  # seconds; CREDIT_MPI_TIMEOUT overrides it, 0 turns the watchdog off
POLL_S = 0.5  # how often the thread looks at the deadline and at queries
ANSWER_S = 2.0  # how long a firing watchdog waits for the other ranks' answers
REPORT_S = 0.5  # how long a firing watchdog waits after its report before the abort (the launcher forwards it)
ABORT_CODE = 1
_TAG_QUERY, _TAG_ANSWER = 31001, 31002
_ANSWER = struct.Struct("<qd32s64s")  # seq, seconds in the current collective (-1: none), operation, communicator


class _State:
    """This process's current collective: what the agreement writes on entry and the thread reads."""

    __slots__ = ("op", "comm", "seq", "since")

    def __init__(self) -> None:
        self.op = ""  # the current (or last) operation
        self.comm: Any = None  # its communicator
        self.seq = 0  # how many agreements this process has entered
        self.since = 0.0  # time.monotonic() at entry; 0.0: not in one


STATE = _State()
monotonic = time.monotonic
_TIMEOUTS: dict[int, float] = {}  # id(comm) -> seconds, from the managers' timeout=
_NAMES: dict[int, str] = {}  # id(comm) -> its name, for the managers' communicators
_PRIVATES: list[Any] = []  # private duplicates of managers' parents, for the queries
_LOCK = threading.Lock()
_STOP = threading.Event()
_THREAD: threading.Thread | None = None


def arm(comm: Any, operation: str) -> None:
    """Entering an agreement on ``comm`` (no MPI call; starts the thread the first time)."""
    state = STATE
    state.seq += 1
    state.op, state.comm, state.since = operation, comm, monotonic()
    if _THREAD is None:
        _start()


def disarm() -> None:
    """Leaving the agreement: nothing to wait for any more."""
    STATE.since = 0.0


def default_timeout() -> float:
    """``CREDIT_MPI_TIMEOUT`` in seconds (``0``: off), else :data:`DEFAULT_TIMEOUT`.

    Raises:
        ValueError: not a non-negative number.
    """
    text = os.environ.get("CREDIT_MPI_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    return check_timeout(text, "CREDIT_MPI_TIMEOUT")


def check_timeout(value: Any, name: str = "timeout") -> float:
    """``value`` as seconds (a non-negative number; ``0`` turns the watchdog off), else a ValueError."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 (0 turns the watchdog off), got {value!r}")
    return seconds


def set_timeout(comm: Any, seconds: float) -> None:
    """The deadline of the collectives on ``comm`` (a manager's communicator, named already)."""
    _TIMEOUTS[id(comm)] = seconds
    _NAMES[id(comm)] = comm.Get_name()  # the thread names it from here: no MPI call on a handle the main thread may free


def forget_timeout(comm: Any) -> None:
    """``comm`` is about to be freed: its deadline goes back to the default."""
    _TIMEOUTS.pop(id(comm), None)
    _NAMES.pop(id(comm), None)


def timeout_of(comm: Any) -> float:
    """The deadline of a collective on ``comm``, in seconds (0: none)."""
    seconds = _TIMEOUTS.get(id(comm))
    return default_timeout() if seconds is None else seconds


def watch_parent(comm: MPI.Intracomm) -> None:
    """Collective over ``comm`` (a manager's parent): a private duplicate for the watchdogs' queries, if none holds it.

    The queries are point to point, so any private communicator that holds
    every rank of ``comm`` serves (a duplicate of ``COMM_WORLD`` holds
    them all): a process makes one per parent that no earlier one holds,
    usually just one, however many managers are built. Every rank of
    ``comm`` decides alike (a private communicator is made by all its
    ranks together, so all of ``comm``'s ranks have it, or none do). None
    below ``MPI_THREAD_MULTIPLE`` (the thread makes no queries then).
    """
    if not _multiple():
        return
    if _private_for(comm, comm.Get_size()) is not None:
        return
    private = comm.Dup()
    private.Set_name("credit_mpi.watchdog")
    with _LOCK:
        _PRIVATES.append(private)
    if _THREAD is None:
        _start()


def _multiple() -> bool:
    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def _start() -> None:
    global _THREAD
    with _LOCK:
        if _THREAD is not None:
            return
        _THREAD = threading.Thread(target=_run, name="credit_mpi.watchdog", daemon=True)
        _THREAD.start()


@atexit.register
def _shutdown() -> None:
    """Stop and join the thread before mpi4py finalizes MPI (registered after MPI's import: runs first)."""
    _STOP.set()
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5.0)


# --------------------------------------------------------------------------- the thread


class _Server:
    """The thread's side of the queries: one posted ``Irecv`` per private communicator, answers sent without blocking."""

    def __init__(self) -> None:
        self.posted: dict[int, tuple[Any, Any, Any]] = {}  # id(private) -> (private, request, buffer)
        self.sends: list[Any] = []  # answers in flight (and their buffers)

    def serve(self) -> None:
        if not _multiple():
            return
        with _LOCK:
            privates = list(_PRIVATES)
        for private in privates:
            entry = self.posted.get(id(private))
            if entry is None:
                buf = bytearray(8)
                entry = self.posted[id(private)] = (private, private.Irecv([buf, MPI.BYTE], MPI.ANY_SOURCE, _TAG_QUERY), buf)
            _, request, _ = entry
            status = MPI.Status()
            while request.Test(status):
                answer = bytearray(_answer())
                self.sends.append((private.Isend([answer, MPI.BYTE], status.Get_source(), _TAG_ANSWER), answer))
                buf = bytearray(8)
                request = private.Irecv([buf, MPI.BYTE], MPI.ANY_SOURCE, _TAG_QUERY)
                self.posted[id(private)] = (private, request, buf)
                status = MPI.Status()
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]

    def close(self) -> None:
        """Cancel the posted receives (the answers in flight complete on their own)."""
        if MPI.Is_finalized():
            return
        for _, request, _ in self.posted.values():
            try:
                request.Cancel()
                request.Wait()
            except MPI.Exception:
                pass
        self.posted.clear()


def _answer() -> bytes:
    """This process's state, as :data:`_ANSWER` bytes."""
    state = STATE
    since, seq, op, comm = state.since, state.seq, state.op, state.comm
    waited = monotonic() - since if since else -1.0
    return _ANSWER.pack(seq, waited, op.encode()[:32], _label(comm).encode()[:64])


def _label(comm: Any) -> str:
    if comm is None:
        return ""
    name = _NAMES.get(id(comm))
    if name:
        return name
    try:
        return comm.Get_name() or f"a communicator of {comm.Get_size()} ranks"
    except MPI.Exception:
        return "a freed communicator"


def _run() -> None:
    server = _Server()
    try:
        seen: tuple | None = None
        while not _STOP.wait(POLL_S):
            try:
                server.serve()
            except Exception as exc:  # noqa: BLE001 - a failing query must not end a healthy job (abort_on_exception's thread hook)
                _warn_once(f"credit_mpi watchdog: answering queries failed ({exc!r}); the deadline still holds")
            state = STATE
            since, seq = state.since, state.seq
            if not since:
                seen = None
                continue
            limit = timeout_of(state.comm)
            if not limit or monotonic() - since < limit:
                continue
            if seen != (seq, since):  # past the deadline at two looks in a row, for the same collective
                seen = (seq, since)
                continue
            if STATE.seq == seq and STATE.since == since:
                _fire(server, state.op, seq, state.comm, monotonic() - since, limit)
    finally:
        server.close()


_WARNED: list[str] = []


def _warn_once(text: str) -> None:
    if not _WARNED:
        _WARNED.append(text)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


# what the engine's phases are (credit_mpi.engine._watched: "<op>: data", "<op>: backward")
_PHASES = {"data": "moving the data, after the agreement", "backward": "the backward's exchange"}


def _fire(server: _Server, op: str, seq: int, comm: Any, waited: float, limit: float) -> None:
    """Ask the others where they are, print the report, abort the job."""
    world = MPI.COMM_WORLD.Get_rank()
    try:
        rank, size = comm.Get_rank(), comm.Get_size()
    except (MPI.Exception, AttributeError):  # a freed communicator; None: a kernel whose plan names none
        rank, size = -1, 0
    where = _label(comm) or "its communicator"
    lines = [
        f"credit_mpi watchdog: rank {rank} of {where} (world rank {world}) waited {waited:.0f} s in {op} #{seq} "
        f"({_PHASES.get(op.rpartition(': ')[2], 'the agreement at its start')}), past its deadline of {limit:g} s "
        f"(CREDIT_MPI_TIMEOUT, or the manager's timeout=); aborting the job"
    ]
    try:
        answers = _ask(server, comm, size, rank) if _multiple() else None
        why = f"MPI thread level below MPI_THREAD_MULTIPLE, or {where} is not a manager's"
    except Exception as exc:  # noqa: BLE001 - the job is aborted whatever the others say
        answers, why = None, f"asking the others failed: {exc!r}"
    if answers is None:
        lines.append(f"  ({why}: this rank's state only)")
    else:
        missing = []
        for peer in range(size):
            if peer == rank:
                continue
            world_peer, answer = answers.get(peer, (None, None))
            lines.append(f"  rank {peer} (world rank {world_peer}): {_describe(answer)}")
            if answer is None or answer[2] != op or answer[3] != where or answer[1] < 0:
                missing.append(peer)
        lines.append(f"  not arrived in {op} on {where}: rank(s) {', '.join(map(str, missing)) or 'none (all are waiting)'}")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    time.sleep(REPORT_S)  # the launcher forwards the report before the abort tears its pipes down (lost under load)
    MPI.COMM_WORLD.Abort(ABORT_CODE)


def _describe(answer: tuple | None) -> str:
    if answer is None:
        return f"no answer in {ANSWER_S:g} s (exited, crashed, in MPI_Finalize, or its watchdog is not running)"
    seq, waited, op, comm = answer
    if waited < 0:
        last = op.partition(": ")[0] or "none"  # the operation, its phase aside (it ended)
        return f"not in a credit_mpi collective; last entered {last} #{seq}" if seq else "not in a credit_mpi collective yet"
    return f"in {op} #{seq} on {comm} since {waited:.0f} s"


def _ask(server: _Server, comm: Any, size: int, rank: int) -> dict[int, tuple] | None:
    """``{peer: (world rank, answer or None)}`` for the other ranks of ``comm``; None when no private communicator holds them."""
    found = _private_for(comm, size)
    if found is None:
        return None
    private, ranks = found
    world_group = MPI.COMM_WORLD.Get_group()
    private_group = private.Get_group()
    worlds = MPI.Group.Translate_ranks(private_group, ranks, world_group)
    world_group.Free()
    private_group.Free()
    query = bytearray(8)
    pending = {}
    for peer in range(size):
        if peer != rank:
            buf = bytearray(_ANSWER.size)
            server.sends.append((private.Isend([query, MPI.BYTE], ranks[peer], _TAG_QUERY), query))
            pending[peer] = (private.Irecv([buf, MPI.BYTE], ranks[peer], _TAG_ANSWER), buf)
    answers: dict[int, tuple] = {peer: (worlds[peer], None) for peer in pending}
    deadline = monotonic() + ANSWER_S
    while pending and monotonic() < deadline:
        server.serve()  # the others may be asking this rank at the same time
        for peer, (request, buf) in list(pending.items()):
            if request.Test():
                seq, waited, op, where = _ANSWER.unpack(bytes(buf))
                answers[peer] = (worlds[peer], (seq, waited, op.rstrip(b"\0").decode(), where.rstrip(b"\0").decode()))
                del pending[peer]
        time.sleep(0.01)
    return answers


def _private_for(comm: Any, size: int) -> tuple[Any, list[int]] | None:
    """A private communicator that holds every rank of ``comm``, and their ranks in it."""
    try:
        group = comm.Get_group()
    except MPI.Exception:
        return None
    with _LOCK:
        privates = list(_PRIVATES)
    try:
        for private in privates:
            other = private.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(size)), other)
            other.Free()
            if MPI.UNDEFINED not in ranks:
                return private, list(ranks)
        return None
    finally:
        group.Free()
