"""One engine for collectives: ``run(op, x, comm, **args)`` agrees, plans, routes autograd and calls the kernel.

An operation is declared once, as an :class:`Op` in its own file of
:mod:`credit_mpi.ops`: its name (the agreement's operation code), its cache
key (the static arguments and the description of ``x``), its local check
(returns a :class:`~credit_mpi.validation.Local`, may raise), its plan (from
the agreed values only, so it is the same decision on every rank), its
kernel and, when it is differentiable, its adjoint. :func:`run` does the
rest, the same way for every op:

1. the agreement, remembered per ``(communicator, op, key)`` by
   :func:`credit_mpi.agreement.agree_cached` (one fixed-size ``Allgather``
   per repeated call; a change or a failure on any rank is seen by every
   rank, which all raise the same exception; forgotten by
   ``manager.free()``);
2. whether autograd records the call, part of what is agreed (a rank that
   records it will communicate again in backward: every rank must);
3. ``kernel(x, plan)``, inside a ``torch.autograd.Function`` whose backward
   is ``adjoint(grad, plan)`` when autograd records it.

The per-call fast path is the engine's too: a call whose key this rank
remembers makes one ``Allgather`` of its header (:meth:`credit_mpi.agreement._Agreed.repeat`)
and goes straight to the kernel when every rank sent the table agreed last
time; nothing else is checked, digested or planned.

Options an op declares (class attributes and hooks, all with defaults):

* ``local_adjoint``: the adjoint is local torch code (the gather's backward
  is this rank's slice of the replicated gradient): autograd's state is then
  not agreed (no rank communicates in backward), the adjoint is recorded by
  torch itself (double backward through plain torch ops) and no MPI thread
  check is made;
* ``bind(plan, args)``: what of this call goes into the remembered plan
  (``out=``: a remembered plan must not keep a caller's array alive);
* ``written(plan)``: the array the kernel writes in place (``out=``), marked
  dirty for autograd;
* ``backward_calls_mpi(plan)``: whether the adjoint calls MPI (False for
  ``transport="torch"``), so the MPI thread check is made only then.

So a new collective is one file: an ``Op`` subclass and a public function of
one line, ``return run(MyOp(), x, comm, ...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

from mpi4py import MPI

from . import watchdog
from .agreement import AGREED_ENTRIES, Local, agree_cached, on_forget, register_operation, remembered

__all__ = ["Op", "run", "run_planned", "run_args", "run_agreed", "agreed_plan", "apply_agreed", "records_grad", "AGREED_PLANS", "Counter"]


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
    local_adjoint: ClassVar[bool] = False  # the adjoint is local torch code (no communication in backward)

    binds: ClassVar[bool] = False  # the op has its own bind() (set by __init_subclass__)
    writes: ClassVar[bool] = False  # the op has its own written() (set by __init_subclass__)
    data_phase: ClassVar[str] = ""  # the watchdog's names of the kernel and of the adjoint (set by __init_subclass__)
    backward_phase: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.binds = cls.bind is not Op.bind  # (the per-call fast path calls neither hook for an op without it)
        cls.writes = cls.written is not Op.written
        if cls.name:
            register_operation(cls.name)
            cls.data_phase, cls.backward_phase = f"{cls.name}: data", f"{cls.name}: backward"

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

    def explain_on(self, locals_: list[Local], comm: MPI.Comm) -> None:
        """:meth:`explain` with the communicator in hand (to name it in the message); default: :meth:`explain`."""
        self.explain(locals_)

    def bind(self, plan: Any, args: dict) -> Any:
        """The plan of this call from the agreed (possibly remembered) one: what must not be remembered goes in here."""
        return plan

    def written(self, plan: Any) -> Any:
        """The tensor the kernel writes in place (``out=``; marked dirty for autograd), or None."""
        return None

    def backward_calls_mpi(self, plan: Any) -> bool:
        """Whether the adjoint calls MPI (the MPI thread-level check is made before it only then)."""
        return not self.local_adjoint


def records_grad(x: Any) -> bool:
    """Whether autograd records an op applied to ``x`` (a torch tensor that requires grad, with grad mode on)."""
    requires = getattr(x, "requires_grad", False)
    if not requires:
        return False
    import torch

    return isinstance(x, torch.Tensor) and torch.is_grad_enabled()


def run(op: Op, x: Any, comm: MPI.Comm, *, check: bool = True, **args: Any) -> Any:
    """Run ``op`` on ``x`` over ``comm``: agreement, plan, kernel (differentiable when ``op`` has an adjoint)."""
    return run_args(op, x, comm, args, check)


def run_planned(op: Op, x: Any, comm: MPI.Comm, *, check: bool = True, **args: Any) -> tuple[Any, Any]:
    """:func:`run`, returning ``(result, plan)``: for a caller that needs what was agreed (a layout the op chose)."""
    return run_args(op, x, comm, args, check, with_plan=True)


def run_args(op: Op, x: Any, comm: MPI.Comm, args: dict, check: bool = True, with_plan: bool = False) -> Any:
    """:func:`run` with the op's arguments as one dict (the facades' per-call fast path: no repacking)."""
    # (the per-call fast path: few Python calls between the facade and the kernel)
    grad = op.adjoint is not None and getattr(x, "requires_grad", False) and records_grad(x)
    key = op.key(x, args)
    full = None if key is None else (key, grad)  # the autograd state is part of the key (decided before any call)
    entry = None if full is None else remembered(comm, op.name, full, check)
    table = None if entry is None else entry.repeat()
    if entry is not None and table is None:
        plan = entry.result  # every rank repeated the remembered call: one Allgather, nothing else
    else:  # agree (settling the table already received, if any) and plan
        agreed = not op.local_adjoint  # a collective backward: every rank must record the call, or none

        def local() -> Local:
            mine = op.local(x, args)
            return Local(mine.plan, mine.calls + (("autograd", grad),), mine.same, mine.count) if agreed else mine

        plan = agree_cached(
            comm, op.name, full, local, lambda mine, counts: op.plan(mine, counts, comm, args),
            check=check, explain=lambda locals_: op.explain_on(locals_, comm), received=table,
        )
    if op.binds:
        plan = op.bind(plan, args)
    if with_plan:
        return _apply(op, x, plan, grad), plan
    return _apply(op, x, plan, grad)


def run_agreed(op: Op, x: Any, comm: MPI.Comm, counts: Sequence[int] | None = None, **args: Any) -> Any:
    """Run ``op`` whose agreement the caller made already: ``counts`` are every rank's agreed counts.

    For a caller whose own agreement covers everything ``op``'s would (a
    converted layer's one agreement per call: the band's description, the
    autograd state, the layer's arguments, every rank's rows), so the op
    makes no ``Allgather`` of its own. ``counts=None``: a domain of one
    (this rank's own count). The plan is remembered per ``(comm, op, key,
    counts, autograd)`` in :data:`AGREED_PLANS`, forgotten by ``manager.free()``.
    """
    return apply_agreed(op, x, agreed_plan(op, x, comm, counts, **args))


def agreed_plan(op: Op, x: Any, comm: MPI.Comm, counts: Sequence[int] | None = None, **args: Any) -> Any:
    """The plan :func:`run_agreed` runs (no MPI call): for a caller that applies ``op``'s kernel or adjoint itself."""
    grad = op.adjoint is not None and records_grad(x)
    key = op.key(x, args)
    full = None if key is None or counts is None else (id(comm), op.name, key, tuple(counts), grad)
    plan = None if full is None else AGREED_PLANS.get(full)
    if plan is None:
        mine = op.local(x, args)
        plan = op.plan(mine.plan, [mine.count] if counts is None else list(counts), comm, args)
        if full is not None:
            AGREED_PLANS[full] = plan
            while len(AGREED_PLANS) > AGREED_ENTRIES:
                AGREED_PLANS.pop(next(iter(AGREED_PLANS)))
    return op.bind(plan, args)


