"""Tensors that every rank of the domain holds whole (not a band): the global mean's output.

``AdaptiveAvgPool`` to one row along the sharded dim returns the same row on
every rank. A later layer that took those replicas for bands (a padded conv
would see ``domain_size`` rows) would be silently wrong, so the output is a
:class:`Replicated` tensor, and what is computed from replicated tensors alone
(and parameters, the same on every rank) stays one: ``torch.relu(r)``,
``r * 2``, ``conv(r)``. A result that also takes a band (``x - r``, a
``torch.cat`` with a band) is a plain tensor again, a band. A converted layer
given a replicated input (on every rank: agreed) runs the original module on
it, which is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["Replicated", "replicated", "is_replicated"]


class Replicated(torch.Tensor):
    """A tensor whose every element is on every rank of the domain (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _PLAIN:
            return out  # what the tensor is made of, not a result (as_subclass makes a view: its _base again...)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not all(isinstance(t, (Replicated, torch.nn.Parameter)) for t in tensors):
            return out  # computed from a band too: a band
        inputs = {id(t) for t in tensors}
        return tree_map_only(torch.Tensor, lambda t: t if id(t) in inputs else t.as_subclass(Replicated), out)


# attribute reads answered as they are: a replicated tensor's ``_base`` (``as_subclass`` of it would be a view whose
# ``_base`` is wrapped again: torch.compile's dynamo walks that chain, a RecursionError) and its gradients
_PLAIN = frozenset(getattr(torch.Tensor, name).__get__ for name in ("_base", "grad", "_grad", "grad_fn"))


def replicated(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked as replicated over the domain (shares its data and autograd history)."""
    return t if isinstance(t, Replicated) else t.as_subclass(Replicated)


def is_replicated(t: Any) -> bool:
    """True for a tensor marked by :func:`replicated` (or computed from such tensors alone)."""
    return isinstance(t, Replicated)
