"""Rules at the function level: every torch function applied to a band is judged by what it does to the sharded dim.

A module converter sees module types; real weather models mix rows inside
their own ``forward`` (``flatten(2)`` then ``softmax(q^T k)``, a latitude mean
concatenated to the band's rows, ``F.interpolate(size=skip.shape[-2:])``).
While a converted model runs (and in :func:`~credit_mpi.nn.describe`'s dry
run on the meta device) a :class:`Tracker` (a
``torch.overrides.TorchFunctionMode``) follows the placement of every tensor
that holds bands and judges each torch function applied to one:

* what leaves the sharded dim alone passes: pointwise ops (a broadcast
  partner must have one row along it), reductions over other dims, softmax, norms, ``linear``,
  ``matmul`` and ``cat`` over other dims, permutes, reshapes that keep the
  band's rows whole;
* what has an exact rule runs it: ``F.interpolate`` along the sharded dim by
  an integer factor, or to a ``size`` stored for the whole field (a plain
  int: the field's rows, computed in global coordinates; the
  :class:`~credit_mpi.nn.DomainParallelInterpolate` layer); ``F.pad`` of the
  sharded dim by zeros (the field's edges; folded into the convolution that
  takes it, so differently padded branches keep one band layout), ``pixel_shuffle`` (output rows ``[r a, r b)`` from input rows
  ``[a, b)``), ``pixel_unshuffle`` and a reshape into windows when every
  band is a whole number of them; ``F.batch_norm`` in training (the
  statistics of the whole field, through the BatchNorm layer: timm's
  ``BatchNormAct2d`` calls it itself); full attention over the tokens of every
  band (:mod:`credit_mpi.nn.attention_rules`: ``F.scaled_dot_product_attention``,
  ``nn.MultiheadAttention``, ``softmax(q k^T) v`` by matmul or einsum); a
  product (``einsum``, ``@``) that contracts a band's tokens with a tensor over
  the field's tokens, a parameter (NCAR CREDIT's nextgen WXFormer bottleneck): a
  sum over the domain, replicated, and its inverse back to the band's tokens
  (:func:`_domain_contraction`, :func:`spread_rule`); ``sum``, ``mean``,
  ``nansum``, ``nanmean`` over dims that include the sharded one (or every
  dim): the band's partial sum, one sum over the domain, replicated
  (:func:`_domain_reduction`);
* a reshape's sizes along the band must follow the band: ``x.shape`` of a
  band gives its size along the sharded dim as an :class:`Extent` (what is
  computed from it stays one), so a size stored for the whole field is told
  from one read from the band in the dry run (which sees the field) as on
  every band;
* everything else that touches the sharded dim raises ``ConversionError``
  naming the module's path and the op. At run time the converted model's
  :class:`~credit_mpi.nn.base.ForwardGuard` makes it every rank's exception;
  ``describe()`` reports it before any data moves.

Why a mode and not a tensor subclass (ShardTensor, DTensor): the layers keep
plain tensors (no subclass reaches user code, ``torch.compile`` or the
optimiser), and a mode also sees the functions a forward calls on tensors it
made itself. The placement is kept per tensor object for the length of one
forward, so nothing outlives it.

A placement is :class:`Sharded` ``(dim, outer, inner)``: the band's row
index is the middle factor of dim ``dim`` (size ``outer * rows * inner``), so
a flatten that merged the rows with the longitude (tokens: ``inner > 1``) or
with the batch (windows moved into the batch: ``outer > 1``) is followed, and
a reshape back recovers the band.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..partition import normalize_dim
from . import base
from ._comm import ConversionError
from .base import DomainParallelModule
from .replicated import is_replicated, replicated

__all__ = ["Sharded", "Extent", "Tracker", "refusal", "active_tracker"]

_STATE = threading.local()


def active_tracker() -> Tracker | None:
    """The tracker of the converted forward running in this thread (None outside one)."""
    return getattr(_STATE, "tracker", None)


@dataclass(frozen=True)
class Sharded:
    """Where a tensor's bands are: the middle factor of dim ``dim`` (size ``outer * rows * inner``)."""

    dim: int
    outer: int = 1
    inner: int = 1

    def moved(self, dim: int) -> Sharded:
        return Sharded(dim, self.outer, self.inner)

    def describe(self) -> str:
        if self.outer == 1 and self.inner == 1:
            return f"dim {self.dim}"
        return f"dim {self.dim} (merged: {self.outer} x rows x {self.inner})"


class Extent(int):
    """A size read from a band's shape along the band (``H = x.shape[-2]`` in a forward), and what is computed from it.

    The dry run sees the whole field's sizes, so ``x.reshape(B, C, H, W)`` with ``H`` read from
    ``x.shape`` and ``x.reshape(B, C, *self.stored_resolution)`` look the same there, while on a
    band the first fits and the second does not. ``x.shape`` and ``x.size()`` of a band return
    the band's dim as an ``Extent``; arithmetic keeps the mark (``H // 2``, ``H * W``), so a
    reshape can tell a size that follows the band from one stored for the whole field, in the
    dry run and on every band alike. Its hash differs from the int's so that caches keyed by
    shapes (einops' recipes) do not hand back sizes computed from plain ints.

    In the dry run an ``Extent`` also carries every band's value (``bands``), so a comparison with a
    plain int is judged there as on each band: ``H == self.img_size[0]`` (a size stored for the
    whole field) is equal on one process and not on a band, and is refused alike (:func:`_compared`).
    """

    bands: tuple[int, ...] | None = None  # every band's value (the dry run), None at run time

    def __new__(cls, value: int, bands: Any = None) -> Extent:
        out = super().__new__(cls, value)
        if bands is not None:
            out.bands = tuple(int(b) for b in bands)
        return out

    def __hash__(self) -> int:
        return hash(("credit_mpi.Extent", int(self)))

    def __eq__(self, other: Any) -> bool:
        return _compared(self, other, "==")

    def __ne__(self, other: Any) -> bool:
        out = _compared(self, other, "!=")
        return out if out is NotImplemented else not out


# plain ints a size read from the band may be compared with on every band (an empty band, one row, -1 for "any")
_COMPARABLE = (0, 1, -1)


def _compared(extent: Extent, other: Any, op: str):
    """``extent == other``, refused where the band's rows are compared with a plain int that is not the band's.

    A plain int that is not the band's size (on some band, in the dry run) is one that does not follow the
    band (a size stored for the whole field, or a constant): the run would take another branch on a band
    than one process takes on the field. Judged in user code only (not inside a rule or a layer, whose
    own shapes are the band's), and not against 0, 1 or -1 (an empty band, a row, "any").
    """
    if type(other) is not int or other in _COMPARABLE:
        return int.__eq__(extent, other)
    tr = active_tracker()
    values = extent.bands if extent.bands is not None else (int(extent),)
    if tr is None or tr.trusted or not _in_user_code(tr, sys._getframe(2)) or all(v == other for v in values):
        return int.__eq__(extent, other)
    raise refusal(tr.stack[-1][0], f"x.shape {op} {other}",
                  f"it compares the band's rows ({', '.join(map(str, sorted(set(values))))} rows, read from x.shape) "
                  f"with a size stored for the whole field ({other}, e.g. set in __init__ from the image size), "
                  f"which the bands do not have: compare with sizes computed from x.shape in the forward, or build "
                  f"the module with the band's height")


def _in_user_code(tr: Tracker, frame) -> bool:
    """True in the model's own code: not credit_mpi's (the tracker's hooks and rules, whose shapes are the band's),
    not torch's inside a rule (the tracker is then off torch's mode stack) or with dispatch disabled."""
    from torch.overrides import _get_current_function_mode_stack

    if frame.f_globals.get("__name__", "").startswith("credit_mpi."):
        return False
    return torch._C._is_torch_function_enabled() and any(m is tr for m in _get_current_function_mode_stack())


def _keeps_mark(name: str):
    method = getattr(int, name)

    def op(self, *other):
        out = method(self, *other)
        if type(out) is not int:
            return out
        if self.bands is None:
            return Extent(out)
        theirs = [getattr(o, "bands", None) or (o,) * len(self.bands) for o in other]
        try:
            return Extent(out, [method(int(b), *(int(t[i]) for t in theirs)) for i, b in enumerate(self.bands)])
        except ArithmeticError:  # an empty band divided: its value is unknown (not judged)
            return Extent(out)

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__"):
    setattr(Extent, _name, _keeps_mark(_name))


def _follows_band(size: Any) -> bool:
    """A requested reshape size that follows the band: ``-1`` or an :class:`Extent`."""
    return isinstance(size, Extent) or (isinstance(size, int) and size == -1)


def refusal(path: str, op: str, why: str) -> ConversionError:
    """The ``ConversionError`` of ``op`` at ``path`` (``.refused``: the three parts, for describe()'s plan)."""
    exc = ConversionError(
        f"{path} calls {op} on a tensor that holds latitude bands: {why}. Nothing ran on bands wrongly; "
        f"change the forward (a module the converter replaces, an op that leaves the sharded dim alone), or "
        f"pass custom_converters={{ThatModule: fn}} (credit_mpi.nn.keep_local if it never mixes rows along "
        f"the sharded dim)")
    exc.refused = (path, op, why)
    return exc


