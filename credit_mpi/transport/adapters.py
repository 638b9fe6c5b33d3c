"""Array adapters: one per array library (numpy, torch, CuPy), registered by kind, found once per array type.

An adapter holds everything that differs between the libraries: what an
array is (:meth:`describe`, the cache keys), how to allocate, view and copy
it (contiguous copies, bands, byte views, the numpy view of a host array,
the output pool), what writing into it means (writability, autograd's
version counter), and how its bytes move (whether the memory is on a
device, stream and device synchronisation, the device context DLPack needs,
pinned host buffers and the copies to and from them, which
:mod:`credit_mpi.transport.staging` stages through). :func:`adapter_of`
finds an array's adapter by its exact type, remembered per type after the
first lookup (one dict lookup, not a chain of ``isinstance`` checks per
question); a caller that asks several questions about one array looks its
adapter up once and passes it down (the ``adapter=`` of
:mod:`credit_mpi.transport.arrays`' helpers). :func:`register` adds a
library (its adapter's ``matches(x)`` says which arrays are its). torch and
CuPy are looked up in ``sys.modules``: never imported here.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import gpu
from .pool import POOL

__all__ = ["ADAPTERS", "register", "adapter_of", "ArrayInfo", "NumpyAdapter", "TorchAdapter", "CupyAdapter"]


def _torch():
    return sys.modules.get("torch")


def _cupy():
    return sys.modules.get("cupy")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cupy(x: Any) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(x, cupy.ndarray)


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


class _NumpyLike:
    """What numpy and CuPy arrays share (``xp``: the module whose functions apply to them)."""

    xp: Any = None
    cache_key = staticmethod(lambda x: None)  # only host arrays have cheap keys
    host_numpy = staticmethod(lambda x: None)  # the numpy view of a host array
    host_bytes = staticmethod(lambda x: None)  # the uint8 numpy view of a contiguous host array

    @staticmethod
    def is_contiguous(x: Any) -> bool:
        return x.flags.c_contiguous

    @classmethod
    def contiguous(cls, x: Any) -> Any:
        return cls.xp.ascontiguousarray(x)

    @classmethod
    def narrow(cls, x: Any, dim: int, start: int, length: int) -> Any:
        return cls.contiguous(x[(slice(None),) * dim + (slice(start, start + length),)])

    @classmethod
    def shares_memory(cls, a: Any, b: Any) -> bool:
        return adapter_of(b) is cls and bool(cls.xp.may_share_memory(a, b))

    mark_written = after_torch_wrote = staticmethod(lambda x: None)  # no autograd; no torch stream to wait for

    @classmethod
    def pooled_empty(cls, like: Any, shape: tuple[int, ...]) -> Any:
        return cls.empty(like, shape)


class NumpyAdapter(_NumpyLike):
    """numpy arrays (treated as on a device only under ``_SIMULATE_DEVICE``)."""

    name = "numpy"
    xp = np
    contiguous = staticmethod(np.ascontiguousarray)  # (the inherited ones, without the module lookup: the hot path)
    is_contiguous = staticmethod(lambda x: x.flags.c_contiguous)
    shares_memory = staticmethod(lambda a, b: isinstance(b, np.ndarray) and bool(np.may_share_memory(a, b)))

    @staticmethod
    def describe(x: Any) -> ArrayInfo:
        if x.dtype.hasobject:
            raise TypeError(f"numpy arrays of dtype {x.dtype} hold Python objects and cannot be sent as bytes")
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(_MASKED)
        return ArrayInfo("numpy", tuple(x.shape), str(x.dtype), "cpu", x.dtype.itemsize)

    @staticmethod
    def empty(like: Any, shape: Sequence[int]) -> Any:
        return np.empty(shape, dtype=like.dtype)

    @staticmethod
    def check_writable(x: Any, what: str) -> None:
        if not x.flags.writeable:
            raise ValueError(f"{what} is a read-only numpy array (flags.writeable is False); pass a writable array")

    @staticmethod
    def cache_key(x: Any) -> tuple:
        return (type(x), x.shape, x.dtype)

    @staticmethod
    def out_cache_key(x: Any, key: tuple) -> tuple:
        return (*key, x.flags.c_contiguous, x.flags.writeable)

    host_numpy = staticmethod(lambda x: x)

    @staticmethod
    def from_host_numpy(like: Any, y: np.ndarray) -> Any:
        return y

    @staticmethod
    def host_bytes(x: Any) -> np.ndarray:
        return x.reshape(-1).view(np.uint8)

    @staticmethod
    def pooled_empty(like: Any, shape: tuple[int, ...]) -> Any:
        dtype = like.dtype
        if dtype.hasobject or 0 in shape:
            return np.empty(shape, dtype=dtype)
        return POOL.take(("numpy", dtype, shape), lambda: np.empty(shape, dtype)).view()  # a new array object

    @staticmethod
    def on_device(x: Any) -> bool:
        return False

    @staticmethod
    def as_bytes(x: Any) -> Any:
        return x.reshape(-1).view(np.uint8)

    sync_stream = sync_device = wait_event = staticmethod(lambda x: None)  # host memory: no stream, no device

    @staticmethod
    def device_context(x: Any) -> Any:
        return contextlib.nullcontext()

    @staticmethod
    def host_buffer(nbytes: int, pinned: bool) -> tuple[Any, np.ndarray]:
        buf = np.empty(nbytes, dtype=np.uint8)
        return buf, buf

    @staticmethod
    def to_host(src: Any, owner: Any, view: np.ndarray) -> None:
        np.copyto(view, src)

    @staticmethod
    def from_host(owner: Any, view: np.ndarray, dst: Any) -> None:
        np.copyto(dst, view)


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


def _is_host_torch(x: Any) -> bool:
    """A torch CPU tensor with the strided layout (the only torch tensors the host fast paths take)."""
    return x.is_cpu and x.layout is _torch().strided


class TorchAdapter:
    """torch tensors: bytes through DLPack, streams through torch.cuda."""

    name = "torch"
    xp = None  # not numpy-like: its own methods

    @staticmethod
    def describe(x: Any) -> ArrayInfo:
        torch = _torch()
        if x.layout != torch.strided:
            raise TypeError(f"torch tensors with layout {x.layout} are not supported (supported: torch.strided)")
        if x.device.type == "cuda":
            _check_device("torch", x.device.index)
        elif x.device.type != "cpu":
            raise TypeError(f"torch tensors on device {x.device} are not supported (supported: cpu, cuda)")
        return ArrayInfo("torch", tuple(x.shape), str(x.dtype), str(x.device), x.element_size())

    @staticmethod
    def is_contiguous(x: Any) -> bool:
        return x.is_contiguous()

    @staticmethod
    def contiguous(x: Any) -> Any:
        # detached (the collectives move data; autograd is credit_mpi.autograd's), lazy conjugate /
        # negative views resolved (DLPack cannot carry them)
        return x.detach().resolve_conj().resolve_neg().contiguous()

    @staticmethod
    def empty(like: Any, shape: Sequence[int]) -> Any:
        return _torch_empty(shape, like.dtype, like.device)

    @staticmethod
    def narrow(x: Any, dim: int, start: int, length: int) -> Any:
        return x.narrow(dim, start, length).contiguous()

    @staticmethod
    def shares_memory(a: Any, b: Any) -> bool:
        if not _is_torch(b) or a.device != b.device:
            return False
        sa, sb = a.untyped_storage(), b.untyped_storage()
        a0, b0 = sa.data_ptr(), sb.data_ptr()
        return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()

    @staticmethod
    def check_writable(x: Any, what: str) -> None:
        if x.requires_grad:
            raise ValueError(f"{what} requires grad: a collective cannot write into it in place; pass a tensor without requires_grad")
        if x.is_inference() and not _torch().is_inference_mode_enabled():
            raise ValueError(f"{what} is an inference tensor and cannot be written outside torch.inference_mode()")

    @staticmethod
    def mark_written(x: Any) -> None:
        if not x.is_inference():
            _torch().autograd.graph.increment_version(x)

    @staticmethod
    def after_torch_wrote(x: Any) -> None:
        pass  # torch orders its own streams

    @staticmethod
    def cache_key(x: Any) -> tuple | None:
        if not _is_host_torch(x):
            return None
        return (type(x), x.shape, x.dtype, x.requires_grad and _torch().is_grad_enabled())

    @staticmethod
    def out_cache_key(x: Any, key: tuple) -> tuple:
        return (*key, x.is_contiguous(), x.requires_grad, x.is_inference(), _torch().is_inference_mode_enabled())

    @staticmethod
    def host_numpy(x: Any) -> np.ndarray | None:
        if not _is_host_torch(x):
            return None
        x = x.detach()
        if x.is_conj() or x.is_neg():  # a lazy conjugate / negative view: resolved first (a copy; DLPack would
            return _shared_numpy(x.resolve_conj().resolve_neg())  # export a negative view's raw data, unnegated)
        try:
            return np.from_dlpack(x)  # not x.numpy() (see _shared_numpy), inline: the per-call path
        except (BufferError, RuntimeError, TypeError):
            return None  # a dtype numpy does not have

    @staticmethod
    def from_host_numpy(like: Any, y: np.ndarray) -> Any:
        return _torch().from_numpy(y)

    @staticmethod
    def host_bytes(x: Any) -> np.ndarray | None:
        if x.device.type != "cpu":
            return None
        typed = _NUMPY_DTYPES.get(x.dtype, False)
        if typed is False:
            typed = _numpy_dtype(x.dtype)
        if typed is not None and not (x.is_conj() or x.is_neg()):  # numpy's own views: the per-call fast path
            flat = np.from_dlpack(x.detach()).reshape(-1)  # not x.numpy() (see _shared_numpy), inline: per call
            if flat.flags.c_contiguous:
                return flat.view(np.uint8)
        return _shared_numpy(_torch_bytes(x.detach()))

    @staticmethod
    def pooled_empty(like: Any, shape: tuple[int, ...]) -> Any:
        if like.device.type != "cpu":
            return _torch_empty(shape, like.dtype, like.device)
        nbytes = like.element_size() * math.prod(shape)
        if nbytes == 0:
            return _torch_empty(shape, like.dtype, like.device)
        base = POOL.take(("torch", str(like.dtype), shape), lambda: np.empty(nbytes, dtype=np.uint8))
        typed = _NUMPY_DTYPES.get(like.dtype, False)
        if typed is False:
            typed = _numpy_dtype(like.dtype)
        if typed is not None:  # shaped by numpy, one tensor made (the view keeps the base: the pool sees it live)
            return _torch().from_numpy(base.view(typed).reshape(shape))
        return _torch().from_numpy(base).view(like.dtype).reshape(shape)

    @staticmethod
    def on_device(x: Any) -> bool:
        return x.device.type == "cuda"

    @staticmethod
    def as_bytes(x: Any) -> Any:
        return _torch_bytes(x)

    @staticmethod
    def sync_stream(x: Any) -> None:
        if x.device.type == "cuda":
            _torch().cuda.current_stream(x.device).synchronize()

    @staticmethod
    def sync_device(x: Any) -> None:
        if x.device.type == "cuda":
            _torch().cuda.synchronize(x.device)

    @staticmethod
    def wait_event(x: Any) -> None:
        """The host waits for the work queued so far on ``x``'s current stream (an event recorded there; not the
        device, not what is queued later): one exchange's wait before a CUDA-aware MPI reads or writes."""
        if x.device.type == "cuda":
            cuda = _torch().cuda
            event = cuda.Event()
            event.record(cuda.current_stream(x.device))
            event.synchronize()

    @staticmethod
    def device_context(x: Any) -> Any:
        # torch exports a CUDA tensor through DLPack only while its device is
        # torch's current one ("Can't export tensors on a different CUDA device").
        if x.device.type == "cuda":
            return _torch().cuda.device(x.device)
        return contextlib.nullcontext()

    @staticmethod
    def host_buffer(nbytes: int, pinned: bool) -> tuple[Any, np.ndarray]:
        torch = _torch()
        owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return owner, owner.numpy()

    @staticmethod
    def to_host(src: Any, owner: Any, view: np.ndarray) -> None:
        # Blocking copy (non_blocking=False) on the current stream: ordered
        # after the kernels that produced ``src``, complete when it returns.
        owner[: view.size].copy_(src)

    @staticmethod
    def from_host(owner: Any, view: np.ndarray, dst: Any) -> None:
        # Blocking too: the staging buffer may be reused right after.
        dst.copy_(owner[: view.size])


