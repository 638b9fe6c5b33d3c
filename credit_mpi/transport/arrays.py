"""Array kinds: what credit_mpi needs to know about numpy, torch (CPU, CUDA) and CuPy arrays.

Everything above :mod:`credit_mpi.transport` speaks "an array with a shape,
a dtype and a buffer"; this module describes arrays (:class:`ArrayInfo`),
allocates outputs of the same kind, dtype and device, makes contiguous
views and byte views, and answers per-library questions (is it in device
memory, which stream to wait for, which MPI datatype). numpy is the
reference type; torch and CuPy are looked up in ``sys.modules`` (never
imported at ``import credit_mpi`` time) and imported here only when the
caller already has one of their arrays.

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

import collections
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import gpu
from .adapters import _cupy, _is_cupy, _is_torch, _torch, _torch_bytes, adapter_of

# Internal switch for tests (never set in production code): treat CPU arrays
# as device arrays, so the CUDA-aware decision and the staging copies run on
# a machine without a GPU (transport.staging routes them).
_SIMULATE_DEVICE = False

__all__ = [
    "ArrayInfo",
    "describe",
    "is_array",
    "is_contiguous",
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


class ArrayInfo(NamedTuple):
    """What the collectives need to know about an array, comparable across ranks.

    A named tuple: it travels in every collective argument check, and
    pickles in a third of the time a dataclass takes.
    """

    kind: str  # "numpy", "torch" or "cupy"
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", "torch.bfloat16"
    device: str  # "cpu", "cuda:0", ...
    itemsize: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: the device without its index, which may differ per rank."""
        return self.device.split(":")[0]

    def same_kind(self, other: ArrayInfo) -> bool:
        """Same library, dtype and device type (the device index may differ per rank)."""
        return (self.kind, self.dtype, self.device_type) == (other.kind, other.dtype, other.device_type)


# --------------------------------------------------------------------------- library lookup (transport.adapters)


def is_array(x: Any) -> bool:
    """True for the array types credit_mpi shards (numpy, torch CPU/CUDA, CuPy)."""
    return isinstance(x, np.ndarray) or _is_torch(x) or _is_cupy(x)


def _current_device(kind: str) -> int:
    if kind == "torch":
        return _torch().cuda.current_device()
    return _cupy().cuda.Device().id


def _check_device(kind: str, index: int) -> None:
    """A device array must be on this rank's device (bound, or else current)."""
    bound = gpu.bound_device()
    expected = bound if bound is not None else _current_device(kind)
    if index != expected:
        how = "by credit_mpi.gpu.bind_device()" if bound is not None else f"the current {kind} device"
        raise ValueError(
            f"{kind} array is on cuda:{index}, but this rank's GPU is cuda:{expected} ({how}); "
            f"move the array to cuda:{expected} or bind the rank with credit_mpi.gpu.bind_device()"
        )


# Refused rather than carried: credit_mpi moves an array's bytes, and a masked array's mask is a second
# array; moving the data alone would silently unmask every value. Moving both is the caller's two calls.
_MASKED = (
    "numpy masked arrays are not supported: their mask would be lost (credit_mpi moves the data only); pass "
    "np.ma.getdata(x) (and the mask as its own array, np.ma.getmaskarray(x), through the same call), or "
    "x.filled(value)"
)


def describe(x: Any) -> ArrayInfo:
    """Shape, dtype and device of ``x``.

    Raises:
        TypeError: ``x`` is not a supported array type (or device type).
        ValueError: ``x`` is on a GPU other than this rank's.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise TypeError(f"numpy arrays of dtype {x.dtype} hold Python objects and cannot be sent as bytes")
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(_MASKED)
        return ArrayInfo("numpy", tuple(x.shape), str(x.dtype), "cpu", x.dtype.itemsize)
    if _is_torch(x):
        torch = _torch()
        if x.layout != torch.strided:
            raise TypeError(f"torch tensors with layout {x.layout} are not supported (supported: torch.strided)")
        if x.device.type == "cuda":
            _check_device("torch", x.device.index)
        elif x.device.type != "cpu":
            raise TypeError(f"torch tensors on device {x.device} are not supported (supported: cpu, cuda)")
        return ArrayInfo("torch", tuple(x.shape), str(x.dtype), str(x.device), x.element_size())
    if _is_cupy(x):
        _check_device("cupy", x.device.id)
        return ArrayInfo("cupy", tuple(x.shape), str(x.dtype), f"cuda:{x.device.id}", x.dtype.itemsize)
    raise TypeError(
        f"unsupported array type {type(x).__module__}.{type(x).__qualname__}; "
        f"expected a numpy.ndarray, a torch.Tensor (CPU or CUDA) or a cupy.ndarray"
    )


# --------------------------------------------------------------------------- allocation, layout


def is_contiguous(x: Any) -> bool:
    """True when ``x`` is C-contiguous (it can be sent or received in place)."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return x.flags.c_contiguous
    return x.is_contiguous()


