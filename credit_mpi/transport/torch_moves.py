"""Data movement over the torch.distributed groups that mirror the MPI communicators.

The transport protocol of :mod:`credit_mpi.transport.moves` over torch
(:class:`TorchMoves`): the halo exchange's one edge swap and the gather
(bands and blocks, :func:`credit_mpi.transport.moves.gather_blocks`) run
on it with ``transport="torch"``, and the ops that take a communicator
(all-gather along a dim, all-to-all, re-banding, the roll, the group
layout, the ring) with ``transport=TorchMoves(group)``. The groups come from
:func:`credit_mpi.init_torch_distributed`; the callers have agreed on every
size already. Imports torch (loaded only when ``transport="torch"`` is used).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import arrays
from .moves import SEND

__all__ = ["TorchMoves"]


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
        """Every message of ``ops`` in one ``batch_isend_irecv``, issued in ``ops``' order, and waited for."""
        self.post(ops).wait()

    def post(self, ops: Sequence[tuple[str, Any, int, int]]) -> _Posted:
        """Every message of ``ops`` in one ``batch_isend_irecv``, issued in ``ops``' order; ``wait()`` completes them.

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
        return _Posted(dist.batch_isend_irecv(p2p) if p2p else [], landing, to_self)

    def allgather_slices(self, send: Any, recv: Any, outer: int) -> bool:
        """Slice ``p`` of every rank's ``send`` into slice ``p`` of ``recv``, all in flight; False when ``recv`` is not on the group's device.

        torch collectives need equal sizes on every rank and a contiguous
        destination on the group's device (numpy arrays and CPU tensors with
        NCCL go through :meth:`allgatherv`'s staging instead).
        """
        device = _group_device(self.group)
        target = arrays.as_torch_bytes(recv)
        if target.device != device:
            return False
        data = arrays.as_torch_bytes(arrays.contiguous(send)).to(device)
        _gather_slices(target.view(outer, -1), data.view(outer, -1), self.group)
        arrays.after_torch_wrote(recv)
        return True

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


    def alltoallv(self, send: Any, send_counts: Sequence[int], recv: Any, recv_counts: Sequence[int]) -> None:
        """``send_counts[r]`` bytes of ``send`` to rank ``r``, ``recv_counts[r]`` from it, packed in rank order (``all_to_all_single``)."""
        device = _group_device(self.group)
        data = arrays.as_torch_bytes(arrays.contiguous(send)).to(device)
        target = arrays.as_torch_bytes(recv)
        buf = target if target.device == device else torch.empty_like(target, device=device)
        dist.all_to_all_single(buf, data, [int(c) for c in recv_counts], [int(c) for c in send_counts], group=self.group)
        if buf is not target:
            target.copy_(buf)
        arrays.after_torch_wrote(recv)

    def allreduce(self, send: Any, recv: Any) -> None:
        """``recv`` = every rank's ``send`` summed (``send`` copied into ``recv`` on the group's device, ``all_reduce``)."""
        device = _group_device(self.group)
        target = arrays.as_torch_bytes(recv)
        buf = target if target.device == device else torch.empty_like(target, device=device)
        buf.copy_(arrays.as_torch_bytes(arrays.contiguous(send)))
        dtype = recv.dtype if isinstance(recv, torch.Tensor) else torch.from_numpy(np.empty(0, recv.dtype)).dtype
        dist.all_reduce(buf.view(dtype), group=self.group)
        if buf is not target:
            target.copy_(buf)
        arrays.after_torch_wrote(recv)


class _Posted:
    """Messages :meth:`TorchMoves.post` put in flight: :meth:`wait` completes them and lands what was received."""

    def __init__(self, works: list, landing: list, to_self: dict) -> None:
        self.works, self.landing, self.to_self = works, landing, to_self

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for buf, target, x, tag in self.landing:
            source = self.to_self[tag].pop(0) if buf is None else buf
            if source is not target:
                target.copy_(source)
            arrays.after_torch_wrote(x)


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