class _Why(Exception):
    """Internal: a rule's reason to refuse (turned into a :func:`refusal` with the path and the op)."""


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return name


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _dims(value: Any, ndim: int) -> list[int] | None:
    """``dim`` arguments as non-negative ints (None: every dim)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [normalize_dim(int(v), ndim) for v in value]
    return [normalize_dim(int(value), ndim)]


class Tracker(TorchFunctionMode):
    """The placements of one converted forward, and the judge of every torch function on a band.

    Args:
        root: The converted model (module paths in messages are its ``named_modules``).
        shard_dim: The sharded dim of the layers' inputs.
        manager: The domain's manager (None in the dry run: exact rules run their layer locally).
        band_sizes: In the dry run, ``rows -> every band's rows`` (checks of whole windows); at run
            time None (each rank checks its own band; the ForwardGuard shares a refusal).
        on_layer: Called ``(module, args, out)`` after every domain-parallel layer (the dry run's plan);
            a tensor it returns replaces the layer's output.
        judge: False on a domain of one band (the original forward is exact): layers are still reported.
        adopt_layout: In the dry run, ``(rows, sizes) -> ok``: a block of merged rows taken as a band
            of that height has that layout (False: an earlier tensor of that height has another one).
    """

    def __init__(self, root: torch.nn.Module, shard_dim: int, manager: Any = None,
                 band_sizes: Callable[[int], list[int]] | None = None,
                 on_layer: Callable[[Any, tuple, Any], Any] | None = None, judge: bool = True,
                 adopt_layout: Callable[[int, list[int]], bool] | None = None) -> None:
        super().__init__()
        self.shard_dim, self.manager, self.on_layer = shard_dim, manager, on_layer
        # heights as plain ints: an Extent (a size read from a band) hashes apart from its int; in the dry run
        # the layout a tensor has (a rule's held tensors, :meth:`layout_of`) before the layout of its height
        self.band_sizes = None if band_sizes is None else (
            lambda rows: self._here.get(int(rows)) or band_sizes(int(rows)))
        self.adopt_layout = None if adopt_layout is None else (
            lambda rows, sizes: adopt_layout(int(rows), [int(v) for v in sizes]))
        self.paths = {id(m): (name or "<root>") for name, m in root.named_modules()}
        # the root's forward is called directly (no module hooks): a layer as the root is trusted here
        self.trusted = int(self._trusts(root) or not judge)
        self.stack: list[tuple[str, bool, tuple | None]] = [(self._path(root), bool(self.trusted), None)]
        self.place: dict[int, tuple[weakref.ref, Sharded]] = {}
        # the order the forward made its bands in (the same on every rank: a join's target is the first made part's)
        self.born: dict[int, tuple[weakref.ref, int]] = {}
        self._births = 0
        # the dry run: a tensor's own band layout (its rows per band) where it differs from its height's
        self.layouts: dict[int, tuple[weakref.ref, list[int]]] = {}
        self._here: dict[int, list[int]] = {}  # while a rule runs: the layouts of its held tensors, by their rows
        self._locals: list = []
        # F.pad of the sharded dim by zeros: padded tensor id -> (padded ref, input, (before, after), the other pads)
        self.edge_pads: dict[int, tuple] = {}
        self._folded: list[torch.nn.Module | None] = []  # per open layer call: the conv whose edge rows were folded
        self._leaves: dict[int, list[Callable[[Any], Any]]] = {}  # per module: how its module rule ends (a stack)
        self._hooks: list = []

    # -- placements ------------------------------------------------------------------------------

    def get(self, t: Any) -> Sharded | None:
        if not isinstance(t, torch.Tensor) or is_replicated(t):
            return None
        entry = self.place.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def set(self, t: torch.Tensor, p: Sharded | None) -> None:
        if p is None or is_replicated(t):
            self.place.pop(id(t), None)
        else:
            self.place[id(t)] = (weakref.ref(t), p)
            entry = self.born.get(id(t))
            if entry is None or entry[0]() is not t:
                self._births += 1
                self.born[id(t)] = (weakref.ref(t), self._births)

    def born_at(self, t: torch.Tensor) -> int:
        """When the forward made band ``t`` (a counter, the same order on every rank)."""
        entry = self.born.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else -1

    def layout_of(self, t: Any) -> list[int] | None:
        """In the dry run: ``t``'s own layout (every band's rows, of the rows of its placement), None: its height's."""
        entry = self.layouts.get(id(t)) if isinstance(t, torch.Tensor) else None
        return list(entry[1]) if entry is not None and entry[0]() is t else None

    def keep_layout(self, t: torch.Tensor, sizes: list[int]) -> None:
        """In the dry run: ``t``'s bands are ``sizes`` (a layer's output layout, a re-banded join's)."""
        self.layouts[id(t)] = (weakref.ref(t), [int(v) for v in sizes])

    def band(self, t: torch.Tensor) -> Sharded | None:
        """The placement of a band along ``shard_dim`` (a layer's input or output), None when ``t`` has too few dims."""
        try:
            return Sharded(normalize_dim(self.shard_dim, t.ndim))
        except (ValueError, IndexError):
            return None

    def mark_inputs(self, tree: Any) -> None:
        """Every floating tensor of the model's input is a band along ``shard_dim`` (a replicated one stays one)."""
        for t in _tensors(tree):
            if t.is_floating_point() and not is_replicated(t):
                self.set(t, self.band(t))

    def as_band(self, t: torch.Tensor, p: Sharded) -> Sharded | None:
        """``p`` as a plain band along its dim when it is one, else None.

        Rows merged with whole inner ones (``outer == 1``: windows merged back, tokens) are a
        contiguous block of the dim: a band of ``inner`` times the rows' layout. At run time a
        partner's shape checks it on every rank; in the dry run that layout is compared with (or
        becomes) the layout of that height.
        """
        if p.outer != 1:
            return None
        if p.inner == 1 or self.band_sizes is None:
            return Sharded(p.dim)
        height = t.shape[p.dim]
        mine = [p.inner * s for s in self.band_sizes(height // p.inner)]
        if self.band_sizes(height) == mine or (self.adopt_layout is not None and self.adopt_layout(height, mine)):
            return Sharded(p.dim)
        return None

    def rows_ok(self, rows: int, factor: int, least: int = 1) -> bool:
        """True when every band (this rank's at run time) is a whole number (at least ``least``) of ``factor`` rows."""
        sizes = [rows] if self.band_sizes is None else self.band_sizes(rows)
        return all(s % factor == 0 and s >= least * factor for s in sizes)

    def ratio_ok(self, rows: int, target: int) -> bool:
        """True when every band's target rows are one whole factor times its rows (this rank's at run time)."""
        if self.band_sizes is None:
            return target % rows == 0
        ins, outs = self.band_sizes(rows), self.band_sizes(target)
        return target % rows == 0 and all(o == (target // rows) * i for i, o in zip(ins, outs, strict=True))

    # -- module boundaries (global module hooks, only while tracking) -----------------------------

    def __enter__(self) -> Tracker:
        from torch.nn.modules import module as module_mod

        self._outer = active_tracker()
        _STATE.tracker = self
        self._hooks = [module_mod.register_module_forward_pre_hook(self._pre),
                       module_mod.register_module_forward_hook(self._post, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for h in self._hooks:
                h.remove()
            _STATE.tracker = self._outer
            self.place.clear()
            self.edge_pads.clear()
            self.born.clear()
            self.layouts.clear()

    def _trusts(self, module: torch.nn.Module) -> bool:
        return isinstance(module, DomainParallelModule) or getattr(module, "_dp_trusted", False)

    def _path(self, module: torch.nn.Module) -> str:
        path = self.paths.get(id(module)) or getattr(module, "dp_path", None) or "?"
        return f"{path} ({type(module).__name__})"

    def _pre(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if active_tracker() is not self:  # the hooks are global: another thread's modules, or a nested tracker's
            return
        trusted = self._trusts(module)
        local, placement = self._check_layer_input(module, args) if trusted and not self.trusted else (False, None)
        if local:
            local_ctx = base.batch_bands()
            local_ctx.__enter__()
            self._locals.append(local_ctx)
        new = self._fold_edge_rows(module, args) if trusted and not self.trusted else None
        self._folded.append(module if new is not None else None)
        if not trusted and not self.trusted:  # a module judged by its forward: its module rules (window_rules)
            for rule in _MODULE_RULES:
                if (got := rule(self, module, args)) is not None:
                    new, leave = got
                    self._leaves.setdefault(id(module), []).append(leave)
                    break
        self.stack.append((self._path(module), trusted, (placement,) if local else None))
        self.trusted += trusted
        return new

    def _post(self, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if active_tracker() is not self:
            return None
        _, trusted, local = self.stack.pop() if len(self.stack) > 1 else (None, False, None)
        self.trusted -= trusted
        if local is not None:
            self._locals.pop().__exit__(None, None, None)
        folded = self._folded.pop() if self._folded else None
        leaves = self._leaves.get(id(module)) if not trusted and not self.trusted else None
        if leaves:
            out = leaves.pop()(out)
        if out is None:
            return None
        if self.on_layer is not None and isinstance(module, DomainParallelModule) and local is None:
            self.trusted += 1  # the plan's own code: its shapes are plain ints, nothing of it judged
            try:
                new = self.on_layer(module, args, out)
            finally:
                self.trusted -= 1
            out = out if new is None else new
        if folded is not None:
            from .conv import fold_edge_rows

            fold_edge_rows(folded, None)
        if trusted and not self.trusted and isinstance(module, DomainParallelModule) and _replicated_input(args):
            # the original module on a replicated input (exact, local): its output is replicated too, in the run
            # and in the dry run alike, also where the module computes with buffers (BatchNorm's running
            # statistics), which are no Parameters and would make Replicated's own rule give a plain tensor
            out = tree_map_only(torch.Tensor, replicated, out)
        if trusted and not self.trusted:  # a layer's output: a band along the sharded dim (or replicated)
            for t in _tensors(out):
                self.set(t, local[0] if local is not None else self.band(t))
        return out

    def _fold_edge_rows(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        """A convolution of an ``F.pad`` of the sharded dim by zeros: the padding folded into the layer (new args).

        Padded as a band, the first band gains the rows before the field and the last the rows after
        it, which moves every band's start and so the output rows each band owns: WXFormer's
        CrossEmbed branches (a ``ZeroPad2d`` of ``kernel - stride`` rows each, then an unpadded strided
        conv) would give bands of different rows to one ``torch.cat``. Folded, the layer pads the
        field's edges itself and owns the output rows anchored on the unpadded field, the same for
        every branch (and for a conv with that padding). Decided from the forward's structure (the
        same on every rank); the layer agrees on the folded rows with its input.
        """
        from .conv import _ConvMixin, fold_edge_rows

        if not isinstance(module, _ConvMixin) or module.padding_mode != "zeros" or len(args) != 1:
            return None
        entry = self.edge_pads.get(id(args[0]))
        if entry is None or entry[0]() is not args[0]:
            return None
        _, x, (before, after), others = entry
        p = self.get(x)
        sd = None if p is None else p.dim - (x.ndim - len(module.kernel_size))
        if sd is None or sd < 0 or (self.manager is not None and self.manager.domain_parallel_size <= 1):
            return None
        source = torch.nn.functional.pad(x, others) if any(others) else x  # the other dims padded as the forward did
        fold_edge_rows(module, (sd, before, after))
        return (source,)

    def _check_layer_input(self, module: torch.nn.Module, args: tuple) -> tuple[bool, Sharded | None]:
        """A layer (or a user's trusted module) takes bands along ``shard_dim``: not tokens, not a permuted band.

        Returns ``(local, placement)``: ``local`` when the layer runs its original forward on this input
        (bands in the batch dim, whole samples; or a tensor without bands, the same on every rank: a
        position table made from parameters), and the placement of its outputs then.
        """
        for t in _tensors(args)[:1]:
            p, want = self.get(t), self.band(t)
            if not isinstance(module, DomainParallelModule):
                break
            if p is None and not is_replicated(t):
                return True, None
            if p is not None and p.dim == 0 and t.ndim >= 3:
                if "BatchNorm" in type(module).__name__:
                    raise refusal(self._path(module), "its forward", "batch statistics over samples that are "
                                  "spread over the bands (windows moved into the batch dim)")
                return True, p
            if p is not None and p != want and self.as_band(t, p) != want:
                from .dropout import _DropoutMixin

                if isinstance(module, _DropoutMixin) and not (module.training and module.p):
                    return True, p  # p == 0 or eval: the identity on any placement (training p > 0: refused as a band)
                raise refusal(self._path(module), "its forward",
                              f"its input holds the bands along {p.describe()} (after a permute or a reshape), "
                              f"but the layer runs on bands along the sharded dim ({want.describe() if want else self.shard_dim})")
        return False, None

    # -- the judge --------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.trusted:
            return func(*args, **kwargs)
        held = [(t, p) for t in _tensors((args, kwargs)) if (p := self.get(t)) is not None]
        if not held:
            if "_dp_fields" in self.__dict__:  # a replicated sum over a field spread back to its tokens
                handled, out = spread_rule(self, func, args, kwargs)
                if handled:
                    return out
            return func(*args, **kwargs)
        op = _op_name(func)
        rule = _RULES.get(op) or _RULES.get(op.rstrip("_") if not op.startswith("__") else op)
        here = self._held_layouts(op, rule, held) if self.layouts else None
        try:
            if rule is None:
                out = func(*args, **kwargs)
                if _tensors(out):
                    raise _Why("no rule says what it does to the sharded dim")
                return out
            out = rule(self, func, args, kwargs, held)
            if here is not None:
                self._inherit(out, held)
            return out
        except _Why as why:
            raise refusal(self.stack[-1][0], f"{op}()", str(why)) from None
        finally:
            if here is not None:
                self._here = here

    # -- the dry run's layouts per tensor ----------------------------------------------------------

    def _held_layouts(self, op: str, rule, held: list) -> dict:
        """In the dry run, while a rule runs: its held tensors' own layouts answer :attr:`band_sizes` for their rows.

        Returns the layouts that were in force (restored after the rule). Two held bands of one height
        whose layouts differ meet in an op that is not a join: the run fails on the ranks whose rows
        differ (``on_conflict``, set by describe(): a row that is not exact).
        """
        before, own = self._here, []
        for t, p in held:
            rows, sizes = t.shape[p.dim] // (p.outer * p.inner), self.layout_of(t)
            own.append((rows, sizes if sizes is not None and sum(sizes) == rows else None))
        mine = dict(before)
        for rows, sizes in own:
            if sizes is not None:
                mine.setdefault(rows, sizes)
        if len(mine) == len(before):
            return before
        if rule is not _join and len(own) > 1 and getattr(self, "on_conflict", None) is not None:
            seen: dict[int, list[int]] = {}
            for rows, sizes in own:
                sizes = sizes if sizes is not None else self.band_sizes(rows)
                if seen.setdefault(rows, sizes) != sizes:
                    self.on_conflict(self.stack[-1][0], f"{op}()", rows, seen[rows], sizes)
                    break
        self._here = mine
        return before

    def _inherit(self, out: Any, held: list) -> None:
        """The dry run: a rule's output of the rows of a held band with its own layout has that layout."""
        for t in _tensors(out):
            q = self.get(t)
            if q is None or self.layout_of(t) is not None:
                continue
            rows = t.shape[q.dim] // (q.outer * q.inner)
            for h, p in held:
                sizes = self.layout_of(h)
                if sizes is not None and sum(sizes) == rows == h.shape[p.dim] // (p.outer * p.inner):
                    self.keep_layout(t, sizes)
                    break

    def run(self, func, args, kwargs, placement: Callable[[torch.Tensor], Sharded | None] | Sharded | None):
        """Run ``func`` and tag its tensor outputs."""
        out = func(*args, **kwargs)
        for t in _tensors(out):
            self.set(t, placement(t) if callable(placement) else placement)
        if self.layouts:  # the dry run: an output of the rows of an input with its own layout has that layout
            self._inherit(out, [(t, p) for t in _tensors(args) if (p := self.get(t)) is not None])
        return out


def _replicated_input(args: tuple) -> bool:
    """True when a layer's input (its first tensor argument) is replicated on every rank."""
    first = _tensors(args)[:1]
    return bool(first) and is_replicated(first[0])


@contextlib.contextmanager
def judge_forward(root: torch.nn.Module, shard_dim: int, manager: Any, inputs: Any):
    """The context of a converted forward at run time: every floating input is a band; one tracker per thread."""
    if active_tracker() is not None:  # a converted model inside a converted forward: judged by the outer one
        yield None
        return
    with Tracker(root, shard_dim, manager) as tracker:
        tracker.mark_inputs(inputs)
        yield tracker


base.judged = judge_forward


# -- the rules ------------------------------------------------------------------------------------

_RULES: dict[str, Callable] = {}


def _rule(*names: str):
    def register(fn):
        for n in names:
            _RULES[n] = fn
        return fn
    return register


_MODULE_RULES: list[Callable] = []


def _module_rule(fn: Callable) -> Callable:
    """Register ``fn(tracker, module, args) -> None | (new args, leave(out) -> out)``: run before the forward of
    a module that is judged by its forward (the first rule that answers wins; ``leave`` gets its output)."""
    _MODULE_RULES.append(fn)
    return fn


_POINTWISE = """
abs absolute add acos arccos acosh asin asinh atan atan2 atanh bitwise_and bitwise_not bitwise_or bitwise_xor ceil clamp
clamp_max clamp_min clip copysign cos cosh deg2rad div divide erf erfc erfinv exp exp2 expm1 float_power floor
floor_divide fmod frac hypot isfinite isinf isnan ldexp lerp lgamma log log10 log1p log2 logaddexp logical_and
logical_not logical_or logical_xor logit maximum minimum fmax fmin mul multiply nan_to_num neg negative pow rad2deg
reciprocal remainder round rsqrt sigmoid sign sin sinh sqrt square sub subtract tan tanh true_divide trunc where
masked_fill addcmul addcdiv relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus
softsign tanhshrink threshold logsigmoid prelu hardshrink softshrink eq ne lt le gt ge greater less greater_equal
less_equal not_equal fill zero clone contiguous detach to type float double half bfloat16 int long bool cpu cuda
requires_grad retain_grad copy zeros_like ones_like empty_like full_like data real imag conj positive sgn
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__
__div__ __rdiv__ __idiv__ __pow__ __rpow__ __ipow__ __neg__ __abs__ __and__ __rand__ __iand__ __or__ __ror__ __ior__
__xor__ __rxor__ __ixor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __floordiv__ __rfloordiv__
__ifloordiv__ __mod__ __rmod__ __imod__
""".split()

# their extra tensor arguments give a dtype or a device, not values
_LIKE = {"to", "type", "type_as", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}


@_rule(*_POINTWISE)
def _pointwise(tr: Tracker, func, args, kwargs, held):
    """Elementwise (with broadcasting): one placement; a partner that is not a band has one row along it."""
    op = _op_name(func)
    tensors = _tensors((args, kwargs))
    if op in _LIKE:
        tensors = tensors[:1]
    ndim = max(t.ndim for t in tensors)
    dims = {(p.dim + ndim - t.ndim, p.outer, p.inner) for t, p in held}
    if len(dims) > 1:  # a band and a block of merged rows (windows merged back): the same band when they line up
        bands = {(b.dim + ndim - t.ndim, 1, 1) if (b := tr.as_band(t, p)) else (None,) for t, p in held}
        if len(bands) > 1 or (None,) in bands:
            raise _Why(f"it combines tensors whose bands are along different dims ({sorted(dims)})")
        dims = bands
    d, outer, inner = dims.pop()
    if len({t.shape[d - (ndim - t.ndim)] for t, _ in held}) > 1:  # else a band of one row would broadcast silently
        raise _Why(_OTHER_LAYOUTS)
    for t in tensors:
        k = d - (ndim - t.ndim)
        if tr.get(t) is None and k >= 0 and t.shape[k] != 1:
            what = "a replicated tensor (a global mean)" if is_replicated(t) else "a tensor that is not a band (a parameter or buffer, or one made in the forward)"
            raise _Why(f"it combines a band with {what} of {t.shape[k]} rows along the sharded dim "
                       f"(make it from the band, or give it one row along that dim)")
    return tr.run(func, args, kwargs, lambda out: Sharded(d - (ndim - out.ndim), outer, inner) if out.ndim >= ndim - d else None)


# Python values read from a tensor (``.item()``, ``bool(t)``, ``t.tolist()``): describe()'s dry run (plan.py)
# answers them for tensors every rank holds whole, which it cannot see on the meta device
VALUE_CALLS = frozenset("item tolist numpy __array__ __bool__ __int__ __float__ __index__ __complex__ is_nonzero equal "
                        "allclose".split())


@_rule(*VALUE_CALLS)
def _value(tr, func, args, kwargs, held):
    """A band's values read into Python: each rank reads its own rows, one process the whole field's."""
    raise _Why("it reads the band's values into Python (a data-dependent check or branch): each rank would see its "
               "own rows where one process sees the whole field's, and the ranks could take different branches; read "
               "a tensor every rank holds whole (a parameter, a global mean such as nn.AdaptiveAvgPool2d(1)'s output)")


@_rule("type_as")
def _type_as(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    return tr.run(func, args, kwargs, p)


@_rule("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")
def _new(tr, func, args, kwargs, held):
    """A new tensor: a band (its rows) when it has the band's shape, else not one."""
    src, p = args[0], tr.get(args[0])
    return tr.run(func, args, kwargs, lambda out: p if p is not None and out.shape == src.shape else None)


@_rule("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")
def _dropout(tr, func, args, kwargs, held):
    p, training = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True)
    if training and p > 0:
        raise _Why(f"dropout in training (p={p}) draws its own mask on every band (not one process's draw)")
    return tr.run(func, args, kwargs, held[0][1])


@_rule("batch_norm")
def _batch_norm(tr, func, args, kwargs, held):
    """Running statistics (eval): pointwise. Batch statistics: the exact layer's (global over every band).

    A subclass of ``nn.BatchNorm2d`` with its own forward (timm's ``BatchNormAct2d``, which the type
    table does not replace) calls ``F.batch_norm`` itself: the statistics are taken by a
    :class:`~credit_mpi.nn.DomainParallelBatchNorm2d` that shares the caller's buffers and parameters.
    """
    x, p = args[0], tr.get(args[0])
    running_mean, running_var = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
    weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
    training = _arg(args, kwargs, 5, "training", False)
    if not training and running_mean is not None:
        return tr.run(func, args, kwargs, held[0][1])
    if p is None or p.dim < 2 or p.outer * p.inner != 1 or x.ndim > 5:
        raise _Why("batch statistics of a tensor whose bands are not along a spatial dim (use nn.BatchNorm*)")
    layer = _batch_norm_layer(x, running_mean, running_var, weight, bias, float(_arg(args, kwargs, 6, "momentum", 0.1)),
                              float(_arg(args, kwargs, 7, "eps", 1e-5)), p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: batch_norm"
    return layer(x)  # the tracker's module hooks: a layer of the plan, its output a band


def _batch_norm_layer(x, running_mean, running_var, weight, bias, momentum: float, eps: float, shard_dim: int):
    """A DomainParallelBatchNorm{1,2,3}d in training mode over ``F.batch_norm``'s own tensors (no copy)."""
    from . import norm

    cls = {2: norm.DomainParallelBatchNorm1d, 3: norm.DomainParallelBatchNorm1d, 4: norm.DomainParallelBatchNorm2d,
           5: norm.DomainParallelBatchNorm3d}[x.ndim]
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.num_features, layer.eps, layer.momentum = x.shape[1], eps, momentum
    layer.affine, layer.track_running_stats = weight is not None, running_mean is not None
    layer._parameters.update(weight=weight, bias=bias)
    counter = torch.zeros((), dtype=torch.long, device=x.device) if running_mean is not None else None
    layer._buffers.update(running_mean=running_mean, running_var=running_var, num_batches_tracked=counter)
    layer.dp_shard_dim = shard_dim
    return layer


@_rule("layer_norm", "rms_norm")
def _layer_norm(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    shape = _arg(args, kwargs, 1, "normalized_shape")
    n = 1 if isinstance(shape, int) else len(shape)
    if p is not None and p.dim >= x.ndim - n:
        raise _Why(f"it normalises over the last {n} dim(s), the sharded one among them (use nn.LayerNorm)")
    return tr.run(func, args, kwargs, p)


@_rule("group_norm", "instance_norm", "local_response_norm")
def _spatial_norm(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    if p is not None and p.dim >= 1:
        raise _Why("statistics over the band alone (use nn.GroupNorm / nn.InstanceNorm*, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


_REDUCE = """sum mean nansum nanmean prod amax amin max min argmax argmin all any std var std_mean var_mean norm
logsumexp median nanmedian mode count_nonzero aminmax""".split()
_ALONG = """softmax log_softmax softmin cumsum cumprod cummax cummin logcumsumexp sort argsort topk kthvalue normalize
glu diff""".split()


# a reduction over the sharded dim that is exact on bands: the band's partial, one sum over the domain
_DOMAIN_REDUCE = frozenset("sum mean nansum nanmean".split())


def _grid_columns(tr: Tracker) -> int:
    """The domain grid's columns: the run's manager's, or in the dry run describe()'s ``domain_grid`` (1 on bands)."""
    if tr.manager is None:
        return (getattr(tr, "grid", None) or (1, 1))[1]
    return grid_cols(tr.manager)


@_rule(*_REDUCE)
def _reduce(tr, func, args, kwargs, held):
    """A reduction over dims other than the sharded one passes; over it (or every dim) a sum or mean is one domain
    sum (:func:`_domain_reduction`), the others are refused (a max, a median, a variance: no rule on bands)."""
    op = _op_name(func)
    x = args[0]
    if op in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _pointwise(tr, func, args, kwargs, held)
    p = tr.get(x)
    if p is None:  # a band as another argument
        raise _Why("a band as a reduction's extra argument")
    index = 2 if op == "norm" else 1
    dims = _dims(_arg(args, kwargs, index, "dim"), x.ndim)
    if dims is not None and not dims and op in _DOMAIN_REDUCE:
        dims = None  # sum(x, dim=()): every dim, as torch reads it
    if dims is None or p.dim in dims:
        if op in _DOMAIN_REDUCE:
            return _domain_reduction(tr, func, args, kwargs, op, p, dims)
        raise _Why(f"it reduces over the sharded dim ({'every dim' if dims is None else 'dim ' + str(p.dim)}): "
                   f"one band's rows are not the field's (sum, mean, nansum and nanmean over it are exact: one sum "
                   f"over the domain; {op} has no rule on bands)")
    dropped = p.dim - sum(1 for k in dims if k < p.dim)
    return tr.run(func, args, kwargs, lambda out: p if out.ndim == x.ndim else p.moved(dropped))


def _domain_reduction(tr: Tracker, func, args: tuple, kwargs: dict, op: str, p: Sharded, dims: list[int] | None):
    """``sum`` / ``mean`` / ``nansum`` / ``nanmean`` over dims that include the sharded one: exact, replicated.

    The band's partial sum over those dims, added over the domain
    (:func:`credit_mpi.ops.allreduce.domain_sum`, differentiable: its adjoint is the
    same sum, so each rank's gradient of the result is its band's part); a mean
    divides by the field's element count, whose rows come from the agreement (every
    band's rows), never from this band; a nan-mean by the domain sum of the non-NaN
    counts (summed in the same call). The result is
    :class:`~credit_mpi.nn.replicated.Replicated`: the layers after it compute on it
    locally, a band times it (one row along the sharded dim) is pointwise, and the
    parameters of those layers get each rank's partial gradient, added by
    ``reduce_gradients``. Every check before the agreement depends on the model's
    structure only (the same on every rank).
    """
    from ..ops.allreduce import agree_domain_sum, domain_sum

    x = args[0]
    reduced = list(range(x.ndim)) if dims is None else sorted(set(dims))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    out_dtype = _arg(args, kwargs, 3, "dtype", None) or x.dtype
    if out_dtype not in (torch.float32, torch.float64):
        raise _Why(f"it takes {op}() over the sharded dim in {out_dtype}: the sum over the domain has a rule for float32 "
                   f"and float64")
    nan = op.startswith("nan")

    def partial(t: torch.Tensor) -> torch.Tensor:  # the band's sum (with its non-NaN count for nanmean)
        s = (torch.nansum if nan else torch.sum)(t, reduced, keepdim=keepdim, dtype=out_dtype)
        if op != "nanmean":
            return s
        return torch.stack([s, (~torch.isnan(t)).sum(reduced, keepdim=keepdim).to(out_dtype)])

    if _grid_columns(tr) > 1:
        raise _Why(f"it takes {op}() over the sharded dim on a latitude x longitude domain grid (no rule there yet: a sum "
                   f"over the rows alone is a sum over a column of the grid)")
    if tr.manager is None:  # the dry run: the whole field, one process's result
        out = replicated(func(*args, **kwargs))
        _report_domain_sum(tr, op, x, p, partial(x.detach()).shape, out_dtype)
        return out
    mine = partial(x)
    grad = torch.is_grad_enabled() and x.requires_grad
    plan = agree_domain_sum(tuple(mine.shape), out_dtype, x.shape[p.dim] // (p.outer * p.inner), grad,
                            tr.manager.domain_group, tr.stack[-1][0])
    total = domain_sum(mine, plan)
    if op == "nanmean":
        return replicated(total[0] / total[1])
    if op == "mean":
        count = math.prod(p.outer * plan.total * p.inner if k == p.dim else x.shape[k] for k in reduced)
        total = total / count
    return replicated(total)


def _report_domain_sum(tr: Tracker, op: str, x: torch.Tensor, p: Sharded, shape: tuple, dtype: torch.dtype) -> None:
    """In the dry run: the domain sum of a reduction as a row of describe()'s plan, with its traffic (``tr.on_move``)."""
    on_move = getattr(tr, "on_move", None)
    if on_move is None:
        return
    from .traffic import domain_sum_traffic

    rows = x.shape[p.dim] // (p.outer * p.inner)
    sizes = tr.band_sizes(rows)
    traffic = domain_sum_traffic(tuple(shape), dtype, len(sizes), x.requires_grad and torch.is_grad_enabled())
    on_move(tr.stack[-1][0], f"domain_sum() of {op}()", rows, sizes, [1] * len(sizes), traffic)


@_rule(*_ALONG)
def _along(tr, func, args, kwargs, held):
    """An op along one dim (softmax, cumsum, sort): passes when that dim is not the sharded one."""
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    default = {"glu": -1, "diff": -1, "normalize": 1}.get(op)
    dim = _arg(args, kwargs, 2 if op == "normalize" else (2 if op == "diff" else 1), "dim", default)
    if op in ("topk", "kthvalue"):
        dim = _arg(args, kwargs, 2, "dim", -1)
    if op in ("sort", "argsort") and dim is None:
        dim = -1
    if p is None or dim is None or normalize_dim(int(dim), x.ndim) == p.dim:
        raise _Why(f"it works along the sharded dim (dim={dim}): the rows of the other bands are missing")
    return tr.run(func, args, kwargs, p)


_RESHAPES = "reshape view view_as reshape_as flatten unflatten squeeze unsqueeze ravel".split()


def _reshaped(tr: Tracker, shape_in: tuple, p: Sharded, shape_out: tuple, requested: list | None = None) -> Sharded:
    """The placement after a reshape, or _Why when the band's rows do not stay whole.

    In flat-index terms the band's rows are the digits of strides ``[after, after * rows)``. A split
    into windows (an output dim of stride ``after * window``, ``1 < window <= rows``, holding the
    window count) is looked for first. ``requested`` (the sizes the forward asked for, when it gave
    them) tells a window count that follows the band (``H // w`` read from ``x.shape``, or ``-1``:
    an :class:`Extent`) over a window size fixed in the model (``w``): only such a count may be one window per
    band (a count dim of size one is otherwise indistinguishable from a dim of whole rows, so
    without ``requested`` every band must hold two windows). Otherwise an output dim that holds
    those digits whole carries the band (merged with its neighbours); a size the forward gave for
    it must follow the band too, else it was stored for the whole field, which the bands do not fit.
    """
    rows = shape_in[p.dim] // (p.outer * p.inner)
    before = math.prod(shape_in[: p.dim]) * p.outer  # blocks outside the rows
    after = p.inner * math.prod(shape_in[p.dim + 1 :])  # elements inside one row
    for j, size in enumerate(shape_out):  # rows split into windows: whole windows on every band
        stride = math.prod(shape_out[j + 1 :])
        # a count read from the band (H // w) over a window size fixed in the model (w)
        follows = (requested is not None and j + 1 < len(shape_out) and _follows_band(requested[j])
                   and not _follows_band(requested[j + 1]))
        if stride % after or not 1 < stride // after <= rows or (stride // after == rows and not follows):
            continue
        window = stride // after
        if rows % window == 0 and (size * stride) % (after * rows) == 0 and size * window % rows == 0:
            _check_follows(requested, j, shape_in, shape_out)
            least = 1 if follows else 2
            if not tr.rows_ok(rows, window, least):
                many = "" if least == 1 else " (at least two: the window count is not read from x.shape)"
                raise _Why(f"it splits the sharded dim into windows of {window} rows, and not every band is a "
                           f"whole number{many} of windows (choose band sizes that are multiples of {window})")
            return Sharded(j, size * window // rows, 1)
    found = []
    for j, size in enumerate(shape_out):
        pj, sj = math.prod(shape_out[:j]), math.prod(shape_out[j + 1 :])
        if before % pj == 0 and after % sj == 0 and size == (before // pj) * rows * (after // sj) and (size != 1 or rows == 1):
            found.append(Sharded(j, before // pj, after // sj))
    if found:  # a band of one row fits several dims: the one whose size the forward read from the band
        best = next((f for f in found if requested is not None and _follows_band(requested[f.dim])), found[0])
        _check_follows(requested, best.dim, shape_in, shape_out)
        return best
    raise _Why(f"a reshape of {tuple(shape_in)} (bands along {p.describe()}) to {tuple(shape_out)} does not keep "
               f"the band's rows whole (a band of one window, or a size stored for the whole field?)")


def _check_follows(requested: list | None, j: int, shape_in: tuple, shape_out: tuple) -> None:
    """The size the forward asked for along the band's dim ``j`` must follow the band (-1 or read from its shape)."""
    if requested is None or _follows_band(requested[j]):
        return
    raise _Why(f"it reshapes {tuple(shape_in)} to {tuple(int(v) for v in requested)}, and the size {int(requested[j])} "
               f"along the dim that holds the bands (dim {j}) is not computed from the band's shape: a size stored "
               f"for the whole field (e.g. set in __init__ from the image size), which no band has. Compute it "
               f"from x.shape in the forward (or pass -1)")


def _requested(func, x: torch.Tensor, args: tuple, kwargs: dict) -> list | None:
    """The output sizes a reshape was given explicitly (``view``/``reshape``/``unflatten``), None for the others.

    None under ``torch.compile`` too: a traced forward's sizes are plain ints (the marks do not
    survive tracing), so a compiled band is judged without them (a stored size then fails the
    reshape itself on the band).
    """
    if torch.compiler.is_compiling():
        return None
    op = _op_name(func)
    if op in ("reshape", "view"):
        shape = list(args[1:]) if len(args) > 1 else list(kwargs.get("shape", kwargs.get("size", ())))
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = list(shape[0])
        return shape if shape and all(isinstance(v, int) for v in shape) else None
    if op == "unflatten":
        dim, sizes = normalize_dim(int(_arg(args, kwargs, 1, "dim")), x.ndim), list(_arg(args, kwargs, 2, "sizes"))
        return [Extent(v) for v in x.shape[:dim]] + sizes + [Extent(v) for v in x.shape[dim + 1 :]]
    return None


@_rule(*_RESHAPES)
def _reshape(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise _Why("a band as the shape of another tensor")
    requested = _requested(func, x, args, kwargs)
    try:
        out = func(*args, **kwargs)
    except RuntimeError as exc:
        raise _Why(f"the reshape does not fit this band ({exc}); a size stored for the whole field? compute it "
                   f"from x.shape in the forward") from None
    tr.set(out, _reshaped(tr, tuple(x.shape), p, tuple(out.shape), requested))
    return out


@_rule("shape", "size")
def _shape(tr, func, args, kwargs, held):
    """The band's size along its dim is an :class:`Extent` (what a reshape computed from it is told from stored sizes)."""
    x, p = args[0], tr.get(args[0])
    out = func(*args, **kwargs)
    if p is None:
        return out
    if isinstance(out, int):
        return _extent(tr, out, p) if normalize_dim(int(_arg(args, kwargs, 1, "dim")), x.ndim) == p.dim else out
    return torch.Size([_extent(tr, v, p) if i == p.dim else v for i, v in enumerate(out)])


def _extent(tr: Tracker, size: int, p: Sharded) -> Extent:
    """The band's ``size`` along its dim; in the dry run with every band's value (the layout of its rows)."""
    merged = p.outer * p.inner
    if tr.band_sizes is None or size % merged:
        return Extent(size)
    return Extent(size, [merged * s for s in tr.band_sizes(size // merged)])


_PERMUTES = "transpose swapaxes swapdims permute movedim moveaxis t adjoint T mT H mH".split()


@_rule(*_PERMUTES)
def _permute(tr, func, args, kwargs, held):
    """A permutation of dims: found by applying it to a meta tensor of distinct sizes."""
    x, p = args[0], tr.get(args[0])
    probe = torch.empty(tuple(range(2, x.ndim + 2)), device="meta")
    moved = func(probe, *args[1:], **kwargs)
    return tr.run(func, args, kwargs, p.moved(list(moved.shape).index(p.dim + 2)))


@_rule("expand", "expand_as", "broadcast_to", "repeat", "tile")
def _expand(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None:  # expanded to a band's shape: one row along the sharded dim is the band's every row
        q, target = held[0][1], held[0][0]
        k = q.dim - (target.ndim - x.ndim)
        if k >= 0 and x.shape[k] != 1:
            raise _Why("it expands a tensor that is not a band to a band's shape")
        return tr.run(func, args, kwargs, q)
    out = func(*args, **kwargs)
    d = p.dim + out.ndim - x.ndim
    if out.shape[d] != x.shape[p.dim]:
        raise _Why("it repeats the sharded dim")
    tr.set(out, p.moved(d))
    return out


@_rule("narrow", "select", "index_select", "gather", "chunk", "split", "tensor_split", "unbind",
       "split_with_sizes", "index_add", "scatter", "scatter_add", "index_copy", "index_fill")
def _indexed(tr, func, args, kwargs, held):
    """An op on one dim: passes when that dim is not the sharded one (``select``/``unbind`` remove it)."""
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    index = {"chunk": 2, "split": 2, "tensor_split": 2, "split_with_sizes": 2}.get(op, 1)
    dim = _arg(args, kwargs, index, "dim", 0 if op in ("chunk", "split", "tensor_split", "unbind", "split_with_sizes") else None)
    if op == "unfold" and "dimension" in kwargs:
        dim = kwargs["dimension"]
    if p is None or dim is None or normalize_dim(int(dim), x.ndim) == p.dim:
        raise _Why(f"it selects along the sharded dim (dim={dim}): a band's index is not the field's")
    d = normalize_dim(int(dim), x.ndim)
    shift = 1 if op in ("select", "unbind") and d < p.dim else 0
    return tr.run(func, args, kwargs, p.moved(p.dim - shift))


# the same words on every rank that sees it (the ranks whose rows happen to match raise it through the agreement)
_LAYOUTS_DIFFER = (
    "it joins bands of one height whose band layouts differ (a band holds other rows of one part than of the "
    "other) and whose rows are merged with another dim, or that lie on a latitude x longitude grid ({what}), which "
    "has no re-band rule yet. On uneven bands a "
    "strided convolution's output bands and a transposed convolution's do not line up: give every band an offset "
    "that is a multiple of the encoder's total stride (even bands of a field whose rows are a multiple of the "
    "domain size times that stride), as describe() shows")


# an elementwise op of two bands of other rows (at run time: this rank's rows differ; shared through the ForwardGuard)
_OTHER_LAYOUTS = ("it combines bands that hold other rows of the field (their band layouts differ: a residual "
                  "around a strided and a transposed convolution on uneven bands): only a join (torch.cat) re-bands "
                  "its parts; give every band an offset that is a multiple of the total stride, or join the parts")


@_rule("cat", "concat", "concatenate", "stack", "hstack", "vstack")
def _join(tr, func, args, kwargs, held):
    """A join over another dim: every part a band along the same dim (a replicated part would count once per rank).

    Bands of one height whose layouts differ (a UNet's skip connection on uneven bands: the
    encoder's bands and the decoder's upsampled ones) are joined exactly: every part is re-banded
    to the layout of the part the forward made first (:func:`_joined`).
    """
    op = _op_name(func)
    parts = list(_arg(args, kwargs, 0, "tensors"))
    if op in ("hstack", "vstack"):
        raise _Why(f"{op} has no rule on bands (use torch.cat with dim)")
    ndim = parts[0].ndim
    dim = normalize_dim(int(_arg(args, kwargs, 1, "dim", 0)), ndim + (op == "stack"))
    places = [tr.get(t) for t in parts]
    got = {q for q in places if q is not None}
    if len(got) > 1:  # a band and a block of merged rows: the same band when they line up
        got = {tr.as_band(t, q) for t, q in zip(parts, places, strict=True) if q is not None}
        if len(got) > 1 or None in got:
            raise _Why(f"it joins tensors whose bands are along different dims ({sorted(map(str, got))})")
    q = got.pop()
    if op != "stack" and dim == q.dim:
        raise _Why("it joins along the sharded dim: on bands the rows would not follow the field's order "
                   "(a replicated row joined to every band would be counted once per rank)")
    for t, pl in zip(parts, places, strict=True):
        if pl is None and t.ndim > q.dim and t.shape[q.dim] != 1:
            what = "a replicated tensor (a global mean)" if is_replicated(t) else "a tensor that is not a band"
            raise _Why(f"it joins a band with {what} that has {t.shape[q.dim]} rows along the sharded dim")
    bands = [i for i, (t, pl) in enumerate(zip(parts, places, strict=True)) if pl is not None and t.ndim > q.dim]
    if len(bands) > 1:
        parts, target = _joined(tr, parts, [places[i] for i in bands], bands, q.dim)
        args, kwargs = _with_parts(args, kwargs, parts)
    d = q.dim + (1 if op == "stack" and dim <= q.dim else 0)
    out = tr.run(func, args, kwargs, q.moved(d))
    if len(bands) > 1 and target is not None:
        tr.keep_layout(out, target)  # the dry run: the output's bands are the target's
    return out


def _with_parts(args: tuple, kwargs: dict, parts: list) -> tuple[tuple, dict]:
    if "tensors" in kwargs:
        return args, {**kwargs, "tensors": parts}
    return (parts, *args[1:]), kwargs


def _joined(tr: Tracker, parts: list, places: list, bands: list[int], dim: int) -> tuple[list, list[int] | None]:
    """The band parts of a join in one layout: the layout of the part the forward made first (and, in the dry run,
    that layout).

    At run time every rank's rows of every part are agreed at the join (one fixed-size agreement
    per three parts, :func:`credit_mpi.ops.reband.join_layouts`: every rank then takes the same
    path), and each part whose layout differs from the target is re-banded to it
    (:func:`credit_mpi.ops.reband.join_moved`: one ``Alltoallv``, differentiable), so the output is
    exact on any bands. The first-made part is the encoder's in a UNet's skip connection, so the
    decoder continues on the layout the encoder had at that height. Bands whose rows are merged
    with another dim's (windows in the batch: ``outer > 1``) and a 2-D domain grid keep the local
    check (the ForwardGuard shares it). In the dry run the same, from every part's layout.
    """
    path = tr.stack[-1][0]
    order = sorted(range(len(bands)), key=lambda k: tr.born_at(parts[bands[k]]))
    first = order[0]
    if any(p.outer != 1 for p in places) or (tr.manager is not None and grid_cols(tr.manager) > 1):
        if len({parts[i].shape[dim] for i in bands}) > 1:
            raise _Why(_LAYOUTS_DIFFER.format(what=", ".join(p.describe() for p in places)))
        return parts, None
    if tr.manager is None:
        return _joined_dry(tr, parts, places, bands, dim, first, path)
    from ..ops.reband import join_layouts, join_moved

    comm = tr.manager.domain_group
    with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's
        counts = join_layouts([parts[i] for i in bands], dim, comm, f"{path}: cat()")
        target, new = counts[first], list(parts)
        for k, i in enumerate(bands):
            if counts[k] != target:
                new[i] = join_moved(parts[i], dim, comm, counts[k], target, f"{path}: cat()")
    for k, i in enumerate(bands):
        tr.set(new[i], places[k])
    return new, None


def _joined_dry(tr: Tracker, parts: list, places: list, bands: list[int], dim: int, first: int,
                path: str) -> tuple[list, list[int]]:
    """The dry run of :func:`_joined`: every part's layout (its own, else its height's), and the move of each that
    differs reported (``tr.on_join``, set by describe(): a plan row with the agreement and the moves' traffic)."""
    sizes, here = [], tr._here
    tr._here = {}  # a part without a layout of its own has its height's (not another part's)
    try:
        for k, i in enumerate(bands):
            t, p = parts[i], places[k]
            rows = t.shape[dim] // p.inner
            own = tr.layout_of(t)
            sizes.append([p.inner * s for s in (own if own is not None and sum(own) == rows else tr.band_sizes(rows))])
    finally:
        tr._here = here
    target = sizes[first]
    on_join = getattr(tr, "on_join", None)
    if on_join is not None:
        on_join(path, [parts[i] for i in bands], dim, sizes, target)
    return parts, target


def grid_cols(manager: Any) -> int:
    """The longitude columns of the manager's domain grid (1: latitude bands)."""
    from ..grid import grid_of

    return grid_of(manager, manager.domain_parallel_size)[1]


def _index_dims(x: torch.Tensor, index: Any) -> list[tuple[int, Any]]:
    """``(input dim, index item)`` of a ``__getitem__`` index (None and Ellipsis expanded)."""
    items = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for i in items if i is not None and i is not Ellipsis and not isinstance(i, bool))
    out, d = [], 0
    for item in items:
        if item is Ellipsis:  # every dim it stands for, as a whole slice (the sharded dim may be one of them)
            out += [(d + i, slice(None)) for i in range(x.ndim - used)]
            d += x.ndim - used
        elif item is None:
            out.append((None, None))
        else:
            out.append((d, item))
            d += 1
    return out


def _whole(item: Any) -> bool:
    return isinstance(item, slice) and item == slice(None)


@_rule("__getitem__", "__setitem__")
def _getitem(tr, func, args, kwargs, held):
    """Indexing that keeps every row of the sharded dim (``x[:, :, :]``, ``x[:, 0]`` of another dim) passes."""
    x, index = args[0], args[1]
    p = tr.get(x)
    if p is None:
        raise _Why("a band written into a tensor that is not one" if _op_name(func) == "__setitem__" else "a band as an index")
    items = _index_dims(x, index)
    if any(isinstance(i, (torch.Tensor, list, tuple, bool)) for _, i in items):
        raise _Why("advanced (tensor or mask) indexing of a band has no rule")
    out_dim, d_out, last = None, 0, -1
    for d, item in items:
        if d is None:
            d_out += 1
            continue
        last = d
        if d == p.dim:
            if not _whole(item):
                raise _Why(f"it indexes the sharded dim with {item!r}: a band's row numbers are not the field's")
            out_dim = d_out
        if not isinstance(item, int):
            d_out += 1
    if out_dim is None:  # the sharded dim comes after the last index item
        out_dim = d_out + (p.dim - last - 1)
    if _op_name(func) == "__setitem__":
        value = args[2]
        if isinstance(value, torch.Tensor) and tr.get(value) is None and value.numel() > 1:
            vd = out_dim - (x.ndim - value.ndim)
            if vd >= 0 and value.shape[vd] != 1:
                raise _Why("it writes a tensor that is not a band into a band's rows")
        return func(*args, **kwargs)
    return tr.run(func, args, kwargs, p.moved(out_dim))


@_rule("flip", "fliplr", "flipud", "rot90")  # roll: credit_mpi.nn.window_rules
def _flip(tr, func, args, kwargs, held):
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    dims = _dims(_arg(args, kwargs, 1, "dims"), x.ndim)
    if op in ("fliplr", "flipud", "rot90") or dims is None or p.dim in dims:
        raise _Why("it moves rows along the sharded dim (it reverses the sharded dim)")
    return tr.run(func, args, kwargs, p)


@_rule("pad")
def _pad(tr, func, args, kwargs, held):
    """Padding of other dims passes; constant padding of the sharded dim pads the global edges only (first and last band)."""
    x, p = args[0], tr.get(args[0])
    pad = list(_arg(args, kwargs, 1, "pad"))
    pair = x.ndim - 1 - p.dim
    if not (2 * pair + 1 < len(pad) and (pad[2 * pair] or pad[2 * pair + 1])):
        return tr.run(func, args, kwargs, p)
    before, after = pad[2 * pair], pad[2 * pair + 1]
    mode = _arg(args, kwargs, 2, "mode", "constant")
    if mode != "constant" or before < 0 or after < 0 or p.outer * p.inner != 1:
        raise _Why(f"F.pad(mode={mode!r}) of the sharded dim by {[before, after]} has no rule (only constant padding "
                   f"of the field's edges: the rows next to a band are the neighbours')")
    rows = x.shape[p.dim]
    value = _arg(args, kwargs, 3, "value", None)
    if not value:  # zeros: a convolution that takes it folds the rows in (Tracker._fold_edge_rows)
        others = [0 if i in (2 * pair, 2 * pair + 1) else v for i, v in enumerate(pad)]
        out = _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows)
        tr.edge_pads[id(out)] = (weakref.ref(out), x, (before, after), others)
        return out
    return _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows)


def _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows):
    """``F.pad`` of the sharded dim as a band: the field's edges only (the first band's top, the last band's bottom)."""
    if tr.manager is not None:  # the run: the first band pads the field's first edge, the last band its last
        from ..grid import grid_of

        size, rank = tr.manager.domain_parallel_size, tr.manager.domain_rank
        if grid_of(tr.manager, size)[1] > 1:
            raise _Why("F.pad of the sharded dim has no rule on a latitude x longitude domain grid yet")
        pad[2 * pair], pad[2 * pair + 1] = (before if rank == 0 else 0), (after if rank == size - 1 else 0)
        rest = [a for i, a in enumerate(args) if i > 1]
        return tr.run(func, (x, tuple(pad), *rest), {k: v for k, v in kwargs.items() if k != "pad"}, p)
    sizes = tr.band_sizes(rows) if tr.band_sizes is not None else [rows]
    padded = [s + (before if i == 0 else 0) + (after if i == len(sizes) - 1 else 0) for i, s in enumerate(sizes)]
    out = tr.run(func, args, kwargs, p)
    if tr.adopt_layout is not None and not tr.adopt_layout(rows + before + after, padded):
        tr.keep_layout(out, padded)  # another layout than an earlier tensor of that height's (a join re-bands it)
    return out


@_rule("pixel_shuffle", "pixel_unshuffle")
def _pixel(tr, func, args, kwargs, held):
    """Output rows ``[r a, r b)`` come from input rows ``[a, b)`` (shuffle); unshuffle needs whole groups of r rows."""
    x, p = args[0], tr.get(args[0])
    r = int(_arg(args, kwargs, 1, "upscale_factor" if _op_name(func) == "pixel_shuffle" else "downscale_factor"))
    if p.dim == x.ndim - 3 or (p.dim >= x.ndim - 2 and p.outer * p.inner != 1):
        raise _Why("it moves channels into rows or rows into channels along the sharded dim")
    if _op_name(func) == "pixel_unshuffle" and p.dim >= x.ndim - 2 and not tr.rows_ok(x.shape[p.dim], r):
        raise _Why(f"pixel_unshuffle({r}) needs every band to be a whole number of {r} rows")
    out = tr.run(func, args, kwargs, p)
    if p.dim >= x.ndim - 2 and tr.band_sizes is not None and tr.adopt_layout is not None:
        _adopt_shuffled(tr, out, _op_name(func), x.shape[p.dim], r)
    return out


def _adopt_shuffled(tr: Tracker, out: torch.Tensor, op: str, rows: int, r: int) -> None:
    """In the dry run: the bands after a pixel (un)shuffle are every band's rows times (divided by) ``r``.

    That layout is the output's (as a transposed convolution's is); where an earlier tensor of that
    height (the encoder's, joined to it by a skip connection) has another one on uneven bands, it is
    the output's own (a join re-bands it).
    """
    sizes = [s * r if op == "pixel_shuffle" else s // r for s in tr.band_sizes(rows)]
    height = rows * r if op == "pixel_shuffle" else rows // r
    if not tr.adopt_layout(height, sizes):
        tr.keep_layout(out, sizes)


_CONVS = "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d".split()
_POOLS = "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d lp_pool1d lp_pool2d lp_pool3d".split()


def _tuple(value: Any, n: int) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value] * n


@_rule(*_CONVS, *_POOLS)
def _window(tr, func, args, kwargs, held):
    """A convolution or pooling functional passes when its window along the sharded dim is one row, stride one."""
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise _Why("a band as the weight")
    nsp = int(op[-2])
    sd = p.dim - (x.ndim - nsp)
    if p.dim < x.ndim - nsp - 1:
        return tr.run(func, args, kwargs, p)  # bands (windows) in the batch dim: each sample is whole
    if sd < 0:
        raise _Why("it mixes the channels, which hold the bands")
    if op in _CONVS:
        kernel = args[1].shape[2 + sd]
        stride = _tuple(_arg(args, kwargs, 3, "stride", 1), nsp)[sd]
        padding = _arg(args, kwargs, 4, "padding", 0)
        padding = 0 if isinstance(padding, str) else _tuple(padding, nsp)[sd]
    else:
        kernel = _tuple(_arg(args, kwargs, 1, "kernel_size"), nsp)[sd]
        stride = _tuple(_arg(args, kwargs, 2, "stride") or kernel, nsp)[sd]
        padding = _tuple(_arg(args, kwargs, 3, "padding", 0), nsp)[sd]
    if kernel != 1 or stride != 1 or padding != 0 or p.outer * p.inner != 1:
        raise _Why(f"its window along the sharded dim (kernel {kernel}, stride {stride}, padding {padding}) reads "
                   f"the neighbours' rows (use the nn module, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


@_rule("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
       "adaptive_max_pool2d", "adaptive_max_pool3d")
def _adaptive(tr, func, args, kwargs, held):
    op = _op_name(func)
    x, p = args[0], tr.get(args[0])
    nsp = int(op[-2])
    sd = p.dim - (x.ndim - nsp)
    size = _tuple(_arg(args, kwargs, 1, "output_size"), nsp)
    if sd >= 0 and size[sd] is not None and size[sd] != x.shape[p.dim]:
        raise _Why("it pools along the sharded dim (use nn.AdaptiveAvgPool*, which the converter replaces)")
    return tr.run(func, args, kwargs, p)


@_rule("linear", "bilinear")
def _linear(tr, func, args, kwargs, held):
    x, p = args[0], tr.get(args[0])
    if p is None or p.dim == x.ndim - 1 or _op_name(func) == "bilinear":
        raise _Why("it contracts the sharded dim (the last one) with a weight")
    return tr.run(func, args, kwargs, p)


@_rule("matmul", "__matmul__", "__rmatmul__", "bmm", "mm")
def _matmul(tr, func, args, kwargs, held):
    """``a @ b``: a band in a batch dim or in a's rows / b's columns passes; contracted, or in both operands' rows, not."""
    a, b = (args[1], args[0]) if _op_name(func) == "__rmatmul__" else (args[0], args[1])
    if a.ndim < 2 or b.ndim < 2:
        raise _Why("a matrix-vector product with a band has no rule")
    ndim = max(a.ndim, b.ndim)
    outs = set()
    for t, role in ((a, "a"), (b, "b")):
        q = tr.get(t)
        if q is None:
            continue
        if (role == "a" and q.dim == t.ndim - 1) or (role == "b" and q.dim == t.ndim - 2):  # a sum over the field's tokens
            specs, positions, _ = _product_specs(func, args)
            letter = specs[0 if role == "a" else 1][q.dim]
            return _domain_contraction(tr, func, args, kwargs, specs, [args[k] for k in positions], positions,
                                       (letter, q.outer, q.inner))
        outs.add((q.dim + ndim - t.ndim, q.outer, q.inner))
    for t in (a, b):  # a batch partner that is not a band
        if tr.get(t) is None:
            for d, _, _ in outs:
                k = d - (ndim - t.ndim)
                if d < ndim - 2 and k >= 0 and t.shape[k] != 1:
                    raise _Why("it pairs a band with a tensor that is not one along the sharded (batch) dim")
    if len(outs) > 1:
        raise _Why("both operands hold bands in different dims of the product, and neither is the tokens of "
                   "whole rows to gather")
    d, outer, inner = outs.pop()
    return tr.run(func, args, kwargs, Sharded(d, outer, inner))


@_rule("einsum")
def _einsum(tr, func, args, kwargs, held):
    equation = args[0]
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if "..." in equation or "->" not in equation:
        raise _Why("an einsum with '...' or without '->' has no rule on bands")
    ins, out = equation.replace(" ", "").split("->")
    letters = set()
    for spec, t in zip(ins.split(","), operands, strict=True):
        q = tr.get(t)
        if q is not None:
            letters.add((spec[q.dim], q.outer, q.inner))
    if len(letters) != 1:
        raise _Why(f"it pairs bands along different letters ({sorted(v[0] for v in letters)}): no rule")
    if next(iter(letters))[0] not in out:
        positions = list(range(1, len(args))) if len(operands) == len(args) - 1 else None
        return _domain_contraction(tr, func, args, kwargs, ins.split(","), operands, positions, next(iter(letters)))
    letter, outer, inner = letters.pop()
    for spec, t in zip(ins.split(","), operands, strict=True):
        if tr.get(t) is None and letter in spec and t.shape[spec.index(letter)] != 1:
            raise _Why("it pairs a band with a tensor that is not one along the sharded dim")
    return tr.run(func, args, kwargs, Sharded(out.index(letter), outer, inner))


def _contracted(what: str, letter: str, why: str) -> str:
    """Why a product that sums over the band's rows is refused, and what the model's author changes."""
    return (f"{what} contracts the sharded dim (letter {letter!r}, the band's rows) {why}, which has no rule (a sum "
            f"over the field's tokens is exact with a tensor that every rank holds whole, a parameter, whose "
            f"contracted dim is the field's tokens: rows x the dims merged after them). Change the forward: pool the "
            f"rows with a layer the converter replaces (e.g. nn.AdaptiveAvgPool2d to a fixed grid, then a Linear over "
            f"its cells), or run this block on the whole field")


def _domain_contraction(tr: Tracker, func, args: tuple, kwargs: dict, specs: list[str], operands: list,
                        positions: list[int] | None, band: tuple[str, int, int]):
    """A product that contracts a band's tokens with a tensor over the field's tokens: a sum over the domain.

    NCAR CREDIT's nextgen WXFormer pools its bottleneck with ``einsum("bcn,kn->bck", x, agg_w)``,
    ``agg_w`` a parameter over the field's ``H * W`` tokens. Each band contracts its own tokens
    ``[start * inner, stop * inner)`` (its rows of the field, from the agreed layout) with that
    slice of every partner that is not a band (a parameter, a replicated tensor), and the partial
    sums are added over the domain (:func:`credit_mpi.ops.allreduce.domain_sum`: one
    sum over the ranks, backward the same sum of the gradient). The result is
    :class:`~credit_mpi.nn.replicated.Replicated`; a parameter's gradient is this band's slice,
    added over the domain by ``reduce_gradients``. The field is remembered for the inverse
    (:func:`_spread`). Every check before the agreement depends on the model's structure only
    (the same on every rank); the field's size after it on agreed values.
    """
    from ..ops.allreduce import agree_domain_sum, domain_sum
    from .replicated import replicated

    letter, outer, inner = band
    what = f"{args[0]!r}" if isinstance(args[0], str) else f"{_op_name(func)}()"
    if positions is None:
        raise _Why(_contracted(what, letter, "with operands given as a list"))
    if outer != 1:
        raise _Why(_contracted(what, letter, "of merged windows (their tokens are not one block of the field's)"))
    at = [spec.index(letter) if letter in spec else None for spec in specs]
    bands = [i for i, t in enumerate(operands) if tr.get(t) is not None]
    x = operands[bands[0]]
    tokens = x.shape[tr.get(x).dim]  # this band's (the dry run: the field's)
    partners = [i for i, t in enumerate(operands) if i not in bands and at[i] is not None and t.shape[at[i]] != 1]
    if len(bands) != 1 or any(tr.get(operands[i]) != Sharded(at[i], outer, inner) for i in bands):
        raise _Why(_contracted(what, letter, "with another band (a sum over pairs of every band's tokens)"))
    if not partners:
        raise _Why(_contracted(what, letter, "alone (no tensor over the field's tokens to weight it)"))
    if _grid_columns(tr) > 1:
        raise _Why(_contracted(what, letter, "on a latitude x longitude domain grid (a band's tokens are not one block)"))
    if tr.manager is None:  # the dry run: global shapes
        sizes = {operands[i].shape[at[i]] for i in partners}
        if sizes != {tokens}:
            raise _Why(_contracted(what, letter, f"with a tensor of {sorted(sizes)} along it where the field has {tokens} tokens"))
        out = replicated(func(*args, **kwargs))
        _remember_field(tr, tokens, inner, None)
        return out
    cut = list(operands)
    for i in partners:  # shapes for the agreement: every partner cut to this band's tokens
        cut[i] = torch.empty(tuple(tokens if d == at[i] else s for d, s in enumerate(operands[i].shape)), device="meta",
                             dtype=operands[i].dtype)
    shape = tuple(func(*_placed(args, positions, [c.to("meta") for c in cut]), **kwargs).shape)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in operands)
    plan = agree_domain_sum(shape, x.dtype, tokens // inner, grad, tr.manager.domain_group, tr.stack[-1][0])
    start, stop = plan.rows()
    field = plan.total * inner
    wrong = sorted({operands[i].shape[at[i]] for i in partners} - {field})
    if wrong:  # agreed values and the model's shapes: the same on every rank
        raise _Why(_contracted(what, letter, f"with a tensor of {wrong} along it where the field has {field} tokens"))
    for i in partners:
        cut[i] = operands[i].narrow(at[i], start * inner, (stop - start) * inner)
    out = replicated(domain_sum(func(*_placed(args, positions, cut), **kwargs), plan))
    _remember_field(tr, field, inner, (start, stop))
    return out


def _placed(args: tuple, positions: list[int], operands: list) -> tuple:
    new = list(args)
    for i, t in zip(positions, operands, strict=True):
        new[i] = t
    return tuple(new)


def _remember_field(tr: Tracker, tokens: int, inner: int, rows: tuple[int, int] | None) -> None:
    """A field of ``tokens`` tokens whose band is ``rows`` (None: the dry run's whole field) for :func:`_spread`;
    two fields of one token count that differ are neither (the inverse is then refused)."""
    fields = tr.__dict__.setdefault("_dp_fields", {})
    entry = (inner, rows)
    fields[tokens] = entry if fields.get(tokens, entry) == entry else None


def spread_rule(tr: Tracker, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """The inverse of a sum over the domain: a replicated tensor contracted with a tensor over a field's tokens.

    ``einsum("bck,nk->bcn", s, scatter_w)`` with ``s`` replicated (a :func:`_domain_contraction`'s
    result) and ``scatter_w`` a parameter whose free dim ``n`` is the tokens of a field this
    forward contracted: the band's tokens are the product with the parameter's rows cut to the
    band (local, no communication), a band of that field. Returns ``(handled, out)``; not handled
    when no operand is replicated, no field was contracted, or no single output letter is a
    field's tokens (the function then runs as before: nothing of it holds bands).
    """
    fields = tr.__dict__.get("_dp_fields")
    op = _op_name(func)
    if not fields or op not in ("einsum", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm"):
        return False, None
    got = _product_specs(func, args)
    if got is None:
        return False, None
    specs, positions, out = got
    operands = [args[i] for i in positions]
    if not any(is_replicated(t) for t in operands):
        return False, None
    found = [(j, c, i) for j, c in enumerate(out) for i, (spec, t) in enumerate(zip(specs, operands, strict=True))
             if c in spec and not is_replicated(t) and t.shape[spec.index(c)] in fields]
    if len({(j, c) for j, c, _ in found}) != 1:
        return False, None
    j, letter, _ = found[0]
    entry = fields[operands[found[0][2]].shape[specs[found[0][2]].index(letter)]]
    if entry is None:
        raise refusal(tr.stack[-1][0], f"{op}()", "it spreads a replicated tensor over a field's tokens, and two "
                      "fields of that many tokens differ in their rows: no rule")
    inner, rows = entry
    # plain tensors: a band is not replicated (Replicated would mark a product of replicas and parameters one)
    cut = [t.as_subclass(torch.Tensor) if is_replicated(t) else t for t in operands]
    if rows is not None:
        start, stop = rows
        for i, (spec, t) in enumerate(zip(specs, operands, strict=True)):
            if letter in spec and t.shape[spec.index(letter)] != 1:
                cut[i] = t.narrow(spec.index(letter), start * inner, (stop - start) * inner)
    return True, tr.run(func, _placed(args, positions, cut), kwargs, Sharded(j, 1, inner))


def _product_specs(func, args: tuple) -> tuple[list[str], list[int], str] | None:
    """An einsum's or a matrix product's operand specs, their positions in ``args`` and the output's spec (None: neither)."""
    op = _op_name(func)
    if op == "einsum":
        equation = args[0]
        if not isinstance(equation, str) or "..." in equation or "->" not in equation or len(args) < 3:
            return None
        ins, out = equation.replace(" ", "").split("->")
        return ins.split(","), list(range(1, len(args))), out
    a_at, b_at = (1, 0) if op == "__rmatmul__" else (0, 1)
    if len(args) < 2 or not all(isinstance(args[i], torch.Tensor) and args[i].ndim >= 2 for i in (a_at, b_at)):
        return None
    a, b = args[a_at], args[b_at]
    batch = "ABCDEFGHIJ"[: max(a.ndim, b.ndim) - 2]
    return [batch[len(batch) - (a.ndim - 2):] + "mk", batch[len(batch) - (b.ndim - 2):] + "kn"], [a_at, b_at], batch + "mn"


@_rule("embedding")
def _embedding(tr, func, args, kwargs, held):
    p = tr.get(args[0])
    if p is None:
        raise _Why("a band as the embedding table")
    return tr.run(func, args, kwargs, p)


@_rule("interpolate")
def _interpolate(tr, func, args, kwargs, held):
    """Along the sharded dim by an integer factor, or to a size stored for the whole field: the exact layer
    (:class:`DomainParallelInterpolate`; a stored size: :func:`_stored_size`)."""
    from .resample import DomainParallelInterpolate

    x, p = args[0], tr.get(args[0])
    nsp = x.ndim - 2
    sd = p.dim - 2
    size, scale = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor")
    mode = _arg(args, kwargs, 3, "mode", "nearest")
    align = _arg(args, kwargs, 4, "align_corners")
    if _arg(args, kwargs, 6, "antialias", False):
        raise _Why("antialias has no rule on bands")
    if sd < 0 or p.outer * p.inner != 1:
        raise _Why("it resamples a dim that holds merged bands")
    rows = x.shape[p.dim]
    if size is not None:
        target = _tuple(size, nsp)[sd]
        if not _follows_band(target) and not torch.compiler.is_compiling():  # (a traced forward's sizes: plain ints)
            return _stored_size(tr, x, p, args, kwargs, mode, align)
        if not torch.compiler.is_compiling() and (tr.manager is None or grid_cols(tr.manager) == 1):
            return _band_size(tr, func, x, p, args, kwargs, size, nsp, mode, align)
        if target == rows:
            return tr.run(func, args, kwargs, p)
        if not tr.ratio_ok(rows, target):
            raise _Why(f"size={tuple(_tuple(size, nsp))} asks a band for its rows times a factor that is not one "
                       f"whole number on every band (give scale_factor, or make every band's target a whole multiple "
                       f"of its rows)")
        factor = target // rows
    elif scale is not None:
        factor = _tuple(scale, nsp)[sd]
        if float(factor) == 1.0:
            return tr.run(func, args, kwargs, p)
    else:
        raise _Why("give size or scale_factor")
    layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                      mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    rest_size = None if size is None else [y.shape[p.dim] if i == sd else s for i, s in enumerate(_tuple(size, nsp))]
    rest_scale = None if scale is None else [1.0 if i == sd else s for i, s in enumerate(_tuple(scale, nsp))]
    if rest_size is not None and list(rest_size) == list(y.shape[2:]):
        return y
    if rest_scale is not None and all(float(s) == 1.0 for s in rest_scale):
        return y
    kw = {"mode": mode}
    if align is not None:
        kw["align_corners"] = align
    return tr.run(func, (y,), {"size": rest_size, "scale_factor": rest_scale, **kw}, p)


def _band_size(tr, func, x, p, args, kwargs, size, nsp, mode, align):
    """``size=`` read from a band's shape (smp's UNet: ``F.interpolate(x, size=skip.shape[-2:])``): the output has the
    field's rows of that band's tensor, in that tensor's layout.

    Every rank's rows of ``x`` and its target are agreed first (one fixed-size agreement,
    :func:`credit_mpi.ops.reband.agree_rows`; the dry run reads them from the layouts): the same
    layouts pass as they are; a target of a whole factor of the field's rows is the exact layer by
    that factor (its output bands ``factor`` times ``x``'s), re-banded to the target's layout where
    that differs (a skip connection's on uneven bands). Any other target is refused on every rank.
    """
    from .resample import DomainParallelInterpolate

    sd, path = p.dim - 2, tr.stack[-1][0]
    target = _tuple(size, nsp)[sd]
    mine, theirs = _rows_and_target(tr, x, p, target, path)
    if mine == theirs:
        _report_size(tr, path, x, p.dim, list(mine), list(theirs))
        return tr.run(func, args, kwargs, p)
    rows, total = sum(mine), sum(theirs)
    if rows == 0 or total % rows or total < rows:
        raise _Why(f"size={tuple(_tuple(size, nsp))} asks for {total} rows of a field of {rows} along the sharded dim, "
                   f"not a whole factor of them (give scale_factor, or a size that is a whole multiple of the rows)")
    factor = total // rows
    layer = DomainParallelInterpolate(scale_factor=tuple(float(factor) if i == sd else 1.0 for i in range(nsp)),
                                      mode=mode, align_corners=align, manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{path}: interpolate"
    y = layer(x)  # the tracker's module hooks: a layer of the plan, its output a band
    moved = [factor * s for s in mine]
    _report_size(tr, path, y, p.dim, moved, list(theirs))
    y = _to_layout(tr, y, p, moved, list(theirs), path)
    rest = [y.shape[p.dim] if i == sd else v for i, v in enumerate(_tuple(size, nsp))]
    if list(rest) == list(y.shape[2:]):
        return y
    kw = {"mode": mode} if align is None else {"mode": mode, "align_corners": align}
    return tr.run(func, (y,), {"size": rest, **kw}, p)


def _rows_and_target(tr, x, p, target, path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every band's rows of ``x`` and of an interpolation's target read from a band: agreed at run time, the layouts in
    the dry run (``x``'s own or its height's; the target's from its :class:`Extent`)."""
    if tr.manager is not None:
        from ..ops.reband import agree_rows, one_layout

        with torch._C.DisableTorchFunction():
            mine, theirs = agree_rows([x.shape[p.dim], int(target)], [x], p.dim, tr.manager.domain_group,
                                      f"{path}: interpolate(size=)", quiet=one_layout)  # moves nothing: skipped
        return mine, theirs
    mine = tuple(tr.band_sizes(x.shape[p.dim]))
    bands = getattr(target, "bands", None)
    return mine, tuple(bands) if bands is not None else tuple(tr.band_sizes(int(target)))


def _report_size(tr, path: str, t: torch.Tensor, dim: int, sizes: list[int], target: list[int]) -> None:
    """The dry run: the agreement of an interpolation to a band's size, and its re-band when ``sizes`` is not ``target``."""
    on_join = getattr(tr, "on_join", None) if tr.manager is None else None
    if on_join is not None:
        on_join(path, [t], dim, [sizes], target, "interpolate(size=)")


def _to_layout(tr, y: torch.Tensor, p: Sharded, sizes: list[int], target: list[int], path: str) -> torch.Tensor:
    """``y`` (bands ``sizes``, agreed) re-banded to ``target`` (no agreement of its own); the dry run reports it."""
    if sizes == target:
        return y
    if tr.manager is None:
        with torch._C.DisableTorchFunction():
            out = y.view_as(y)
        tr.set(out, p)
        tr.keep_layout(out, target)
        return out
    from ..ops.reband import join_moved

    with torch._C.DisableTorchFunction():
        out = join_moved(y, p.dim, tr.manager.domain_group, tuple(sizes), tuple(target), f"{path}: interpolate(size=)")
    tr.set(out, p)
    return out


def _stored_size(tr, x, p, args, kwargs, mode, align):
    """``size=`` whose entry along the sharded dim is a plain int: a size stored for the whole field, the GLOBAL rows.

    CREDIT's ``F.interpolate(x, size=(self.image_height, self.image_width))``: each output row is
    computed from its source rows in global coordinates (the halo of rows it needs), by
    :class:`~credit_mpi.nn.DomainParallelInterpolate`; the output is a tensor of the field's rows,
    banded as the model's input is (:func:`credit_mpi.nn.resample.stored_size_bands`).
    """
    from .resample import DomainParallelInterpolate

    nsp = x.ndim - 2
    size = tuple(int(v) for v in _tuple(_arg(args, kwargs, 1, "size"), nsp))
    layer = DomainParallelInterpolate(size=size, mode=mode, align_corners=align,
                                      recompute_scale_factor=_arg(args, kwargs, 5, "recompute_scale_factor"),
                                      manager=_NoManager, shard_dim=p.dim - x.ndim)
    layer.dp_manager = tr.manager
    layer.dp_path = f"{tr.stack[-1][0]}: interpolate"
    layer.__dict__["dp_stored_size"] = True
    return layer(x)  # the tracker's module hooks: a layer of the plan, its output a band


class _NoManagerType:
    domain_parallel_size = 1


_NoManager = _NoManagerType()


@_rule("fold", "grid_sample", "cross_entropy", "mse_loss", "l1_loss")  # unfold: window_rules; multi_head_attention_forward: attention_rules
def _refused(tr, func, args, kwargs, held):
    raise _Why("it mixes positions across the sharded dim and has no rule on bands")


@_rule("fill_", "zero_", "requires_grad_", "retain_grad")
def _inplace(tr, func, args, kwargs, held):
    return tr.run(func, args, kwargs, tr.get(args[0]))
