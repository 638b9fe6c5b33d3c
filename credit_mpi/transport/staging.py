"""How bytes reach MPI: straight from the array, or staged through host memory.

* Host arrays (numpy, torch CPU): the byte view of
  :mod:`credit_mpi.transport.arrays` goes to MPI as it is.
* Device arrays when MPI is CUDA-aware on the communicator
  (:func:`credit_mpi.gpu.is_cuda_aware`, one verdict all ranks agree on):
  the device pointer goes to MPI. mpi4py asks DLPack for the pointer with
  ``stream=-1`` (no synchronisation), so before MPI reads a device buffer
  this module synchronises the array's current stream (work queued on other
  streams is the caller's to order, as with ``torch.distributed``), and
  after MPI has written one it synchronises the device, so later kernels on
  any stream see the data. Within one exchange (a :class:`Wait` given by
  :class:`~credit_mpi.transport.moves.MpiMoves` to every buffer of one
  ``post``/``exchange``/collective) the host waits once, on an event of the
  producing stream recorded before the first device buffer, and not for the
  device afterwards: MPI's requests are complete when ``Waitall`` returns
  (a CUDA-aware MPI's own copies are done), and the next kernels are queued
  after that on the host.
* Device arrays when MPI is not CUDA-aware: staged through pinned host
  memory (one staging buffer per direction, grown as needed and reused
  across calls; a :class:`RuntimeWarning` the first time). Both copies run
  on the array's current stream and are waited for, so they are ordered
  after the work that produced the data and complete before MPI or the
  caller touches it (or the staging buffer is reused).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import gpu
from ..validation import comm_label
from . import arrays
from .arrays import _ops, _torch

__all__ = ["send_buffer", "recv_buffer", "release_staging_buffers"]

logger = logging.getLogger(__name__)

# How many transfers took each path ("host", "direct", "staged"), per direction.
_ROUTES: collections.Counter = collections.Counter()
_WARNED_STAGING = False


# --------------------------------------------------------------------------- staging


class _Staging:
    """One reusable host buffer for one direction ("send" or "recv").

    Pinned (page-locked) when a GPU is present, so device copies run at full
    bandwidth; grown when a larger message comes, never shrunk (see
    :func:`release_staging_buffers`). If the buffer is already in use (two
    transfers of the same direction at once) a temporary one is used.
    """

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.library: str | None = None
        self.owner: Any = None
        self.view: np.ndarray | None = None
        self.busy = False
        self.allocations = 0

    def capacity(self) -> int:
        return 0 if self.view is None else self.view.size

    @contextlib.contextmanager
    def take(self, ops, nbytes: int) -> Iterator[tuple[Any, np.ndarray]]:
        if self.busy:
            owner, view = _allocate(ops, nbytes)
            yield owner, view[:nbytes]
            return
        if self.library != ops.name or self.capacity() < nbytes:
            self.owner = self.view = None  # let the old one go before the new one is made
            self.owner, self.view = _allocate(ops, max(nbytes, 2 * self.capacity() if self.library == ops.name else 0))
            self.library = ops.name
            self.allocations += 1
        self.busy = True
        try:
            yield self.owner, self.view[:nbytes]
        finally:
            self.busy = False


def _allocate(ops, nbytes: int) -> tuple[Any, np.ndarray]:
    pinned = ops.name == "cupy" or (ops.name == "torch" and _torch().cuda.is_available())
    nbytes = max(int(nbytes), 1)
    logger.debug("allocating a %s-byte %s staging buffer for %s", nbytes, "pinned" if pinned else "host", ops.name)
    return ops.host_buffer(nbytes, pinned)


_STAGING = {"send": _Staging("send"), "recv": _Staging("recv")}


class Wait:
    """One exchange's wait for the producing stream (the CUDA-aware route): the first device buffer of the
    exchange records an event on its current stream and the host waits for it; the others wait no more."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def before(self, ops: Any, x: Any) -> None:
        if not self.done:
            self.done = True
            getattr(ops, "wait_event", ops.sync_stream)(x)


