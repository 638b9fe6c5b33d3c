"""Domain Parallel Manager - communicator creation and coordination.

Creates a 2D logical mesh of (data_parallel, domain_parallel) communicators
from a flat MPI communicator. Domain-parallel ranks share the same data sample
but hold different spatial shards. Data-parallel ranks hold the same spatial
shard but process different data samples.

Example with 8 ranks and domain_parallel_size=2:
    domain groups:  [0,1], [2,3], [4,5], [6,7]
    data-parallel groups: [0,2,4,6], [1,3,5,7]

This is CREDIT's ``credit.domain_parallel.manager`` API on MPI: the groups are
mpi4py communicators made by ``Comm.Split``. The manager is the only part of
credit_mpi that creates communicators, and it can free every one it creates.
It never calls ``MPI.Init``/``MPI.Finalize``; any parent communicator works,
so the library can live inside an existing MPI code.
"""

from __future__ import annotations

import logging
import numbers
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from mpi4py import MPI

from . import watchdog
from .agreement import agree_values
from .grid import check_grid, grid_coords, grid_neighbors
from .partition import halo_neighbors
from .validation import DomainParallelError, check_int, forget_agreements

__all__ = [
    "DomainParallelManager",
    "initialize_domain_parallel",
    "get_domain_parallel_manager",
    "destroy_domain_parallel",
    "Domain",
    "domain_of",
    "live_domain_comm",
]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

_MANAGER: DomainParallelManager | None = None
_LEAKED = 0  # managers garbage-collected without free()
_LIVE = 0  # managers made and not freed (nor garbage-collected)


class TorchGroups(NamedTuple):
    """The torch.distributed state a manager carries once the torch bridge is initialised."""

    domain: Any  # mirrors domain_group
    data_parallel: Any  # mirrors data_parallel_group
    mesh: Any  # DeviceMesh ("dp", "domain")
    teardown: Callable[[Any], None]  # destroys them; free() calls it


class ResourceLeakWarning(UserWarning):
    """A manager was garbage-collected without ``free()`` (shown by default, unlike ResourceWarning)."""


