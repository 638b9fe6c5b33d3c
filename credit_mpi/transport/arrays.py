"""Array kinds: what credit_mpi needs to know about numpy, torch (CPU, CUDA) and CuPy arrays.

Everything above :mod:`credit_mpi.transport` speaks "an array with a shape,
a dtype and a buffer"; this module is the one door to the array libraries:
every helper (describe an array as :class:`ArrayInfo`, allocate an output of
the same kind, dtype and device, contiguous views and byte views, device
memory and streams, writability) asks the array's adapter
(:mod:`credit_mpi.transport.adapters`: one class per library, found by the
array's type in one dict lookup) and takes ``adapter=`` from a caller that
looked it up already, so a collective looks its array's library up once per
call. numpy is the reference type; torch and CuPy are looked up in
``sys.modules`` (never imported at ``import credit_mpi`` time) and imported
only when the caller already has one of their arrays.

Data always travels as raw bytes (``MPI.BYTE``): credit_mpi's collectives
move data without arithmetic, so every dtype works the same way, including
those MPI has no name for (``bool``, ``float16``, torch ``bfloat16``).
numpy arrays give a ``uint8`` view (buffer protocol); torch tensors and CuPy
arrays a ``uint8`` view that mpi4py reads through DLPack. Tensors that
require grad are detached, conjugate/negative views resolved, and
non-contiguous arrays made contiguous once (:func:`contiguous`).
How those bytes reach MPI (directly or staged through host memory) is
:mod:`credit_mpi.transport.staging`'s job.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import gpu
from .adapters import (  # noqa: F401 - _check_device, _cupy: re-exported (the tests reach them here)
    _BY_TYPE,
    ArrayInfo,
    _check_device,
    _cupy,
    _current_device,
    _is_torch,
    _torch,
    _torch_bytes,
    _torch_empty,
    adapter_of,
)
from .pool import POOL as _POOL

# Internal switch for tests (never set in production code): treat CPU arrays
# as device arrays, so the CUDA-aware decision and the staging copies run on
# a machine without a GPU (transport.staging routes them).
_SIMULATE_DEVICE = False

__all__ = [
    "ArrayInfo",
    "adapter",
    "describe",
    "is_array",
    "is_contiguous",
    "in_host_memory",
    "contiguous",
    "empty",
    "empty_described",
    "narrow",
    "host_numpy",
    "out_cache_key",
    "release_output_pool",
    "from_host_numpy",
    "dtype_of",
    "shares_memory",
    "check_writable",
    "mark_written",
    "requires_grad",
    "as_torch_bytes",
    "mpi_datatype",
    "in_device_memory",
    "after_torch_wrote",
    "sync_stream",
]

# --------------------------------------------------------------------------- the adapter of an array


def adapter(x: Any) -> Any:
    """``x``'s adapter (:func:`credit_mpi.transport.adapters.adapter_of`): look it up once, pass it as ``adapter=``.

    Raises:
        TypeError: ``x`` is not a supported array type (named in the message).
    """
    found = _BY_TYPE.get(type(x)) or adapter_of(x)
    if found is None:
        raise TypeError(
            f"unsupported array type {type(x).__module__}.{type(x).__qualname__}; "
            f"expected a numpy.ndarray, a torch.Tensor (CPU or CUDA) or a cupy.ndarray"
        )
    return found


_ops = adapter  # (the name staging and the tests use)


def is_array(x: Any) -> bool:
    """True for the array types credit_mpi shards (numpy, torch CPU/CUDA, CuPy)."""
    return (_BY_TYPE.get(type(x)) or adapter_of(x)) is not None


def describe(x: Any, adapter: Any = None) -> ArrayInfo:
    """Shape, dtype and device of ``x``.

    Raises:
        TypeError: ``x`` is not a supported array type (or device type).
        ValueError: ``x`` is on a GPU other than this rank's.
    """
    return (adapter or _BY_TYPE.get(type(x)) or _ops(x)).describe(x)


# --------------------------------------------------------------------------- allocation, layout


def is_contiguous(x: Any, adapter: Any = None) -> bool:
    """True when ``x`` is C-contiguous (it can be sent or received in place)."""
    return (adapter or _BY_TYPE.get(type(x)) or _ops(x)).is_contiguous(x)


def contiguous(x: Any, adapter: Any = None) -> Any:
    """``x`` as a C-contiguous array of the same kind (copied only if needed).

    torch tensors are detached (the collectives move data; autograd is
    handled by :mod:`credit_mpi.autograd`), and lazy conjugate/negative views
    are resolved, since DLPack cannot carry them.
    """
    return (adapter or _BY_TYPE.get(type(x)) or _ops(x)).contiguous(x)


def empty(like: Any, shape: Sequence[int], adapter: Any = None) -> Any:
    """A new uninitialised array of ``shape`` with ``like``'s kind, dtype and device."""
    return (adapter or _BY_TYPE.get(type(like)) or _ops(like)).empty(like, shape)


