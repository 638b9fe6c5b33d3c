"""torch.distributed process groups that mirror the MPI communicators.

A job launched with ``mpiexec``/``srun`` gets a torch.distributed default
group and torch groups with exactly the layout of a
:class:`~credit_mpi.DomainParallelManager`'s MPI communicators, so that the
model wrapper (DDP/FSDP), NCCL collectives and credit_mpi's MPI collectives
agree on who is who:

* torch rank ``r`` is rank ``r`` of the manager's parent communicator;
* ``manager.torch_domain_group`` holds the same ranks as
  ``manager.domain_group``, ``manager.torch_data_parallel_group`` the same
  ranks as ``manager.data_parallel_group``;
* ``manager.device_mesh`` is a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`
  named ``("dp", "domain")`` over those two groups (row ``i`` of the mesh
  is domain group ``i``).

The rendezvous needs nothing from the launcher: rank 0 starts a
:class:`torch.distributed.TCPStore` on a port the operating system picks and
tells the other ranks its address over MPI. ``MASTER_ADDR``/``MASTER_PORT``
(as rank 0 sees them) are used instead when set, e.g. left over from a
torchrun script. Connecting to the store is bounded by ``connect_timeout``
(default :data:`CONNECT_TIMEOUT` seconds, not torch's 30 minutes): a stale
address fails in seconds with the same error on every rank, naming
``MASTER_ADDR``/``MASTER_PORT`` and how to unset them.

This module is the only part of credit_mpi that imports torch at module
level; ``import credit_mpi`` does not import it (``credit_mpi.init_torch_distributed``
is resolved lazily).
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from .manager import DomainParallelManager, TorchGroups, get_domain_parallel_manager
from .validation import DomainParallelError, allgather_or_raise, comm_label

__all__ = ["init_torch_distributed", "destroy_torch_distributed", "is_bridged"]

logger = logging.getLogger(__name__)
logger.addHandler(logging.NullHandler())

# Managers bridged by this module, and whether this module created torch's
# default group (then it destroys it when the last bridge goes).
_BRIDGED: weakref.WeakSet[DomainParallelManager] = weakref.WeakSet()
_OWNS_DEFAULT_GROUP = False

#: Seconds that the ranks may take to reach rank 0's rendezvous store
#: (``init_torch_distributed(connect_timeout=)``); afterwards the store and
#: the groups use ``timeout``.
CONNECT_TIMEOUT = 60.0


def init_torch_distributed(
    manager: DomainParallelManager | None = None,
    backend: str | None = None,
    *,
    timeout: timedelta | float | None = None,
    connect_timeout: timedelta | float | None = None,
) -> DomainParallelManager:
    """Initialise torch.distributed from the MPI job and mirror the manager's groups.

    Collective over the manager's parent communicator (every rank calls it).

    If torch.distributed is not initialised yet, its default group is
    created with rank and world size taken from ``manager.comm`` (rendezvous
    through a TCPStore on rank 0, address and port sent over MPI). If it is
    already initialised (by the user, or for another manager), its ranks
    must be those of ``manager.comm`` in the same order; only the groups
    are added.

    Then every rank creates every domain group, then every data-parallel
    group, in the same order, and the groups this rank belongs to are set on
    the manager as ``torch_domain_group`` / ``torch_data_parallel_group``,
    together with ``device_mesh``. :func:`destroy_torch_distributed` (or
    ``manager.free()``) releases them. If building the groups fails after
    this call created the default group, the default group is destroyed
    again, so torch.distributed is left as it was.

    Args:
        manager: The manager to mirror (default: the global singleton from
            :func:`~credit_mpi.initialize_domain_parallel`).
        backend: torch.distributed backend, e.g. ``"nccl"`` or ``"gloo"``.
            ``None``: ``"nccl"`` when CUDA is available on every rank and
            no node has more ranks than GPUs, else ``"gloo"`` (when torch.distributed is already initialised,
            ``None`` keeps the default group's backend for the new groups).
            With NCCL each rank first binds the CUDA device of its local rank
            (its rank among the ranks on its node, modulo the device count).
        timeout: Timeout of the rendezvous and of the process groups'
            collectives (``timedelta`` or seconds); ``None`` means torch's
            default.
        connect_timeout: How long the ranks may take to connect to the
            rendezvous store on rank 0 (``timedelta`` or seconds; ``None``:
            :data:`CONNECT_TIMEOUT`, 60 s). A store that cannot be reached
            in that time (a stale ``MASTER_ADDR``/``MASTER_PORT``) is a
            :class:`~credit_mpi.DomainParallelError` on every rank.

    Returns:
        The manager, now carrying the torch groups and the device mesh.

    Raises:
        ValueError: no manager; the backend is unknown or not available in
            this build of torch; NCCL asked for where ranks share a GPU; the
            manager was already bridged (every rank).
        DomainParallelError: torch.distributed is initialised with a world
            size or rank order that differs from ``manager.comm``; the
            rendezvous store could not be started or reached within
            ``connect_timeout`` (every rank).
    """
    global _OWNS_DEFAULT_GROUP
    if manager is None:
        manager = get_domain_parallel_manager()
        if manager is None:
            raise ValueError(
                "init_torch_distributed: no manager given and none initialised; call "
                "credit_mpi.initialize_domain_parallel(...) first or pass manager="
            )
    if not isinstance(manager, DomainParallelManager):
        raise TypeError(f"manager must be a DomainParallelManager, got {type(manager).__name__}")
    comm = manager.comm
    _ = manager.domain_group  # raises DomainParallelError if the manager was freed
    gpus_shared = _ranks_per_gpu_over_one(comm)  # collective: before anything may raise

    def check() -> tuple:
        _timeout(timeout)  # bad values raise here, agreed on every rank
        _timeout(connect_timeout, CONNECT_TIMEOUT, "connect_timeout")
        if manager in _BRIDGED or getattr(manager, "torch_domain_group", None) is not None:
            raise ValueError(
                "init_torch_distributed was already called for this manager; call "
                "credit_mpi.destroy_torch_distributed(manager) first to rebuild the groups"
            )
        if not dist.is_available():
            raise ValueError("this build of torch has no torch.distributed (torch.distributed.is_available() is False)")
        initialised = dist.is_initialized()
        chosen = _choose_backend(backend, initialised, gpus_shared)
        torch_rank = dist.get_rank() if initialised else None
        torch_size = dist.get_world_size() if initialised else None
        return initialised, chosen, torch_rank, torch_size

    states = allgather_or_raise(comm, check)
    if backend is None and {s[1] for s in states} == {"nccl", "gloo"}:
        states = [(s[0], "gloo", *s[2:]) for s in states]  # the automatic choice: NCCL only if every rank can
    _check_agreement(comm, states)
    initialised, chosen, _, _ = states[comm.Get_rank()]
    timeout = _timeout(timeout)
    connect = _timeout(connect_timeout, CONNECT_TIMEOUT, "connect_timeout")

    if chosen is not None and _is_nccl(chosen):
        _bind_local_device(comm)
    created_default = not initialised
    if created_default:
        _init_default_group(comm, chosen, timeout, connect)
        _OWNS_DEFAULT_GROUP = True

    try:
        device_type = "cuda" if _is_nccl(chosen or dist.get_backend()) else "cpu"
        domain = _new_groups(manager.domain_groups(), comm.Get_rank(), chosen, timeout, "domain")
        data_parallel = _new_groups(manager.data_parallel_groups(), comm.Get_rank(), chosen, timeout, "data_parallel")
        mesh = _device_mesh(manager, data_parallel, domain, device_type)
    except BaseException:
        if created_default and not _BRIDGED and dist.is_initialized():
            dist.destroy_process_group()  # torch as it was before this call, so that a retry can initialise it
            _OWNS_DEFAULT_GROUP = False
        raise

    manager.attach_torch_groups(TorchGroups(domain, data_parallel, mesh, destroy_torch_distributed))
    _BRIDGED.add(manager)
    logger.debug(
        "rank %d: torch.distributed bridged (%s), domain group %s, data-parallel group %s",
        comm.Get_rank(),
        dist.get_backend(domain),
        dist.get_process_group_ranks(domain),
        dist.get_process_group_ranks(data_parallel),
    )
    return manager


def destroy_torch_distributed(manager: DomainParallelManager | None = None) -> None:
    """Destroy the torch groups that :func:`init_torch_distributed` made for ``manager``.

    Collective over the manager's parent communicator. Removes
    ``torch_domain_group``, ``torch_data_parallel_group`` and
    ``device_mesh`` from the manager (they become ``None``). When the bridge
    created torch's default group and no other bridged manager is left, the
    default group is destroyed too, so torch.distributed can be initialised
    again; a default group the user created is left alone. A manager that
    is not bridged is a no-op. ``manager.free()`` calls this.
    """
    global _OWNS_DEFAULT_GROUP
    if manager is None:
        manager = get_domain_parallel_manager()
        if manager is None:
            return
    if manager not in _BRIDGED:
        return
    attached = manager.detach_torch_groups()
    groups = () if attached is None else (attached.domain, attached.data_parallel)
    _BRIDGED.discard(manager)
    if not dist.is_initialized():  # the user destroyed everything already
        return
    # Nobody may tear down (rank 0 hosts the store) while another rank still
    # has a collective in flight on these groups.
    if not MPI.Is_finalized():
        manager.comm.Barrier()
    for group in groups:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    if _OWNS_DEFAULT_GROUP and not _BRIDGED:
        dist.destroy_process_group()
        _OWNS_DEFAULT_GROUP = False


def is_bridged(manager: DomainParallelManager) -> bool:
    """True when ``manager`` carries torch groups made by :func:`init_torch_distributed`."""
    return manager in _BRIDGED


# -- internals ---------------------------------------------------------------


def _timeout(timeout: timedelta | float | None, default: float | None = None, name: str = "timeout") -> timedelta:
    """``timeout`` as a positive timedelta; ``None``: ``default`` seconds, or torch's default."""
    if timeout is None:
        if default is not None:
            return timedelta(seconds=default)
        from torch.distributed.constants import default_pg_timeout

        return default_pg_timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"{name} must be a datetime.timedelta or seconds, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{name} must be positive, got {timeout!r}")
    return timedelta(seconds=seconds)


