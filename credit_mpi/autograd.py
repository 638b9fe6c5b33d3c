"""torch autograd through credit_mpi's collectives.

Imported only when a torch tensor that requires grad reaches a collective
(or when :class:`HaloExchange` is used), so ``import credit_mpi`` never
imports torch. The plain functions route here by themselves: with grad mode
on and ``x.requires_grad``, :func:`credit_mpi.shard_tensor`,
:func:`credit_mpi.gather_tensor` and :func:`credit_mpi.halo_exchange` return
a tensor with a ``grad_fn``. Each ``torch.autograd.Function`` below calls the
plain implementation forward (autograd is off inside ``forward``), and its
backward is itself a collective over the domain group, so every rank of the
group must run the backward pass (as in any data- or model-parallel code).

Semantics follow torch DTensor's redistribution between ``Replicate()`` and
``Shard(dim)`` placements:

* ``gather_tensor`` (Shard -> Replicate): the gradient of the gathered
  tensor is taken to be replicated (the same on every rank, as when every
  rank computes the same loss from the gathered field); the backward returns
  this rank's slice of it, with no communication.
* ``shard_tensor`` (Replicate -> Shard): the backward all-gathers the shard
  gradients, so every rank gets the gradient of the whole input.
* ``halo_exchange``: each halo row is a copy of a row of some band (or a
  constant at a ``"zero"`` edge); the backward sends the halo gradients back
  to the ranks that own those rows and adds them there (for ``"reflect"``
  and ``"earth"`` edges, into the band's own mirrored rows).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from . import halo as _halo
from . import sharding
from .manager import DomainParallelManager
from .partition import normalize_dim
from .validation import DomainParallelError, check_transport

__all__ = [
    "HaloExchange",
    "gather_tensor_autograd",
    "halo_exchange_autograd",
    "shard_tensor_autograd",
]


_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "THREAD_MULTIPLE",
}


def check_backward_thread() -> None:
    """Raise unless this thread may call MPI.

    torch runs the backward of CUDA tensors on its own worker thread per
    device, not on the thread that called ``backward()``; MPI allows that
    from THREAD_SERIALIZED up (mpi4py asks for THREAD_MULTIPLE unless
    ``mpi4py.rc.thread_level`` says otherwise). Checked before each backward
    collective, so the error is a clear one instead of undefined behaviour.
    """
    level = MPI.Query_thread()
    if level >= MPI.THREAD_SERIALIZED or MPI.Is_thread_main():
        return
    raise DomainParallelError(
        f"a credit_mpi backward pass runs on a thread other than MPI's main thread (torch's autograd "
        f"worker thread for CUDA tensors), but MPI was initialised with {_THREAD_LEVELS.get(level, level)}; "
        f"it needs THREAD_SERIALIZED or THREAD_MULTIPLE (set mpi4py.rc.thread_level = 'multiple', "
        f"mpi4py's default, before importing mpi4py.MPI)"
    )


class _ShardTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, manager, uneven, check):
        ctx.dim, ctx.manager = dim, manager
        return sharding.shard_tensor(x, dim, manager, uneven=uneven, check=check)

    @staticmethod
    def backward(ctx, grad):
        # Replicate <- Shard: every rank gets the gradient of the whole input.
        check_backward_thread()
        return sharding.gather_tensor(grad.contiguous(), ctx.dim, ctx.manager, check=False), None, None, None, None


class _GatherTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, manager, check, transport, out):
        # The gather agrees on the arguments on every rank first; only then
        # is it safe to run another collective (the exscan of band starts).
        gathered = sharding.gather_tensor(x, dim, manager, check=check, transport=transport, out=out)
        ctx.axis = normalize_dim(dim, x.ndim)
        ctx.rows = x.shape[ctx.axis]
        ctx.start = manager.domain_group.exscan(ctx.rows) or 0
        return gathered

    @staticmethod
    def backward(ctx, grad):
        # Shard <- Replicate: this rank's slice of the (replicated) gradient.
        return grad.narrow(ctx.axis, ctx.start, ctx.rows).contiguous(), None, None, None, None, None


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return _halo._forward(x, plan)

    @staticmethod
    def backward(ctx, grad):
        if ctx.plan.torch_group is None:  # over MPI (transport="torch" calls no MPI here)
            check_backward_thread()
        return _halo._adjoint(grad, ctx.plan), None


def shard_tensor_autograd(
    x: torch.Tensor, dim: int, manager: DomainParallelManager, *, uneven: bool = False, check: bool = True
) -> torch.Tensor:
    """Differentiable :func:`credit_mpi.shard_tensor` (backward: all-gather)."""
    return _ShardTensor.apply(x, dim, manager, uneven, check)


def gather_tensor_autograd(
    x: torch.Tensor,
    dim: int,
    manager: DomainParallelManager,
    *,
    check: bool = True,
    transport: str = "mpi",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable :func:`credit_mpi.gather_tensor` (backward: this rank's slice)."""
    return _GatherTensor.apply(x, dim, manager, check, transport, out)


def halo_exchange_autograd(x: torch.Tensor, plan: _halo._Plan) -> torch.Tensor:
    """Differentiable :func:`credit_mpi.halo_exchange` of ``x`` with its agreed ``plan`` (backward: halo gradients go home)."""
    return _HaloExchange.apply(x, plan)


class HaloExchange(torch.nn.Module):
    """Differentiable halo exchange as a module (the reference package's name).

    ``HaloExchange(halo_width, dim=-2, boundary="zero")(x)`` is
    :func:`credit_mpi.halo_exchange` with the global manager; pass
    ``manager=`` to use another one and ``transport="torch"`` to move the
    rows over the mirrored torch.distributed group. Typically followed by a
    convolution with no padding along ``dim`` (and circular padding along
    longitude).
    """

    def __init__(
        self,
        halo_width: int,
        dim: int = -2,
        boundary: str = "zero",
        manager: DomainParallelManager | None = None,
        *,
        transport: str = "mpi",
    ) -> None:
        super().__init__()
        self.halo_width = _halo._check_width(halo_width)
        self.boundary = _halo._check_boundary_name(boundary)
        self.transport = check_transport(transport)
        self.dim, self.manager = dim, manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _halo.halo_exchange(
            x, self.halo_width, self.dim, self.manager, boundary=self.boundary, transport=self.transport
        )

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, boundary={self.boundary!r}, transport={self.transport!r}"
