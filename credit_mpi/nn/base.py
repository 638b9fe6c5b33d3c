"""The common part of every domain-parallel layer: adopting an existing module.

A wrapper is an instance of a subclass of the wrapped module's class
(``DomainParallelConv2d`` is an ``nn.Conv2d``) that takes over the module's
state: the SAME Parameter objects and buffers under the same names, so
``state_dict()`` keys are those of the unconverted model and a checkpoint
loads both ways; ``.to()``/``.double()`` work as on the original. Only
``forward`` changes, and on a domain of size 1 (or without a manager) it is
the original module's ``forward``.

The manager is held through a :class:`ManagerRef` whose ``deepcopy`` is
itself: ``copy.deepcopy(model)`` (an EMA copy) gets its own parameters and
shares the manager and its communicators; pickling it (``torch.save(model)``)
raises a ``TypeError`` that names ``state_dict()`` (communicators do not
travel between processes).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..agreement import quiet_forward, quiet_known, remember_quiet
from ..grid import grid_of
from ..manager import DomainParallelManager
from ..partition import normalize_dim
from ..transport import paths
from ..validation import Local
from ..validation import agree as agree_once
from ._comm import forward_done, forward_start, share_failure
from .errors import ConversionError
from .geometry import RowGeometry
from .replicated import is_replicated

__all__ = ["DomainParallelModule", "ManagerRef", "ForwardGuard", "adopt", "guard_forward", "layout_refusal", "no_empty_band"]

_DICTS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks")


def layout_refusal(path: str, lay: Any, stride: int = 1) -> ConversionError:
    """The one refusal of a band layout a layer cannot run (a band with no row, or too few for its window or halo).

    ``lay`` is the layer's :class:`~credit_mpi.nn.geometry.LayerBands` of the AGREED bands, so every rank builds
    the same error before any of the layer's data moves; a ConversionError (a DomainParallelError), as every
    layout without an exact rule is, naming the layer, every rank's rows and what would run.
    """
    least = max(int(lay.min_rows), 1)
    return ConversionError(
        f"{path}: the band layout cannot run exactly: {lay.problem} (an input of {lay.size} rows on "
        f"{len(lay.bands)} domain ranks). This layer needs every band to hold at least {least} row(s) of its input"
        + (f", with band offsets that are multiples of the stride {stride} to keep skip connections aligned" if stride > 1 else "")
        + f"; use at most {max(lay.size // least, 1)} domain rank(s) for this field, or a field of at least "
        f"{len(lay.bands) * least} rows"
    )


def no_empty_band(path: str, sizes: list[int]) -> None:
    """Raise the refusal of a layer whose input has a band of no row (more domain ranks than rows), from AGREED
    ``sizes``: the same ConversionError on every rank, before the layer's statistics or halo move anything."""
    if any(s == 0 for s in sizes):
        total = sum(sizes)
        raise ConversionError(
            f"{path}: a band holds no row (each domain rank's rows along the sharded dim: {list(sizes)}, {total} in "
            f"all); every band needs at least one row: use at most {max(total, 1)} domain rank(s) for this field, "
            f"or a field of at least {len(sizes)} rows"
        )


class ManagerRef:
    """Holds a layer's manager: shared by ``copy.deepcopy`` (a copy of a model runs on the same ranks), never pickled."""

    __slots__ = ("manager",)

    def __init__(self, manager: DomainParallelManager | None) -> None:
        self.manager = manager

    def __deepcopy__(self, memo: dict) -> ManagerRef:
        return self

    def __copy__(self) -> ManagerRef:
        return self

    def __reduce__(self):
        if self.manager is None:
            return (ManagerRef, (None,))
        raise TypeError(
            "a converted credit_mpi model holds a DomainParallelManager (MPI communicators), which cannot be "
            "pickled: save model.state_dict() (the keys are those of the unconverted model) and load it into a "
            "model converted in the new process; copy.deepcopy(model) works (the copy shares the manager)"
        )


