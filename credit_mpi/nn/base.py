"""The common part of every domain-parallel layer: adopting an existing module.

A wrapper is an instance of a subclass of the wrapped module's class
(``DomainParallelConv2d`` is an ``nn.Conv2d``) that takes over the module's
state: the SAME Parameter objects and buffers under the same names, so
``state_dict()`` keys are those of the unconverted model and a checkpoint
loads both ways; ``.to()``/``.double()`` work as on the original. Only
``forward`` changes, and on a domain of size 1 (or without a manager) it is
the original module's ``forward``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..manager import DomainParallelManager
from ..partition import normalize_dim

__all__ = ["DomainParallelModule", "adopt"]

_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks")


class DomainParallelModule:
    """Mixin of every domain-parallel layer (the manager, the sharded dim, the module's path)."""

    dp_manager: DomainParallelManager | None
    dp_shard_dim: int
    dp_path: str

    def dp_active(self) -> bool:
        """True when the layer runs on bands (a manager with a domain of more than one rank)."""
        m = self.dp_manager
        return m is not None and m.domain_parallel_size > 1

    def dp_spatial_axis(self, x: torch.Tensor, nspatial: int, what: str) -> int:
        """The sharded axis of ``x``, which must be one of its last ``nspatial`` (spatial) dims."""
        axis = normalize_dim(self.dp_shard_dim, x.ndim)
        if axis < x.ndim - nspatial:
            raise ValueError(
                f"{self.dp_path} ({what}): shard_dim={self.dp_shard_dim} is dim {axis} of a {x.ndim}-dimensional "
                f"input, not one of its {nspatial} spatial dims (the last {nspatial}); shard a spatial dim"
            )
        return axis

    def extra_repr(self) -> str:  # noqa: D102
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, shard_dim={self.dp_shard_dim}" if base else f"shard_dim={self.dp_shard_dim}"


def adopt(cls: type, module: torch.nn.Module, manager: DomainParallelManager | None, shard_dim: int, path: str) -> Any:
    """A ``cls`` instance that shares ``module``'s parameters, buffers, submodules and settings."""
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    for name in _DICTS:
        if name in state:
            state[name] = OrderedDict(state[name])
    new.__dict__.update(state)
    new.dp_manager = manager
    new.dp_shard_dim = shard_dim
    new.dp_path = path or "<root>"
    return new
