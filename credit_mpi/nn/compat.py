"""CREDIT's ``credit.domain_parallel`` names on credit_mpi: layers built by wrapping a module, and an import alias.

CREDIT builds its layers from the module they replace (``DomainParallelConv2d(conv)``,
``.halo_width``) and takes custom converters of one argument
(``custom_converters={T: lambda m: DomainParallelPeriodicConv2d(m)}``). credit_mpi's
layers are the wrapped classes themselves (a ``DomainParallelConv2d`` *is* an
``nn.Conv2d``, made by the converter); this module gives CREDIT's spelling:

* :data:`DomainParallelConv2d` and the other wrapped layers: ``Cls(module, shard_dim)``
  returns credit_mpi's layer sharing ``module``'s parameters (exact on even and uneven
  bands), with CREDIT's ``halo_width`` (the rows CREDIT's layer exchanges; credit_mpi
  computes each band's own, which :func:`~credit_mpi.nn.describe` shows), and
  ``isinstance(layer, Cls)`` holds for every credit_mpi layer of that kind, the
  converter's included;
* :class:`DomainParallelPeriodicConv2d`: CREDIT's ``PeriodicConv2d`` (circular longitude,
  reflected latitude, a conv without padding) with the latitude's reflection at the
  field's edges and the neighbours' rows inside it;
* :class:`DomainParallelCrossEmbedBranch`: a ``CrossEmbedConvBranch``
  (``ZeroPad2d`` + ``Conv2d``) whose padding of the latitude is the field's edges only;
* :func:`credit_modules` / :func:`credit_alias`: ``credit.domain_parallel`` and its
  submodules as modules of these names, so code written for CREDIT (its own tests
  included) imports credit_mpi unchanged;
* CREDIT's trainer mode (``credit_alias(torch_groups=True)``, what
  :mod:`credit_mpi.credit` runs CREDIT's trainer under): the manager CREDIT's code gets is a
  :class:`CreditManager`, whose ``domain_group`` / ``data_parallel_group`` are torch process
  groups (CREDIT's ``gather_spatial`` and gradient averaging call ``torch.distributed`` on
  them), while credit_mpi's layers and collectives keep the MPI communicators.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..manager import DomainParallelManager, get_domain_parallel_manager, initialize_domain_parallel
from . import conv, norm, resample
from .base import adopt
from .conv import fold_edge_rows
from .exchange import HaloExchange

__all__ = [
    "DomainParallelConv2d", "DomainParallelConv3d", "DomainParallelConvTranspose2d", "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm", "DomainParallelPeriodicConv2d", "DomainParallelCrossEmbedBranch",
    "DomainParallelInterpolate", "convert_to_domain_parallel", "credit_modules", "credit_alias", "CreditManager",
]


def _along(value: Any, index: int) -> int:
    return value if isinstance(value, int) else value[index]


def credit_halo_width(module: nn.Module, index: int) -> int:
    """The halo CREDIT's layer exchanges for ``module`` (its formula; ``index``: the latitude's place in kernel_size)."""
    k, s = _along(module.kernel_size, index), _along(module.stride, index)
    if isinstance(module, (nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return _along(module.padding, index) if k > s else 0
    return (k - 1) // 2 if s == 1 else max(0, (k - s) // 2)


class _Wrapping(type):
    """The metaclass of CREDIT's layer names: calling one wraps a module, ``isinstance`` asks credit_mpi's class."""

    def __call__(cls, module: nn.Module, shard_dim: int | None = None):
        if not isinstance(module, cls._wraps):
            raise TypeError(f"{cls.__name__} wraps an {cls._wraps.__name__}, got {type(module).__name__}")
        dim = cls._shard_dim if shard_dim is None else shard_dim
        layer = adopt(cls._layer, module, get_domain_parallel_manager(), dim, cls.__name__)
        if cls._index is not None:
            layer.halo_width = credit_halo_width(module, cls._index)
        return layer

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._layer)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._layer)


def _wrapping(name: str, wraps: type, layer: type, index: int | None, shard_dim: int = -2) -> type:
    doc = (f"CREDIT's ``{name}({wraps.__name__.lower()}, shard_dim={shard_dim})``: credit_mpi's "
           f":class:`~{layer.__module__}.{layer.__name__}` sharing the module's parameters.")
    return _Wrapping(name, (), {"__doc__": doc, "_wraps": wraps, "_layer": layer, "_index": index, "_shard_dim": shard_dim})


DomainParallelConv2d = _wrapping("DomainParallelConv2d", nn.Conv2d, conv.DomainParallelConv2d, 0)
DomainParallelConv3d = _wrapping("DomainParallelConv3d", nn.Conv3d, conv.DomainParallelConv3d, 1, 3)
DomainParallelConvTranspose2d = _wrapping("DomainParallelConvTranspose2d", nn.ConvTranspose2d,
                                          conv.DomainParallelConvTranspose2d, 0)
DomainParallelConvTranspose3d = _wrapping("DomainParallelConvTranspose3d", nn.ConvTranspose3d,
                                          conv.DomainParallelConvTranspose3d, 1, 3)
DomainParallelGroupNorm = _wrapping("DomainParallelGroupNorm", nn.GroupNorm, norm.DomainParallelGroupNorm, None)


class _WrapsConv:
    """CREDIT's wrappers expose their conv's ``weight`` and ``bias``."""

    @property
    def weight(self) -> torch.Tensor:
        return self.conv.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.conv.bias


class DomainParallelPeriodicConv2d(_WrapsConv, nn.Module):
    """CREDIT's ``DomainParallelPeriodicConv2d(periodic_conv, shard_dim=-2)``: a ``PeriodicConv2d`` on bands.

    ``PeriodicConv2d`` pads the longitude circularly and the latitude by reflection, then runs a
    conv without padding (``.conv``, ``.padding``). Here the latitude gets the neighbours' rows
    (``.halo_exchange``, boundary ``"reflect"``: the field's edges reflected as the original does),
    so the conv sees what it sees on one process: exact (stride 1 along the latitude).
    """

    _dp_trusted = True  # its forward exchanges the halo itself: not judged function by function

    def __init__(self, periodic_conv: nn.Module, shard_dim: int = -2) -> None:
        super().__init__()
        self.conv = periodic_conv.conv
        self.padding = periodic_conv.padding
        self.shard_dim = shard_dim
        if _along(self.conv.stride, 0) != 1:
            raise ValueError(f"DomainParallelPeriodicConv2d: the conv's latitude stride is {self.conv.stride}; only 1 "
                             f"has a rule here (convert the conv itself with padding_mode='circular' instead)")
        self.halo_exchange = HaloExchange(self.padding, dim=shard_dim, boundary="reflect")

    def dp_adopt_manager(self, manager: Any) -> None:
        """The converter's manager (CREDIT's layer uses the global one; a CREDIT converter passes none)."""
        if self.halo_exchange.manager is None:
            self.halo_exchange = HaloExchange(self.padding, dim=self.shard_dim, boundary="reflect", manager=manager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.padding, self.padding, 0, 0), mode="circular")  # longitude: whole on every band
        return self.conv(self.halo_exchange(x))


class DomainParallelCrossEmbedBranch(_WrapsConv, nn.Module):
    """CREDIT's ``DomainParallelCrossEmbedBranch(branch, shard_dim=-2)``: a ``ZeroPad2d`` + ``Conv2d`` branch on bands.

    The ``ZeroPad2d`` pads the longitude as it is; its latitude rows are the conv's own padding at
    the field's edges (:func:`credit_mpi.nn.conv.fold_edge_rows`): the conv is credit_mpi's
    :class:`~credit_mpi.nn.DomainParallelConv2d`, which reads the neighbours' rows itself and owns the
    output rows anchored on the unpadded field, so every branch of a CrossEmbedLayer gives the same
    bands. credit_mpi's converter does the same with the branch as it is (no custom converter needed).
    """

    _dp_trusted = True

    def __init__(self, branch: nn.Module, shard_dim: int = -2) -> None:
        super().__init__()
        zero_pad, inner = branch[0], branch[1]
        self.conv = DomainParallelConv2d(inner, shard_dim)
        self.shard_dim = shard_dim
        left, right, top, bottom = zero_pad.padding
        self.w_padding, self.h_padding = (left, right), (top, bottom)
        self.halo_width = self.conv.halo_width
        # the sharded dim's padding folded into the conv (spatial dim 0 for shard_dim -2, 1 for -1); the other padded here
        self._sd = shard_dim % 2
        fold_edge_rows(self.conv, (self._sd, *(self.h_padding if self._sd == 0 else self.w_padding)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (*self.w_padding, 0, 0) if self._sd == 0 else (0, 0, *self.h_padding)))


def DomainParallelInterpolate(size, mode: str = "bilinear", shard_dim: int = -2) -> resample.DomainParallelInterpolate:  # noqa: N802
    """CREDIT's ``DomainParallelInterpolate(size, mode="bilinear", shard_dim=-2)`` (CREDIT's default mode)."""
    return resample.DomainParallelInterpolate(size=size, mode=mode, shard_dim=shard_dim)


def convert_to_domain_parallel(model: nn.Module, manager: Any = None, shard_dim: int = -2, custom_converters=None):
    """CREDIT's signature (``custom_converters`` positional too; factories of ``(module)`` or ``(module, manager, dim)``)."""
    from .convert import convert_to_domain_parallel as convert

    return convert(model, manager, shard_dim, custom_converters=custom_converters)