_BATCH = threading.local()


@contextlib.contextmanager
def batch_bands():
    """Within: the layers run their original forward (their input holds the bands in its batch dim)."""
    _BATCH.depth = getattr(_BATCH, "depth", 0) + 1
    try:
        yield
    finally:
        _BATCH.depth -= 1


class DomainParallelModule:
    """Mixin of every domain-parallel layer (the manager, the sharded dim, the module's path)."""

    dp_shard_dim: int
    dp_path: str

    #: Agreements of one repeated call on a replicated input (a global mean's): none (the first call's one agreement
    #: is remembered: the layer makes no MPI call, :func:`credit_mpi.agreement.quiet_forward`).
    dp_local_agreements = 0

    #: The layer's spatial dims (a conv's, a pooling's: its kernel's), None: every dim after ``(N, C)``.
    _nd: int | None = None

    def dp_spatial_index(self, ndim: int, axis: int) -> int:
        """Which of the layer's spatial dims the sharded ``axis`` of an ``ndim``-dimensional input is (its index
        into ``kernel_size``, ``stride``, ``output_size``): counted from the end, as torch counts an unbatched
        ``(C, H, W)`` input's. The one formula the forwards and ``describe()`` read (``axis - 2`` is wrong there)."""
        nd = ndim - 2 if self._nd is None else self._nd
        return axis - (ndim - nd)

    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> RowGeometry:
        """What this layer does to the rows of spatial dim ``sd`` for input bands ``sizes`` (``h_out``: the output's
        global rows, where the layer needs them): the one place its forward, ``describe()`` and the traffic count
        read it. The default: the output keeps the input's bands (a pointwise layer)."""
        return RowGeometry()

    def dp_no_halo(self, sizes: list[int], sd: int) -> bool:
        """True when a call on bands ``sizes`` (agreed) reads and writes no row of another band (a 1x1 conv, a pooling
        whose windows stay in the band): a windowed layer whose layout has no halo makes no MPI call after its
        agreement, so a repeat of it may skip that (:func:`credit_mpi.agreement.quiet_forward`)."""
        lay = self.dp_geometry(sizes, sd).layout
        return lay is not None and not lay.problem and not lay.width

    def dp_traffic(self, shape_in: tuple[int, ...], shape_out: tuple[int, ...], dtype: torch.dtype, axis: int, n: int,
                   width: int, grad: bool, weight_grad: bool) -> Callable[[int], Any] | None:
        """``rank -> Traffic`` of one call on ``n`` bands (:mod:`credit_mpi.nn.traffic`), or None: no rule (the
        default), ``describe()`` shows no numbers."""
        return None

    def dp_replicated(self, h_in: int, h_out: int) -> bool:
        """True when the output of ``h_in`` -> ``h_out`` rows is replicated on every rank, not bands (a global mean)."""
        return False

    def dp_refusal(self, n: int, grid: tuple[int, int] | None) -> str:
        """Why the run refuses this layer on ``n`` bands / a domain ``grid`` that the layer rule lets through ("" when
        it does not): what ``describe()`` reports in place of a layout."""
        return ""

    @property
    def dp_manager(self) -> DomainParallelManager | None:
        """The layer's manager (None: the original module's forward)."""
        ref = self.__dict__.get("_dp_ref")
        return None if ref is None else ref.manager

    @dp_manager.setter
    def dp_manager(self, manager: DomainParallelManager | None) -> None:
        # a new holder, never the old one mutated: a deepcopy shares the holder with the original
        self.__dict__["_dp_ref"] = ManagerRef(manager)

    def dp_active(self) -> bool:
        """True when the layer runs on bands (a manager with a domain of more than one rank)."""
        m = self.dp_manager
        return m is not None and m.domain_parallel_size > 1

    def dp_local(self, x: Any) -> bool:
        """True when the layer runs its original ``forward``: no bands, an input replicated on every rank, or bands in the batch.

        Bands in the batch dim (windows moved there by a custom forward, as
        CrossFormer's short-distance attention does) are whole samples: the
        function-level tracker says so through :func:`batch_bands` (the same
        on every rank: it follows the same forward).

        A :class:`~credit_mpi.nn.replicated.Replicated` input (a global
        mean's output, whole on every rank) is computed locally, which is
        exact; that it is replicated on every rank is agreed first (one
        ``Allgather``, only then: a rank whose input is a band is in its
        band agreement, and both raise).
        """
        if not self.dp_active() or getattr(_BATCH, "depth", 0):
            return True
        if not is_replicated(x):
            return False
        shape, dtype, comm = tuple(x.shape), str(x.dtype), self.dp_manager.domain_group
        key = ("replicated", self.dp_path, shape, dtype)  # the layer then makes no MPI call: skipped once known
        if quiet_known(comm, key) is None:
            agree_once(comm, "layer", lambda: Local(("replicated", shape), ("replicated", shape, dtype)))
            remember_quiet(comm, key, True)
        return True

    def dp_mode(self) -> tuple[bool, str]:
        """What the layer's agreement carries besides its input: the training mode and the module's settings.

        Both decide which collectives the layer makes (BatchNorm's statistics,
        a pooling's halo or global mean), so a rank in eval mode, or whose
        layer was changed, raises with the others instead of leaving them waiting.
        """
        return bool(self.training), super().extra_repr()  # type: ignore[misc]

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


