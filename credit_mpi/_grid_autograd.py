"""torch autograd for the 2-D grid operations (imported only when a tensor that requires grad reaches one).

* 2-D gather (Shard -> Replicate in both dims): the gathered gradient is
  taken to be replicated; the backward returns this rank's block of it, no
  communication (as the 1-D gather).
* 2-D halo exchange: linear; its backward is its adjoint
  (:func:`credit_mpi.halo2d.halo2d_adjoint`: halo and corner gradients go
  home and are added, pole pieces go back to the opposite longitudes), itself
  a differentiable Function whose backward is the exchange again, so double
  backward is exact. Backward passes that communicate are collectives over
  the domain grid: every rank runs them.
"""

from __future__ import annotations

import torch

from . import halo2d
from .blocks import Gather2d, gather2d_kernel

__all__ = ["gather2d_autograd", "halo2d_autograd"]


def _check_thread() -> None:
    from .autograd import check_backward_thread  # the 1-D module's rule: MPI from torch's backward thread

    check_backward_thread()


class _Gather2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, out):
        gathered = gather2d_kernel(x, plan)
        if out is not None:
            ctx.mark_dirty(out)
        (ctx.y0, ctx.x0), ctx.plan_axes = plan.start, (plan.ay, plan.ax)
        ctx.h, ctx.w = x.shape[plan.ay], x.shape[plan.ax]
        return gathered

    @staticmethod
    def backward(ctx, grad):
        ay, ax = ctx.plan_axes
        return grad.narrow(ay, ctx.y0, ctx.h).narrow(ax, ctx.x0, ctx.w), None, None


class _Halo2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return halo2d.halo2d_kernel(x, plan)

    @staticmethod
    def backward(ctx, grad):
        return _Halo2dAdjoint.apply(grad, ctx.plan), None


class _Halo2dAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad, plan):
        ctx.plan = plan
        _check_thread()
        return halo2d.halo2d_adjoint(grad, plan)

    @staticmethod
    def backward(ctx, grad):
        _check_thread()
        return _Halo2d.apply(grad, ctx.plan), None


def gather2d_autograd(x: torch.Tensor, plan: Gather2d) -> torch.Tensor:
    """Differentiable 2-D gather of ``x`` with its agreed ``plan`` (backward: this rank's block)."""
    return _Gather2d.apply(x, plan, plan.out)


def halo2d_autograd(x: torch.Tensor, plan: halo2d.Plan2d) -> torch.Tensor:
    """Differentiable 2-D halo exchange of ``x`` with its agreed ``plan`` (backward: the adjoint)."""
    return _Halo2d.apply(x, plan)
