"""The group-major layout: rows at a stride across the field moved to the rank that owns their group, differentiable.

CrossFormer's long-distance attention (``rearrange(x, "b d (l1 h) (l2 w) ->
(b h w) d l1 l2", l1=window)``) attends within groups of rows at a stride of
``h = H / window`` across the whole latitude: group ``j`` holds the rows
``{i1 * h + j : i1 < window}``, one from each of ``window`` slices of the
field, so every group spans (nearly) every band. The group layout splits
the ``h`` groups among the ranks (:func:`credit_mpi.layout.split`, uneven
allowed: the first ranks one more), rank ``r`` (groups ``[J_r, J_r + h_r)``)
holding its groups' rows window-major: local row ``i1 * h_r + (j - J_r)`` is
global row ``i1 * h + j``. The module's own forward, which counts its groups
from its input's shape (``h_r``), then sees whole groups in the order the
rearrange expects, and runs locally: exact.

:func:`to_groups` moves a band layout there and :func:`from_groups` back:
the row maps ``"to_groups"`` and ``"from_groups"`` of :mod:`credit_mpi.ops.rows` (one
``alltoallv`` each of the transport; the map is written once, :func:`group_source`,
the move back its inverse), which is also each one's adjoint. Per rank the
move sends the rows of its band that belong to other ranks' groups, about
``(P - 1) / P`` of its band.

Run by the one op of row moves (:class:`~credit_mpi.ops.rows.MoveRows`): every rank's rows travel in the
agreement, the window and the band layout to return to are agreed, so a
height that is not a multiple of the window (the model itself requires one)
or a bad argument on one rank raises the same exception on every rank before
data moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..layout import offsets, split
from .rows import move_along, moved_along, row_map

__all__ = ["to_groups", "from_groups", "grouped", "group_sizes", "group_source", "NoGroupLayout", "group_layout_problem"]


class NoGroupLayout(ValueError):
    """The field has no group layout of the window on these ranks (``.why``: the reason, the same on every rank)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.why = why


def group_layout_problem(height: int, window: int, n: int, least: int = 0) -> str | None:
    """Why ``height`` rows have no group layout of ``window`` rows a group on ``n`` ranks, each with ``least`` groups
    (None: they have one). One place for the words of the op and of describe()'s dry run."""
    if height % window:
        return (f"the field's {height} rows are not a multiple of the window {window} (the groups are the rows "
                f"i * (H / {window}) + j; valid heights are multiples of {window})")
    if height // window // n < least:
        return (f"the field's {height // window} groups (H / window = {height} / {window}) are fewer than "
                f"{least} per rank on {n} ranks (the module's forward needs at least {least} group(s) on every "
                f"rank): use at most {max(1, height // window // max(least, 1))} ranks or a smaller window")
    return None


