"""Recomputation in backward judged as the forward: activation checkpointing, and custom autograd Functions.

A converted forward's torch functions are judged while the :class:`~credit_mpi.nn.judge.tracker.Tracker`
is active, that is during the forward. Two things run a forward's code again later, in backward,
where no tracker is:

* **activation checkpointing** (``torch.utils.checkpoint.checkpoint``): the block's forward runs again
  in backward to rebuild what it did not keep. Without the rules, a block judged by its forward (a
  ``torch.roll`` of the sharded dim, a domain mean, attention over every band's tokens) recomputes on
  the band alone: the forward is exact, the gradients are not (reentrant), or torch's ``CheckpointError``
  says the recomputed tensors differ (non-reentrant). Here the function given to checkpoint is wrapped
  while a converted forward runs: its recomputation in backward enters a tracker of its own, with the
  placements its inputs had in the forward (by position: the reentrant kind recomputes on detached
  copies of the inputs, the non-reentrant kind on the inputs themselves), the module path and the trust
  of the layer that called it. The same rules run, the same collectives in the same order on every rank
  (autograd recomputes the blocks in the same order on every rank, as it does for the layers).
  Both entries are looked up by ``torch.utils.checkpoint.checkpoint`` at call time
  (``CheckpointFunction.forward``, ``_checkpoint_without_reentrant_generator``), so ``checkpoint`` imported
  by name, ``checkpoint_sequential`` and timm's ``checkpoint_seq`` are covered alike.
* **a custom** ``torch.autograd.Function`` whose backward recomputes (memory-saving attention kernels): its
  ``forward`` runs without autograd, and what its ``backward`` computes is its own code, which no rule can
  see. So a collective of the judge or of a layer (an engine op: a domain sum, the keys of every band, a
  halo) inside such a forward is refused with a :class:`~credit_mpi.nn.ConversionError`, before that op
  moves any data, at the same op on every rank (every rank runs the same forward; the converted forward
  shares the exception). A custom Function whose forward only does what stays in the band (an activation,
  timm's memory-efficient Swish) runs as before.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt
from torch.utils._pytree import tree_flatten

from ... import engine
from .. import base
from .registry import conversion_error
from .tracker import Tracker, active_tracker

__all__ = ["rejudged", "refuse_in_custom_function", "checked_dry_run", "checked_report", "checked_engine"]


def _tensors(args: Any) -> list:
    return [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]


def rejudged(fn: Any, tracker: Tracker, args: Any) -> Any:
    """``fn`` that, called with no tracker active (a recomputation in backward), runs under a new tracker with the
    placements ``args`` have in ``tracker`` now (and ``tracker``'s module path and trust)."""
    placements = [tracker.get(t) for t in _tensors(args)]
    stack, trusted, fields = list(tracker.stack), tracker.trusted, dict(tracker.fields)
    root_paths, root, shard_dim, manager = tracker.paths, tracker._root, tracker.shard_dim, tracker.manager

    def recompute(*a: Any, **k: Any) -> Any:
        if active_tracker() is not None:  # the forward itself (or a nested one): judged by the tracker in force
            return fn(*a, **k)
        tr = Tracker(torch.nn.Module(), shard_dim, manager)
        tr.paths, tr._root = root_paths, root
        with tr:
            tr.stack, tr.trusted, tr.fields = list(stack), trusted, dict(fields)
            for t, p in zip(_tensors((a, k)), placements, strict=False):
                if p is not None:
                    tr.set(t, p)
            return fn(*a, **k)

    recompute.__wrapped__ = fn
    return recompute


_reentrant_forward = _ckpt.CheckpointFunction.forward
_non_reentrant = _ckpt._checkpoint_without_reentrant_generator


def _checkpoint_forward(ctx: Any, run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
    tr = active_tracker()
    if tr is not None and not tr.trusted:
        run_function = rejudged(run_function, tr, args)
    return _reentrant_forward(ctx, run_function, preserve_rng_state, *args)


# the generator's settings before the function's own ``*args`` (preserve_rng_state, context_fn, ...); 0 where torch
# is the docs build's mock (no function to inspect, and nothing is checkpointed there)
_SETTINGS = sum(1 for p in inspect.signature(_non_reentrant).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD) - 1 if inspect.isfunction(_non_reentrant) else 0


def _checkpoint_generator(fn: Any, *rest: Any, **kwargs: Any) -> Any:
    tr = active_tracker()
    if tr is not None and not tr.trusted:
        fn = rejudged(fn, tr, (rest[_SETTINGS:], kwargs))
    return _non_reentrant(fn, *rest, **kwargs)


_ckpt.CheckpointFunction.forward = staticmethod(_checkpoint_forward)
_ckpt._checkpoint_without_reentrant_generator = _checkpoint_generator

# -- custom autograd Functions ------------------------------------------------------------------------------

_APPLY = torch.autograd.Function.apply.__func__.__code__
_OURS = ("credit_mpi.", "torch.")


def _custom_function() -> type | None:
    """The user's ``torch.autograd.Function`` whose ``forward`` is running (None: none; credit_mpi's and torch's own
    Functions, activation checkpointing among them, are not the user's)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY:
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and not cls.__module__.startswith(_OURS):
                return cls
        frame = frame.f_back
    return None


def refuse_in_custom_function(op: Any) -> None:
    """The engine's check before an op's data moves without autograd (:data:`credit_mpi.engine.BEFORE_DATA`):
    inside a converted forward, within a user's custom autograd Function's forward, it is refused."""
    tr = active_tracker()
    if tr is None or torch.is_grad_enabled():
        return
    _refuse(tr, getattr(op, "name", str(op)))


def _refuse(tr: Tracker, what: str) -> None:
    cls = _custom_function()
    if cls is None:
        return
    raise conversion_error(tr.stack[-1][0], f"{cls.__qualname__}.apply()",
                           f"a custom torch.autograd.Function whose forward moves rows between the bands ({what}): its "
                           f"backward is its own code, which runs outside the rules (a recomputation there sees "
                           f"the band alone: wrong gradients); write the block with torch functions (autograd "
                           f"differentiates the rules) and use torch.utils.checkpoint to save memory, which is "
                           f"judged in backward as in the forward")


def checked_dry_run(tr: Tracker) -> None:
    """describe()'s dry run (no engine): a rule's move or gather and a layer's call inside a user's custom autograd
    Function's forward are refused there as the run refuses them (``tr.on_move`` and ``tr.on_layer`` checked)."""
    for name in ("on_move", "on_layer"):
        report = getattr(tr, name)
        if report is not None:
            setattr(tr, name, _checked(tr, report, name))


def _checked(tr: Tracker, report: Any, name: str) -> Any:
    def checked(*args: Any) -> Any:
        what = args[1] if name == "on_move" else f"{type(args[0]).__name__.replace('DomainParallel', '')} layer"
        _refuse(tr, str(what))
        return report(*args)

    return checked


def checked_report(tr: Tracker, report: Any) -> Any:
    """describe()'s attention reporter ``report(tracker, q, k, v, gqa)`` (its gathers), checked as
    :func:`checked_dry_run` checks the moves."""
    def checked(*args: Any) -> Any:
        if tr.trusted == 0 and any(tr.get(t) is not None for t in args[1:4]):
            _refuse(tr, "scaled_dot_product_attention over every band's tokens")
        return report(*args)

    return checked


@contextlib.contextmanager
def checked_engine():
    """While a converted forward runs: the engine's ops without autograd are checked by
    :func:`refuse_in_custom_function` (nothing is installed outside converted forwards: no cost on other paths)."""
    hooks = engine.BEFORE_DATA
    hooks.append(refuse_in_custom_function)
    try:
        yield
    finally:
        hooks.remove(refuse_in_custom_function)


_judge_forward = base.judged


@contextlib.contextmanager
def _judged(root: torch.nn.Module, shard_dim: int, manager: Any, inputs: Any):
    """:func:`~credit_mpi.nn.judge.tracker.judge_forward` with the engine's check of custom Functions."""
    with checked_engine(), _judge_forward(root, shard_dim, manager, inputs) as tracker:
        yield tracker


base.judged = _judged
