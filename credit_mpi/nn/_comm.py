"""The collectives of the model-side layers, in one place.

* :func:`agree` - every rank's band of a layer input (one fixed-size
  ``Allgather`` through :func:`credit_mpi.validation.agree_cached`: a bad
  input on one rank is the same exception on every rank). Layers learn the
  band layout here at run time, remembered per call shape.
* :func:`fetch_rows` - the global input rows ``[lo, hi)`` a band needs, from
  :func:`credit_mpi.halo_exchange` (differentiable) plus the module's own
  padding at the global edges.
* :func:`allgather_stats` - a differentiable allgather of small statistics
  (backward: the gradients summed over the ranks).
* :func:`overlap_add` - the adjoint of a halo exchange (transposed
  convolutions), differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable

from ..autograd import check_backward_thread
from ..halo import halo_exchange
from ..partition import check_halo_width
from ..validation import DomainParallelError, Local, agree_cached, comm_label


class ConversionError(DomainParallelError):
    """A module the converter has no exact rule for (raised on every rank), or a layout a layer cannot run."""


@dataclass(frozen=True)
class Bands:
    """The agreed band layout of one layer input along ``axis``."""

    sizes: list[int]
    rank: int
    axis: int

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def agree(x: torch.Tensor, axis_of: Callable[[torch.Tensor], int], comm: MPI.Comm, path: str, extra: Callable[[], Any] | None = None) -> Bands:
    """Every rank's rows of ``x`` along ``axis_of(x)`` (collective over ``comm``).

    ``axis_of`` runs the layer's local checks and returns the sharded axis;
    ``extra`` returns more arguments that must be equal on every rank.
    Raises (on every rank alike) when a rank's checks fail or when the bands
    differ in anything but their rows along the axis.

    One fixed-size agreement (:func:`credit_mpi.validation.agree_cached`:
    an ``Allgather`` of five int64 per rank, every call); the band layout of
    a call shape seen before is remembered, so a layer called with the same
    shapes step after step does not plan again. A change on any rank is
    still seen by every rank (its header differs).
    """

    def describe(axis: int) -> tuple:
        shape = tuple(x.shape)
        grad = bool(torch.is_grad_enabled() and x.requires_grad)
        return axis, shape[:axis] + shape[axis + 1 :], str(x.dtype), x.device.type, grad, extra() if extra else None

    def local() -> Local:
        axis = axis_of(x)
        mine = describe(axis)
        return Local(mine, (mine[0], mine[1], mine[2], mine[3], mine[4], repr(mine[5])), (), x.shape[axis])

    def explain(locals_: list[Local]) -> None:
        detail = "; ".join(
            f"rank {r}: axis {e[0]}, other dims {e[1]}, {e[2]} on {e[3]}, requires_grad={e[4]}"
            + (f", {e[5]}" if e[5] is not None else "")
            for r, e in enumerate(loc.plan for loc in locals_)
        )
        raise ValueError(
            f"{path}: the bands do not fit together across {comm_label(comm)} (the same dtype, device type, "
            f"requires_grad and every dimension but the sharded one are needed on every rank): {detail}"
        )

    def finish(plan: tuple, sizes: list[int]) -> Bands:
        return Bands(sizes, comm.Get_rank(), plan[0])

    key = None
    try:  # the layer's own checks run every call (local, cheap); a failure is carried into the agreement
        key = (path, x.shape, describe(axis_of(x)))
        hash(key)
    except Exception:  # noqa: BLE001 - local() raises it again inside the agreement, on every rank
        key = None
    return agree_cached(comm, "layer", key, local, finish, explain=explain)


def check_halo(path: str, sizes: list[int], width: int, boundary: str, axis: int) -> None:
    """:func:`credit_mpi.partition.check_halo_width` with the layer named (agreed sizes: raises on every rank)."""
    try:
        check_halo_width(sizes, width, boundary, axis)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def fetch_rows(
    x: torch.Tensor,
    bands: Bands,
    lo: int,
    hi: int,
    width: int,
    manager: Any,
    boundary: str = "zero",
    fill: float | None = None,
) -> torch.Tensor:
    """Global rows ``[lo, hi)`` along ``bands.axis`` for this rank (collective over the domain group).

    ``width`` is the agreed symmetric halo (>= the rows needed on either
    side on every rank). Rows outside ``[0, total)`` are the boundary's:
    ``"zero"``, ``"periodic"``, ``"reflect"`` (as halo_exchange), or
    ``"replicate"`` (the edge row repeated), or ``fill`` when given.
    """
    axis, a, total = bands.axis, bands.start, bands.total
    exchange = "zero" if boundary == "replicate" else boundary
    padded = halo_exchange(x, width, axis, manager, boundary=exchange, check=False) if width else x
    rows = padded.narrow(axis, lo - (a - width), hi - lo)
    if boundary == "replicate" or fill is not None:
        low, high = max(0, -lo), max(0, hi - total)
        if low or high:
            parts = []
            if low:
                edge = x.narrow(axis, 0, 1) if fill is None else torch.full_like(x.narrow(axis, 0, 1), fill)
                parts.append(edge.expand(*[low if d == axis else -1 for d in range(x.ndim)]))
            parts.append(rows.narrow(axis, low, rows.shape[axis] - low - high))
            if high:
                last = x.narrow(axis, x.shape[axis] - 1, 1)
                edge = last if fill is None else torch.full_like(last, fill)
                parts.append(edge.expand(*[high if d == axis else -1 for d in range(x.ndim)]))
            rows = torch.cat(parts, axis)
    return rows


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, comm):
        ctx.comm = comm
        send = np.ascontiguousarray(t.detach().cpu().numpy())
        recv = np.empty((comm.Get_size(),) + send.shape, send.dtype)
        comm.Allgather(send, recv)
        return torch.from_numpy(recv).to(t.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        check_backward_thread()
        comm = ctx.comm
        g = np.ascontiguousarray(grad.detach().cpu().numpy())
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        return torch.from_numpy(g[comm.Get_rank()]).to(grad.device), None


def allgather_stats(t: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """Stack every rank's ``t`` (float32/float64) along a new first dim; differentiable.

    The backward sums the gradient over the ranks (each rank's loss is its
    share of the global loss, as :func:`credit_mpi.reduce_gradients` assumes).
    """
    return _AllGather.apply(t, comm)


class _OverlapAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, width, axis, manager):
        ctx.width, ctx.axis, ctx.manager = width, axis, manager
        shape = list(y.shape)
        shape[axis] = rows
        with torch.enable_grad():
            z = torch.zeros(shape, dtype=y.dtype, device=y.device, requires_grad=True)
            padded = halo_exchange(z, width, axis, manager, check=False)
            (out,) = torch.autograd.grad(padded, z, y)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # the adjoint of the adjoint: the plain exchange (no grad of its own: double backward is refused)
        return halo_exchange(grad.detach().contiguous(), ctx.width, ctx.axis, ctx.manager, check=False), None, None, None, None


def overlap_add(y: torch.Tensor, rows: int, width: int, axis: int, manager: Any) -> torch.Tensor:
    """``y`` holds ``rows + 2*width`` rows (``width`` before and after the own ``rows``): add the outer ones to the neighbours'.

    The adjoint of :func:`credit_mpi.halo_exchange` with a zero boundary
    (rows beyond the global edges are dropped). Collective over the domain
    group; differentiable once.
    """
    return _OverlapAdd.apply(y, rows, width, axis, manager)
