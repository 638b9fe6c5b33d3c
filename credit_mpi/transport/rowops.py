"""Row helpers for the halo exchange and its adjoint (numpy, CuPy and torch alike).

Views, copies, sums and flips of the rows ``start:start+length`` along one
dimension, written once for the three array libraries.
"""

from __future__ import annotations

from typing import Any

from .arrays import _numpy_like, _torch

__all__ = ["band", "copy_rows", "add_rows", "fill_rows", "flipped_rows", "roll", "clone", "clone_rows"]


# -- row helpers for halo exchange and autograd (numpy, CuPy and torch) ----


def band(x: Any, dim: int, start: int, length: int) -> Any:
    """A view of rows ``start:start+length`` along ``dim`` (no copy; :func:`arrays.narrow` copies strided bands)."""
    if _numpy_like(x) is not None:
        return x[(slice(None),) * dim + (slice(start, start + length),)]
    return x.narrow(dim, start, length)


def copy_rows(dst: Any, dim: int, start: int, src: Any) -> None:
    """Write ``src`` into rows ``start:start+len(src)`` of ``dst`` along ``dim``."""
    if _numpy_like(dst) is not None:
        band(dst, dim, start, src.shape[dim])[...] = src
    else:
        band(dst, dim, start, src.shape[dim]).copy_(src)


def add_rows(dst: Any, dim: int, start: int, src: Any) -> None:
    """Add ``src`` to rows ``start:start+len(src)`` of ``dst`` along ``dim`` (in place)."""
    if _numpy_like(dst) is not None:
        band(dst, dim, start, src.shape[dim])[...] += src
    else:
        band(dst, dim, start, src.shape[dim]).add_(src)


def fill_rows(x: Any, dim: int, start: int, length: int, value: float = 0) -> None:
    """Set rows ``start:start+length`` of ``x`` along ``dim`` to ``value``."""
    if _numpy_like(x) is not None:
        band(x, dim, start, length)[...] = value
    else:
        band(x, dim, start, length).fill_(value)


def flipped_rows(x: Any, dim: int, start: int, length: int) -> Any:
    """Rows ``start:start+length`` of ``x`` in reverse order along ``dim`` (a new array)."""
    rows = band(x, dim, start, length)
    xp = _numpy_like(x)
    if xp is not None:
        return xp.flip(rows, axis=dim).copy()
    return rows.flip(dim)


def roll(x: Any, shift: int, dim: int) -> Any:
    """``x`` rolled by ``shift`` along ``dim`` (``numpy.roll`` / ``cupy.roll`` / ``torch.roll``)."""
    xp = _numpy_like(x)
    if xp is not None:
        return xp.roll(x, shift, axis=dim)
    return x.roll(shift, dim)


def clone(x: Any) -> Any:
    """A contiguous copy of ``x`` that shares no memory with it (detached for torch)."""
    xp = _numpy_like(x)
    if xp is not None:
        return xp.array(x, order="C", copy=True)
    return x.detach().clone(memory_format=_torch().contiguous_format)


def clone_rows(x: Any, dim: int, start: int, length: int) -> Any:
    """A contiguous copy of rows ``start:start+length`` of ``x`` along ``dim`` (one copy, detached for torch)."""
    return clone(band(x, dim, start, length))