def empty_described(info: ArrayInfo, shape: Sequence[int], dtype: Any = None) -> Any:
    """A new array of ``shape`` of the kind and dtype that ``info`` describes.

    For ranks that must allocate like an array they do not hold (the
    receivers of a scatter). Device arrays go to this rank's GPU (the bound
    one, else the current one), not to the device index in ``info``, which
    is another rank's. torch or CuPy is imported here only because the data
    is of that kind. ``dtype`` is the dtype object itself (:func:`dtype_of`
    on the rank that holds the array, sent along): a record dtype cannot be
    rebuilt from ``info.dtype``, its text.
    """
    if info.kind == "numpy":
        return np.empty(shape, dtype=np.dtype(info.dtype) if dtype is None else dtype)
    if info.kind == "cupy":
        cupy = importlib.import_module("cupy")
        with cupy.cuda.Device(_local_index("cupy")):
            return cupy.empty(tuple(shape), dtype=np.dtype(info.dtype) if dtype is None else dtype)
    torch = importlib.import_module("torch")
    if dtype is None:
        dtype = getattr(torch, info.dtype.removeprefix("torch."))
    device = info.device_type if info.device_type == "cpu" else f"cuda:{_local_index('torch')}"
    return _torch_empty(shape, dtype, device)


def _local_index(kind: str) -> int:
    bound = gpu.bound_device()
    return bound if bound is not None else _current_device(kind)


def _numpy_like(x: Any):
    """numpy or cupy, the module whose functions apply to ``x``; None for torch (and unsupported types)."""
    found = _BY_TYPE.get(type(x)) or adapter_of(x)
    return None if found is None else found.xp


def dtype_of(x: Any) -> Any:
    """``x``'s dtype object (``numpy.dtype`` or ``torch.dtype``): it pickles, record dtypes included."""
    return x.dtype


def shares_memory(a: Any, b: Any, adapter: Any = None) -> bool:
    """True when ``a`` and ``b`` may overlap in memory (same kind of array; conservative)."""
    return (adapter or _BY_TYPE.get(type(a)) or _ops(a)).shares_memory(a, b)


def check_writable(x: Any, what: str, adapter: Any = None) -> None:
    """Raise ``ValueError`` unless a collective may write into ``x`` in place.

    Refused: read-only numpy arrays, torch tensors that require grad (an
    in-place write into a leaf of the graph), torch inference tensors outside
    inference mode.
    """
    (adapter or _BY_TYPE.get(type(x)) or _ops(x)).check_writable(x, what)


def mark_written(x: Any, adapter: Any = None) -> None:
    """Tell torch autograd that ``x`` was written in place (its version counter moves on).

    A tensor that autograd saved for a backward pass and that a collective
    then overwrote is then an error at ``backward()``, as after torch's own
    in-place operations, instead of a silently wrong gradient.
    """
    (adapter or _BY_TYPE.get(type(x)) or _ops(x)).mark_written(x)


def narrow(x: Any, dim: int, start: int, length: int, adapter: Any = None) -> Any:
    """The rows ``start:start+length`` of ``x`` along ``dim``, as a contiguous array.

    Shares memory with ``x`` when that band is already contiguous (as
    ``torch.Tensor.narrow(...).contiguous()`` does), otherwise a copy.
    """
    return (adapter or _BY_TYPE.get(type(x)) or _ops(x)).narrow(x, dim, start, length)