def apply_agreed(op: Op, x: Any, plan: Any) -> Any:
    """``op``'s kernel on ``x`` with an agreed ``plan``, differentiable when autograd records it (agreed by the caller)."""
    return _apply(op, x, plan, op.adjoint is not None and records_grad(x))


AGREED_PLANS: dict = {}  # run_agreed's plans: (id(comm), op name, key, counts, autograd) -> plan


@on_forget
def _forget_agreed_plans(comm: MPI.Comm | None) -> None:
    """Drop :data:`AGREED_PLANS` on ``comm`` (None: all), as :func:`credit_mpi.agreement.forget_agreements` does its own."""
    if comm is None:
        AGREED_PLANS.clear()
        return
    for full in [full for full, plan in AGREED_PLANS.items() if full[0] == id(comm) or getattr(plan, "comm", None) is comm]:
        del AGREED_PLANS[full]


#: Checks ``fn(op)`` run before the data of an op that autograd does not record moves (installed only while a
#: converted forward runs, by :mod:`credit_mpi.nn.judge.recompute`: a collective inside a custom autograd
#: Function's forward is refused there); they raise to refuse, before any data of the op moves.
BEFORE_DATA: list = []


def _apply(op: Op, x: Any, plan: Any, grad: bool) -> Any:
    """The kernel, inside the engine's autograd Function when autograd records the call."""
    if not grad:
        if BEFORE_DATA:  # a converted forward's checks (credit_mpi.nn.judge.recompute): none outside one
            for check in BEFORE_DATA:
                check(op)
        return _watched(op.data_phase, plan, op.kernel, x)
    run = _FUNCTION[0] if _FUNCTION else _function()  # (made once: the per-call path asks no function for it)
    return run.apply(x, op, plan, op.written(plan) if op.writes else None)