class CreditManager:
    """The manager CREDIT's trainer sees: a :class:`~credit_mpi.DomainParallelManager` whose groups are torch's.

    CREDIT's own code calls ``torch.distributed`` on ``manager.domain_group`` (``gather_spatial``
    between rollout steps, ``sync_domain_gradients``); here those are the torch groups that
    :func:`~credit_mpi.init_torch_distributed` made with the same ranks as the MPI communicators
    (``domain_group`` / ``data_parallel_group``). Every other attribute is the MPI manager's
    (``mpi_manager``), which credit_mpi's layers and collectives use: the aliased functions
    (``shard_tensor``, ``convert_to_domain_parallel``, ...) take either.
    """

    def __init__(self, mpi_manager: DomainParallelManager) -> None:
        if mpi_manager.torch_domain_group is None:
            raise ValueError("CreditManager needs a manager with torch groups: call "
                             "credit_mpi.init_torch_distributed(manager) first")
        self.mpi_manager = mpi_manager

    @property
    def domain_group(self) -> Any:
        """The torch process group of this rank's domain group."""
        return self.mpi_manager.torch_domain_group

    @property
    def data_parallel_group(self) -> Any:
        """The torch process group of this rank's data-parallel group."""
        return self.mpi_manager.torch_data_parallel_group

    def __getattr__(self, name: str) -> Any:
        if name == "mpi_manager":  # before __init__ has set it (copy, pickle)
            raise AttributeError(name)
        return getattr(self.mpi_manager, name)

    def __repr__(self) -> str:
        return f"CreditManager({self.mpi_manager!r}, torch groups)"