def contiguous(x: Any) -> Any:
    """``x`` as a C-contiguous array of the same kind (copied only if needed).

    torch tensors are detached (the collectives move data; autograd is
    handled by :mod:`credit_mpi.autograd`), and lazy conjugate/negative views
    are resolved, since DLPack cannot carry them.
    """
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    if _is_cupy(x):
        return _cupy().ascontiguousarray(x)
    return x.detach().resolve_conj().resolve_neg().contiguous()


def empty(like: Any, shape: Sequence[int]) -> Any:
    """A new uninitialised array of ``shape`` with ``like``'s kind, dtype and device."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    if _is_cupy(like):
        with like.device:
            return _cupy().empty(tuple(shape), dtype=like.dtype)
    return _torch_empty(shape, like.dtype, like.device)


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


_HUGE_PAGE_BYTES = 1 << 21  # below one huge page, torch.empty is as good


def _torch_empty(shape: Sequence[int], dtype: Any, device: Any) -> Any:
    """``torch.empty``, but CPU tensors get numpy's allocator.

    numpy asks the kernel for transparent huge pages on large buffers
    (``madvise``), torch's CPU allocator does not: first touching a fresh
    66 MB output costs 33 ms through torch.empty and 10 ms through numpy
    (measured here), and a gather that returns a new tensor pays exactly that.
    The tensor owns the numpy buffer; nothing else changes.
    """
    torch = _torch() or importlib.import_module("torch")
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if torch.device(device).type != "cpu" or nbytes < _HUGE_PAGE_BYTES:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).reshape(tuple(shape))


def _local_index(kind: str) -> int:
    bound = gpu.bound_device()
    return bound if bound is not None else _current_device(kind)


def _numpy_like(x: Any):
    """numpy or cupy, the module whose functions apply to ``x``; None for torch."""
    if isinstance(x, np.ndarray):
        return np
    return _cupy() if _is_cupy(x) else None


def dtype_of(x: Any) -> Any:
    """``x``'s dtype object (``numpy.dtype`` or ``torch.dtype``): it pickles, record dtypes included."""
    return x.dtype


