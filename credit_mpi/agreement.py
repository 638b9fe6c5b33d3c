"""The agreement: every rank of a communicator agrees on what happens next, or every rank raises the same.

The rule every collective of credit_mpi follows (:func:`agree`): **anything
that changes which MPI calls a rank will make is agreed before the first MPI
call of the operation**. Each rank validates its own arguments locally,
without raising; then one fixed-size ``Allgather`` of a small integer header
(the operation, the check mode, "my local validation failed", a 64-bit
digest of everything that must be equal on every rank, and one count such
as the band rows) tells every rank what every rank is about to do. Only when
all headers agree does the operation move data; otherwise every rank takes
the same second, pickled ``allgather`` that names what each rank did, and
every rank raises the same exception.

:func:`agree_cached` remembers an agreement per call key (a repeat is one
``Allgather`` of the header), :func:`forget_agreements` (``manager.free()``)
drops what was remembered on a communicator. The engine
(:mod:`credit_mpi.engine`) runs every op through these; the public
helpers built on them (:func:`credit_mpi.validation.allgather_or_raise`,
the argument checks) live in :mod:`credit_mpi.validation`, which re-exports
this module's names.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from . import watchdog
from .printing import install_print_once, raised_alike, settled_comm

__all__ = [
    "DomainParallelError",
    "Local",
    "OPERATIONS",
    "agree",
    "agree_cached",
    "agree_values",
    "Free",
    "forget_agreements",
    "on_forget",
    "remembered",
    "quiet_forward",
    "quiet_known",
    "remember_quiet",
    "register_operation",
    "comm_label",
    "digest",
]


class DomainParallelError(RuntimeError):
    """A problem that involves several ranks (ranks disagree, a freed manager).

    Raised identically on every rank of the communicator involved.
    """


# Exception types that travel between ranks as themselves; anything else
# becomes a DomainParallelError on the ranks that did not raise it.
_PORTABLE = (ValueError, TypeError, DomainParallelError)


class Local(NamedTuple):
    """What one rank brings to :func:`agree`.

    Attributes:
        plan: What the operation needs on this rank afterwards (any object;
            pickled only when ranks disagree, to name what each one did).
        calls: Plain values (str, int, float, bool, None, tuples of them)
            that decide which MPI calls this rank will make, with which byte
            counts: arguments, the transport, whether autograd records the
            call, ``out``. Always compared.
        same: Plain values that must be equal for the result to be right
            (kinds, dtypes, dims); compared when the operation's ``check``
            is true. Both are compared through one 64-bit digest, so the
            common case moves a few integers.
        count: One integer every rank learns from every other rank (the band
            rows along the sharded dim, for instance).
    """

    plan: Any
    calls: tuple
    same: tuple = ()
    count: int = 0


# Every operation that starts with an agreement has a code, so that a rank in
# one operation never pairs silently with a rank in another.
OPERATIONS = [
    "shard_tensor", "shard_batch", "gather_tensor", "scatter_tensor", "halo_exchange", "reduce_gradients",
    "collective",  # agree()'s default, for code outside the core operations
    "agree_values",  # values that must be equal on every rank (agree_values)
    "layer",  # a converted model's layer (credit_mpi.nn)
    # The 2-D grid's paths (a (lat, lon) pair): their own codes, on the same communicator as the 1-D
    # paths, so that a rank that passed a single dim meets the others' pair in one Allgather and every
    # rank raises (the 1-D/2-D decision is agreed, not local).
    "shard_tensor/2d", "shard_batch/2d", "gather_tensor/2d", "scatter_tensor/2d", "halo_exchange/2d",
]  # and every op of credit_mpi.ops, added by register_operation when its module is imported
GRID_SUFFIX = "/2d"
_HEADER = 5  # operation, check, failed, digest, count


def agree(
    comm: MPI.Comm,
    operation: str,
    local: Callable[[], Local],
    *,
    check: bool = True,
    explain: Callable[[list[Local]], None] | None = None,
) -> tuple[Any, list[int]]:
    """The collective start of an operation: every rank agrees on what happens next, or every rank raises.

    ``local()`` runs on this rank and may raise (a bad argument or array);
    its exception is not raised here but carried into the agreement. Then
    one ``Allgather`` of five int64 per rank compares the operation, the
    ``check`` mode, the failure flags and the digest of ``local().calls``
    (and of ``local().same`` when ``check``) across ``comm``. If anything differs, a second,
    pickled ``allgather`` (taken by every rank, since every rank sees the
    same table) shares each rank's :class:`Local` or error, and every rank
    raises the same exception: the failing ranks' error (as in
    :func:`allgather_or_raise`), else what ``explain(locals)`` raises for
    ranks in the same operation (a precise message), else a
    :class:`DomainParallelError` that names each rank's call.

    Args:
        comm: The communicator the operation runs on.
        operation: One of :data:`OPERATIONS`.
        local: This rank's validation; returns a :class:`Local`.
        check: Compare ``same`` across ranks too (the operation's ``check``
            argument). ``False`` still agrees on the operation, the check
            mode itself, failures and ``calls``: ranks never make different calls.
        explain: Called with every rank's :class:`Local` when the ranks are
            in the same operation but differ; raises the operation's own
            message (deterministic, so every rank raises the same).

    Returns:
        ``(plan, counts)``: this rank's plan and every rank's count.
    """
    mine, error, header = _local_header(operation, check, local)
    table = np.empty((comm.Get_size(), _HEADER), dtype=np.int64)
    _allgather_header(comm, operation, header, table)
    return _settle(comm, operation, check, explain, mine, error, table)


def _allgather_header(comm: MPI.Comm, operation: str, header: np.ndarray, table: np.ndarray) -> None:
    """The agreement's ``Allgather``, under the watchdog's deadline (:mod:`credit_mpi.watchdog`)."""
    watchdog.arm(comm, operation)
    try:
        comm.Allgather(header, table)
    finally:
        watchdog.STATE.since = 0.0


def _local_header(operation: str, check: bool, local: Callable[[], Local]) -> tuple[Local | None, Exception | None, np.ndarray]:
    """This rank's :class:`Local` (or its error) and its header row for :func:`agree`."""
    error: Exception | None = None
    mine: Local | None = None
    try:
        mine = local()
        digest = _digest((mine.calls, mine.same) if check else mine.calls)
        count = int(mine.count)
    except Exception as exc:  # noqa: BLE001 - every rank raises it below
        error, digest, count = exc, 0, 0
    header = np.array([_operation_code(operation), bool(check), error is not None, digest, count], dtype=np.int64)
    return mine, error, header


