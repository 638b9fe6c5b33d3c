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

from ..grid import grid_of
from ..manager import DomainParallelManager
from ..partition import normalize_dim
from ._comm import ConversionError

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

    def dp_grid(self) -> tuple[int, int]:
        """``(rows, cols)`` of the manager's domain grid (``(n, 1)``: latitude bands)."""
        m = self.dp_manager
        return grid_of(m, m.domain_parallel_size)

    def dp_on_grid(self) -> bool:
        """True when the layer runs on 2-D blocks (a domain grid of more than one column)."""
        return self.dp_active() and self.dp_grid()[1] > 1

    def dp_grid_axes(self, x: torch.Tensor, nspatial: int, what: str) -> tuple[int, int]:
        """The (latitude, longitude) axes of ``x`` on a 2-D grid: its last two dims, ``shard_dim`` the first of them.

        Raises:
            ConversionError: the layer has fewer than two spatial dims.
            ValueError: ``shard_dim`` is not the second-to-last dim of ``x``.
        """
        rows, cols = self.dp_grid()
        if nspatial < 2:
            raise ConversionError(
                f"{self.dp_path} ({what}): a {rows}x{cols} domain grid splits latitude and longitude (the last two "
                f"dims), but this layer has {nspatial} spatial dim; use a grid of one column (domain_grid=None)"
            )
        axis = normalize_dim(self.dp_shard_dim, x.ndim)
        if axis != x.ndim - 2:
            raise ValueError(
                f"{self.dp_path} ({what}): on a {rows}x{cols} domain grid the blocks split the last two dims "
                f"(latitude, longitude), so shard_dim must be dim {x.ndim - 2} (or -2) of this {x.ndim}-dimensional "
                f"input, got shard_dim={self.dp_shard_dim}"
            )
        return x.ndim - 2, x.ndim - 1

    def dp_spatial_axis(self, x: torch.Tensor, nspatial: int, what: str) -> int:
        """The sharded axis of ``x``, which must be one of its last ``nspatial`` (spatial) dims.

        Raises:
            ConversionError: the manager has a 2-D grid (more than one column):
                the layers that call this know latitude bands only.
            ValueError: the sharded dim is not a spatial dim.
        """
        rows, cols = self.dp_grid()
        if cols > 1:
            raise ConversionError(
                f"{self.dp_path} ({what}): this layer has no exact rule on a {rows}x{cols} latitude x longitude "
                f"domain grid yet (only convolutions and normalisations do); use latitude bands "
                f"(domain_grid=None or ({rows * cols}, 1)) or a custom converter"
            )
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