def group_sizes(height: int, window: int, n: int) -> tuple[int, ...]:
    """Every rank's rows in the group layout of ``height`` rows in groups of ``window`` (``window`` x its groups)."""
    return tuple(window * g for g in split(height // window, n, uneven=True))


def group_source(height: int, window: int, n: int):
    """``src(o)``: the global row (band order) of row ``o`` of the group layout (rows concatenated in rank order)."""
    sizes = split(height // window, n, uneven=True)
    groups = np.array(sizes)
    starts = np.array(offsets([window * g for g in sizes]))  # each rank's first row
    first = np.array(offsets(sizes))  # J_r: each rank's first group
    h = height // window

    def src(o: np.ndarray) -> np.ndarray:
        r = np.searchsorted(starts, o, side="right") - 1  # empty ranks (the last ones) start at the end: own nothing
        local, per = o - starts[r], np.maximum(groups[r], 1)
        return (local // per) * h + first[r] + local % per

    return src


def _check_window(window: Any, height: int, n: int, least: int, path: str) -> None:
    """The window against the field's height (agreed: every rank raises alike)."""
    if window < 1:
        raise ValueError(f"{path}: window must be >= 1 (the rows of each group), got {window}")
    if (why := group_layout_problem(height, window, n, least)) is not None:
        raise NoGroupLayout(path, why)


def _check_int_window(path: str, window: Any, **rest: Any) -> None:
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{path}: window must be an int (the rows of each group), got {window!r}")


@row_map("to_groups", "to the group layout of rows at a stride (ops.group_rows)", check=_check_int_window)
def _to_groups(counts: tuple[int, ...], path: str, window: int, least: int) -> tuple:
    """Bands to the group layout: output row ``o`` is :func:`group_source` ``(o)``."""
    height, n = sum(counts), len(counts)
    _check_window(window, height, n, least, path)
    return counts, group_sizes(height, window, n), group_source(height, window, n)


@row_map("from_groups", "back from the group layout (ops.group_rows)", check=_check_int_window)
def _from_groups(counts: tuple[int, ...], path: str, window: int, bands: tuple[int, ...]) -> tuple:
    """The group layout back to the bands ``bands``: the inverse of :func:`_to_groups`'s map."""
    height, n = sum(counts), len(counts)
    _check_window(window, height, n, 0, path)
    groups = group_sizes(height, window, n)
    if counts != groups or len(bands) != n or sum(bands) != height or min(bands) < 0:
        raise ValueError(f"{path}: the bands {list(counts)} are not the group layout {list(groups)} of "
                         f"{height} rows in groups of {window}, or {list(bands)} is not a band layout of "
                         f"them (one size >= 0 per rank, the same total)")
    inverse = np.argsort(group_source(height, window, n)(np.arange(height)))  # band row -> its group-layout row
    return counts, tuple(bands), lambda j: inverse[j]


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def to_groups(t: torch.Tensor, dim: int, window: int, comm: MPI.Comm, path: str = "to_groups",
              least: int = 0, *, transport: Any = "mpi") -> torch.Tensor:
    """This rank's part of the group layout of the field banded along ``dim`` (collective; differentiable).

    Args:
        t: This rank's band (float32 or float64, any band layout); the other dims equal on every rank.
        dim: The banded dim.
        window: The rows of each group (CrossFormer's ``window_size``); the field's height a multiple of it.
        comm: The domain's communicator (bands in rank order).
        path: Named in errors.
        least: The groups every rank must get (a module's forward may need one).
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Returns:
        ``window * h_r`` rows: local row ``i1 * h_r + (j - J_r)`` = global row ``i1 * h + j``.

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor, or ``window`` not an int (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``, ``window`` < 1; :class:`NoGroupLayout`: the height
            not a multiple of it, or fewer than ``least`` groups a rank; ``transport`` not a transport; or the
            ranks' windows, other dims, dtypes, transports or autograd states differ.
    """
    return grouped(t, dim, window, comm, path, least, transport=transport)[0]


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def from_groups(t: torch.Tensor, dim: int, window: int, sizes: tuple[int, ...], comm: MPI.Comm,
                path: str = "from_groups", *, transport: Any = "mpi") -> torch.Tensor:
    """The group layout (:func:`to_groups`) moved back to the band layout ``sizes`` (collective; differentiable).

    Raises:
        ValueError: as :func:`to_groups`, or ``t``'s rows are not the group layout, or ``sizes``
            not a layout of the same rows (the same on every rank).
    """
    return move_along(t, "from_groups", dim, comm, path, transport=transport, window=window,
                      bands=tuple(int(s) for s in sizes))


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def grouped(t: torch.Tensor, dim: int, window: int, comm: MPI.Comm, path: str = "to_groups", least: int = 0, *,
            transport: Any = "mpi") -> tuple:
    """:func:`to_groups`; returns ``(part, the band layout)`` (what :func:`from_groups` takes back to).

    The layout is the agreed plan's (:func:`credit_mpi.engine.run_planned`).
    """
    out, bands, _ = moved_along(t, "to_groups", dim, comm, path, transport=transport, window=window, least=int(least))
    return out, bands