def _settle(
    comm: MPI.Comm,
    operation: str,
    check: bool,
    explain: Callable[[list[Local]], None] | None,
    mine: Local | None,
    error: Exception | None,
    table: np.ndarray,
) -> tuple[Any, list[int]]:
    """What every rank does with the agreed ``table``: ``(plan, counts)``, or the same exception everywhere.

    Decided by ``table`` alone (the same on every rank), so every rank takes
    the second, pickled round or none does.
    """
    if not table[:, 2].any() and (table[:, :4] == table[0, :4]).all():
        return mine.plan, table[:, 4].tolist()
    # Some rank failed or differs: every rank saw the same table, so every rank is here, and raises alike.
    install_print_once()
    if error is not None:
        item = (False, (type(error) if isinstance(error, _PORTABLE) else None, str(error)))
    else:
        item = (True, (operation, bool(check), mine))
    items = comm.allgather(item)
    failures = {rank: info for rank, (ok, info) in enumerate(items) if not ok}
    where = comm_label(comm)
    if failures:
        raise raised_alike(_agreed_error(failures, where), comm) from error
    calls = [info for _, info in items]
    _raise_mixed_forms(where, [op for op, _, _ in calls])
    if explain is not None and len({(op, chk) for op, chk, _ in calls}) == 1:
        explain([loc for _, _, loc in calls])
    detail = "; ".join(
        f"rank {r}: {op}(check={chk}, {loc.calls!r}, {loc.same!r})" for r, (op, chk, loc) in enumerate(calls)
    )
    raise DomainParallelError(
        f"ranks of {where} made different calls (every rank must call the same operation with the same "
        f"arguments, check mode, transport and autograd state): {detail}"
    )


def _raise_mixed_forms(where: str, operations: list[str]) -> None:
    """The same operation called with a single dim on some ranks and a (lat, lon) pair on others: one clear ValueError."""
    bases = {op.removesuffix(GRID_SUFFIX) for op in operations}
    if len(bases) != 1 or len(set(operations)) == 1:
        return
    line = [r for r, op in enumerate(operations) if not op.endswith(GRID_SUFFIX)]
    grid = [r for r, op in enumerate(operations) if op.endswith(GRID_SUFFIX)]
    raise ValueError(
        f"{bases.pop()}: ranks of {where} passed a single dim / halo_width / boundary (latitude bands) on rank(s) "
        f"{_ranks(line)} and a (lat, lon) pair (2-D blocks of the domain grid) on rank(s) {_ranks(grid)}; every rank "
        f"must pass the same form: pairs such as dim=(-2, -1) on a domain_grid, single values for latitude bands"
    )