class DomainParallelManager:
    """Manages the communicators for domain parallelism.

    Collective over ``comm``: every rank of it constructs the manager with the
    same arguments (checked; a disagreement raises on every rank).

    Args:
        world_size: Total number of ranks; must equal ``comm``'s size.
            ``None`` means ``comm``'s size.
        domain_parallel_size: Number of ranks per domain-parallel group; must
            divide ``world_size``.
        shard_dim: Which spatial dimension to shard. -2 means latitude (H)
            in a (B, C, H, W) tensor.
        comm: Parent communicator (default ``MPI.COMM_WORLD``). All ranks
            reported by the manager (``neighbor_ranks``) are ranks of it.
        domain_grid: ``(rows, cols)`` with ``rows * cols ==
            domain_parallel_size`` lays the domain group out as a row-major
            grid over latitude x longitude (see :mod:`credit_mpi.grid`): an
            MPI Cartesian communicator (``domain_cart``, periodic in
            longitude), ``domain_coords``, :meth:`grid_neighbor_ranks`.
            ``None`` (default): latitude bands, exactly as without it (an
            ``(n, 1)`` grid, no extra communicator).
        timeout: Seconds a collective on this manager's communicators may
            wait for the other ranks before the watchdog reports where every
            rank is and aborts the job (:mod:`credit_mpi.watchdog`); ``None``:
            ``CREDIT_MPI_TIMEOUT``, else 30 minutes; ``0``: no deadline.

    Raises:
        ValueError: ``world_size`` differs from ``comm``'s size,
            ``domain_parallel_size`` is not a positive divisor of it, or
            ``domain_grid`` does not hold ``domain_parallel_size`` ranks.
    """

    def __init__(
        self,
        world_size: int | None,
        domain_parallel_size: int,
        shard_dim: int = -2,
        *,
        comm: MPI.Comm | None = None,
        domain_grid: tuple[int, int] | None = None,
        timeout: float | None = None,
    ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        size, rank = comm.Get_size(), comm.Get_rank()

        def check() -> tuple:
            args = (
                check_int("world_size", size if world_size is None else world_size, minimum=1),
                check_int("domain_parallel_size", domain_parallel_size, minimum=1),
                check_int("shard_dim", shard_dim),
            )
            n, d, _ = args
            if n != size:
                raise ValueError(
                    f"world_size={n} does not match the communicator size {size}; "
                    f"pass world_size={size} or None"
                )
            if n % d:
                divisors = [k for k in range(1, n + 1) if n % k == 0]
                raise ValueError(
                    f"domain_parallel_size={d} does not divide world_size={n}; "
                    f"valid sizes: {divisors}" + (_launch_hint(d) if n == 1 else "")
                )
            seconds = watchdog.default_timeout() if timeout is None else watchdog.check_timeout(timeout)
            return (*args, check_grid(domain_grid, d), seconds)

        def explain(everyone: list[tuple]) -> None:
            detail = "; ".join(
                f"rank {r}: world_size={a[0]}, domain_parallel_size={a[1]}, shard_dim={a[2]}, domain_grid={a[3]}, "
                f"timeout={a[4]}"
                for r, a in enumerate(everyone)
            )
            raise ValueError(f"ranks passed different arguments to DomainParallelManager: {detail}")

        agreed, _ = agree_values(comm, "DomainParallelManager", check, explain)
        self.world_size, self.domain_parallel_size, self.shard_dim, self._grid, self.timeout = agreed
        self.data_parallel_size = self.world_size // self.domain_parallel_size
        self._comm = comm
        self._rank = rank
        self._domain_group_idx = rank // self.domain_parallel_size
        self._domain_rank = rank % self.domain_parallel_size
        self._dp_rank = self._domain_group_idx
        self._domain_group: MPI.Intracomm | None = None
        self._dp_group: MPI.Intracomm | None = None
        self._cart: MPI.Cartcomm | None = None
        # torch.distributed groups mirroring the two communicators: attached
        # by credit_mpi.init_torch_distributed, torn down by free().
        self._torch: TorchGroups | None = None

        self._make_communicators(comm, rank)
        logger.debug(
            "rank %d: domain group %d (domain rank %d of %d), data-parallel rank %d of %d",
            rank,
            self._domain_group_idx,
            self._domain_rank,
            self.domain_parallel_size,
            self._dp_rank,
            self.data_parallel_size,
        )

    def _make_communicators(self, comm: MPI.Intracomm, rank: int) -> None:
        """The domain and data-parallel groups (and the Cartesian grid), under the watchdog's deadline.

        Collective over ``comm``. An MPI library out of communicators (MPICH:
        "Too many communicators", after about a thousand managers that were
        never freed) raises a DomainParallelError naming the live and leaked
        managers and ``free()``, on every rank (the library's context ids
        are agreed, so every rank fails alike).
        """
        global _LIVE
        try:
            watchdog.watch_parent(comm)
            # Consecutive ranks form a domain group; ranks holding the same band
            # (same domain rank) form a data-parallel group.
            self._domain_group = comm.Split(color=self._domain_group_idx, key=rank)
            self._dp_group = comm.Split(color=self._domain_rank, key=rank)
            if self._grid is not None:
                # reorder=False: Cartesian rank == domain rank, row-major (row = latitude band)
                self._cart = self._domain_group.Create_cart(list(self._grid), periods=[False, True], reorder=False)
        except MPI.Exception as exc:
            for made in (self._domain_group, self._dp_group):
                if made is not None:
                    made.Free()
            self._domain_group = self._dp_group = None
            raise DomainParallelError(
                f"MPI could not create this DomainParallelManager's communicators ({_last_line(exc)}): "
                f"{_LIVE} manager(s) of this process are live (never freed) and {_LEAKED} were garbage-collected "
                f"without free(), each holding {2 if self._grid is None else 3} communicators. Call manager.free() "
                f"when a manager is done, or use `with DomainParallelManager(...) as manager:` (or "
                f"credit_mpi.destroy_domain_parallel() for the singleton)"
            ) from exc
        _LIVE += 1
        self._domain_group.Set_name(f"credit_mpi.domain[{self._domain_group_idx}]")
        self._dp_group.Set_name(f"credit_mpi.data_parallel[{self._domain_rank}]")
        if self._cart is not None:
            self._cart.Set_name(f"credit_mpi.domain_cart[{self._domain_group_idx}]")
        for made in (self._domain_group, self._dp_group, self._cart):
            if made is not None:
                watchdog.set_timeout(made, self.timeout)

    # -- the reference's properties ---------------------------------------

    @property
    def domain_group(self) -> MPI.Intracomm:
        """Communicator for domain-parallel communication (halo exchange, reductions)."""
        return self._live(self._domain_group)

    @property
    def data_parallel_group(self) -> MPI.Intracomm:
        """Communicator for data-parallel communication (gradient sync)."""
        return self._live(self._dp_group)

    @property
    def domain_rank(self) -> int:
        """Rank within the domain-parallel group (0 to domain_parallel_size-1)."""
        return self._domain_rank

    @property
    def domain_world_size(self) -> int:
        """Number of ranks in the domain-parallel group."""
        return self.domain_parallel_size

    @property
    def dp_rank(self) -> int:
        """Rank within the data-parallel group."""
        return self._dp_rank

    @property
    def dp_world_size(self) -> int:
        """Number of ranks in the data-parallel group."""
        return self.data_parallel_size

    @property
    def is_first_domain_rank(self) -> bool:
        """True if this is the first rank in its domain group (north edge)."""
        return self._domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        """True if this is the last rank in its domain group (south edge)."""
        return self._domain_rank == self.domain_parallel_size - 1

    def neighbor_ranks(self) -> tuple[int | None, int | None]:
        """Returns (prev_rank, next_rank) ranks of the parent communicator for halo exchange.

        Returns None for non-existent neighbors at edges.
        """
        prev, nxt = self.domain_neighbor_ranks()
        base = self._domain_group_idx * self.domain_parallel_size
        return (
            None if prev is None else base + prev,
            None if nxt is None else base + nxt,
        )

    # -- additions (not in the reference) ----------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The parent communicator the manager was built from."""
        return self._comm

    @property
    def rank(self) -> int:
        """Rank in the parent communicator."""
        return self._rank

    @property
    def domain_group_index(self) -> int:
        """Which domain group (0 to data_parallel_size-1) this rank belongs to."""
        return self._domain_group_idx

    def domain_neighbor_ranks(self, periodic: bool = False) -> tuple[int | None, int | None]:
        """(prev, next) ranks *inside* ``domain_group``; None at the edges.

        With ``periodic`` the first and the last rank are neighbours (the
        halo exchange's ``boundary="periodic"``).
        """
        return halo_neighbors(self._domain_rank, self.domain_parallel_size, periodic)

    # -- torch.distributed groups (credit_mpi.init_torch_distributed) ---------

    @property
    def torch_domain_group(self) -> Any:
        """The torch group mirroring ``domain_group`` (None until the torch bridge is initialised)."""
        return None if self._torch is None else self._torch.domain

    @property
    def torch_data_parallel_group(self) -> Any:
        """The torch group mirroring ``data_parallel_group`` (None until the torch bridge is initialised)."""
        return None if self._torch is None else self._torch.data_parallel

    @property
    def device_mesh(self) -> Any:
        """A 2-D torch ``DeviceMesh`` named ``("dp", "domain")`` over the torch groups (or None)."""
        return None if self._torch is None else self._torch.mesh

    def torch_group(self, name: str) -> Any:
        """The torch group named ``"domain"`` or ``"dp"`` (the device mesh's names).

        Raises:
            DomainParallelError: the torch bridge is not initialised for this manager.
            ValueError: another name.
        """
        if name not in ("domain", "dp"):
            raise ValueError(f"torch group name must be 'domain' or 'dp', got {name!r}")
        if self._torch is None:
            raise DomainParallelError(
                "transport='torch' needs torch.distributed groups that mirror the manager; "
                "call credit_mpi.init_torch_distributed(manager) first (or use transport='mpi')"
            )
        return self._torch.domain if name == "domain" else self._torch.data_parallel

    def attach_torch_groups(self, groups: TorchGroups) -> None:
        """Record the torch groups that mirror this manager (called by the torch bridge)."""
        if self._torch is not None:
            raise DomainParallelError("this manager already has torch groups; destroy_torch_distributed(manager) first")
        self._torch = groups

    def detach_torch_groups(self) -> TorchGroups | None:
        """Forget the torch groups and return them (the torch bridge destroys them)."""
        groups, self._torch = self._torch, None
        return groups

    def domain_groups(self) -> list[list[int]]:
        """Parent-communicator ranks of every domain group, e.g. [[0, 1], [2, 3]]."""
        d = self.domain_parallel_size
        return [list(range(g * d, (g + 1) * d)) for g in range(self.data_parallel_size)]

    def data_parallel_groups(self) -> list[list[int]]:
        """Parent-communicator ranks of every data-parallel group, e.g. [[0, 2], [1, 3]]."""
        d = self.domain_parallel_size
        return [list(range(r, self.world_size, d)) for r in range(d)]

    # -- the 2-D grid (domain_grid=) ----------------------------------------

    @property
    def domain_grid(self) -> tuple[int, int]:
        """``(rows, cols)`` of the domain grid; ``(domain_parallel_size, 1)`` without ``domain_grid=``."""
        return (self.domain_parallel_size, 1) if self._grid is None else self._grid

    @property
    def domain_coords(self) -> tuple[int, int]:
        """This rank's ``(row, col)`` in the domain grid (row: latitude band, col: longitude band)."""
        return grid_coords(self._domain_rank, self.domain_grid)

    @property
    def domain_cart(self) -> MPI.Cartcomm | None:
        """The domain group as an MPI Cartesian communicator (periodic in longitude).

        Its ranks are the domain ranks (``reorder=False``). ``None`` without
        ``domain_grid=`` (no communicator is created then).
        """
        if self._grid is None:
            return None
        return self._live(self._cart)

    def grid_neighbor_ranks(self) -> dict[str, int | None]:
        """Domain ranks of the 8 grid neighbours: ``{"north", "south", "west", "east", "northwest", ...}``.

        Longitude wraps around (a one-column grid is its own east/west);
        latitude does not (``None`` past the first / last grid row).
        """
        return grid_neighbors(self._domain_rank, self.domain_grid)

    @property
    def freed(self) -> bool:
        """True once :meth:`free` has run."""
        return self._domain_group is None

    def free(self) -> None:
        """Free the domain and data-parallel communicators (collective).

        Every rank of the parent communicator calls it. Calling it again is a
        no-op. The manager cannot be used afterwards. torch groups made by
        :func:`credit_mpi.init_torch_distributed` are destroyed first.
        """
        if self._domain_group is None:
            return
        if self._torch is not None:
            self._torch.teardown(self)  # detaches them
        row = self.__dict__.pop("_dp_longitude_row", None)  # a grid row's communicator (credit_mpi.nn.judge.longitude)
        for comm in (row, self._cart, self._domain_group, self._dp_group):
            if comm is not None:
                watchdog.forget_timeout(comm)
                forget_agreements(comm)  # no remembered plan outlives its communicator
            if comm is not None and comm != MPI.COMM_NULL and not MPI.Is_finalized():
                comm.Free()
        self._domain_group = self._dp_group = self._cart = None
        global _LIVE
        _LIVE -= 1
        global _MANAGER
        if _MANAGER is self:
            _MANAGER = None

    def __del__(self, _finalizing=sys.is_finalizing, _mpi_finalized=MPI.Is_finalized) -> None:
        # Freeing a communicator is collective, and garbage collection runs at
        # a different moment on every rank, so a forgotten manager cannot be
        # freed here; say so, before the MPI library runs out of communicators.
        # (The checks bound at definition: at interpreter exit this module's globals may be gone already.)
        if getattr(self, "_domain_group", None) is None or _finalizing() or _mpi_finalized():
            return
        global _LEAKED, _LIVE
        _LEAKED += 1
        _LIVE -= 1
        row = self.__dict__.pop("_dp_longitude_row", None)  # a grid row's communicator (credit_mpi.nn.judge.longitude)
        for comm in (row, self._cart, self._domain_group, self._dp_group):
            if comm is not None:
                watchdog.forget_timeout(comm)  # its Python object dies here: another may take its id
                forget_agreements(comm)
        warnings.warn(
            f"a DomainParallelManager was garbage-collected without free(): its {2 if self._cart is None else 3} "
            f"communicators stay allocated "
            f"({_LEAKED} manager(s) leaked in this process; MPI libraries allow a few thousand communicators). "
            f"Call manager.free(), use `with DomainParallelManager(...) as manager:`, or "
            f"credit_mpi.destroy_domain_parallel() for the singleton",
            ResourceLeakWarning,
            stacklevel=2,
        )

    def __enter__(self) -> DomainParallelManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"domain rank {self._domain_rank}, dp rank {self._dp_rank}"
        return (
            f"DomainParallelManager(world_size={self.world_size}, "
            f"domain_parallel_size={self.domain_parallel_size}, shard_dim={self.shard_dim}"
            + ("" if self._grid is None else f", domain_grid={self._grid}")
            + f"; {state})"
        )

    def _live(self, comm: MPI.Intracomm | None) -> MPI.Intracomm:
        if comm is None:
            raise DomainParallelError(
                "this DomainParallelManager has been freed; create a new one "
                "(initialize_domain_parallel) before communicating"
            )
        return comm


def initialize_domain_parallel(
    world_size: int | None,
    domain_parallel_size: int,
    shard_dim: int = -2,
    *,
    comm: MPI.Comm | None = None,
    domain_grid: tuple[int, int] | None = None,
    timeout: float | None = None,
) -> DomainParallelManager:
    """Initialize the global DomainParallelManager singleton.

    Collective over ``comm``. A manager created earlier by this function is
    freed and replaced.

    Args:
        world_size: Total number of ranks (``None``: the size of ``comm``).
        domain_parallel_size: Number of ranks per domain group.
        shard_dim: Spatial dimension to shard (-2 for lat in BCHW).
        comm: Parent communicator (default ``MPI.COMM_WORLD``).
        domain_grid: ``(rows, cols)`` grid of the domain group over latitude
            x longitude (see :class:`DomainParallelManager`); None: latitude bands.
        timeout: The watchdog's deadline in seconds (see :class:`DomainParallelManager`).

    Returns:
        DomainParallelManager instance.
    """
    global _MANAGER
    manager = DomainParallelManager(world_size, domain_parallel_size, shard_dim, comm=comm, domain_grid=domain_grid,
                                    timeout=timeout)
    if _MANAGER is not None:
        _MANAGER.free()
    _MANAGER = manager
    return manager


def get_domain_parallel_manager() -> DomainParallelManager | None:
    """Get the global DomainParallelManager singleton.

    Returns:
        DomainParallelManager or None if not initialized.
    """
    return _MANAGER


class Domain(NamedTuple):
    """This rank's place in its domain group: what every operation asks first.

    ``size`` and ``rank`` come from any manager-like object with
    ``domain_parallel_size`` and ``domain_rank`` (the reference's unit tests
    use plain objects and mocks); no manager means a domain of one.
    """

    size: int
    rank: int
    manager: Any = None

    @property
    def comm(self) -> MPI.Intracomm:
        """The domain group's communicator (``MPI.COMM_SELF`` for a domain of one).

        Raises:
            TypeError: the manager has no mpi4py ``domain_group`` (a stand-in
                that only supports the local functions).
        """
        if self.size <= 1:
            return MPI.COMM_SELF
        group = getattr(self.manager, "domain_group", None)
        if not isinstance(group, MPI.Intracomm):
            raise TypeError(
                f"this operation communicates over the manager's domain_group, but the manager "
                f"{type(self.manager).__name__} has domain_group={group!r} (need an mpi4py intracommunicator: "
                f"use credit_mpi.DomainParallelManager); only shard_tensor and shard_batch (local) work "
                f"with a manager stand-in"
            )
        return group

    def neighbors(self, periodic: bool = False) -> tuple[int | None, int | None]:
        """(prev, next) domain ranks of this rank's halo exchange (see :func:`credit_mpi.partition.halo_neighbors`)."""
        return halo_neighbors(self.rank, self.size, periodic)


def _launch_hint(d: int) -> str:
    """Why a job has one rank (started without a launcher, most likely), and the command that starts more."""
    import os

    here = os.path.join(sys.prefix, "bin", "mpiexec")
    mpiexec = here if os.path.exists(here) else "mpiexec"
    return (f". This process is a single MPI rank: started without a launcher? Start it with "
            f"`{mpiexec} -n {d} python ...` (or `srun -n {d}` in a Slurm job)")


def domain_of(manager: Any = None) -> Domain:
    """``Domain(size, rank, manager)`` of ``manager`` (the singleton when None; size 1 when there is none).

    Works with any object that has ``domain_parallel_size`` and
    ``domain_rank``. A freed :class:`DomainParallelManager` raises
    :class:`~credit_mpi.DomainParallelError`.
    """
    manager = _MANAGER if manager is None else manager
    if manager is None:
        return Domain(1, 0, None)
    if isinstance(manager, DomainParallelManager):
        manager._live(manager._domain_group)  # raises once freed
        return Domain(manager.domain_parallel_size, manager._domain_rank, manager)
    size = getattr(manager, "domain_parallel_size", None)
    if type(size) is int and size == 1:  # one band: rank 0, whatever domain_rank is (CREDIT's stand-ins set none)
        return Domain(1, 0, manager)
    for name in ("domain_parallel_size", "domain_rank"):
        if not hasattr(manager, name):
            raise TypeError(
                f"manager must be a DomainParallelManager or an object with domain_parallel_size and "
                f"domain_rank; {type(manager).__name__} has no {name}"
            )
    for name in ("domain_parallel_size", "domain_rank"):  # ints, not whatever has __index__ (a bare MagicMock)
        value = getattr(manager, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"manager.{name} must be an int, got {type(value).__name__} {value!r}")
    size = check_int("manager.domain_parallel_size", manager.domain_parallel_size, minimum=1)
    rank = check_int("manager.domain_rank", manager.domain_rank, minimum=0)
    if rank >= size:
        raise ValueError(f"manager.domain_rank={rank} is out of range for domain_parallel_size={size}")
    return Domain(size, rank, manager)


def live_domain_comm(manager: Any = None) -> MPI.Intracomm | None:
    """The domain communicator of a live :class:`DomainParallelManager` (the singleton when None), else None.

    No checks and no errors: the per-call fast paths ask here first and
    take the full path (which raises what is wrong) on None.
    """
    manager = _MANAGER if manager is None else manager
    return manager._domain_group if type(manager) is DomainParallelManager else None


def destroy_domain_parallel() -> None:
    """Free the global manager's communicators and reset the singleton (collective)."""
    global _MANAGER
    if _MANAGER is not None:
        _MANAGER.free()
    _MANAGER = None


def _last_line(exc: MPI.Exception) -> str:
    """The gist of an MPI error (MPICH's error string is a stack whose last line says what ran out)."""
    lines = [line.strip(" :") for line in exc.Get_error_string().splitlines() if line.strip(" :")]
    return lines[-1] if lines else str(exc)