def release_staging_buffers() -> None:
    """Free the host staging buffers (they are re-made on the next staged transfer)."""
    for direction in _STAGING:
        _STAGING[direction] = _Staging(direction)


# --------------------------------------------------------------------------- buffers for MPI


def _route(ops, x: Any, comm: MPI.Comm | None) -> str:
    """"host", "direct" (device pointer to CUDA-aware MPI) or "staged"."""
    if not (ops.on_device(x) or arrays._SIMULATE_DEVICE):
        return "host"
    comm = MPI.COMM_WORLD if comm is None else comm
    if gpu.is_cuda_aware(comm):
        return "direct"
    _warn_staging(comm)
    return "staged"


def _warn_staging(comm: MPI.Comm) -> None:
    global _WARNED_STAGING
    if _WARNED_STAGING:
        return
    _WARNED_STAGING = True
    reason = gpu.cuda_awareness_report(comm)["reason"]
    warnings.warn(
        f"credit_mpi: device buffers are staged through host memory on {comm_label(comm)} ({reason}); "
        f"set {gpu.ENV_OVERRIDE}=1 if this MPI is CUDA-aware",
        RuntimeWarning,
        stacklevel=6,  # the caller of shard/gather (through the context manager)
    )


@contextlib.contextmanager
def send_buffer(x: Any, comm: MPI.Comm | None = None, adapter: Any = None, wait: Wait | None = None) -> Iterator[Any]:
    """A buffer mpi4py can send (``MPI.BYTE``) holding the bytes of contiguous ``x``.

    For a device array the transfer path is the one ``comm``'s ranks agreed
    on (:func:`credit_mpi.gpu.is_cuda_aware`; ``comm=None`` means
    ``MPI.COMM_WORLD``): collective over ``comm`` the first time a device
    array is sent or received on it, so call it on every rank. ``adapter``:
    ``x``'s (:func:`credit_mpi.transport.arrays.adapter`), when the caller has it. ``wait``: the
    exchange's one wait (:class:`Wait`; None: this buffer's stream synchronised on its own).
    """
    ops = adapter or _ops(x)
    route = _route(ops, x, comm)
    _ROUTES[route, "send"] += 1
    data = ops.as_bytes(x)
    if route == "host":
        yield data
    elif route == "direct":
        with ops.device_context(x):
            if wait is None:
                ops.sync_stream(x)  # the kernels that produced x are done before MPI reads it
            else:
                wait.before(ops, x)  # once per exchange: an event of the producing stream
            yield data
    else:
        with _STAGING["send"].take(ops, data.shape[0]) as (owner, view):
            ops.to_host(data, owner, view)
            yield view


@contextlib.contextmanager
def recv_buffer(out: Any, comm: MPI.Comm | None = None, *, inout: bool = False, adapter: Any = None,
                wait: Wait | None = None) -> Iterator[Any]:
    """A buffer mpi4py can receive into (``MPI.BYTE``); its bytes end up in ``out``.

    ``out`` holds the data when the ``with`` block ends normally (a staged
    transfer is copied back then; a direct one is synchronised then). Same
    collective rule as :func:`send_buffer`. With ``inout=True`` the buffer
    also starts with ``out``'s bytes (a staged buffer is filled from the
    device first), for calls that send from and receive into one array, as
    the halo exchange does.
    """
    ops = adapter or _ops(out)
    route = _route(ops, out, comm)
    _ROUTES[route, "recv"] += 1
    data = ops.as_bytes(out)
    if route == "host":
        yield data
    elif route == "direct":
        with ops.device_context(out):
            if wait is None:
                ops.sync_stream(out)  # nothing queued still touches out's memory when MPI writes it
                yield data
                ops.sync_device(out)  # MPI's writes are visible to later kernels on any stream
            else:
                wait.before(ops, out)  # the exchange's one wait; its requests complete before the caller reads
                yield data
    else:
        with _STAGING["recv"].take(ops, data.shape[0]) as (owner, view):
            if inout:
                ops.to_host(data, owner, view)
            yield view
            ops.from_host(owner, view, data)


