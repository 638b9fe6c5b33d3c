"""What a converted model runs eagerly under ``torch.compile``: every forward the judge follows function by function.

The judge (:mod:`credit_mpi.nn.judge`) is a ``TorchFunctionMode`` that
follows each band through the torch functions of a module's own forward,
with sizes read from a band as the field's (:class:`~credit_mpi.nn.judge.tracker.Extent`).
Dynamo does not keep either: it inlines ``F.pad`` (whose ``has_torch_function``
check it evaluates as False under a mode: ``aten.constant_pad_nd`` in the graph,
no edge-pad record for the next convolution to fold) and it turns ``x.shape``
into its own ints (a bias built from the band's rows instead of the field's:
refused). Compiled, WXFormer's CrossEmbed and Attention were refused on
every rank (issue 35). So the forward of every module the judge follows
(a user's module that the converter does not replace, and torch's padding
modules) runs eagerly under ``torch.compile`` (``torch.compiler.disable``,
recursive: one graph break per call), exactly as in eager; what dynamo
still compiles is the converted root's own forward (under its
:class:`~credit_mpi.nn.base.ForwardGuard`) and the layers it calls itself.
Containers (``nn.Sequential``) keep compiling: their forward only calls
modules. ``F.pad`` called directly in a compiled forward is refused at run
time where its input is a band the tracker knows.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["EagerForward", "keep_eager", "judged_eagerly"]

_CONTAINERS = (torch.nn.Sequential.forward,)


class EagerForward:
    """A module's ``forward`` (an instance attribute) that ``torch.compile`` leaves eager: a graph break."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _eager_call(self.module, args, kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The module's own forward signature (for code that inspects ``module.forward``)."""
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __deepcopy__(self, memo: dict) -> EagerForward:
        import copy

        return EagerForward(copy.deepcopy(self.module, memo))

    def __reduce__(self):
        return (EagerForward, (self.module,))


@torch.compiler.disable(recursive=True)
def _eager_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    return type(module).forward(module, *args, **kwargs)


def judged_eagerly(module: torch.nn.Module, path: str, manager: Any) -> bool:
    """True when a converted model's ``module`` (at ``path``, "" the root) gets an eager ``forward``: on a domain of
    several bands, not the root (its :class:`~credit_mpi.nn.base.ForwardGuard`), not a container."""
    return (bool(path) and manager is not None and manager.domain_parallel_size > 1
            and type(module).forward not in _CONTAINERS and "forward" not in module.__dict__)


def keep_eager(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with a ``forward`` that runs eagerly under ``torch.compile`` (idempotent); returns ``module``."""
    if not isinstance(module.__dict__.get("forward"), EagerForward):
        module.__dict__["forward"] = EagerForward(module)
    return module
