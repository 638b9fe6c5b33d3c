"""One engine for collectives: ``run(op, x, comm, **args)`` agrees, plans, routes autograd and calls the kernel.

An operation is declared once, as an :class:`Op` in its own file of
:mod:`credit_mpi.ops`: its name (the agreement's operation code), its cache
key (the static arguments and the description of ``x``), its local check
(returns a :class:`~credit_mpi.validation.Local`, may raise), its plan (from
the agreed values only, so it is the same decision on every rank), its
kernel and, when it is differentiable, its adjoint. :func:`run` does the
rest, the same way for every op:

1. the agreement, remembered per ``(communicator, op, key)`` by
   :func:`credit_mpi.validation.agree_cached` (one fixed-size ``Allgather``
   per repeated call; a change or a failure on any rank is seen by every
   rank, which all raise the same exception; forgotten by
   ``manager.free()``);
2. whether autograd records the call, part of what is agreed (a rank that
   records it will communicate again in backward: every rank must);
3. ``kernel(x, plan)``, inside a ``torch.autograd.Function`` whose backward
   is ``adjoint(grad, plan)`` when autograd records it.

So a new collective is one file: an ``Op`` subclass and a public function of
one line, ``return run(MyOp(), x, comm, ...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, ClassVar

from mpi4py import MPI

from .validation import Local, agree_cached, register_operation

__all__ = ["Op", "run", "records_grad", "Counter"]


class Counter:
    """Elements an op's forwards received from other ranks, per thread: the volume a test compares with the theory."""

    def __init__(self) -> None:
        self._local = threading.local()

    def add(self, n: int) -> None:
        self._local.n = getattr(self._local, "n", 0) + int(n)

    def received(self, reset: bool = False) -> int:
        """The count since the last reset (``reset=True``: start again from zero)."""
        n = getattr(self._local, "n", 0)
        if reset:
            self._local.n = 0
        return n


class Op:
    """One collective's declaration (subclass it; one instance may serve every call).

    ``args`` below is the dict of keyword arguments given to :func:`run`.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            register_operation(cls.name)

    def key(self, x: Any, args: dict) -> Hashable | None:
        """What decides ``local()`` on this rank (None: agree and plan every call)."""
        return None

    def local(self, x: Any, args: dict) -> Local:
        """This rank's checks and its part of the agreement (raise on bad input: every rank raises it)."""
        raise NotImplementedError

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> Any:
        """The plan, from this rank's agreed ``mine`` and every rank's count (deterministic in them)."""
        return mine, counts

    def kernel(self, x: Any, plan: Any) -> Any:
        """The data movement and the local compute of the forward."""
        raise NotImplementedError

    adjoint: Any = None  # def adjoint(self, grad, plan) -> the gradient of x (a collective: every rank runs it)

    def explain(self, locals_: list[Local]) -> None:
        """Raise this op's precise message when the ranks differ (every rank's Local in hand); default: the generic one."""


def records_grad(x: Any) -> bool:
    """Whether autograd records an op applied to ``x`` (a torch tensor that requires grad, with grad mode on)."""
    requires = getattr(x, "requires_grad", False)
    if not requires:
        return False
    import torch

    return isinstance(x, torch.Tensor) and torch.is_grad_enabled()


def run(op: Op, x: Any, comm: MPI.Comm, *, check: bool = True, **args: Any) -> Any:
    """Run ``op`` on ``x`` over ``comm``: agreement, plan, kernel (differentiable when ``op`` has an adjoint)."""
    grad = op.adjoint is not None and records_grad(x)
    key = op.key(x, args)

    def local() -> Local:
        mine = op.local(x, args)
        return Local(mine.plan, mine.calls + (("autograd", grad),), mine.same, mine.count)

    plan = agree_cached(
        comm, op.name, None if key is None else (key, grad), local,
        lambda mine, counts: op.plan(mine, counts, comm, args), check=check, explain=op.explain,
    )
    if not grad:
        return op.kernel(x, plan)
    return _function().apply(x, op, plan)


_FUNCTION: list = []


def _function() -> Any:
    """The one ``torch.autograd.Function`` of the engine (made on first use: the engine imports torch lazily)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch

    from .autograd import check_backward_thread

    class _Run(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, op, plan):
            ctx.op, ctx.plan = op, plan
            return op.kernel(x, plan)

        @staticmethod
        def backward(ctx, grad):
            check_backward_thread()
            if torch.is_grad_enabled():  # double backward: the adjoint recorded as an op of its own
                return _Adjoint.apply(grad, ctx.op, ctx.plan), None, None
            return ctx.op.adjoint(grad, ctx.plan), None, None

    class _Adjoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, grad, op, plan):
            ctx.op, ctx.plan = op, plan
            return op.adjoint(grad, plan)

        @staticmethod
        def backward(ctx, grad):  # the adjoint of a linear op's adjoint is the op
            check_backward_thread()
            return _Run.apply(grad, ctx.op, ctx.plan), None, None

    _FUNCTION.append(_Run)
    return _Run