def _ranks_per_gpu_over_one(comm: MPI.Comm) -> str | None:
    """Why NCCL cannot run here (two ranks of a node on one GPU), or None. Collective over ``comm``.

    Each rank names the GPU it would bind (its local rank modulo the GPUs it
    sees, as :func:`credit_mpi.gpu.bind_device` picks) by the device's UUID,
    so ranks that each see a different single GPU (``CUDA_VISIBLE_DEVICES``
    per rank, ``srun --gpus-per-task=1``) do not count as sharing.
    """
    from . import gpu

    local, _ = gpu.local_rank(comm)
    uuid = None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        try:
            uuid = str(torch.cuda.get_device_properties(local % torch.cuda.device_count()).uuid)
        except Exception:  # noqa: BLE001 - no UUID: cannot tell, assume not shared
            uuid = None
    devices = allgather_or_raise(comm, lambda: (MPI.Get_processor_name(), uuid))
    mine = devices[comm.Get_rank()]
    if mine[1] is None:
        return None
    sharing = [r for r, d in enumerate(devices) if d == mine]
    if len(sharing) > 1:
        return f"ranks {sharing} of {comm_label(comm)} share GPU {mine[1]} on {mine[0]}, and NCCL needs one GPU per rank"
    return None


def _choose_backend(backend: str | None, initialised: bool, gpus_shared: str | None = None) -> str | None:
    """The backend for the new groups; ``None`` keeps an existing default group's backend.

    ``gpus_shared`` (why ranks share a GPU on this node, or None) rules NCCL
    out: the default becomes gloo, and an explicit NCCL is an error.
    """
    if backend is None:
        if initialised:
            return None
        nccl = torch.cuda.is_available() and dist.is_nccl_available() and gpus_shared is None
        return "nccl" if nccl else "gloo"
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a torch.distributed backend name such as 'nccl' or 'gloo', got {backend!r}")
    name = backend.lower()
    try:
        available = dist.is_backend_available(name)
    except Exception:  # noqa: BLE001 - an unknown name may raise inside torch
        available = False
    if not available:
        known = [b for b in ("gloo", "nccl", "mpi", "ucc", "xccl") if _available(b)]
        raise ValueError(
            f"backend {backend!r} is not available in this build of torch "
            f"({torch.__version__}); available here: {known}"
        )
    if _is_nccl(name) and not torch.cuda.is_available():
        raise ValueError(f"backend {backend!r} needs CUDA, but torch.cuda.is_available() is False on this rank")
    if _is_nccl(name) and gpus_shared is not None:
        raise ValueError(f"backend {backend!r} cannot run here: {gpus_shared}; use backend='gloo' or one rank per GPU")
    return name


