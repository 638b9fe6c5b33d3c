"""Errors that every rank agrees on.

A mistake that one rank sees (a wrong shape, dtype, device or argument) must
not leave the other ranks waiting in a collective. The pattern used across
credit_mpi: each rank does its local checks, then one small ``allgather``
shares either its metadata or its error; if any rank failed, every rank
raises the same exception, naming the ranks that failed.

The rule every collective operation follows is :mod:`credit_mpi.agreement`'s
(:func:`agree`, re-exported here with the rest of that module's names):
**anything that changes which MPI calls a rank will make is agreed before
the first MPI call of the operation**. This module holds what is built on
it for code outside the ops: :func:`allgather_or_raise` (an op of the
engine, :mod:`credit_mpi.ops.collective`), :func:`raise_on_all`, and the
argument checks every op uses inside its agreement (:func:`check_int`,
:func:`check_root`, :func:`check_transport`, :func:`check_bands_fit`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from . import agreement
from .agreement import (  # noqa: F401 - the agreement's names, re-exported (the package imports them from here)
    _AGREED,
    AGREED_ENTRIES,
    GRID_SUFFIX,
    OPERATIONS,
    DomainParallelError,
    Local,
    _Agreed,
    _digest,
    _ranks,
    agree,
    agree_cached,
    comm_label,
    digest,
    forget_agreements,
    on_forget,
    register_operation,
    remembered,
)
from .engine import run
from .ops.collective import COLLECTIVE

__all__ = [  # the agreement's names, re-exported, and this module's own
    *agreement.__all__,
    "allgather_or_raise",
    "raise_on_all",
    "check_int",
    "check_root",
    "check_bands_fit",
    "check_transport",
]


def allgather_or_raise(comm: MPI.Comm, compute: Callable[[], Any]) -> list[Any]:
    """Run ``compute()`` on every rank and allgather the results.

    Collective over ``comm``. If ``compute`` raises on any rank, every rank
    raises the same exception (the common type when all failing ranks agree
    on one of ``ValueError``/``TypeError``/``DomainParallelError``, else
    ``DomainParallelError``), with a message naming each failing rank.

    It starts like every credit_mpi collective, with :func:`agree`'s
    fixed-size ``Allgather`` (operation ``"collective"``), so a rank here and
    a rank that is in another credit_mpi operation raise on both sides
    instead of pairing their messages; then one ``Allgatherv`` of the
    pickled results. Each rank pickles its result inside the agreement (the
    byte count is the agreed count), so a result that cannot be pickled on
    one rank is a ``TypeError`` on every rank, not a rank that fails while
    the others wait.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    """
    return run(COLLECTIVE, compute, comm)


def check_root(root: Any, n: int) -> int:
    """``root`` if it is a rank of a domain of ``n`` (``bool`` refused); else a ValueError naming the valid range."""
    if isinstance(root, bool) or not (isinstance(root, int) and 0 <= root < n):
        raise ValueError(f"root must be a domain rank in 0..{n - 1}, got {root!r}")
    return root


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
    (:class:`credit_mpi.transport.arrays.ArrayInfo`) and the arguments that must be
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


def raise_on_all(comm: MPI.Comm, error: Exception | None) -> None:
    """Collective: raise on every rank if ``error`` is not None on any rank."""

    def compute() -> None:
        if error is not None:
            raise error

    allgather_or_raise(comm, compute)
