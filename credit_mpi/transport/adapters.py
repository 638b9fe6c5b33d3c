"""Array adapters: one per array library (numpy, torch, CuPy), registered by kind, found once per array type.

An adapter holds what differs between the libraries when bytes move: the
byte view (:meth:`as_bytes`), whether the memory is on a device, stream and
device synchronisation, the device context DLPack needs, pinned host
buffers and the copies to and from them (:mod:`credit_mpi.transport.staging`
stages through these). :func:`adapter_of` finds an array's adapter by its
exact type, remembered per type after the first lookup (one dict lookup per
call, not a chain of ``isinstance`` checks per question); :func:`register`
adds a library (its adapter's ``matches(x)`` says which arrays are its).
torch and CuPy are looked up in ``sys.modules``: never imported here.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

__all__ = ["ADAPTERS", "register", "adapter_of", "NumpyAdapter", "TorchAdapter", "CupyAdapter"]


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


class NumpyAdapter:
    """numpy arrays (treated as on a device only under ``_SIMULATE_DEVICE``)."""

    name = "numpy"

    @staticmethod
    def on_device(x: Any) -> bool:
        return False

    @staticmethod
    def as_bytes(x: Any) -> Any:
        return x.reshape(-1).view(np.uint8)

    @staticmethod
    def sync_stream(x: Any) -> None:
        pass

    @staticmethod
    def sync_device(x: Any) -> None:
        pass

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


class TorchAdapter:
    """torch tensors: bytes through DLPack, streams through torch.cuda."""

    name = "torch"

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


def _torch_bytes(x: Any) -> Any:
    """A flat uint8 view of the contiguous tensor ``x`` (shares memory).

    ``as_strided`` rather than ``reshape``: torch calls a one-element tensor
    contiguous whatever its stride, and ``view(uint8)`` refuses a stride != 1.
    """
    return x.as_strided((x.numel(),), (1,)).view(_torch().uint8)


class CupyAdapter:
    """CuPy arrays: bytes through DLPack, streams through cupy.cuda."""

    name = "cupy"

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



NumpyAdapter.matches = staticmethod(lambda x: isinstance(x, np.ndarray))
CupyAdapter.matches = staticmethod(_is_cupy)
TorchAdapter.matches = staticmethod(_is_torch)

ADAPTERS: dict[str, Any] = {}  # kind -> adapter, in lookup order
_BY_TYPE: dict[type, Any] = {}  # an array type -> its adapter, filled on first sight


def register(adapter: Any) -> Any:
    """Add ``adapter`` (a class with ``name``, ``matches(x)`` and the byte operations) for its kind."""
    ADAPTERS[adapter.name] = adapter
    _BY_TYPE.clear()
    return adapter


for _adapter in (NumpyAdapter, CupyAdapter, TorchAdapter):
    register(_adapter)


def adapter_of(x: Any) -> Any:
    """``x``'s adapter, or None for an unsupported type (the caller names it)."""
    kind = type(x)
    adapter = _BY_TYPE.get(kind)
    if adapter is None:
        adapter = next((a for a in ADAPTERS.values() if a.matches(x)), None)
        if adapter is not None:
            _BY_TYPE[kind] = adapter
    return adapter