def _available(name: str) -> bool:
    try:
        return bool(dist.is_backend_available(name))
    except Exception:  # noqa: BLE001
        return False


def _is_nccl(backend: str | None) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def _check_agreement(comm: MPI.Comm, states: list[tuple]) -> None:
    """Every rank must see the same torch state, and torch's ranks must be MPI's."""
    size = comm.Get_size()
    initialised = {s[0] for s in states}
    if len(initialised) > 1:
        on = [r for r, s in enumerate(states) if s[0]]
        raise DomainParallelError(
            f"torch.distributed is initialised on rank(s) {on} of {comm.Get_name()} but not on the "
            f"others; initialise it on every rank or on none"
        )
    backends = {s[1] for s in states}
    if len(backends) > 1:
        detail = ", ".join(f"rank {r}: {s[1]}" for r, s in enumerate(states))
        raise DomainParallelError(f"ranks chose different torch backends ({detail}); pass backend= explicitly")
    if initialised.pop():
        mapping = [(r, s[2], s[3]) for r, s in enumerate(states)]
        if any(ts != size for _, _, ts in mapping):
            sizes = sorted({ts for _, _, ts in mapping})
            raise DomainParallelError(
                f"torch.distributed is initialised with world size {sizes[0] if len(sizes) == 1 else sizes}, "
                f"but the manager's communicator {comm.Get_name()} has {size} ranks; the torch world "
                f"must be exactly the MPI communicator"
            )
        wrong = [(r, tr) for r, tr, _ in mapping if r != tr]
        if wrong:
            detail = ", ".join(f"MPI rank {r} is torch rank {tr}" for r, tr in wrong)
            raise DomainParallelError(
                f"torch.distributed's rank order differs from {comm.Get_name()}'s ({detail}); "
                f"torch rank r must be MPI rank r"
            )