def _mpi_manager(manager: Any) -> Any:
    """The MPI manager behind a :class:`CreditManager` (any other manager as it is)."""
    return manager.mpi_manager if isinstance(manager, CreditManager) else manager


def _torch_mode_names() -> dict[str, Any]:
    """CREDIT's manager and sharding names where the manager CREDIT's code holds is a :class:`CreditManager`."""
    import credit_mpi

    from ..torch_bridge import init_torch_distributed

    views: dict[int, CreditManager] = {}

    def view(manager: DomainParallelManager | None) -> CreditManager | None:
        if manager is None:
            return None
        if id(manager) not in views or views[id(manager)].mpi_manager is not manager:
            views[id(manager)] = CreditManager(manager)
        return views[id(manager)]

    def initialize(world_size: int | None, domain_parallel_size: int, shard_dim: int = -2, **kwargs: Any):
        """CREDIT's ``initialize_domain_parallel``, then the torch groups (reusing CREDIT's torch.distributed)."""
        manager = initialize_domain_parallel(world_size, domain_parallel_size, shard_dim, **kwargs)
        init_torch_distributed(manager)
        return view(manager)

    def unwrapping(function):
        def call(*args, **kwargs):
            args = tuple(_mpi_manager(a) for a in args)
            return function(*args, **{k: _mpi_manager(v) for k, v in kwargs.items()})

        call.__name__, call.__doc__ = function.__name__, function.__doc__
        return call

    def convert(model, manager=None, shard_dim=-2, custom_converters=None):
        return convert_to_domain_parallel(model, _mpi_manager(manager), shard_dim, custom_converters)

    return {
        "manager": {"initialize_domain_parallel": initialize,
                    "get_domain_parallel_manager": lambda: view(get_domain_parallel_manager())},
        "sharding": {n: unwrapping(getattr(credit_mpi, n)) for n in ("shard_tensor", "gather_tensor", "shard_batch")},
        "convert": {"convert_to_domain_parallel": convert},
    }