def agree_values(
    comm: MPI.Comm,
    what: str,
    compute: Callable[[], Any],
    explain: Callable[[list[Any]], None],
    *,
    count: Callable[[Any], int] | None = None,
) -> tuple[Any, list[int]]:
    """The one "every rank must have the same values" of the package: ``(value, counts)``, or one exception everywhere.

    For an agreement with no data op after it (a manager's arguments, a
    dataset's store description, the flags of a loss): ``compute()`` runs on
    every rank (it may raise: every rank raises it, as in :func:`agree`), and
    one fixed-size ``Allgather`` compares a fingerprint of its value (numpy
    arrays by their bytes; :class:`Free` parts left out). Only when the
    ranks differ is every rank's value shared (the pickled round), and
    ``explain(values)`` raises the caller's own message on every rank (a
    generic :class:`DomainParallelError` when it returns, or when ranks are
    in agreements of different ``what``). ``count(value)`` is the one integer
    every rank learns from every other (default 0).

    Returns:
        ``(value, counts)``: this rank's value (equal on every rank but its
        :class:`Free` parts) and every rank's count.
    """

    def local() -> Local:
        value = compute()
        return Local(value, (what, _fingerprint(value)), (), 0 if count is None else int(count(value)))

    def explain_all(locals_: list[Local]) -> None:
        whats = [loc.calls[0] for loc in locals_]
        if len(set(whats)) == 1:
            explain([loc.plan for loc in locals_])
            return
        detail = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
        raise DomainParallelError(f"ranks of {comm_label(comm)} are in different agreements ({detail}); every rank must make the same call")

    return agree(comm, "agree_values", local, explain=explain_all)


class Free:
    """A value :func:`agree_values` carries but does not compare (it always compares equal: per-rank data)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Free)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "Free(...)"


def _fingerprint(value: Any) -> int:
    """What :func:`agree_values` compares: :func:`digest` of ``value`` made plain (arrays by their bytes, dicts sorted)."""
    return _digest((_plain(value),))


def _plain(value: Any) -> Any:
    if isinstance(value, Free):
        return "free"
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, digest(np.ascontiguousarray(value).tobytes()) if value.dtype != object else repr(value.tolist()))
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_plain(v) for v in value])
    return value


def register_operation(name: str) -> str:
    """Add ``name`` to :data:`OPERATIONS` (an op of :mod:`credit_mpi.engine`; idempotent)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an operation's name must be a non-empty str, got {name!r}")
    if name not in OPERATIONS:
        OPERATIONS.append(name)
    return name


def _operation_code(operation: str) -> int:
    """The operation's code in the agreement's header: the digest of its name.

    Not its index in :data:`OPERATIONS`: ranks may import the op modules in
    different orders, the name is the same everywhere.
    """
    code = _CODES.get(operation)
    if code is None:
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; known: {', '.join(OPERATIONS)}")
        code = _CODES[operation] = _digest((operation,))
    return code


_CODES: dict[str, int] = {}


class _Agreed:
    """One remembered agreement of :func:`agree_cached`.

    It holds its communicator weakly (the plan it remembers may hold it:
    :func:`forget_agreements`, which ``manager.free()`` calls, drops both).
    """

    __slots__ = ("_comm", "operation", "mine", "header", "table", "table_bytes", "result", "received")

    def __init__(self, comm: MPI.Comm, operation: str, mine: Local, header: np.ndarray, table: np.ndarray, result: Any) -> None:
        self._comm, self.operation, self.mine, self.header = weakref.ref(comm), operation, mine, header
        self.table, self.table_bytes, self.result = table, table.tobytes(), result
        self.received = np.empty_like(table)  # each repeat's table lands here (collectives on one comm never overlap)

    @property
    def comm(self) -> MPI.Comm | None:
        """The communicator agreed on (None once it is gone)."""
        return self._comm()

    def repeat(self) -> np.ndarray | None:
        """This rank's agreement for a repeat of the remembered call: the fixed-size ``Allgather`` of its header.

        Returns None when every rank sent the very table agreed last time
        (``result`` stands), else the table received: pass it to
        :func:`agree_cached` as ``received=`` (it settles the new call
        without another ``Allgather``).
        """
        state = watchdog.STATE  # the watchdog's deadline: a few attribute writes, no MPI call (the per-call fast path)
        state.seq += 1
        comm = self._comm()
        state.op, state.comm, state.since = self.operation, comm, watchdog.monotonic()
        try:
            comm.Allgather(self.header, self.received)
        finally:
            state.since = 0.0
        if self.received.tobytes() == self.table_bytes:
            return None
        return self.received.copy()