def _bind_local_device(comm: MPI.Comm) -> None:
    """Bind this rank's CUDA device from its local rank (:func:`credit_mpi.gpu.bind_device`)."""
    from . import gpu

    gpu.bind_device(comm, library="torch")


def _init_default_group(comm: MPI.Comm, backend: str, timeout: timedelta, connect_timeout: timedelta) -> None:
    """Rendezvous through a TCPStore hosted by rank 0; address and port go over MPI.

    Starting and reaching the store is bounded by ``connect_timeout``; a
    failure is one :class:`DomainParallelError` on every rank that names
    ``MASTER_ADDR``/``MASTER_PORT`` when they were set. Once connected, the
    store waits up to ``timeout``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = allgather_or_raise(comm, MPI.Get_processor_name)
    store = None
    env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    env = allgather_or_raise(comm, lambda: env)[0]  # what rank 0 saw: it decides the address

    def host_store() -> tuple[str, int] | None:
        nonlocal store
        if rank != 0:
            return None
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname())
        port_text = env.get("MASTER_PORT", "0")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"MASTER_PORT must be a port number, got {port_text!r}{_stale_hint(env)}") from None
        try:
            if env.get("MASTER_ADDR"):
                _bindable(addr)  # not an address of this node: say so now, not after torch's retries
            store = dist.TCPStore(addr, port, size, is_master=True, wait_for_workers=False, timeout=connect_timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises several types (DistNetworkError, RuntimeError)
            raise DomainParallelError(_rendezvous_error("start", addr, port, connect_timeout, exc, env)) from None
        return addr, store.port

    addr, port = allgather_or_raise(comm, host_store)[0]

    def connect() -> None:
        nonlocal store
        if rank != 0:
            try:
                _reachable(addr, port, connect_timeout)  # one bounded attempt, before torch's logged retries
                store = dist.TCPStore(addr, port, size, is_master=False, timeout=connect_timeout)
            except Exception as exc:  # noqa: BLE001
                raise DomainParallelError(_rendezvous_error("reach", addr, port, connect_timeout, exc, env)) from None
        store.set_timeout(timeout)

    allgather_or_raise(comm, connect)
    logger.debug("rank %d: torch.distributed rendezvous at %s:%d (%s)", rank, addr, port, backend)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def _bindable(addr: str) -> None:
    """Raise OSError at once when ``addr`` is no address of this node (rank 0 could not host the store there).

    Without it, torch's TCPStore retries connecting to itself until well past
    ``connect_timeout`` and logs every attempt with its C++ frames.
    """
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((addr, 0))
        except OSError as exc:
            raise OSError(f"{addr} is not an address of rank 0's node {socket.gethostname()} ({exc.strerror})") from None


def _reachable(addr: str, port: int, limit: timedelta) -> None:
    """One TCP connection to rank 0's store, bounded by ``limit`` (OSError when it cannot be made)."""
    with socket.create_connection((addr, port), timeout=limit.total_seconds()):
        pass


