"""The data path of a converted model: which transport its layers and rules move their data on.

A converted model (:func:`credit_mpi.nn.convert_to_domain_parallel`, ``transport=``) moves every
layer's and every rule's data (halos, overlap-add, statistics, domain sums, re-bands, attention's
gathers and all-to-alls) on one *data path*; its agreements stay MPI collectives of host metadata.
A data path is one interface with two implementations:

* :class:`MpiPath` (``transport="mpi"``, the default): :class:`~credit_mpi.transport.moves.MpiMoves`
  over each layer's MPI communicator (host memory in place; device memory staged, or straight to a
  CUDA-aware MPI);
* :class:`TorchPath` (``transport="torch"``, or a transport object such as
  ``TorchMoves(manager.torch_group("domain"))``): the transport protocol over the torch.distributed
  group that mirrors the domain group (NCCL on GPUs, stream-ordered, no host synchronisation; gloo on
  CPU). Its peers are domain ranks, so it serves the domain communicator and the 2-D grid's
  Cartesian one (the same ranks in the same order).

Both answer two questions: :meth:`~DataPath.moves` (the moves object of a communicator: what a
kernel calls ``post``/``allgatherv``/``alltoallv``/``allreduce`` on) and
:meth:`~DataPath.transport` (what an op that takes ``transport=`` is given: ``"mpi"`` or the moves
object). The converted forward sets its path with :func:`using` for the whole forward (the plans its
ops make keep the moves object, so their backward moves on the same path); :func:`current` is what
a layer or a rule asks. Outside a converted forward the path is MPI.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from mpi4py import MPI

from .moves import MpiMoves, transport_name

__all__ = ["DataPath", "MpiPath", "TorchPath", "MPI_PATH", "path_of", "current", "using"]


class DataPath:
    """The interface: how a converted model's data moves over a communicator of its domain."""

    #: what the ranks agree on (the transport's name)
    name: str = ""

    def moves(self, comm: MPI.Comm) -> Any:
        """The moves object (:mod:`credit_mpi.transport.moves`' protocol) whose peers are ``comm``'s ranks."""
        raise NotImplementedError

    def transport(self, comm: MPI.Comm) -> Any:
        """What an op that takes ``transport=`` gets for ``comm``: ``"mpi"`` or a moves object."""
        raise NotImplementedError

    def rebind(self, plan: Any, comm: MPI.Comm) -> Any:
        """A halo plan (``moves`` and ``torch_group`` fields) made for MPI, moved onto this path."""
        raise NotImplementedError


class MpiPath(DataPath):
    """Every move over MPI (:class:`~credit_mpi.transport.moves.MpiMoves`): the default path."""

    name = "mpi"

    def moves(self, comm: MPI.Comm) -> MpiMoves:
        return MpiMoves(comm)

    def transport(self, comm: MPI.Comm) -> str:
        return "mpi"

    def rebind(self, plan: Any, comm: MPI.Comm) -> Any:
        return plan

    def __repr__(self) -> str:
        return "MpiPath()"


class TorchPath(DataPath):
    """Every move over one torch.distributed transport whose peers are the domain ranks.

    ``moves`` is a transport object (:class:`~credit_mpi.transport.torch_moves.TorchMoves` over the
    mirrored domain group, or any object of the protocol over the same ranks in the same order).
    """

    def __init__(self, moves: Any) -> None:
        self.name = transport_name(moves, "transport")
        self._moves = moves
        self.group = getattr(moves, "group", None)
        self._size = _size_of(moves)

    def moves(self, comm: MPI.Comm) -> Any:
        if self._size is not None and comm.Get_size() != self._size:
            raise ValueError(f"transport {self.name}: its group has {self._size} ranks, the communicator "
                             f"{comm.Get_name()} {comm.Get_size()}; a converted model's transport spans its domain group")
        return self._moves

    def transport(self, comm: MPI.Comm) -> Any:
        return self.moves(comm)

    def rebind(self, plan: Any, comm: MPI.Comm) -> Any:
        import dataclasses

        group = self.group if self.group is not None else self._moves  # not None: the kernels' device path
        return dataclasses.replace(plan, torch_group=group, moves=self.moves(comm))

    def __repr__(self) -> str:
        return f"TorchPath({self.name})"


def _size_of(moves: Any) -> int | None:
    group = getattr(moves, "group", None)
    if group is None:
        return None
    import torch.distributed as dist

    return dist.get_world_size(group)


MPI_PATH = MpiPath()


def path_of(transport: Any, manager: Any) -> DataPath:
    """The data path of ``transport``: ``"mpi"``, ``"torch"`` (the manager's mirrored domain group:
    :func:`credit_mpi.init_torch_distributed` first), or a transport object over the domain ranks.

    Raises:
        ValueError: anything else.
        DomainParallelError: ``"torch"`` with no torch groups on ``manager``.
    """
    if isinstance(transport, DataPath):
        return transport
    if isinstance(transport, str) and transport == "mpi":
        return MPI_PATH
    if isinstance(transport, str) and transport == "torch":
        from .torch_moves import TorchMoves

        if manager is None or manager.domain_parallel_size <= 1:
            return MPI_PATH  # one band: nothing moves
        return TorchPath(TorchMoves(manager.torch_group("domain")))
    transport_name(transport, "convert_to_domain_parallel")  # ValueError for what is no transport
    return TorchPath(transport)


_STATE = threading.local()


def current() -> DataPath:
    """The data path of the converted forward running on this thread (MPI outside one)."""
    return getattr(_STATE, "path", MPI_PATH)


@contextlib.contextmanager
def using(path: DataPath) -> Iterator[DataPath]:
    """Within: :func:`current` is ``path`` (on this thread; nested forwards restore the outer one)."""
    before = getattr(_STATE, "path", MPI_PATH)
    _STATE.path = path
    try:
        yield path
    finally:
        _STATE.path = before
