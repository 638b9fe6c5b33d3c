"""The local checks of an op along one dim of a banded tensor: the tensor, the dim, the transport, the cache key."""

from __future__ import annotations

from typing import Any

import torch

from ..partition import normalize_dim
from ..transport.moves import transport_name

__all__ = ["check_float", "check_band", "transport_key"]

_DTYPES = (torch.float32, torch.float64)
# What a byte move carries (rows, all-to-all): no arithmetic, so half precisions (a bf16 model's joins) and complex
# (spectra) too; an op that adds (ring attention's softmax sums) keeps to float32/float64.
_MOVED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def check_float(t: Any, path: str, verb: str, name: str = "", moved_only: bool = False) -> None:
    """The ops' tensor check: ``t`` a float32/float64 tensor, else the TypeError ``"<path>: <verb> float32/float64 tensors, got ..."``.

    ``moved_only``: the op only moves bytes, so float16, bfloat16 and complex tensors pass too.
    """
    allowed = _MOVED_DTYPES if moved_only else _DTYPES
    if not isinstance(t, torch.Tensor) or t.dtype not in allowed:
        kinds = "floating-point or complex" if moved_only else "float32/float64"
        raise TypeError(f"{path}: {verb} {kinds} tensors, got {name}{getattr(t, 'dtype', type(t).__name__)}")


def check_band(t: Any, args: dict, verb: str = "moves") -> tuple[int, tuple, str]:
    """The local check of an op along one dim: ``t`` a float tensor (:func:`check_float`), ``dim`` one of its
    dims, ``transport`` a transport; returns ``(axis, the other dims, the transport's name)`` (the last two agreed)."""
    check_float(t, args["path"], verb, moved_only=True)
    transport = transport_name(args["transport"], args["path"])
    axis = normalize_dim(args["dim"], t.ndim)
    return axis, tuple(t.shape[:axis]) + tuple(t.shape[axis + 1 :]), transport


def transport_key(t: Any, args: dict, *static: Any) -> Any:
    """The cache key of the ops of a torch tensor over MPI (``static``: the arguments that decide the plan), else None."""
    transport = args["transport"]
    if not isinstance(t, torch.Tensor) or not (isinstance(transport, str) and transport == "mpi"):
        return None
    return (*static, tuple(t.shape), t.dtype)