def _stale_hint(env: dict[str, str]) -> str:
    """What to do about ``MASTER_ADDR``/``MASTER_PORT`` when rank 0 had them set; else ''."""
    if not env:
        return ""
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    return (
        f"; rank 0's environment sets {shown}, which overrides credit_mpi's own rendezvous "
        f"(left over from a torchrun script?): `unset MASTER_ADDR MASTER_PORT` before launching, "
        f"or set them to an address and free port of rank 0's node that every rank can reach"
    )


def _rendezvous_error(what: str, addr: str, port: int, limit: timedelta, exc: BaseException, env: dict[str, str]) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"init_torch_distributed: could not {what} the torch.distributed rendezvous store at {addr}:{port} "
        f"within connect_timeout={limit.total_seconds():g} s ({type(exc).__name__}: {first[:300]})"
        f"{_stale_hint(env)}"
    )


def _new_groups(layout: list[list[int]], rank: int, backend: str | None, timeout: timedelta, what: str) -> Any:
    """Create every group of ``layout`` in order (collective); return the one holding ``rank``."""
    mine = None
    for ranks in layout:
        group = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"credit_mpi.{what}")
        if rank in ranks:
            mine = group
    return mine


def _device_mesh(manager: DomainParallelManager, dp_group: Any, domain_group_: Any, device_type: str) -> Any:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        return None
    layout = torch.arange(manager.world_size, dtype=torch.int).reshape(
        manager.data_parallel_size, manager.domain_parallel_size
    )
    return DeviceMesh.from_group(
        [dp_group, domain_group_], device_type, mesh=layout, mesh_dim_names=("dp", "domain")
    )