def shares_memory(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` may overlap in memory (same kind of array; conservative)."""
    xp = _numpy_like(a)
    if xp is not None:
        return _numpy_like(b) is xp and bool(xp.may_share_memory(a, b))
    if not _is_torch(b) or a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


def check_writable(x: Any, what: str) -> None:
    """Raise ``ValueError`` unless a collective may write into ``x`` in place.

    Refused: read-only numpy arrays, torch tensors that require grad (an
    in-place write into a leaf of the graph), torch inference tensors outside
    inference mode.
    """
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{what} is a read-only numpy array (flags.writeable is False); pass a writable array")
    if _is_torch(x):
        torch = _torch()
        if x.requires_grad:
            raise ValueError(f"{what} requires grad: a collective cannot write into it in place; pass a tensor without requires_grad")
        if x.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{what} is an inference tensor and cannot be written outside torch.inference_mode()")


def mark_written(x: Any) -> None:
    """Tell torch autograd that ``x`` was written in place (its version counter moves on).

    A tensor that autograd saved for a backward pass and that a collective
    then overwrote is then an error at ``backward()``, as after torch's own
    in-place operations, instead of a silently wrong gradient.
    """
    if _is_torch(x) and not x.is_inference():
        _torch().autograd.graph.increment_version(x)


def narrow(x: Any, dim: int, start: int, length: int) -> Any:
    """The rows ``start:start+length`` of ``x`` along ``dim``, as a contiguous array.

    Shares memory with ``x`` when that band is already contiguous (as
    ``torch.Tensor.narrow(...).contiguous()`` does), otherwise a copy.
    """
    if isinstance(x, np.ndarray) or _is_cupy(x):
        index = (slice(None),) * dim + (slice(start, start + length),)
        return contiguous(x[index])
    return x.narrow(dim, start, length).contiguous()


def as_torch_bytes(x: Any) -> Any:
    """A flat uint8 torch tensor over the bytes of contiguous ``x`` (numpy, torch or CuPy; no copy)."""
    torch = importlib.import_module("torch")
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.reshape(-1).view(np.uint8))
    if not _is_torch(x):  # CuPy (or any DLPack producer)
        x = torch.from_dlpack(x)
    return _torch_bytes(x)


def _ops(x: Any) -> Any:
    """``x``'s adapter (:func:`credit_mpi.transport.adapters.adapter_of`); a TypeError that names an unsupported type."""
    adapter = adapter_of(x)
    if adapter is None:
        describe(x)  # raises the TypeError that names the type
    return adapter


def in_device_memory(buf: Any) -> bool:
    """True when ``buf`` (an array, or a buffer from :func:`send_buffer`/:func:`recv_buffer`) is GPU memory.

    A staged transfer yields host memory, a direct one device memory: code
    that must treat device pointers differently (non-blocking collectives,
    reusing scratch) asks here.
    """
    return _ops(buf).on_device(buf)


def sync_stream(x: Any) -> None:
    """Wait for the work queued on ``x``'s current stream (nothing for host arrays).

    Before MPI writes memory that device kernels queued earlier still read
    (scratch reused across iterations), as :func:`send_buffer` does before MPI reads.
    """
    _ops(x).sync_stream(x)


def after_torch_wrote(x: Any) -> None:
    """torch (a torch.distributed collective and copies on torch's current stream) wrote ``x``'s memory.

    For a CuPy array wait for that work: CuPy's current stream need not be
    torch's, so its next kernel could otherwise read the memory too early.
    numpy arrays and torch tensors need nothing (host copies block; torch
    orders its own streams).
    """
    if _is_cupy(x):
        _torch().cuda.current_stream(x.device.id).synchronize()


def mpi_datatype(x: Any) -> MPI.Datatype:
    """The predefined MPI datatype of ``x``'s elements (``MPI.Datatype.fromcode``), for reductions.

    Data that only moves travels as bytes; a reduction needs MPI to know the type.

    Raises:
        TypeError: the dtype has no MPI counterpart (torch ``bfloat16``;
            ``float16`` in MPIs without ``MPIX_C_FLOAT16``): widen to float32 first.
    """
    dtype = x.dtype
    if _is_torch(x):
        torch = _torch()
        try:
            dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # numpy has no such dtype (bfloat16)
            raise TypeError(f"{dtype} has no MPI datatype; convert to torch.float32 to reduce it") from None
    try:
        datatype = MPI.Datatype.fromcode(np.dtype(dtype).char)
    except (KeyError, ValueError):
        datatype = MPI.DATATYPE_NULL
    if datatype == MPI.DATATYPE_NULL:
        raise TypeError(f"{dtype} has no MPI datatype in this MPI; convert to float32 to reduce it")
    return datatype



def requires_grad(x: Any) -> bool:
    """True when ``x`` is a torch tensor that autograd is recording (grad mode on)."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


# -- per-call fast paths: cache keys, host byte views, an output pool ----


def cache_key(x: Any) -> tuple | None:
    """A hashable key that decides :func:`describe` of ``x`` (and its kind), or None when none is cheap.

    Two arrays with the same key describe alike, so a plan made for one is
    the plan for the other. Host arrays only (numpy, torch CPU with the
    strided layout): a device array's description also depends on this
    rank's current device, and under ``_SIMULATE_DEVICE`` every array takes
    the device paths. ``requires_grad`` (with grad mode) is part of the key.
    """
    if _SIMULATE_DEVICE:
        return None
    if isinstance(x, np.ndarray):
        return (type(x), x.shape, x.dtype)
    if _is_host_torch(x):
        return (type(x), x.shape, x.dtype, x.requires_grad and _torch().is_grad_enabled())
    return None


def _is_host_torch(x: Any) -> bool:
    """A torch CPU tensor with the strided layout (the only torch tensors the host fast paths take)."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and x.is_cpu and x.layout is torch.strided


def out_cache_key(x: Any) -> tuple | None:
    """:func:`cache_key` of an output array, with what decides :func:`is_contiguous` and :func:`check_writable` of it.

    Two outputs with the same key pass or fail a collective's checks of
    ``out=`` alike, so a plan checked for one is the plan for the other.
    """
    key = cache_key(x)
    if key is None:
        return None
    if isinstance(x, np.ndarray):
        return (*key, x.flags.c_contiguous, x.flags.writeable)
    return (*key, x.is_contiguous(), x.requires_grad, x.is_inference(), _torch().is_inference_mode_enabled())


def host_numpy(x: Any) -> np.ndarray | None:
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
    if isinstance(x, np.ndarray):
        return x
    if _is_host_torch(x):
        try:
            return x.detach().numpy()
        except TypeError:  # a dtype numpy does not have
            return None
        except RuntimeError:  # a lazy conjugate / negative view: resolved first (a copy)
            return x.detach().resolve_conj().resolve_neg().numpy()
    return None


def from_host_numpy(like: Any, y: np.ndarray) -> Any:
    """``y`` (a result computed on :func:`host_numpy` views) as an array of ``like``'s kind (shares memory)."""
    if isinstance(like, np.ndarray):
        return y
    return _torch().from_numpy(y)


def host_bytes(x: Any) -> np.ndarray | None:
    """A flat ``uint8`` numpy view of contiguous host ``x`` (numpy or torch CPU; shares memory), or None.

    None for device arrays (and under ``_SIMULATE_DEVICE``): they go
    through :func:`send_buffer` / :func:`recv_buffer`.
    """
    if _SIMULATE_DEVICE:
        return None
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    if _is_torch(x) and x.device.type == "cpu":
        return _torch_bytes(x.detach()).numpy()
    return None


class _OutputPool:
    """Host buffers for outputs a collective returns new each call, reused once no array uses them.

    A loop that gathers the same shape every step would otherwise get fresh
    memory every call and pay for first touching its pages. The pool keeps
    at most :attr:`per_key` buffers per (kind, dtype, shape) and
    :attr:`max_bytes` in all (least recently used keys go first). A buffer
    is handed out again only when nothing but the pool refers to it: every
    numpy view of it and every torch tensor made from it holds a reference
    (torch keeps the numpy array alive), so a live array keeps its memory.
    """

    per_key = 2
    max_bytes = 1 << 30

    def __init__(self) -> None:
        self.buffers: collections.OrderedDict = collections.OrderedDict()  # key -> list of arrays (numpy: typed; torch: uint8 bases)
        self.reused = 0
        self.allocated = 0

    def take(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        """A pooled array for ``key`` that nothing else refers to, or a new one from ``make()`` (kept if there is room)."""
        free = self.buffers.pop(key, None)
        if free is None:
            free = []
        self.buffers[key] = free  # most recently used last
        for i in range(len(free)):
            # references: the list, and getrefcount's argument (nothing else: no live view)
            if sys.getrefcount(free[i]) == 2:
                self.reused += 1
                return free[i]
        base = make()
        self.allocated += 1
        if len(free) < self.per_key and base.nbytes <= self.max_bytes:
            free.append(base)
            self._trim()
        return base

    def _trim(self) -> None:
        total = sum(b.nbytes for bases in self.buffers.values() for b in bases)
        while total > self.max_bytes and self.buffers:
            _, bases = self.buffers.popitem(last=False)
            total -= sum(b.nbytes for b in bases)

    def clear(self) -> None:
        self.buffers.clear()


_POOL = _OutputPool()


def pooled_empty(like: Any, shape: Sequence[int]) -> Any:
    """:func:`empty` for outputs returned new on every call: host memory comes from a reuse pool.

    The result is a new array object of ``like``'s kind, dtype and device;
    on the host its memory is a pooled buffer that no live array uses (see
    :class:`_OutputPool`), so a loop that drops last step's result does not
    first-touch new pages every call. Device arrays: :func:`empty` (torch
    and CuPy have caching allocators of their own).
    """
    if _SIMULATE_DEVICE:
        return empty(like, shape)
    if type(shape) is not tuple:
        shape = tuple(int(s) for s in shape)
    if isinstance(like, np.ndarray):
        dtype = like.dtype
        if dtype.hasobject or 0 in shape:
            return empty(like, shape)
        return _POOL.take(("numpy", dtype, shape), lambda: np.empty(shape, dtype)).view()  # a new array object
    if _is_torch(like) and like.device.type == "cpu":
        torch = _torch()
        nbytes = like.element_size() * math.prod(shape)
        if nbytes == 0:
            return empty(like, shape)
        base = _POOL.take(("torch", str(like.dtype), shape), lambda: np.empty(nbytes, dtype=np.uint8))
        return torch.from_numpy(base).view(like.dtype).reshape(shape)
    return empty(like, shape)


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
