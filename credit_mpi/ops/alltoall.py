"""All-to-all between two layouts (token bands <-> head-sharded: Ulysses attention), differentiable.

Exact global attention when the heads divide among the ranks: every rank
sends the tokens of its band, one group of ``H / P`` heads to each rank
(one ``alltoallv`` of the transport protocol, :mod:`credit_mpi.transport.moves`:
MPI, or torch.distributed with ``transport=TorchMoves(group)``), so rank ``s`` holds heads ``[s H / P, (s + 1) H / P)`` of
every token in the field's order and attends them locally; the output goes
back the reverse way. Uneven token bands are allowed (the counts are agreed).

One op, two directions: ``alltoall(t, split_dim, cat_dim, comm)`` splits
``split_dim`` evenly into ``P`` parts (part ``s`` to rank ``s``) and joins
what arrives along ``cat_dim`` in rank order (each rank's own size there);
with ``keep=n`` it splits ``split_dim`` by every rank's agreed ``keep``
instead (the way back: each rank keeps its own tokens) and the parts it
receives are equal along ``cat_dim``. The adjoint of either is the other
(the reverse all-to-all of the gradient).

Per rank, for ``N`` tokens of ``d`` features (all heads) on ``P`` ranks, the
forward receives ``(N - n_rank) d / P`` elements for each of q, k, v (to
heads) and ``(P - 1) n_rank d / P`` for the output (back to bands): ``4 N d
(P - 1) / P^2`` on even bands, about ``4 N d / P`` (the factor ``(P - 1) /
P`` is the part a rank keeps). :func:`received_elements` counts it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from mpi4py import MPI

from ..engine import Counter, Op, run
from ..partition import normalize_dim
from ..transport.moves import transport_name, transport_of
from ..validation import Local
from .along import check_float, transport_key

__all__ = ["alltoall", "received_elements"]

_RECEIVED = Counter()
received_elements = _RECEIVED.received  # elements of alltoall forwards received from other ranks (this thread; reset=True)


class _Plan(NamedTuple):
    split: int  # the dim split among the ranks
    cat: int  # the dim the received parts are joined along
    comm: MPI.Comm
    send: tuple[int, ...]  # the size along ``split`` of the part for each rank
    recv: tuple[int, ...]  # the size along ``cat`` of the part from each rank
    keep: bool  # split by agreed counts (the way back) instead of evenly
    transfer: Any  # the transport the parts move on


class Alltoall(Op):
    """Part ``s`` of ``split_dim`` to rank ``s``, the parts received joined along ``cat_dim``; adjoint: the reverse."""

    name = "alltoall"

    def key(self, t: Any, args: dict) -> Any:
        return transport_key(t, args, args["path"], args["split_dim"], args["cat_dim"], args["keep"])

    def local(self, t: Any, args: dict) -> Local:
        path, keep = args["path"], args["keep"]
        check_float(t, path, "all-to-all of", moved_only=True)
        transport = transport_name(args["transport"], path)
        split, cat = normalize_dim(args["split_dim"], t.ndim), normalize_dim(args["cat_dim"], t.ndim)
        if split == cat:
            raise ValueError(f"{path}: split_dim and cat_dim are both dim {split}; give two different dims")
        if keep is None:
            rest = tuple(s for i, s in enumerate(t.shape) if i != cat)  # equal on every rank; cat's size is the count
            return Local((split, cat, False, t.shape[split]), (path, split, cat, False, t.ndim, rest, str(t.dtype), transport),
                         (), t.shape[cat])
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"{path}: keep={keep!r} must be this rank's size along split_dim after the all-to-all (an int >= 0)")
        return Local((split, cat, True, t.shape[split]), (path, split, cat, True, t.ndim, tuple(t.shape), str(t.dtype), transport),
                     (), keep)

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        split, cat, keep, size = mine
        p, path = comm.Get_size(), args["path"]
        counts = tuple(int(c) for c in counts)
        if not keep:  # even parts of split; each rank's own size along cat
            if size % p:
                raise ValueError(f"{path}: dim {split} of size {size} does not split evenly among {p} ranks "
                                 f"(give a size that is a multiple of {p})")
            return _Plan(split, cat, comm, (size // p,) * p, counts, False, transport_of(args["transport"], comm))
        if sum(counts) != size:
            raise ValueError(f"{path}: the ranks keep {list(counts)} along dim {split}, {sum(counts)} in all, "
                             f"but the tensor has {size} there")
        return _Plan(split, cat, comm, counts, None, True, transport_of(args["transport"], comm))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        return _exchange(t, p.split, p.cat, p, p.send, p.recv, count=True)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        return _exchange(grad, p.cat, p.split, p, p.recv, p.send)


def _exchange(t: torch.Tensor, split: int, cat: int, p: _Plan, send: tuple[int, ...] | None,
              recv: tuple[int, ...] | None, count: bool = False) -> torch.Tensor:
    """One ``alltoallv``: ``send[s]`` rows of ``split`` to rank ``s``; from rank ``r`` ``recv[r]`` rows of ``cat``.

    ``None`` for either means equal parts (the tensor's size divided by the rank count along that dim
    for ``send``; this rank's size along ``cat`` for ``recv``).
    """
    size, rank = p.comm.Get_size(), p.comm.Get_rank()
    if send is None:
        send = (t.shape[split] // size,) * size
    if recv is None:
        recv = (t.shape[cat],) * size
    x = t.detach().movedim(split, 0).contiguous()  # parts of split are contiguous blocks
    cat_moved = cat + 1 if cat < split else cat  # cat's index once split is in front
    shape = list(x.shape)
    inner, itemsize = math.prod(shape[1:]), t.element_size()
    mine = send[rank]  # every rank sends this rank the same number of rows of split (the tuples are agreed)
    other = math.prod(s for i, s in enumerate(shape) if i not in (0, cat_moved))
    part_elems = [mine * other * r for r in recv]
    recvbuf = torch.empty(sum(part_elems), dtype=t.dtype, device=t.device)
    p.transfer.alltoallv(x, [s * inner * itemsize for s in send], recvbuf, [n * itemsize for n in part_elems])
    if count:
        _RECEIVED.add(sum(part_elems) - part_elems[rank])
    parts, at = [], 0
    for r, n in zip(recv, part_elems, strict=True):
        part_shape = [mine] + shape[1:]
        part_shape[cat_moved] = r
        parts.append(recvbuf[at : at + n].reshape(part_shape))
        at += n
    return torch.cat(parts, dim=cat_moved).movedim(0, split)


_OP = Alltoall()


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def alltoall(t: torch.Tensor, split_dim: int, cat_dim: int, comm: MPI.Comm, *, keep: int | None = None,
             path: str = "alltoall", transport: Any = "mpi") -> torch.Tensor:
    """Part ``s`` of ``t`` along ``split_dim`` sent to rank ``s``; the parts received joined along ``cat_dim`` (collective; differentiable).

    Args:
        t: This rank's tensor (float32 or float64).
        split_dim: The dim divided among the ranks: evenly (its size a multiple of the rank count),
            or with ``keep`` by every rank's ``keep``.
        cat_dim: The dim the received parts are joined along, in rank order (with ``keep`` None its
            size may differ between ranks: uneven token bands).
        comm: The domain's communicator.
        keep: None, or this rank's size along ``split_dim`` afterwards (the way back to bands).
        path: Named in errors (the module that calls it).
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor (on every rank alike).
        ValueError: the dims are not two dims of ``t``; ``split_dim`` does not divide evenly; the
            ranks' ``keep`` do not add up to its size; the ranks' other dims, dtypes or autograd states differ.
    """
    return run(_OP, t, comm, split_dim=split_dim, cat_dim=cat_dim, keep=keep, path=path, transport=transport)