def _unjudged(root: torch.nn.Module, shard_dim: int, manager: Any, inputs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


#: ``(root, shard_dim, manager, inputs) -> context`` in which a converted forward runs: set by
#: :mod:`credit_mpi.nn.judge` (imported with the converter), whose tracker judges every torch
#: function applied to a band (installed from above: that module builds on this one).
judged: Callable[[torch.nn.Module, int, Any, Any], contextlib.AbstractContextManager] = _unjudged

#: ``(comm, args, kwargs, shard_dim, manager) -> None``: raises (collectively, on every rank) when a converted forward's new inputs are
#: not bands (the whole field on every rank); ``(tracker, manager, out) -> out``: the root's output checked and
#: marked with its placement. Both set by :mod:`credit_mpi.nn.outside` (installed from above, as ``judged``).
def inputs_checked(comm: Any, args: tuple, kwargs: dict, shard_dim: int, manager: Any) -> None:  # noqa: D103
    return None


def placed_output(tracker: Any, manager: Any, out: Any) -> Any:  # noqa: D103
    return out


class ForwardGuard:
    """A converted model's ``forward`` (an instance attribute of its root): no rank waits for one that failed.

    A rank-local exception anywhere inside the forward (a ``torch.cat`` of
    bands that do not join, user code between layers, a layer's local
    compute) is shared through the agreement the other ranks are in (the
    next layer's, or the one that ends every forward): every rank raises the
    same exception. The cost: one fixed-size ``Allgather`` per forward.
    Backward is not covered (a rank-local error there still leaves the
    others waiting: the watchdog's case).

    The forward runs under a :class:`~credit_mpi.nn.judge.tracker.Tracker`: every
    torch function applied to a band outside the layers is judged by what
    it does to the sharded dim, and one without an exact rule raises
    ``ConversionError`` (shared like any other exception).
    """

    def __init__(self, module: torch.nn.Module, ref: ManagerRef, shard_dim: int = -2,
                 path: paths.DataPath = paths.MPI_PATH) -> None:
        self.module, self.ref, self.shard_dim = module, ref, shard_dim
        self.path = path  # the data path of every layer and rule (credit_mpi.transport.paths)
        self._last_inputs: tuple | None = None  # this rank's inputs to the last forward (forward_start compares them)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, manager = self.module, self.ref.manager
        forward = type(module).forward
        if manager is None or manager.domain_parallel_size <= 1:
            return forward(module, *args, **kwargs)
        return self._guarded(module, forward, manager, args, kwargs)

    @torch.compiler.disable(recursive=False)
    def _guarded(self, module, forward, manager, args, kwargs) -> Any:
        """The judged, shared forward; under ``torch.compile`` this frame stays eager (the judge and the
        agreements must run every call), the model's own forward below it is still compiled."""
        comm = manager.domain_group
        mine = _inputs_described(module, args, kwargs)
        same = forward_start(comm, mine, self._last_inputs, self.path.name)
        self._last_inputs = mine
        try:
            if not same:  # a new input (the first call, a new shape): bands, not the field on every rank
                inputs_checked(comm, args, kwargs, self.shard_dim, manager)
            with paths.using(self.path), quiet_forward(comm, same), judged(module, self.shard_dim, manager, (args, kwargs)) as tracker:
                out = placed_output(tracker, manager, _at_root(tracker, module, forward, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - raised again on every rank
            share_failure(comm, exc)
        forward_done(comm)
        return out

    @property
    def __signature__(self) -> inspect.Signature:
        """The module's own forward signature (for code that inspects ``model.forward``)."""
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __deepcopy__(self, memo: dict) -> ForwardGuard:
        import copy

        return ForwardGuard(copy.deepcopy(self.module, memo), self.ref, self.shard_dim, self.path)

    def __reduce__(self):
        return (ForwardGuard, (self.module, self.ref, self.shard_dim, self.path))


def _inputs_described(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What of a forward's inputs decides its layers' calls: every tensor's shape, dtype, device and autograd state,
    the other values' reprs, the grad mode and the root's training mode (:func:`forward_start` compares it)."""
    try:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        grad = torch.is_grad_enabled()
        return (grad, bool(module.training), tuple(
            (tuple(t.shape), str(t.dtype), t.device.type, bool(grad and t.requires_grad)) if isinstance(t, torch.Tensor)
            else repr(t) for t in leaves))
    except Exception:  # noqa: BLE001 - an input without a repr: equal to nothing (every layer agrees this forward)
        return (object(),)


def _at_root(tracker: Any, module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
    """The root's forward, between the tracker's module boundary as every other module has it.

    The run calls the root's ``forward`` from inside its own ``__call__`` (this guard), so no module
    hook sees the root; describe()'s dry run calls the root through its hooks. Entering and leaving
    the root's boundary here gives the root the same module rules (a windowed module re-banded to
    whole windows, long attention moved to the group layout) in the run as in the plan.
    """
    if tracker is None:  # a converted model inside a converted forward: the outer tracker's hooks saw it
        return forward(module, *args, **kwargs)
    new = tracker._pre(module, args)
    out = forward(module, *(args if new is None else new), **kwargs)
    new_out = tracker._post(module, args, out)
    return out if new_out is None else new_out


def guard_forward(root: torch.nn.Module, manager: DomainParallelManager | None, shard_dim: int = -2,
                  path: paths.DataPath | None = None) -> torch.nn.Module:
    """Install (or renew) the :class:`ForwardGuard` of a converted model's root (``path``: its data path,
    :mod:`credit_mpi.transport.paths`; None: the old guard's, or MPI)."""
    old = root.__dict__.get("forward")
    if isinstance(old, ForwardGuard):
        path = old.path if path is None else path
        del root.__dict__["forward"]
    if manager is not None:
        root.__dict__["forward"] = ForwardGuard(root, ManagerRef(manager), shard_dim, path or paths.MPI_PATH)
    return root


def adopt(cls: type, module: torch.nn.Module, manager: DomainParallelManager | None, shard_dim: int, path: str) -> Any:
    """A ``cls`` instance that shares ``module``'s parameters, buffers, submodules and settings."""
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    if isinstance(state.get("forward"), ForwardGuard):
        del state["forward"]  # the guard of the old root (convert installs the new one's)
    for name in _DICTS:
        if name in state:
            state[name] = OrderedDict(state[name])
    new.__dict__.update(state)
    new.dp_manager = manager
    new.dp_shard_dim = shard_dim
    new.dp_path = path or "<root>"
    return new
