"""Data movement over the torch.distributed groups that mirror the MPI communicators.

The ``transport="torch"`` counterparts of the MPI data paths: the 1-D
gather's ``Allgather(v)`` (:func:`allgather_bands`) and the transport
protocol of :mod:`credit_mpi.transport.moves` (:class:`TorchMoves`), which
the halo exchange's one edge swap and the 2-D gather run on. The groups come from
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
from .limits import SLICE_BYTES
from .moves import SEND

__all__ = ["allgather_bands", "TorchMoves"]


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


class TorchMoves:
    """The transport protocol of :mod:`credit_mpi.transport.moves` over the torch.distributed group ``group``.

    Peers are ranks of the group (the domain ranks). Data not on the
    group's device (numpy arrays and CPU tensors with NCCL) is copied there
    and back. Receive targets are contiguous arrays.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)

    def exchange(self, ops: Sequence[tuple[str, Any, int, int]]) -> None:
        """Every message of ``ops`` in one ``batch_isend_irecv``, issued in ``ops``' order.

        NCCL matches point-to-point messages between two ranks in issue
        order, not by tag: the callers issue them in the same order on every
        rank. Messages to this rank itself are copied (matched by tag).
        """
        device = _group_device(self.group)
        p2p, landing, to_self = [], [], {}
        for kind, x, peer, tag in ops:
            if kind == SEND:
                data = arrays.as_torch_bytes(arrays.contiguous(x))
                if peer == self.rank:
                    to_self.setdefault(tag, []).append(data)
                    continue
                data = data if data.device == device else data.to(device)
                p2p.append(dist.P2POp(dist.isend, data, dist.get_global_rank(self.group, peer), self.group, tag))
                continue
            target = arrays.as_torch_bytes(x)
            if peer == self.rank:
                landing.append((None, target, x, tag))
                continue
            buf = target if target.device == device else torch.empty_like(target, device=device)
            p2p.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, peer), self.group, tag))
            landing.append((buf, target, x, tag))
        if p2p:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()
        for buf, target, x, tag in landing:
            source = to_self[tag].pop(0) if buf is None else buf
            if source is not target:
                target.copy_(source)
            arrays.after_torch_wrote(x)

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int], displs: Sequence[int]) -> None:
        """Every rank's ``send`` bytes at ``displs[r]`` of ``recv``: one all-gather, every part padded to the widest."""
        device = _group_device(self.group)
        n, widest = len(counts), max(counts)
        data = arrays.as_torch_bytes(arrays.contiguous(send)).reshape(-1).to(device)
        padded = torch.zeros(widest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        staging = torch.empty((n, widest), dtype=torch.uint8, device=device)
        _gather_slices(staging.view(1, n * widest), padded.view(1, widest), self.group)
        target = arrays.as_torch_bytes(recv).reshape(-1)
        for r, (count, displ) in enumerate(zip(counts, displs, strict=True)):
            target[displ : displ + count].copy_(staging[r, :count])
        arrays.after_torch_wrote(recv)


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
