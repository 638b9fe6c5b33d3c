"""GPUs and MPI: is the MPI library CUDA-aware, and which GPU is each rank's.

CUDA-awareness decides how :mod:`credit_mpi.transport.staging` moves device arrays:
straight from device memory (CUDA-aware MPI), or staged through pinned host
memory (any MPI). The verdict is taken **once per communicator and agreed by
all of its ranks**: each rank reads its own signals, one ``allgather`` shares
them, and the communicator is CUDA-aware only if every rank says so. A rank
that disagrees therefore moves everyone to the host-staged path (which works
with any MPI) instead of leaving ranks on different protocols. The verdict is
cached on the communicator itself (an MPI attribute), so it lives and dies
with the communicator.

The signals, in the order they decide (first that answers wins):

1. ``CREDIT_MPI_CUDA_AWARE=1|0`` (``auto``, the default, detects).
2. An environment switch that turns the library's GPU support off
   (Cray's ``MPICH_GPU_SUPPORT_ENABLED=0``, ``MPIR_CVAR_ENABLE_GPU=0``,
   ``MV2_USE_CUDA=0``, ``OMPI_MCA_opal_cuda_support=0``, ``I_MPI_OFFLOAD=0``);
   Cray MPICH without ``MPICH_GPU_SUPPORT_ENABLED=1`` counts as off (its GPU
   support needs the switch whatever the library query says).
3. The library itself: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH) or
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH 4.1+,
   Cray MPICH), called through :mod:`ctypes` from the loaded libmpi.
4. The MPI-4.1 info key ``mpi_memory_alloc_kinds`` of the communicator
   (``cuda`` or ``cuda:device`` in it means device memory is supported;
   ``cuda:host`` alone does not).
5. An environment switch that turns GPU support on where the library gave
   no answer (``MPICH_GPU_SUPPORT_ENABLED=1``, ``MV2_USE_CUDA=1``,
   ``I_MPI_OFFLOAD>=1``, ``PSP_CUDA=1``).
6. Otherwise: not CUDA-aware.

Device binding (:func:`bind_device`) picks each rank's GPU from its rank on
the node, found with ``Split_type(COMM_TYPE_SHARED)`` rather than from
launcher-specific environment variables.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from .validation import allgather_or_raise, comm_label

__all__ = [
    "ENV_OVERRIDE",
    "is_cuda_aware",
    "cuda_awareness_report",
    "local_rank",
    "bind_device",
    "bound_device",
]

logger = logging.getLogger(__name__)

#: The environment variable that overrides detection: ``auto`` (default), ``1`` or ``0``.
ENV_OVERRIDE = "CREDIT_MPI_CUDA_AWARE"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# Environment switches of known MPI libraries: name -> meaning of its value.
# "off" values always disable; "on" values enable only where the library
# itself gave no answer (a switch cannot add support that is not built in).
_ENV_SWITCHES = {
    "MPICH_GPU_SUPPORT_ENABLED": "Cray MPICH",
    "MPIR_CVAR_ENABLE_GPU": "MPICH",
    "MV2_USE_CUDA": "MVAPICH2",
    "OMPI_MCA_opal_cuda_support": "Open MPI",
    "I_MPI_OFFLOAD": "Intel MPI",
    "PSP_CUDA": "ParaStation MPI",
}
_ENV_CAN_ENABLE = {"MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA", "I_MPI_OFFLOAD", "PSP_CUDA"}

# MPICH's enum value for CUDA in MPIX_GPU_query_support (mpi.h: MPIX_GPU_SUPPORT_CUDA).
_MPIX_GPU_SUPPORT_CUDA = 0

_LIBMPI_NAME = re.compile(r"lib(mpi|mpich|mpi_cray|mpi_gnu|mpi_intel|mpi_nvidia)[\w.-]*\.(so|dylib)")

_KEYVAL: int | None = None  # MPI attribute key under which a communicator caches its report
_BOUND: int | None = None  # the GPU index bind_device chose for this process


# --------------------------------------------------------------------------- detection


def _override() -> bool | None:
    """The value of CREDIT_MPI_CUDA_AWARE: True, False, or None for ``auto``/unset."""
    raw = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(
        f"{ENV_OVERRIDE}={os.environ.get(ENV_OVERRIDE)!r} is not understood; "
        f"use auto (detect), 1 (CUDA-aware) or 0 (stage through host memory)"
    )


def _loaded_libraries() -> list[str]:
    """Paths of the shared objects that look like an MPI library, as this process mapped them."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                if path.startswith("/") and _LIBMPI_NAME.search(os.path.basename(path)) and path not in paths:
                    paths.append(path)
    except OSError:  # not Linux: fall back to the handles below
        pass
    return paths