_AGREED: collections.OrderedDict = collections.OrderedDict()
AGREED_ENTRIES = 256  # remembered agreements (least recently used go first)


def agree_cached(
    comm: MPI.Comm,
    operation: str,
    key: Hashable | None,
    local: Callable[[], Local],
    finish: Callable[[Any, list[int]], Any],
    *,
    check: bool = True,
    explain: Callable[[list[Local]], None] | None = None,
    received: np.ndarray | None = None,
) -> Any:
    """:func:`agree`, then ``finish(plan, counts)``; both remembered per ``key`` for the next identical call.

    ``key`` must decide everything ``local()`` returns on this rank (the
    array's description, the arguments; ``None``: nothing is remembered).
    Every call still makes the same fixed-size ``Allgather`` of five int64
    per rank as :func:`agree`, so a change on any rank (another shape, dtype,
    argument, operation, a failure) is still seen by every rank: a rank
    whose key is new runs ``local()`` and sends a new header, and every rank
    whose table differs from the one it remembered settles it as
    :func:`agree` does (the same exception on every rank, or a new
    agreement). What a repeated call skips is this rank's local checks, the
    digest, and ``finish`` (planning), when the whole table is the one it
    agreed on last time.

    ``finish`` must be deterministic in ``(plan, counts)`` (they are agreed,
    so an exception it raises is raised on every rank alike); an exception
    is never remembered. ``received``: the table that
    :meth:`_Agreed.repeat` of this call's remembered agreement returned (the
    ``Allgather`` of this call was made already).

    Returns:
        ``finish(plan, counts)``.
    """
    if key is None:
        return finish(*agree(comm, operation, local, check=check, explain=explain))
    full = (id(comm), operation, bool(check), key)
    entry = _AGREED.get(full)
    if entry is not None and entry.comm is comm:
        _AGREED.move_to_end(full)
        table = entry.repeat() if received is None else received
        if table is None:
            return entry.result
        mine, error, header = entry.mine, None, entry.header
    else:
        mine, error, header = _local_header(operation, check, local)
        table = np.empty((comm.Get_size(), _HEADER), dtype=np.int64)
        _allgather_header(comm, operation, header, table)
    plan, counts = _settle(comm, operation, check, explain, mine, error, table)
    result = finish(plan, counts)
    _AGREED[full] = _Agreed(comm, operation, mine, header, table, result)
    while len(_AGREED) > AGREED_ENTRIES:
        _AGREED.popitem(last=False)
    return result


def remembered(comm: MPI.Comm, operation: str, key: Hashable | None, check: bool = True) -> _Agreed | None:
    """The agreement :func:`agree_cached` remembers for this call on ``comm``, or None (no MPI call).

    The per-call fast path of the halo exchange and the gather: when one
    exists, its :meth:`_Agreed.repeat` is the whole agreement of a repeated call.
    """
    if key is None:
        return None
    full = (id(comm), operation, bool(check), key)
    entry = _AGREED.get(full)
    if entry is None or entry.comm is not comm:
        return None
    _AGREED.move_to_end(full)  # least recently used go first
    return entry


class _Quiet(threading.local):
    """The converted forward under way on this thread: None (none), ``"learn"`` or ``"skip"`` (:func:`quiet_forward`)."""

    mode: str | None = None


_QUIET = _Quiet()
# per communicator: key -> result of an agreement after which its layer makes no MPI call (:func:`remember_quiet`)
_QUIET_KNOWN: dict[int, tuple[weakref.ref, dict]] = {}