def as_torch_bytes(x: Any) -> Any:
    """A flat uint8 torch tensor over the bytes of contiguous ``x`` (numpy, torch or CuPy; no copy)."""
    torch = importlib.import_module("torch")
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.reshape(-1).view(np.uint8))
    if not _is_torch(x):  # CuPy (or any DLPack producer)
        x = torch.from_dlpack(x)
    return _torch_bytes(x)


def in_device_memory(buf: Any, adapter: Any = None) -> bool:
    """True when ``buf`` (an array, or a buffer from :func:`send_buffer`/:func:`recv_buffer`) is GPU memory.

    A staged transfer yields host memory, a direct one device memory: code
    that must treat device pointers differently (non-blocking collectives,
    reusing scratch) asks here.
    """
    return (adapter or _BY_TYPE.get(type(buf)) or _ops(buf)).on_device(buf)


def in_host_memory(x: Any, adapter: Any = None) -> bool:
    """True when ``x`` is host memory that MPI reads and writes in place (numpy, torch CPU): False on a device,
    and for every array under ``_SIMULATE_DEVICE`` (the tests' stand-in for device memory)."""
    return not _SIMULATE_DEVICE and not in_device_memory(x, adapter)


def sync_stream(x: Any, adapter: Any = None) -> None:
    """Wait for the work queued on ``x``'s current stream (nothing for host arrays).

    Before MPI writes memory that device kernels queued earlier still read
    (scratch reused across iterations), as :func:`send_buffer` does before MPI reads.
    """
    (adapter or _BY_TYPE.get(type(x)) or _ops(x)).sync_stream(x)


def after_torch_wrote(x: Any, adapter: Any = None) -> None:
    """torch (a torch.distributed collective and copies on torch's current stream) wrote ``x``'s memory.

    For a CuPy array wait for that work: CuPy's current stream need not be
    torch's, so its next kernel could otherwise read the memory too early.
    numpy arrays and torch tensors need nothing (host copies block; torch
    orders its own streams).
    """
    (adapter or _BY_TYPE.get(type(x)) or _ops(x)).after_torch_wrote(x)


def mpi_datatype(x: Any) -> MPI.Datatype:
    """The predefined MPI datatype of ``x``'s elements (``MPI.Datatype.fromcode``), for reductions.

    Data that only moves travels as bytes; a reduction needs MPI to know the type.

    Raises:
        TypeError: the dtype has no MPI counterpart (torch ``bfloat16``;
            ``float16`` in MPIs without ``MPIX_C_FLOAT16``): widen to float32 first.
    """
    dtype = x.dtype
    datatype = _DATATYPES.get(dtype)  # (a torch dtype and a numpy one never compare equal: one table for both)
    if datatype is not None:
        return datatype
    plain = dtype
    if _is_torch(x):
        torch = _torch()
        try:
            plain = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # numpy has no such dtype (bfloat16)
            raise TypeError(f"{dtype} has no MPI datatype; convert to torch.float32 to reduce it") from None
    try:
        datatype = MPI.Datatype.fromcode(np.dtype(plain).char)
    except (KeyError, ValueError):
        datatype = MPI.DATATYPE_NULL
    if datatype == MPI.DATATYPE_NULL:
        raise TypeError(f"{dtype} has no MPI datatype in this MPI; convert to float32 to reduce it")
    _DATATYPES[dtype] = datatype
    return datatype


_DATATYPES: dict = {}  # mpi_datatype's answers per dtype (asked once per reduction call: the gradients' every step)