def credit_modules(torch_groups: bool = False) -> dict[str, types.ModuleType]:
    """``credit.domain_parallel`` and its submodules, as modules whose names are credit_mpi's (for ``sys.modules``).

    ``torch_groups=True``: CREDIT's trainer mode (see :func:`credit_alias`).
    """
    import credit_mpi

    from .validate import validate_sharding_constraints

    layers = {"DomainParallelConv2d": DomainParallelConv2d, "DomainParallelConv3d": DomainParallelConv3d,
              "DomainParallelConvTranspose2d": DomainParallelConvTranspose2d,
              "DomainParallelConvTranspose3d": DomainParallelConvTranspose3d,
              "DomainParallelGroupNorm": DomainParallelGroupNorm,
              "DomainParallelPeriodicConv2d": DomainParallelPeriodicConv2d,
              "DomainParallelCrossEmbedBranch": DomainParallelCrossEmbedBranch,
              "DomainParallelInterpolate": DomainParallelInterpolate, "HaloExchange": HaloExchange}
    parts = {
        "manager": {"DomainParallelManager": DomainParallelManager, "initialize_domain_parallel": initialize_domain_parallel,
                    "get_domain_parallel_manager": get_domain_parallel_manager},
        "sharding": {n: getattr(credit_mpi, n) for n in ("shard_tensor", "gather_tensor", "shard_batch")},
        "halo_exchange": {"HaloExchange": HaloExchange},
        "layers": layers,
        "convert": {"convert_to_domain_parallel": convert_to_domain_parallel,
                    "validate_sharding_constraints": validate_sharding_constraints, **layers},
    }
    if torch_groups:
        for name, names in _torch_mode_names().items():
            parts[name].update(names)
    modules = {}
    package = types.ModuleType("credit.domain_parallel", "credit_mpi's names under CREDIT's (credit_mpi.nn.compat)")
    package.__path__ = []
    for name, names in parts.items():
        module = types.ModuleType(f"credit.domain_parallel.{name}")
        module.__dict__.update(names)
        setattr(package, name, module)
        package.__dict__.update(names)
        modules[module.__name__] = module
    package.__all__ = sorted(n for names in parts.values() for n in names)
    modules[package.__name__] = package
    return modules


@contextlib.contextmanager
def credit_alias(torch_groups: bool = False):
    """Within: ``import credit.domain_parallel...`` gives credit_mpi's names (the previous modules restored after).

    ``torch_groups=True`` is CREDIT's trainer mode: ``initialize_domain_parallel`` also calls
    :func:`~credit_mpi.init_torch_distributed` (reusing the torch.distributed that CREDIT's setup
    started, or starting one from the MPI job), and it and ``get_domain_parallel_manager`` give a
    :class:`CreditManager`, whose ``domain_group`` / ``data_parallel_group`` are torch process
    groups, since CREDIT's trainer calls ``torch.distributed`` on them. credit_mpi's layers and
    collectives keep the MPI communicators: the aliased functions take either manager.
    """
    modules = credit_modules(torch_groups)
    try:
        import credit  # noqa: F401 - CREDIT installed: its other modules (the models) stay importable
    except ImportError:
        stand_in = types.ModuleType("credit", "a stand-in parent of credit_mpi's credit.domain_parallel alias")
        stand_in.__path__ = []
        modules["credit"] = stand_in
    saved = {name: sys.modules.get(name) for name in modules}
    parent = sys.modules.get("credit") if "credit" not in modules else None
    sys.modules.update(modules)
    if "credit" in modules:
        modules["credit"].domain_parallel = modules["credit.domain_parallel"]
    had = parent is not None and hasattr(parent, "domain_parallel")
    old = getattr(parent, "domain_parallel", None) if parent is not None else None
    if parent is not None:
        parent.domain_parallel = modules["credit.domain_parallel"]
    try:
        yield modules["credit.domain_parallel"]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if parent is not None:
            if had:
                parent.domain_parallel = old
            else:
                del parent.domain_parallel