@contextlib.contextmanager
def quiet_forward(comm: MPI.Comm, same: bool):
    """Within: a converted forward on ``comm`` whose layers may skip the agreements of the calls that make no MPI call.

    ``same`` must be agreed (the same on every rank): every rank's inputs to the forward are those of its
    last forward. Then a layer call whose key and plan this rank remembered from an earlier forward as
    making no MPI call (:func:`remember_quiet`) skips its agreement: every rank remembered the same calls
    (what is remembered is decided by agreed plans, and forgotten on every rank of ``comm`` at once, when
    ``same`` is False), so every rank skips the same ones, and the next agreement still meets every rank.
    A rank whose call nevertheless differs (a shape that depends on the data) agrees while the others
    skip: its agreement meets theirs of the next layer (or the forward's last one), and every rank raises
    the same error (the ranks are in different steps of the model); a rank that raises alone inside a
    skipped layer meets the next agreement with its failure, as before. Not across a change of inputs:
    ``same`` False forgets what ``comm``'s forwards remembered and every layer agrees (and learns again).
    """
    if not same:
        _QUIET_KNOWN.pop(id(comm), None)
    before = _QUIET.mode
    _QUIET.mode = "skip" if same else "learn"
    try:
        yield
    finally:
        _QUIET.mode = before


def quiet_known(comm: MPI.Comm, key: Hashable | None) -> tuple[Any] | None:
    """``(result,)`` of a call that makes no MPI call after its agreement, remembered on ``comm`` for ``key``,
    when the converted forward under way may skip it (:func:`quiet_forward`); else None (agree). No MPI call."""
    if _QUIET.mode != "skip" or key is None:
        return None
    known = _QUIET_KNOWN.get(id(comm))
    if known is None or known[0]() is not comm:
        return None
    return known[1].get(key)


def remember_quiet(comm: MPI.Comm, key: Hashable | None, result: Any) -> None:
    """Remember that the call ``key`` on ``comm`` (agreed, with ``result``) makes no MPI call after its agreement.

    Only inside a converted forward (:func:`quiet_forward`), and only from an agreed plan (the same
    decision on every rank).
    """
    if _QUIET.mode is None or key is None:
        return
    known = _QUIET_KNOWN.get(id(comm))
    if known is None or known[0]() is not comm:
        known = _QUIET_KNOWN[id(comm)] = (weakref.ref(comm), {})
    known[1][key] = (result,)


def forget_agreements(comm: MPI.Comm | None = None) -> None:
    """Forget the remembered agreements on ``comm`` (default: all); the next call of each operation plans again.

    :meth:`credit_mpi.DomainParallelManager.free` calls it for its
    communicators: no plan outlives the communicator it was agreed on
    (an id may be reused by a communicator made later).
    """
    for hook in _FORGET_HOOKS:
        hook(comm)
    if comm is None:
        _AGREED.clear()
        _QUIET_KNOWN.clear()
        return
    _QUIET_KNOWN.pop(id(comm), None)
    for full in [full for full, entry in _AGREED.items() if entry.comm is None or entry.comm is comm]:
        del _AGREED[full]


_FORGET_HOOKS: list[Callable[[MPI.Comm | None], None]] = []


def on_forget(hook: Callable[[MPI.Comm | None], None]) -> Callable[[MPI.Comm | None], None]:
    """Register ``hook(comm)`` to drop a module's own plans on ``comm`` (None: all) when :func:`forget_agreements` runs."""
    _FORGET_HOOKS.append(hook)
    return hook


def digest(data: bytes) -> int:
    """The package's one digest: 64 bits of ``data``, the same on every rank (``hash()`` of a str is salted per process).

    What ranks compare instead of sending the data itself: the agreement's
    header, coordinates, latitudes.
    """
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _digest(values: tuple) -> int:
    """:func:`digest` of plain values (their ``repr``)."""
    return digest(repr(values).encode())


def comm_label(comm: MPI.Comm) -> str:
    """The communicator's name for messages (credit_mpi names the ones it creates)."""
    return comm.Get_name() or f"a communicator of {comm.Get_size()} ranks"


def _agreed_error(failures: dict[int, tuple[type | None, str]], where: str) -> Exception:
    types = {cls for cls, _ in failures.values()}
    cls = types.pop() if len(types) == 1 and None not in types else DomainParallelError
    messages = {msg for _, msg in failures.values()}
    ranks = sorted(failures)
    if len(messages) == 1:
        text = f"{messages.pop()} [on rank(s) {_ranks(ranks)} of {where}]"
    else:
        text = f"ranks of {where} disagree: " + "; ".join(
            f"rank {r}: {failures[r][1]}" for r in ranks
        )
    return cls(text)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def agreed_already(exc: BaseException) -> bool:
    """True when ``exc`` came out of an agreement (:mod:`credit_mpi.validation` settled it): every rank raises it.

    Such an exception is not shared again: the ranks that raised it are
    done with the agreement, a second one would wait for ranks that left.
    """
    return settled_comm(exc.__traceback__) is not None