def requires_grad(x: Any) -> bool:
    """True when ``x`` is a torch tensor that autograd is recording (grad mode on)."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


# -- per-call fast paths: cache keys, host byte views, an output pool ----


def cache_key(x: Any, adapter: Any = None) -> tuple | None:
    """A hashable key that decides :func:`describe` of ``x`` (and its kind), or None when none is cheap.

    Two arrays with the same key describe alike, so a plan made for one is
    the plan for the other. Host arrays only (numpy, torch CPU with the
    strided layout): a device array's description also depends on this
    rank's current device, and under ``_SIMULATE_DEVICE`` every array takes
    the device paths. ``requires_grad`` (with grad mode) is part of the key.
    """
    if _SIMULATE_DEVICE:
        return None
    found = adapter or _BY_TYPE.get(type(x)) or adapter_of(x)
    return None if found is None else found.cache_key(x)


def out_cache_key(x: Any, adapter: Any = None) -> tuple | None:
    """:func:`cache_key` of an output array, with what decides :func:`is_contiguous` and :func:`check_writable` of it.

    Two outputs with the same key pass or fail a collective's checks of
    ``out=`` alike, so a plan checked for one is the plan for the other.
    """
    found = adapter or _BY_TYPE.get(type(x)) or adapter_of(x)
    key = cache_key(x, found)
    return None if key is None else found.out_cache_key(x, key)


def host_numpy(x: Any, adapter: Any = None) -> np.ndarray | None:
    """A numpy view of host ``x`` (numpy itself, or a CPU torch tensor of a dtype numpy has), or None.

    The view shares memory with ``x`` (torch tensors are detached; lazy
    conjugate / negative views are resolved first, a copy). None for device
    arrays, torch dtypes numpy lacks (``bfloat16``, float8) and under
    ``_SIMULATE_DEVICE``. The halo exchange runs its numpy code on torch CPU
    tensors through this view: one numpy operation costs about a tenth of a
    torch one at the sizes of a coarse UNet level.
    """
    if _SIMULATE_DEVICE:
        return None
    found = adapter or _BY_TYPE.get(type(x)) or adapter_of(x)
    return None if found is None else found.host_numpy(x)


def from_host_numpy(like: Any, y: np.ndarray, adapter: Any = None) -> Any:
    """``y`` (a result computed on :func:`host_numpy` views) as an array of ``like``'s kind (shares memory)."""
    return (adapter or _BY_TYPE.get(type(like)) or _ops(like)).from_host_numpy(like, y)


def host_bytes(x: Any, adapter: Any = None) -> np.ndarray | None:
    """A flat ``uint8`` numpy view of contiguous host ``x`` (numpy or torch CPU; shares memory), or None.

    None for device arrays (and under ``_SIMULATE_DEVICE``): they go
    through :func:`send_buffer` / :func:`recv_buffer`.
    """
    if _SIMULATE_DEVICE:
        return None
    found = adapter or _BY_TYPE.get(type(x)) or adapter_of(x)
    return None if found is None else found.host_bytes(x)


def pooled_empty(like: Any, shape: Sequence[int], adapter: Any = None) -> Any:
    """:func:`empty` for outputs returned new on every call: host memory comes from a reuse pool.

    The result is a new array object of ``like``'s kind, dtype and device;
    on the host its memory is a pooled buffer that no live array uses (see
    :class:`credit_mpi.transport.pool._OutputPool`), so a loop that drops last step's result does not
    first-touch new pages every call. Device arrays: :func:`empty` (torch
    and CuPy have caching allocators of their own).
    """
    found = adapter or _BY_TYPE.get(type(like)) or _ops(like)
    if _SIMULATE_DEVICE:
        return found.empty(like, shape)
    if type(shape) is not tuple:
        shape = tuple(int(s) for s in shape)
    return found.pooled_empty(like, shape)


def release_output_pool() -> None:
    """Let go of the memory that credit_mpi keeps for the outputs it returns new each call.

    :func:`credit_mpi.gather_tensor` and :func:`credit_mpi.halo_exchange` of
    host arrays (numpy, torch CPU) take their outputs from a reuse pool, so
    a loop does not first-touch fresh pages every step: at most two buffers
    per shape and dtype, 1 GiB in all, each handed out again only once no
    array, view or tensor refers to it. The pool holds those buffers after
    your results are gone; call this when a phase with large outputs ends
    (arrays still using a buffer keep it alive). Local, no MPI.
    """
    _POOL.clear()