_NUMPY_DTYPES: dict = {}  # torch dtype -> numpy dtype, or None where numpy has none (bfloat16, float8)


def _numpy_dtype(dtype: Any) -> Any:
    """numpy's dtype for the torch ``dtype``, or None, remembered in ``_NUMPY_DTYPES`` (read it first: a dict
    lookup, no call; torch is never imported here)."""
    if not _NUMPY_DTYPES:
        torch = _torch()
        for name in ("float16", "float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64",
                     "uint8", "bool"):
            _NUMPY_DTYPES[getattr(torch, name)] = np.dtype(name)
    return _NUMPY_DTYPES.setdefault(dtype, None)


def _shared_numpy(x: Any) -> np.ndarray:
    """numpy's view of the host tensor ``x`` (no grad; shares memory and keeps ``x`` alive) through DLPack.

    Not ``x.numpy()``: torch marks the storage of a tensor it hands numpy unresizable for good, and a user's
    tensor that went through a collective must stay what it was (FSDP2 frees and regathers its parameters'
    storage; ``resize_`` refuses such a storage). Raises TypeError for a dtype numpy lacks (bfloat16), as
    ``numpy()`` does, and RuntimeError for a lazy conjugate or negative view.
    """
    if x.is_conj() or x.is_neg():  # checked here: DLPack exports a negative view's raw data, unnegated
        raise RuntimeError("a lazy conjugate or negative view")
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError) as exc:  # torch exports no bfloat16 (numpy has none either)
        raise TypeError(str(exc)) from None


