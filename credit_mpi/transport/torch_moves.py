"""Data movement over the torch.distributed groups that mirror the MPI communicators.

The ``transport="torch"`` counterparts of the MPI data paths: the gather's
``Allgather(v)`` (:func:`allgather_bands`) and the halo exchange's two
``Sendrecv`` (:func:`swap_edges`). The groups come from
:func:`credit_mpi.init_torch_distributed`; the callers have agreed on every
size already. Imports torch (loaded only when ``transport="torch"`` is used).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..partition import band_offsets
from . import arrays
from .limits import SLICE_BYTES, TAG_DOWN, TAG_UP

__all__ = ["allgather_bands", "swap_edges"]


def allgather_bands(x: Any, out: Any, axis: int, sizes: Sequence[int], group: Any) -> Any:
    """Fill ``out`` with every rank's band of ``x`` along ``axis`` over the torch domain group.

    The torch counterpart of :func:`credit_mpi.gather_tensor`'s ``Allgather(v)``;
    the caller has agreed on ``sizes`` (rows per domain rank) and allocated
    ``out``. Data moves as bytes, so every dtype is gathered bit for bit.
    torch collectives need equal sizes on every rank and a contiguous
    destination. With equal bands, each outer slice of ``out`` (the
    dimensions before ``axis``) holds the bands of all ranks contiguously,
    so each slice is gathered straight into place, all slices in flight at
    once (as the MPI path does for slices of at least
    :data:`~credit_mpi.transport.limits.SLICE_BYTES`). Uneven bands, and many small
    slices, go through a staging buffer with every band padded to the
    widest (per slice for large slices, one collective for small ones) and
    are then copied into place: one extra copy of the field.
    NumPy arrays and CPU tensors are staged on the current CUDA device when
    the group is NCCL.

    Returns:
        ``out``.
    """
    n = len(sizes)
    shape = _shape(out)
    outer = math.prod(shape[:axis])
    row = math.prod(shape[axis + 1 :]) * arrays.describe(out).itemsize
    device = _group_device(group)

    send = arrays.as_torch_bytes(arrays.contiguous(x)).to(device)
    target = arrays.as_torch_bytes(out)
    total, widest = sum(sizes), max(sizes)
    per_slice = outer > 1 and total * row >= SLICE_BYTES  # large slices: one collective each
    if len(set(sizes)) == 1 and target.device == device and (outer == 1 or per_slice):
        # Each outer slice of out holds the bands of all ranks contiguously and
        # in rank order: gather every slice straight into place.
        _gather_slices(target.view(outer, total * row), send.view(outer, widest * row), group)
        arrays.after_torch_wrote(out)
        return out

    # Staging: (slices, n, width) bytes, every band padded to the widest.
    slices = outer if per_slice else 1
    width = outer * widest * row // slices
    mine = send.numel() // slices
    if mine != width:
        padded = torch.zeros((slices, width), dtype=torch.uint8, device=device)
        padded[:, :mine] = send.view(slices, mine)
        send = padded
    staging = torch.empty((slices, n * width), dtype=torch.uint8, device=device)
    _gather_slices(staging, send.view(slices, width), group)
    staging = staging.view(slices, n, width)

    on_device = target if target.device == device else torch.empty_like(target, device=device)
    placed = on_device.view(outer, total, row)
    for r, (first, rows) in enumerate(zip(band_offsets(list(sizes)), sizes, strict=True)):
        band = staging[:, r, : outer * rows * row // slices]  # (slices, outer/slices * rows * row)
        placed[:, first : first + rows].copy_(band.reshape(outer, rows, row))
    if on_device is not target:
        target.copy_(on_device)
    arrays.after_torch_wrote(out)
    return out


def swap_edges(up: Any, down: Any, prev: int | None, nxt: int | None, group: Any) -> tuple[Any, Any]:
    """Send ``up`` to domain rank ``prev`` and ``down`` to ``nxt`` over the torch group ``group``.

    ``up`` is None exactly when ``prev`` is, ``down`` when ``nxt`` is.

    The torch counterpart of the two ``Sendrecv`` calls of
    :func:`credit_mpi.halo_exchange` (forward and backward). Returns
    ``(from_next, from_prev)``: what ``nxt`` sent up and what ``prev`` sent
    down, as new arrays of the edges' kind and shape (None without that
    neighbour). The operations are issued in the same order on every rank
    (NCCL matches point-to-point messages between two ranks in issue order,
    not by tag). Data not on the group's device (CPU tensors with NCCL) is
    copied there and back.
    """
    device = _group_device(group)
    ops, landing = [], []

    def on_device(x: Any) -> Any:
        data = arrays.as_torch_bytes(arrays.contiguous(x))
        return data if data.device == device else data.to(device)

    def send(x: Any, peer: int, tag: int) -> None:
        ops.append(dist.P2POp(dist.isend, on_device(x), dist.get_global_rank(group, peer), group, tag))

    def recv(like: Any, peer: int, tag: int) -> Any:
        result = arrays.empty(like, like.shape)
        target = arrays.as_torch_bytes(result)
        buf = target if target.device == device else torch.empty_like(target, device=device)
        ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group, tag))
        landing.append((buf, target))
        return result

    from_next = from_prev = None
    like = up if up is not None else down
    if prev is not None:
        send(up, prev, TAG_UP)
    if nxt is not None:
        from_next = recv(like, nxt, TAG_UP)
        send(down, nxt, TAG_DOWN)
    if prev is not None:
        from_prev = recv(like, prev, TAG_DOWN)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buf, target in landing:
        if buf is not target:
            target.copy_(buf)
    for result in (from_next, from_prev):
        if result is not None:
            arrays.after_torch_wrote(result)
    return from_next, from_prev



def _group_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_slices(output: torch.Tensor, input_: torch.Tensor, group: Any) -> None:
    """All-gather ``input_[p]`` into ``output[p]`` for every row ``p``, all in flight at once."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    works = [gather(output[p], input_[p], group=group, async_op=True) for p in range(output.shape[0])]
    for work in works:
        work.wait()


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)