def _watched(phase: str, plan: Any, fn: Any, x: Any) -> Any:
    """``fn(x, plan)`` under the watchdog's deadline (:mod:`credit_mpi.watchdog`): a kernel or an adjoint.

    The agreement is watched by itself; after it, a rank that fails in the
    data phase (out of memory on one rank) or raises in backward before an
    adjoint (a hook, a loss on one rank) would leave the others waiting in
    the kernel's or the adjoint's collective with nothing to end the job.
    A few attribute writes, no MPI call (the thread was started by the
    agreement that came first).
    """
    state = watchdog.STATE  # the agreement's sequence number stays: "gather_tensor: data #12" follows "gather_tensor #12"
    state.op, state.comm, state.since = phase, getattr(plan, "comm", None), watchdog.monotonic()
    try:
        return fn(x, plan)
    finally:
        state.since = 0.0


_FUNCTION: list = []


def _function() -> Any:
    """The one ``torch.autograd.Function`` of the engine (made on first use: the engine imports torch lazily)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch

    from . import autograd  # its check_backward_thread looked up per call (tests replace it)

    class _Run(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, op, plan, written):
            ctx.op, ctx.plan = op, plan
            out = _watched(op.data_phase, plan, op.kernel, x)
            if written is not None:
                ctx.mark_dirty(written)  # written in place: autograd moves its version on, as for torch's in-place ops
            return out

        @staticmethod
        def backward(ctx, grad):
            op, plan = ctx.op, ctx.plan
            if op.backward_calls_mpi(plan):
                autograd.check_backward_thread()
            if op.local_adjoint:  # local torch code records itself (double backward through torch's ops), unwatched:
                return op.adjoint(grad, plan), None, None, None  # it cannot wait for another rank
            if not torch.is_grad_enabled():  # a backward that records no graph: the same calls, one Function less
                return _watched(op.backward_phase, plan, op.adjoint, grad), None, None, None
            return _Adjoint.apply(grad, op, plan), None, None, None  # double backward: the adjoint recorded as an op

    class _Adjoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, grad, op, plan):  # (a communicating adjoint: a local one records itself, above)
            ctx.op, ctx.plan = op, plan
            return _watched(op.backward_phase, plan, op.adjoint, grad)

        @staticmethod
        def backward(ctx, grad):  # the adjoint of a linear op's adjoint is the op
            if ctx.op.backward_calls_mpi(ctx.plan):
                autograd.check_backward_thread()
            return _Run.apply(grad, ctx.op, ctx.plan, None), None, None

    _FUNCTION.append(_Run)
    return _Run
