"""The gradient reduction: a sum over the domain group, then a mean over the data-parallel group, in place.

An op of :mod:`credit_mpi.engine` over the manager's parent communicator.
The agreement covers ``over`` and which gradients exist with their dtypes,
sizes and device types (they decide the ``Allreduce`` calls), whatever
``check`` says. The kernel packs the gradients into one flat buffer per
dtype (float16/bfloat16 widened to float32, which MPI can add) and makes
one ``Allreduce`` per group and dtype, in place on the device when MPI is
CUDA-aware, else staged (:mod:`credit_mpi.transport.staging`). Not
differentiable (it writes ``.grad``). Its agreement is remembered per
description of the gradients: a repeated step's is one ``Allgather`` of
the remembered header, no checks redone. The public function is
:func:`credit_mpi.reduce_gradients` (:mod:`credit_mpi.grad_sync`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mpi4py import MPI

from ..engine import Op
from ..transport import arrays, staging
from ..validation import Local

__all__ = ["ReduceGradients", "REDUCE", "OVER", "check_over"]

# dtypes MPI cannot add directly are reduced in float32
_WIDEN = {"torch.float16", "torch.bfloat16"}

# over= -> (sum over the domain group, mean over the data-parallel group)
OVER = {"all": (True, True), "domain": (True, False), "data_parallel": (False, True)}


def check_over(over: Any) -> str:
    """``over`` if it names one of :data:`OVER`, else the ValueError that lists them."""
    if not isinstance(over, str) or over not in OVER:
        raise ValueError(f"reduce_gradients: over must be one of {sorted(OVER)}, got {over!r}")
    return over


class _Reduce(NamedTuple):
    over: str
    manager: Any


class ReduceGradients(Op):
    """``x`` is the list of ``(index, grad)`` of the parameters that have a gradient."""

    name = "reduce_gradients"

    def key(self, grads: list, args: dict) -> tuple | None:
        """What decides :meth:`local` and the plan: a step's repeat (the same gradients) is one ``Allgather``."""
        over = args["over"]
        if not isinstance(over, str):
            return None  # local() raises the ValueError on every rank
        return over, id(args["manager"]), tuple((i, g.dtype, g.numel(), g.device.type) for i, g in grads)

    def local(self, grads: list, args: dict) -> Local:
        over = args["over"]
        # Which gradients exist, their dtypes, sizes and device types, and which groups reduce
        # decide the Allreduce calls: agreed whatever ``check`` says.
        return Local(check_over(over), (over, tuple((i, str(g.dtype), g.numel(), g.device.type) for i, g in grads)))

    def explain(self, locals_: list[Local]) -> None:
        overs = [loc.calls[0] for loc in locals_]
        if len(set(overs)) > 1:
            detail = ", ".join(f"rank {r}: {o!r}" for r, o in enumerate(overs))
            raise ValueError(f"reduce_gradients: ranks passed different over= ({detail}); pass the same on every rank")
        ranks = [r for r, loc in enumerate(locals_) if loc.calls != locals_[0].calls]
        raise ValueError(
            "reduce_gradients: ranks hold gradients for different parameters, dtypes, sizes or device types "
            f"(rank(s) {ranks} differ from rank 0); run the same model and backward pass on every rank"
        )

    def plan(self, over: str, counts: list[int], comm: MPI.Comm, args: dict) -> _Reduce:
        return _Reduce(over, args["manager"])

    def kernel(self, grads: list, p: _Reduce) -> None:
        manager = p.manager
        groups: dict[str, list] = {}
        for _, g in grads:
            groups.setdefault(str(g.dtype), []).append(g)
        sum_domain, mean_dp = OVER[p.over]
        domain = manager.domain_parallel_size if sum_domain else 1
        dp = manager.data_parallel_size if mean_dp else 1
        if not groups:
            return
        import torch  # the gradients are torch tensors, so torch is loaded already
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # DDP's C++ pack and unpack

        comms = [comm for comm, size in ((manager.domain_group, domain), (manager.data_parallel_group, dp)) if size > 1]
        for dtype in sorted(groups):
            tensors = groups[dtype]
            # a large contiguous gradient is reduced where it is (a copy in and out of a flat buffer costs about what
            # the Allreduce of its bytes costs); the small ones share one flat buffer (one call, no Python per tensor)
            alone = [] if dtype in _WIDEN else [t for t in tensors if t.numel() * t.element_size() >= ALONE_BYTES
                                                 and t.is_contiguous()]
            taken = {id(t) for t in alone}
            packed = [t for t in tensors if id(t) not in taken]
            for t in alone:
                _allreduce(t.detach(), comms)
            if alone and dp > 1:
                torch._foreach_div_(alone, dp)
            if not packed:
                continue
            flat = _flatten_dense_tensors([t.detach() for t in packed])  # no Python per tensor
            if dtype in _WIDEN:
                flat = flat.float()
            _allreduce(flat, comms)
            if dp > 1:
                flat.div_(dp)
            torch._foreach_copy_(packed, _unflatten_dense_tensors(flat, packed))  # (widened: back to the narrow dtype)


ALONE_BYTES = 64 * 1024  # a gradient of at least this many bytes gets its own in-place Allreduce


def _allreduce(buffer: Any, comms: list) -> None:
    """Sum ``buffer`` (a contiguous tensor) over each of ``comms`` in place; device tensors direct or host-staged, as
    staging decides for each communicator."""
    datatype = arrays.mpi_datatype(buffer)
    for comm in comms:
        with staging.recv_buffer(buffer, comm, inout=True) as buf:
            comm.Allreduce(MPI.IN_PLACE, [buf, datatype], op=MPI.SUM)


REDUCE = ReduceGradients()
