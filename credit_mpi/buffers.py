"""The one place that knows the array libraries.

Everything above this module speaks "an array with a shape, a dtype and a
buffer"; this module turns numpy arrays and torch tensors into what mpi4py
sends and receives, and allocates outputs of the same kind, dtype and device
as the input. numpy is the reference type; torch is imported only when the
caller already has a torch tensor (it is looked up in ``sys.modules``, never
imported here).

Data always travels as raw bytes (``MPI.BYTE``): credit_mpi's collectives
move data without arithmetic, so every dtype works the same way, including
those MPI has no name for (``bool``, ``float16``, torch ``bfloat16``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = [
    "ArrayInfo",
    "describe",
    "is_array",
    "is_contiguous",
    "contiguous",
    "empty",
    "empty_described",
    "narrow",
    "send_buffer",
    "recv_buffer",
]


@dataclass(frozen=True)
class ArrayInfo:
    """What the collectives need to know about an array, comparable across ranks."""

    kind: str  # "numpy" or "torch"
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

    def same_kind(self, other: "ArrayInfo") -> bool:
        """Same library, dtype and device type (the device index may differ per rank)."""
        return (self.kind, self.dtype, self.device_type) == (other.kind, other.dtype, other.device_type)


def _torch():
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_array(x: Any) -> bool:
    """True for the array types credit_mpi shards (numpy arrays, torch tensors)."""
    return isinstance(x, np.ndarray) or _is_torch(x)


def describe(x: Any) -> ArrayInfo:
    """Shape, dtype and device of ``x``.

    Raises:
        TypeError: ``x`` is not a supported array type.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise TypeError(f"numpy arrays of dtype {x.dtype} hold Python objects and cannot be sent as bytes")
        return ArrayInfo("numpy", tuple(x.shape), str(x.dtype), "cpu", x.dtype.itemsize)
    if _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(
                f"torch tensors on device {x.device} are not supported by this build of "
                f"credit_mpi's buffer layer (supported: cpu)"
            )
        return ArrayInfo("torch", tuple(x.shape), str(x.dtype), str(x.device), x.element_size())
    raise TypeError(
        f"unsupported array type {type(x).__module__}.{type(x).__qualname__}; "
        f"expected a numpy.ndarray or a torch.Tensor"
    )


def is_contiguous(x: Any) -> bool:
    """True when ``x`` is C-contiguous (it can be sent or received in place)."""
    if isinstance(x, np.ndarray):
        return x.flags.c_contiguous
    return x.is_contiguous()


def contiguous(x: Any) -> Any:
    """``x`` as a C-contiguous array of the same kind (copied only if needed).

    torch tensors are detached: the collectives move data, autograd is
    handled by :mod:`credit_mpi.autograd`.
    """
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    return x.detach().contiguous()


def empty(like: Any, shape: Sequence[int]) -> Any:
    """A new uninitialised array of ``shape`` with ``like``'s kind, dtype and device."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    return _torch().empty(tuple(shape), dtype=like.dtype, device=like.device)


def empty_described(info: ArrayInfo, shape: Sequence[int]) -> Any:
    """A new array of ``shape`` of the kind and dtype that ``info`` describes.

    For ranks that must allocate like an array they do not hold (the
    receivers of a scatter). torch is imported here only because the data
    is a torch tensor.
    """
    if info.kind == "numpy":
        return np.empty(shape, dtype=np.dtype(info.dtype))
    torch = importlib.import_module("torch")
    dtype = getattr(torch, info.dtype.removeprefix("torch."))
    return torch.empty(tuple(shape), dtype=dtype, device=info.device_type)


def narrow(x: Any, dim: int, start: int, length: int) -> Any:
    """The rows ``start:start+length`` of ``x`` along ``dim``, as a contiguous array.

    Shares memory with ``x`` when that band is already contiguous (as
    ``torch.Tensor.narrow(...).contiguous()`` does), otherwise a copy.
    """
    if isinstance(x, np.ndarray):
        index = (slice(None),) * dim + (slice(start, start + length),)
        return np.ascontiguousarray(x[index])
    return x.narrow(dim, start, length).contiguous()


def _bytes(x: Any) -> np.ndarray:
    """A 1-D uint8 view of the contiguous CPU array ``x`` (no copy)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    torch = _torch()
    return x.reshape(-1).view(torch.uint8).numpy()


@contextlib.contextmanager
def send_buffer(x: Any) -> Iterator[np.ndarray]:
    """A buffer mpi4py can send (``MPI.BYTE``) holding the bytes of contiguous ``x``."""
    yield _bytes(x)


@contextlib.contextmanager
def recv_buffer(out: Any) -> Iterator[np.ndarray]:
    """A buffer mpi4py can receive into (``MPI.BYTE``); its bytes end up in ``out``."""
    yield _bytes(out)
