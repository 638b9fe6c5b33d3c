"""Errors that every rank agrees on.

A mistake that one rank sees (a wrong shape, dtype, device or argument) must
not leave the other ranks waiting in a collective. The pattern used across
credit_mpi: each rank does its local checks, then one small ``allgather``
shares either its metadata or its error; if any rank failed, every rank
raises the same exception, naming the ranks that failed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

__all__ = [
    "DomainParallelError",
    "allgather_or_raise",
    "raise_on_all",
    "comm_label",
    "check_int",
    "check_bands_fit",
    "check_transport",
]


class DomainParallelError(RuntimeError):
    """A problem that involves several ranks (ranks disagree, a freed manager).

    Raised identically on every rank of the communicator involved.
    """


# Exception types that travel between ranks as themselves; anything else
# becomes a DomainParallelError on the ranks that did not raise it.
_PORTABLE = (ValueError, TypeError, DomainParallelError)


def allgather_or_raise(comm: MPI.Comm, compute: Callable[[], Any]) -> list[Any]:
    """Run ``compute()`` on every rank and allgather the results.

    Collective over ``comm``. If ``compute`` raises on any rank, every rank
    raises the same exception (the common type when all failing ranks agree
    on one of ``ValueError``/``TypeError``/``DomainParallelError``, else
    ``DomainParallelError``), with a message naming each failing rank.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    """
    local_error = None
    try:
        item = (True, compute())
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
        local_error = exc
        item = (False, (type(exc) if isinstance(exc, _PORTABLE) else None, str(exc)))
    items = comm.allgather(item)
    failures = {rank: info for rank, (ok, info) in enumerate(items) if not ok}
    if failures:
        raise _agreed_error(failures, comm_label(comm)) from local_error
    return [value for _, value in items]


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int (``bool`` refused), at least ``minimum``; else a ValueError naming both."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bands_fit(what: str, bands: Sequence[tuple], labels: Sequence[str], comm: MPI.Comm, note: str = "") -> None:
    """Every rank's band must fit the others along the sharded axis (all ranks see the same ``bands``).

    ``bands[r]`` is rank r's ``(info, axis, *more)``: an array description
    (:class:`credit_mpi.buffers.ArrayInfo`) and the arguments that must be
    equal on every rank, named by ``labels`` (``labels[0]`` names the axis).
    The bands must have the same kind, dtype and device type (else
    ``TypeError``), the same arguments and every dimension but the axis equal
    (else ``ValueError``). Deterministic, so it raises on every rank alike.
    """
    first, axis = bands[0][0], bands[0][1]

    def rest(shape: tuple) -> tuple:
        return (len(shape), shape[:axis] + shape[axis + 1 :])

    kinds_ok = all(band[0].same_kind(first) for band in bands)
    fit = all(tuple(band[1:]) == tuple(bands[0][1:]) and rest(band[0].shape) == rest(first.shape) for band in bands)
    if kinds_ok and fit:
        return
    detail = "; ".join(
        f"rank {r}: {info.kind} {info.dtype} {info.shape} on {info.device}"
        + "".join(f", {label} {value!r}" for label, value in zip(labels, args, strict=True))
        for r, (info, *args) in enumerate(bands)
    )
    if not kinds_ok:
        raise TypeError(f"{what}: bands differ in array kind, dtype or device type across {comm_label(comm)} ({detail})")
    raise ValueError(
        f"{what}: bands do not fit together along dim {axis} across {comm_label(comm)} (the same "
        f"{', '.join(labels)} and every dimension but dim {axis} equal on every rank{note}): {detail}"
    )


TRANSPORTS = ("mpi", "torch")


def check_transport(transport: Any) -> str:
    """``transport`` if it names a way to move data (``"mpi"`` or ``"torch"``), else a ValueError."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be {' or '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    return transport


def comm_label(comm: MPI.Comm) -> str:
    """The communicator's name for messages (credit_mpi names the ones it creates)."""
    return comm.Get_name() or f"a communicator of {comm.Get_size()} ranks"


def raise_on_all(comm: MPI.Comm, error: Exception | None) -> None:
    """Collective: raise on every rank if ``error`` is not None on any rank."""

    def compute() -> None:
        if error is not None:
            raise error

    allgather_or_raise(comm, compute)


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