def _torch_bytes(x: Any) -> Any:
    """A flat uint8 view of the contiguous tensor ``x`` (shares memory).

    ``as_strided`` rather than ``reshape``: torch calls a one-element tensor
    contiguous whatever its stride, and ``view(uint8)`` refuses a stride != 1.
    """
    return x.as_strided((x.numel(),), (1,)).view(_torch().uint8)


class CupyAdapter(_NumpyLike):
    """CuPy arrays: bytes through DLPack, streams through cupy.cuda."""

    name = "cupy"  # xp: the cupy module, set when the first CuPy array is seen (never imported here)

    @staticmethod
    def describe(x: Any) -> ArrayInfo:
        _check_device("cupy", x.device.id)
        return ArrayInfo("cupy", tuple(x.shape), str(x.dtype), f"cuda:{x.device.id}", x.dtype.itemsize)

    @staticmethod
    def empty(like: Any, shape: Sequence[int]) -> Any:
        with like.device:
            return _cupy().empty(tuple(shape), dtype=like.dtype)

    @staticmethod
    def check_writable(x: Any, what: str) -> None:
        pass

    @staticmethod
    def after_torch_wrote(x: Any) -> None:
        # CuPy's current stream need not be torch's: wait for torch's work, so CuPy's next kernel
        # does not read the memory too early
        _torch().cuda.current_stream(x.device.id).synchronize()

    @staticmethod
    def on_device(x: Any) -> bool:
        return True

    @staticmethod
    def as_bytes(x: Any) -> Any:
        return x.reshape(-1).view(_cupy().uint8)

    @staticmethod
    def sync_stream(x: Any) -> None:
        with x.device:
            _cupy().cuda.get_current_stream().synchronize()

    @staticmethod
    def sync_device(x: Any) -> None:
        x.device.synchronize()

    @staticmethod
    def wait_event(x: Any) -> None:
        with x.device:
            event = _cupy().cuda.Event()
            event.record()
            event.synchronize()

    @staticmethod
    def device_context(x: Any) -> Any:
        return x.device

    @staticmethod
    def host_buffer(nbytes: int, pinned: bool) -> tuple[Any, np.ndarray]:
        # As cupyx.empty_pinned does: a writable numpy array over page-locked memory.
        memory = _cupy().cuda.alloc_pinned_memory(nbytes)
        return memory, np.ndarray((nbytes,), dtype=np.uint8, buffer=memory)

    @staticmethod
    def to_host(src: Any, owner: Any, view: np.ndarray) -> None:
        # ndarray.get: on the current stream, blocking by default.
        src.get(out=view)

    @staticmethod
    def from_host(owner: Any, view: np.ndarray, dst: Any) -> None:
        # ndarray.set queues an asynchronous copy on the current stream;
        # wait for it, since the staging buffer is reused right after.
        with dst.device:
            dst.set(view)
            _cupy().cuda.get_current_stream().synchronize()


def _matches_cupy(x: Any) -> bool:
    if not _is_cupy(x):
        return False
    CupyAdapter.xp = _cupy()
    return True


NumpyAdapter.matches = staticmethod(lambda x: isinstance(x, np.ndarray))
CupyAdapter.matches = staticmethod(_matches_cupy)
TorchAdapter.matches = staticmethod(_is_torch)

ADAPTERS: dict[str, Any] = {}  # kind -> adapter, in lookup order
_BY_TYPE: dict[type, Any] = {}  # an array type -> its adapter, filled on first sight


def register(adapter: Any) -> Any:
    """Add ``adapter`` (a class with ``name``, ``matches(x)`` and the operations above) for its kind."""
    ADAPTERS[adapter.name] = adapter
    _BY_TYPE.clear()
    return adapter


for _adapter in (NumpyAdapter, CupyAdapter, TorchAdapter):
    register(_adapter)


def adapter_of(x: Any) -> Any:
    """``x``'s adapter, or None for an unsupported type (the caller names it)."""
    adapter = _BY_TYPE.get(type(x))
    if adapter is None:
        adapter = next((a for a in ADAPTERS.values() if a.matches(x)), None)
        if adapter is not None:
            _BY_TYPE[type(x)] = adapter
    return adapter