def _handles() -> list[tuple[str, Any]]:
    """ctypes handles to search for MPIX symbols: the loaded libmpi(s), mpi4py's module, the process."""
    handles = []
    noload = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in _loaded_libraries() + [MPI.__file__]:
        try:
            handles.append((path, ctypes.CDLL(path, mode=noload)))
        except OSError:
            continue
    try:
        handles.append(("<process>", ctypes.CDLL(None)))
    except OSError:  # pragma: no cover - platforms without a global namespace handle
        pass
    return handles


def _query_library() -> dict:
    """Ask the loaded MPI library whether it supports CUDA memory.

    Returns ``{"value": 1|0|None, "symbol": name|None, "library": path|None}``;
    ``value`` is None when no library exports either query.
    """
    for path, handle in _handles():
        func = getattr(handle, "MPIX_Query_cuda_support", None)
        if func is not None:
            func.restype, func.argtypes = ctypes.c_int, []
            return {"value": int(bool(func())), "symbol": "MPIX_Query_cuda_support", "library": path}
        func = getattr(handle, "MPIX_GPU_query_support", None)
        if func is not None:
            flag = ctypes.c_int(0)
            func.restype, func.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            if func(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return {"value": int(bool(flag.value)), "symbol": "MPIX_GPU_query_support", "library": path}
    return {"value": None, "symbol": None, "library": None}


def _memory_alloc_kinds(comm: MPI.Comm) -> str | None:
    """The MPI-4.1 ``mpi_memory_alloc_kinds`` info value of ``comm`` (or COMM_WORLD), if any."""
    for c in (comm, MPI.COMM_WORLD):
        try:
            info = c.Get_info()
        except MPI.Exception:  # pragma: no cover - MPI without communicator info
            continue
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
        if value is not None:
            return value
    return None


def _env_switches() -> dict[str, str]:
    return {name: os.environ[name] for name in _ENV_SWITCHES if name in os.environ}


def _library_version() -> str:
    try:
        return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    except Exception:  # noqa: BLE001 - cosmetic only
        return "unknown MPI"


def _local_signals(comm: MPI.Comm) -> dict:
    """Everything this rank knows about CUDA-awareness (no communication)."""
    return {
        "override": _override(),
        "library": _query_library(),
        "memory_alloc_kinds": _memory_alloc_kinds(comm),
        "env": _env_switches(),
        "mpi": _library_version(),
    }


def _decide(signals: dict) -> tuple[bool, str]:
    """This rank's verdict and the one-line reason, from its signals."""
    override = signals["override"]
    if override is not None:
        word = "CUDA-aware" if override else "not CUDA-aware"
        return override, f"{word}: {ENV_OVERRIDE}={os.environ.get(ENV_OVERRIDE, '').strip()} overrides detection"
    env = signals["env"]
    for name, value in env.items():
        if value.strip().lower() in _FALSE:
            return False, f"not CUDA-aware: {name}={value} turns {_ENV_SWITCHES[name]}'s GPU support off"
    lib, kinds, mpi = signals["library"], signals["memory_alloc_kinds"], signals["mpi"]
    cray_switch = env.get("MPICH_GPU_SUPPORT_ENABLED", "").strip().lower()
    if "cray mpich" in mpi.lower() and cray_switch not in _TRUE:
        return False, (
            f"not CUDA-aware: {mpi} reads device buffers only with MPICH_GPU_SUPPORT_ENABLED=1 "
            f"(it is {'unset' if not cray_switch else repr(env['MPICH_GPU_SUPPORT_ENABLED'])})"
        )
    if lib["value"] == 1:
        return True, f"CUDA-aware: {lib['symbol']}() reports CUDA support in {lib['library']} ({mpi})"
    if _names_cuda_device_memory(kinds):
        return True, f"CUDA-aware: mpi_memory_alloc_kinds={kinds!r} names cuda device memory ({mpi})"
    if lib["value"] is None:
        for name, value in env.items():
            if name in _ENV_CAN_ENABLE and value.strip().lower() not in _FALSE:
                return True, f"CUDA-aware: {name}={value} turns {_ENV_SWITCHES[name]}'s GPU support on ({mpi})"
    why = []
    if lib["value"] == 0:
        why.append(f"{lib['symbol']}() returned 0 in {lib['library']}")
    else:
        why.append("the MPI library exports neither MPIX_Query_cuda_support nor MPIX_GPU_query_support")
    if kinds is not None:
        why.append(f"mpi_memory_alloc_kinds={kinds!r} names no cuda device memory")
    return False, f"not CUDA-aware: {mpi}: " + "; ".join(why)


def _names_cuda_device_memory(kinds: str | None) -> bool:
    """Whether an ``mpi_memory_alloc_kinds`` value covers CUDA device memory.

    MPI 4.1 writes kinds as ``kind[:restrictor...]`` separated by commas: a
    bare ``cuda`` means every CUDA allocation, ``cuda:device`` device
    memory; ``cuda:host`` (pinned host memory) or ``cuda:managed`` alone do
    not let MPI read ``cudaMalloc`` pointers.
    """
    for kind in (kinds or "").lower().split(","):
        name, *restrictors = [part.strip() for part in kind.split(":")]
        if name == "cuda" and (not restrictors or "device" in restrictors):
            return True
    return False


def _keyval() -> int:
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval()
    return _KEYVAL


def cuda_awareness_report(comm: MPI.Comm | None = None, *, refresh: bool = False) -> dict:
    """How credit_mpi decided whether MPI is CUDA-aware on ``comm``, and why.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``) the first time (or
    with ``refresh=True``); later calls read the report cached on the
    communicator. Every rank returns the same ``cuda_aware`` verdict.

    Returns:
        A dict with ``cuda_aware`` (the agreed verdict), ``reason`` (one
        line), ``agreed`` (whether every rank reached the same verdict on its
        own), ``ranks`` (each rank's ``{"cuda_aware", "reason"}``) and
        ``local`` (this rank's raw signals: ``override``, ``library``
        (``value``/``symbol``/``library`` of the MPIX query),
        ``memory_alloc_kinds``, ``env``, ``mpi``).

    Raises:
        ValueError: ``CREDIT_MPI_CUDA_AWARE`` holds something other than
            auto/1/0 on any rank (raised on every rank).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    key = _keyval()
    if not refresh:
        cached = comm.Get_attr(key)
        if cached is not None:
            return cached

    def local() -> tuple[bool, str, dict]:
        signals = _local_signals(comm)
        verdict, reason = _decide(signals)
        return verdict, reason, signals

    everyone = allgather_or_raise(comm, local)
    mine = everyone[comm.Get_rank()]
    verdicts = [v for v, _, _ in everyone]
    agreed = len(set(verdicts)) == 1
    if agreed:
        verdict, reason = verdicts[0], mine[1]
    else:
        verdict = False
        yes = [r for r, v in enumerate(verdicts) if v]
        no = [r for r, v in enumerate(verdicts) if not v]
        reason = (
            f"ranks disagree (CUDA-aware on rank(s) {_ranks(yes)}: {everyone[yes[0]][1]}; "
            f"not on rank(s) {_ranks(no)}: {everyone[no[0]][1]}), so every rank stages through host memory"
        )
        if comm.Get_rank() == 0:
            logger.warning("credit_mpi: %s", reason)
    report = {
        "cuda_aware": verdict,
        "reason": reason,
        "agreed": agreed,
        "ranks": [{"cuda_aware": v, "reason": why} for v, why, _ in everyone],
        "local": mine[2],
    }
    comm.Set_attr(key, report)
    logger.debug("CUDA-aware MPI on %s: %s (%s)", comm_label(comm), verdict, reason)
    return report


def is_cuda_aware(comm: MPI.Comm | None = None) -> bool:
    """Whether device buffers can be handed to MPI directly on ``comm``.

    The verdict every rank of ``comm`` agreed on (see
    :func:`cuda_awareness_report`). Collective the first time per
    communicator, cached afterwards.
    """
    return bool(cuda_awareness_report(comm)["cuda_aware"])


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


# --------------------------------------------------------------------------- binding


def local_rank(comm: MPI.Comm | None = None) -> tuple[int, int]:
    """This rank's index among the ranks of ``comm`` on the same node, and their number.

    Collective over ``comm`` (one ``Split_type(COMM_TYPE_SHARED)``, freed
    before returning).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _libraries(library: str | None) -> list[str]:
    if library is not None:
        names = [library] if isinstance(library, str) else list(library)
        bad = [n for n in names if n not in ("torch", "cupy")]
        if bad:
            raise ValueError(f"library must be 'torch', 'cupy' or None (every loaded one), got {library!r}")
        return names
    loaded = [name for name in ("torch", "cupy") if name in sys.modules]
    if loaded:
        return loaded
    for name in ("torch", "cupy"):  # neither imported yet: the first that is installed
        try:
            __import__(name)
            return [name]
        except ImportError:
            continue
    raise RuntimeError("bind_device needs torch or CuPy, and neither is installed")


def _device_count(library: str) -> int:
    if library == "torch":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def _set_device(library: str, index: int) -> None:
    if library == "torch":
        import torch

        torch.cuda.set_device(index)
    else:
        import cupy

        cupy.cuda.Device(index).use()


def bind_device(comm: MPI.Comm | None = None, *, library: str | None = None) -> int:
    """Make GPU ``local_rank % gpus_on_node`` this rank's current device.

    The local rank comes from ``comm.Split_type(COMM_TYPE_SHARED)``, so it is
    right under any launcher (mpirun, srun, mpiexec). With
    ``CUDA_VISIBLE_DEVICES`` already narrowed to one GPU per rank, every rank
    simply takes device 0. Sets the device for torch and/or CuPy
    (``library=None``: each of them that is imported; if neither is, the
    first installed). Afterwards :mod:`credit_mpi` refuses arrays on any
    other device, on every rank.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``). When a node has
    more ranks than GPUs, ranks share GPUs round-robin and the node's first
    rank issues a :class:`RuntimeWarning` saying so.

    Returns:
        The device index this rank is now bound to.

    Raises:
        DomainParallelError: a rank sees no CUDA device (raised on every rank).
        ValueError: ``library`` is not ``"torch"``, ``"cupy"`` or None.
    """
    global _BOUND
    comm = MPI.COMM_WORLD if comm is None else comm
    mine, local_size = local_rank(comm)

    def bind() -> tuple[str, int, int, int]:
        libraries = _libraries(library)
        counts = {name: _device_count(name) for name in libraries}
        gpus = min(counts.values())
        if gpus == 0:
            raise RuntimeError(
                f"bind_device: no CUDA device visible on {socket.gethostname()} "
                f"({', '.join(f'{n}: {c}' for n, c in counts.items())} devices; "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        index = mine % gpus
        for name in libraries:
            _set_device(name, index)
        return socket.gethostname(), mine, local_size, gpus

    results = allgather_or_raise(comm, bind)
    host, _, _, gpus = results[comm.Get_rank()]
    _BOUND = mine % gpus
    if mine == 0 and local_size > gpus:
        warnings.warn(
            f"credit_mpi: {local_size} ranks share {gpus} GPU(s) on node {host}; "
            f"local rank r is bound to GPU r % {gpus}",
            RuntimeWarning,
            stacklevel=2,
        )
    logger.info("rank %d bound to GPU %d (local rank %d of %d on %s)", comm.Get_rank(), _BOUND, mine, local_size, host)
    return _BOUND


def bound_device() -> int | None:
    """The GPU index :func:`bind_device` bound this process to, or None if it was never called."""
    return _BOUND
