"""Rules at the function level: every torch function applied to a band is judged by what it does to the sharded dim.

A module converter sees module types; real weather models mix rows inside
their own ``forward`` (``flatten(2)`` then ``softmax(q^T k)``, a latitude mean
concatenated to the band's rows, ``F.interpolate(size=skip.shape[-2:])``).
While a converted model runs (and in :func:`~credit_mpi.nn.describe`'s dry
run on the meta device) a :class:`Tracker` (a
``torch.overrides.TorchFunctionMode``) follows the placement of every tensor
that holds bands and judges each torch function applied to one:

* what leaves the sharded dim alone passes: pointwise ops (a broadcast
  partner has one row along it, or the field's rows: the band takes its own rows of it,
  :mod:`credit_mpi.nn.judge.field_values`), reductions over other dims, softmax, norms, ``linear``,
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
  band (:mod:`credit_mpi.nn.judge.attention`: ``F.scaled_dot_product_attention``,
  ``nn.MultiheadAttention``, ``softmax(q k^T) v`` by matmul or einsum); a
  product (``einsum``, ``@``) that contracts a band's tokens with a tensor over
  the field's tokens, a parameter (NCAR CREDIT's nextgen WXFormer bottleneck): a
  sum over the domain, replicated, and its inverse back to the band's tokens
  (:mod:`credit_mpi.nn.judge.reductions`); ``sum``, ``mean``,
  ``nansum``, ``nanmean`` over dims that include the sharded one (or every
  dim): the band's partial sum, one sum over the domain, replicated
  (:mod:`credit_mpi.nn.judge.reductions`);
* sizes are the field's: ``x.shape`` (``size``, ``numel``, ``len``) of a band
  gives the whole field's size along the sharded dim as an :class:`Extent`
  (an int of the field's value carrying every band's), so a stored image size
  compares equal and a branch goes as in one process; a reshape, a slice, a
  pad given the field's sizes or row indices maps them to the band
  (:mod:`credit_mpi.nn.judge.field_sizes`);
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
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ...grid import grid_of
from ...partition import normalize_dim
from .. import base
from ..base import DomainParallelModule
from ..replicated import is_replicated, replicated
from ..rules import traits_of
from .registry import MISS, Refusal, conversion_error, module_rules, rule_of, rules_without_bands, tensors_in

__all__ = ["Sharded", "Placement", "Extent", "Tracker", "active_tracker", "judge_forward", "follows_band", "grid_columns",
           "tracked_columns"]

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


@dataclass(slots=True, eq=False)
class Placement:
    """Everything the judge knows of one tensor during one forward: its one record (run and dry run alike).

    ``where`` is the band's position (a :class:`Sharded`: a plain band along a dim, or rows merged
    with the dims around them: tokens, windows in the batch), None when the tensor holds no bands
    (a tensor every rank holds whole carries :class:`~credit_mpi.nn.replicated.Replicated` instead,
    which outlives the forward). The rest is read by the rules that need it:

    * ``born``: when the forward made it a band (a counter, the same order on every rank: a join
      re-bands its parts to the first-made part's layout);
    * ``layout``: in the dry run, its own band layout (every band's rows) where it differs from
      the layout of its height (a transposed convolution's output on uneven bands);
    * ``global_dims``: dims that hold the whole field's tokens (gathered keys: attention's scores);
    * ``edge_pad``: an ``F.pad`` of the field's edges by zeros, ``(input, (before, after), other pads)``,
      which a convolution that takes it folds in;
    * ``bands``: at run time, every band's rows of the placement, once a size of the field was needed
      (:func:`credit_mpi.nn.judge.field_sizes.band_layout`).
    """

    ref: weakref.ref
    where: Sharded | None = None
    born: int = -1
    layout: list[int] | None = None
    global_dims: frozenset = frozenset()
    edge_pad: tuple | None = None
    bands: tuple | None = None  # at run time: every band's rows, once agreed or derived (credit_mpi.nn.judge.field_sizes)


class Extent(int):
    """A size read from a band's shape along the band (``H = x.shape[-2]`` in a forward), and what is computed from it.

    Its value is the whole FIELD's size (:mod:`credit_mpi.nn.judge.field_sizes`): comparisons, branches
    and arithmetic (float too) go as in one process, on every rank. It also carries every band's
    value (``bands``, in rank order), which arithmetic keeps (``H // 2``, ``H * W``), so an op given
    such a size knows each band's share of it (``F.interpolate(size=skip.shape[-2:])``: the skip's
    layout). Its hash differs from the int's so that caches keyed by shapes (einops' recipes) do not
    hand back sizes computed from plain ints.
    """

    bands: tuple[int, ...] | None = None  # every band's value (None: unknown, e.g. an empty band divided)
    # a block's own size on a latitude x longitude grid, read along a dim that merges the block's rows or columns with
    # another (tokens: no field size there): a tensor op given one is refused (pointwise rules)
    block: bool = False

    def __new__(cls, value: int, bands: Any = None) -> Extent:
        out = super().__new__(cls, value)
        if bands is not None:
            out.bands = tuple(int(b) for b in bands)
        return out

    def __hash__(self) -> int:
        return hash(("credit_mpi.Extent", int(self)))

    __eq__ = int.__eq__
    __ne__ = int.__ne__


def _keeps_mark(name: str):
    method = getattr(int, name)

    def op(self, *other):
        out = method(self, *other)
        if type(out) is not int:
            return out
        if self.bands is None:
            marked = Extent(out)
        else:
            theirs = [getattr(o, "bands", None) or (o,) * len(self.bands) for o in other]
            try:
                marked = Extent(out, [method(int(b), *(int(t[i]) for t in theirs)) for i, b in enumerate(self.bands)])
            except (ArithmeticError, IndexError):  # an empty band divided: its value is unknown (not judged)
                marked = Extent(out)
        marked.block = self.block or any(getattr(o, "block", False) for o in other)
        return marked

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__"):
    setattr(Extent, _name, _keeps_mark(_name))


def follows_band(size: Any) -> bool:
    """A requested reshape size that follows the band: ``-1`` or an :class:`Extent`."""
    return isinstance(size, Extent) or (isinstance(size, int) and size == -1)


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
            lambda rows: self._layouts_in_rule.get(int(rows)) or band_sizes(int(rows)))
        self.adopt_layout = None if adopt_layout is None else (
            lambda rows, sizes: adopt_layout(int(rows), [int(v) for v in sizes]))
        self._root, self._fresh_paths = root, False
        self.paths = _paths_of(root)  # id -> (a weak reference to the module, its path)
        self._named: dict[int, tuple] = {}  # id -> (module, its path and type): the stack's label, once per module
        # the root's forward is called directly (no module hooks): a layer as the root is trusted here
        self.trusted = int(self._trusts(root) or not judge)
        self.stack: list[tuple[str, bool, tuple | None]] = [(self._path(root), bool(self.trusted), None)]
        self.records: dict[int, Placement] = {}  # one per tensor the forward placed, by id (checked by its ref)
        self.field_reads = 0  # band layouts agreed in this forward (credit_mpi.nn.judge.field_sizes: a size of the field read)
        self.size_agreements = 0  # the collectives those made (they move no data: not a module's communication)
        self._births = 0
        self.own_layouts = 0  # the dry run: how many tensors have a layout of their own (none: nothing to inherit)
        self._layouts_in_rule: dict[int, list[int]] = {}  # while a rule runs: the layouts of its held tensors, by their rows
        self._locals: list = []
        self._unhooked: list[bool] = []  # per open module call: this mode stepped aside for a trusted layer's own code
        self.judging = bool(judge)
        self._folded: list[torch.nn.Module | None] = []  # per open layer call: the conv whose edge rows were folded
        self._leaves: dict[int, list[Callable[[Any], Any]]] = {}  # per module: how its module rule ends (a stack)
        self._hooks: list = []
        # fields a product contracted over the domain: tokens -> (inner, this band's rows) (None: two differ)
        self.fields: dict[int, tuple | None] = {}
        # a forward Fourier transform's field rows moved off the bands -> every band's rows (its inverse puts them back so)
        self.spectra: dict[int, tuple] = {}
        # describe()'s dry run sets these (credit_mpi.nn.plan): where the rules report their moves, joins, conflicts
        self.on_move: Callable | None = None
        self.on_join: Callable | None = None
        self.on_conflict: Callable | None = None
        self.plan_rows: list = []  # the plan's rows so far (a module rule asks what its forward communicated)
        self.grid: tuple[int, int] | None = None  # the dry run's domain grid (None: latitude bands)
        self.columns: int | None = None  # at run time: the manager's grid's columns, once read (tracked_columns)
        # replicated rows joined to a band along the sharded dim (credit_mpi.nn.judge.field_values): what a split takes apart
        self.joins: list[tuple] = []
        # describe()'s dry run: the host values of integer and bool tensors on the meta device (index buffers, indices
        # made in the forward), by id -> (meta tensor, host tensor): a rule that takes the field's rows reads them
        self.seen_values: dict[int, tuple] = {}
        # on a grid, while the longitude's judge runs its own code: sizes read here are the block's (plain ints)
        self.plain_sizes = 0

    # -- placements ------------------------------------------------------------------------------

    def record_of(self, t: Any) -> Placement | None:
        """``t``'s record (None: the forward has not placed it)."""
        rec = self.records.get(id(t)) if isinstance(t, torch.Tensor) else None
        return rec if rec is not None and rec.ref() is t else None

    def record(self, t: torch.Tensor) -> Placement:
        """``t``'s record, a new one when it has none (a dead tensor's record under the same id is replaced)."""
        rec = self.records.get(id(t))
        if rec is None or rec.ref() is not t:
            rec = self.records[id(t)] = Placement(weakref.ref(t))
        return rec

    def get(self, t: Any) -> Sharded | None:
        """Where ``t``'s bands are (None: it holds none, or is replicated)."""
        if not isinstance(t, torch.Tensor) or is_replicated(t):
            return None
        rec = self.records.get(id(t))
        return rec.where if rec is not None and rec.ref() is t else None

    def set(self, t: torch.Tensor, p: Sharded | None) -> None:
        """``t`` holds bands at ``p`` (None: none); the first time, it is born (:meth:`born_at`)."""
        if p is None or is_replicated(t):
            if (rec := self.record_of(t)) is not None:
                rec.where = None
            return
        rec = self.record(t)
        rec.where = p
        if rec.born < 0:
            self._births += 1
            rec.born = self._births

    def born_at(self, t: torch.Tensor) -> int:
        """When the forward made band ``t`` (a counter, the same order on every rank)."""
        rec = self.record_of(t)
        return rec.born if rec is not None else -1

    def layout_of(self, t: Any) -> list[int] | None:
        """In the dry run: ``t``'s own layout (every band's rows, of the rows of its placement), None: its height's."""
        rec = self.record_of(t)
        return list(rec.layout) if rec is not None and rec.layout is not None else None

    def keep_layout(self, t: torch.Tensor, sizes: list[int]) -> None:
        """In the dry run: ``t``'s bands are ``sizes`` (a layer's output layout, a re-banded join's)."""
        self.record(t).layout = [int(v) for v in sizes]
        self.own_layouts += 1

    def band(self, t: torch.Tensor) -> Sharded | None:
        """The placement of a band along ``shard_dim`` (a layer's input or output), None when ``t`` has too few dims."""
        try:
            return Sharded(normalize_dim(self.shard_dim, t.ndim))
        except (ValueError, IndexError):
            return None

    def mark_inputs(self, tree: Any) -> None:
        """Every floating tensor of the model's input is a band along ``shard_dim`` (a replicated one stays one)."""
        for t in tensors_in(tree):
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
            self.records.clear()

    def _trusts(self, module: torch.nn.Module) -> bool:
        return isinstance(module, DomainParallelModule) or getattr(module, "_dp_trusted", False)

    def _path(self, module: torch.nn.Module) -> str:
        key = id(module)
        named = self._named.get(key)
        if named is None or named[0] is not module:
            entry = self.paths.get(key)
            if (entry is None or entry[0]() is not module) and not self._fresh_paths:  # the tree changed: walk it again
                self.paths, self._fresh_paths = _paths_of(self._root, fresh=True), True
                entry = self.paths.get(key)
            path = entry[1] if entry is not None and entry[0]() is module else getattr(module, "dp_path", None) or "?"
            named = self._named[key] = (module, f"{path} ({type(module).__name__})")
        return named[1]

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
        if not trusted and not self.trusted:  # a module judged by its forward: its module rules (credit_mpi.nn.judge.rows)
            for rule in module_rules():
                if (got := rule(self, module, args)) is not None:
                    new, leave = got
                    self._leaves.setdefault(id(module), []).append(leave)
                    break
        self.stack.append((self._path(module), trusted, (placement,) if local else None))
        self._unhooked.append(trusted and not self.trusted and self._step_aside())
        self.trusted += trusted
        return new

    def _step_aside(self) -> bool:
        """At run time, a trusted layer's own code runs without this mode (True: it was popped, :meth:`_post` puts it
        back): the judge passes every op of a layer through anyway, and a norm or a band conv makes ~50 small ops a call.
        Only while this mode is the innermost one (another mode above it stays as it is)."""
        if self.manager is None or not self.judging:
            return False
        depth = torch._C._len_torch_function_stack()
        if not depth or torch._C._get_function_stack_at(depth - 1) is not self:
            return False
        torch._C._pop_torch_function_stack()
        return True

    def _post(self, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if active_tracker() is not self:
            return None
        _, trusted, local = self.stack.pop() if len(self.stack) > 1 else (None, False, None)
        if self._unhooked and self._unhooked.pop():
            torch._C._push_on_torch_function_stack(self)
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
            from ..conv import fold_edge_rows

            fold_edge_rows(folded, None)
        if trusted and not self.trusted and isinstance(module, DomainParallelModule) and _replicated_input(args):
            # the original module on a replicated input (exact, local): its output is replicated too, in the run
            # and in the dry run alike, also where the module computes with buffers (BatchNorm's running
            # statistics), which are no Parameters and would make Replicated's own rule give a plain tensor
            out = tree_map_only(torch.Tensor, replicated, out)
        if trusted and not self.trusted:  # a layer's output: a band along the sharded dim (or replicated)
            for t in tensors_in(out):
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
        if not traits_of(module).folds_edge_rows or module.padding_mode != "zeros" or len(args) != 1:
            return None
        rec = self.record_of(args[0])
        if rec is None or rec.edge_pad is None:
            return None
        from ..conv import fold_edge_rows
        x, (before, after), others = rec.edge_pad
        p = self.get(x)
        sd = None if p is None else p.dim - (x.ndim - len(module.kernel_size))
        if sd is None or sd < 0 or (self.manager is not None and self.manager.domain_parallel_size <= 1):
            return None
        if any(others) and len(others) > 2 * len(module.kernel_size):  # a pad of a non-spatial dim: done as the forward did
            fold_edge_rows(module, (sd, before, after))
            return (torch.nn.functional.pad(x, others),)
        # the other spatial dims' zeros folded too (the conv pads them itself: no padded copy of the band)
        fold_edge_rows(module, (sd, before, after, *others) if any(others) else (sd, before, after))
        return (x,)

    def _check_layer_input(self, module: torch.nn.Module, args: tuple) -> tuple[bool, Sharded | None]:
        """A layer (or a user's trusted module) takes bands along ``shard_dim``: not tokens, not a permuted band.

        Returns ``(local, placement)``: ``local`` when the layer runs its original forward on this input
        (bands in the batch dim, whole samples; or a tensor without bands, the same on every rank: a
        position table made from parameters), and the placement of its outputs then.
        """
        for t in tensors_in(args)[:1]:
            p, want = self.get(t), self.band(t)
            if not isinstance(module, DomainParallelModule):
                break
            if p is None and not is_replicated(t):
                return True, None
            if p is not None and p.dim == 0 and t.ndim >= 3:
                if traits_of(module).batch_statistics:
                    raise conversion_error(self._path(module), "its forward", "batch statistics over samples that are "
                                  "spread over the bands (windows moved into the batch dim)")
                return True, p
            if p is not None and p != want and self.as_band(t, p) != want:
                identity, local_on = traits_of(module).identity, traits_of(module).local_on
                if identity is not None and identity(module):
                    return True, p  # the identity now (dropout: p == 0 or eval) on any placement
                if local_on is not None and local_on(module, t, p.dim):
                    return True, p  # reads no other row of the dim that holds the bands (channels-last LayerNorm)
                raise conversion_error(self._path(module), "its forward",
                              f"its input holds the bands along {p.describe()} (after a permute or a reshape), "
                              f"but the layer runs on bands along the sharded dim ({want.describe() if want else self.shard_dim})")
        return False, None

    # -- the judge --------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.trusted:
            return func(*args, **kwargs)
        op, rule, fast, reads = rule_of(func)
        if reads:  # x.ndim, x.dtype: no tensor out, no size read
            return func(*args, **kwargs)
        if fast is not None and not self.own_layouts and (out := fast(self, func, args, kwargs)) is not MISS:
            return out
        held = [(t, p) for t in tensors_in((args, kwargs)) if (p := self.get(t)) is not None]
        if not held:
            if self.fields:  # a replicated sum over a field spread back to its tokens
                for spread in rules_without_bands():
                    handled, out = spread(self, func, args, kwargs)
                    if handled:
                        return out
            return func(*args, **kwargs)
        here = self._held_layouts(op, rule, held) if self.own_layouts else None
        try:
            if rule is None:
                out = func(*args, **kwargs)
                if tensors_in(out):
                    raise Refusal("no rule says what it does to the sharded dim")
                return out
            out = rule(self, func, args, kwargs, held)
            if here is not None:
                self._inherit(out, held)
            return out
        except Refusal as why:
            raise conversion_error(self.stack[-1][0], f"{op}()", str(why)) from None
        finally:
            if here is not None:
                self._layouts_in_rule = here

    # -- the dry run's layouts per tensor ----------------------------------------------------------

    def _held_layouts(self, op: str, rule, held: list) -> dict:
        """In the dry run, while a rule runs: its held tensors' own layouts answer :attr:`band_sizes` for their rows.

        Returns the layouts that were in force (restored after the rule). Two held bands of one height
        whose layouts differ meet in an op that is not a join: the run fails on the ranks whose rows
        differ (``on_conflict``, set by describe(): a row that is not exact).
        """
        before, own = self._layouts_in_rule, []
        for t, p in held:
            rows, sizes = t.shape[p.dim] // (p.outer * p.inner), self.layout_of(t)
            own.append((rows, sizes if sizes is not None and sum(sizes) == rows else None))
        mine = dict(before)
        for rows, sizes in own:
            if sizes is not None:
                mine.setdefault(rows, sizes)
        if len(mine) == len(before):
            return before
        if not getattr(rule, "joins", False) and len(own) > 1 and self.on_conflict is not None:
            seen: dict[int, list[int]] = {}
            for rows, sizes in own:
                sizes = sizes if sizes is not None else self.band_sizes(rows)
                if seen.setdefault(rows, sizes) != sizes:
                    self.on_conflict(self.stack[-1][0], f"{op}()", rows, seen[rows], sizes)
                    break
        self._layouts_in_rule = mine
        return before

    def _inherit(self, out: Any, held: list) -> None:
        """The dry run: a rule's output of the rows of a held band with its own layout has that layout."""
        for t in tensors_in(out):
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
        for t in tensors_in(out):
            self.set(t, placement(t) if callable(placement) else placement)
        if self.own_layouts:  # the dry run: an output of the rows of an input with its own layout has that layout
            self._inherit(out, [(t, p) for t in tensors_in(args) if (p := self.get(t)) is not None])
        return out


_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its modules' paths (see _paths_of)


def _paths_of(root: torch.nn.Module, fresh: bool = False) -> dict[int, tuple]:
    """``id(module) -> (weak reference, path)`` of ``root``'s modules (``"<root>"`` the root), remembered per root:
    a forward's tracker asks for it every call (walking ``named_modules`` cost ~1 ms a WXFormer step); ``fresh``:
    walked again (a module the tracker meets is not the one remembered under its id)."""
    got = None if fresh else _PATHS.get(root)
    if got is None:
        got = {id(m): (weakref.ref(m), name or "<root>") for name, m in root.named_modules()}
        try:
            _PATHS[root] = got
        except TypeError:  # a root that cannot be weakly referenced: not remembered
            pass
    return got


def _replicated_input(args: tuple) -> bool:
    """True when a layer's input (its first tensor argument) is replicated on every rank."""
    first = tensors_in(args)[:1]
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



def grid_columns(manager: Any) -> int:
    """The longitude columns of the manager's domain grid (1: latitude bands)."""
    return grid_of(manager, manager.domain_parallel_size)[1]


def tracked_columns(tr: Tracker) -> int:
    """The domain grid's columns of a tracked forward: the run's manager's, or in the dry run describe()'s
    ``domain_grid`` (1 on bands)."""
    if tr.manager is None:
        return (getattr(tr, "grid", None) or (1, 1))[1]
    if tr.columns is None:  # read for every size and reshape: once per forward (the manager's grid is fixed)
        tr.columns = grid_columns(tr.manager)
    return tr.columns
