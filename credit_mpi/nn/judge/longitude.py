"""The longitude's judge on a latitude x longitude domain grid: custom forwards judged along both grid dims.

On a ``rows x cols`` grid (``cols > 1``) a converted forward's block holds
latitude rows *and* longitude columns of its own. The :class:`Tracker` of
the run follows the latitude (its sharded dim, the domain group); this
module adds, at run time, a second tracker for the longitude: a
:class:`LongitudeTracker` (shard dim -1, the last dim of the layers'
inputs) that follows the longitude blocks through the same rules and
judges every torch function by what it does to them. It is what
``describe()``'s longitude plan (:class:`~credit_mpi.nn.plan.GridPlan`) runs
in the dry run, so the run's verdict is the plan's in both directions:

* an op that leaves the longitude alone passes (to the latitude's judge);
* ``mean(-1)``, ``sum(-1)``, ``roll(..., -1)``, ``flip(-1)``,
  ``softmax(-1)``, a circular ``F.pad`` of the longitude, attention over
  tokens that merge the block's rows and columns (``flatten(2)``: the
  tokens of a block are not one block of the field's order, so a mask or
  ``is_causal`` would attend in block order): the rules refuse them on a
  grid, naming the module and the op, on every rank (the refusal depends on
  the forward's structure only), before any data moves. Before this judge
  each of them ran on the block's own columns (silently wrong).

The second tracker's manager is a view of the grid's row: its ranks are
the blocks of the same latitude rows (``domain_group``: the Cartesian
communicator's row, made on first use, collective over the domain), so a
rule that moves data along the longitude moves it among them.

Cost per call on a grid only: a second ``TorchFunctionMode`` (each torch
function on a block is judged twice, once per grid dim); nothing on
latitude bands.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import base
from . import tracker as _tracker
from .tracker import Sharded, Tracker, grid_columns, judge_forward

__all__ = ["LongitudeTracker", "judge_longitude", "along_longitude"]


def along_longitude(tr: Tracker) -> bool:
    """True when ``tr`` follows the longitude blocks of a grid of more than one column: the run's
    :class:`LongitudeTracker`, or describe()'s longitude plan (the dry run of shard dim -1 on a grid).

    Its rules move data among the blocks of one grid row (the longitude is then a 1-D band
    decomposition: a row move, a domain sum over the longitude are exact there)."""
    if isinstance(tr, LongitudeTracker):
        return True
    grid = getattr(tr, "grid", None)
    return tr.manager is None and grid is not None and grid[1] > 1 and tr.shard_dim == -1


class _RowView:
    """The manager as the longitude tracker's rules see it: the blocks of this rank's grid row (``cols`` of them)."""

    def __init__(self, manager: Any) -> None:
        from ...grid import grid_of

        self._manager = manager
        rows, cols = grid_of(manager, manager.domain_parallel_size)
        self.domain_grid = (1, cols)  # a grid of more than one column: the rules without one refuse, as in the plan
        self.domain_parallel_size = cols
        self.domain_rank = manager.domain_rank % cols
        self.domain_coords = (0, self.domain_rank)
        self.grid, self.grid_rank = (rows, cols), manager.domain_rank  # an Extent's values are every domain rank's

    @property
    def grid_group(self):
        """The whole domain's communicator (the size agreements of :mod:`credit_mpi.nn.judge.field_sizes`)."""
        return self._manager.domain_group

    @property
    def domain_group(self):
        """The ranks of this grid row (longitude blocks in order), made once per manager (collective on first use)."""
        comm = getattr(self._manager, "_dp_longitude_row", None)
        if comm is None:
            from ... import watchdog

            comm = self._manager.domain_cart.Sub([False, True])  # freed by manager.free()
            comm.Set_name(f"credit_mpi.grid_row[{self._manager.domain_rank // self.domain_parallel_size}]")
            if getattr(self._manager, "timeout", None) is not None:
                watchdog.set_timeout(comm, self._manager.timeout)
            self._manager._dp_longitude_row = comm
        return comm


class LongitudeTracker(Tracker):
    """The longitude blocks of one converted forward on a grid (the :class:`Tracker` of shard dim -1).

    It runs inside the latitude tracker's mode (it sees every torch function first and hands what
    it passes to the latitude's judge). Its module hooks are its own (the latitude tracker stays
    :func:`~credit_mpi.nn.judge.tracker.active_tracker`, whose hooks decide the layers' local runs).
    """

    def __init__(self, root: torch.nn.Module, manager: Any) -> None:
        super().__init__(root, -1, _RowView(manager))

    def __enter__(self) -> LongitudeTracker:
        from torch.nn.modules import module as module_mod

        self._hooks = [module_mod.register_module_forward_pre_hook(self._lon_pre),
                       module_mod.register_module_forward_hook(self._lon_post, always_call=True)]
        self._owner = _tracker.active_tracker()
        return TorchFunctionMode.__enter__(self)

    def __exit__(self, *exc: Any) -> None:
        try:
            TorchFunctionMode.__exit__(self, *exc)
        finally:
            for h in self._hooks:
                h.remove()
            self.records.clear()

    @contextlib.contextmanager
    def _as_active(self):
        state = _tracker._STATE
        before = getattr(state, "tracker", None)
        if before is not self._owner:  # another thread's forward, or a nested converted model's
            yield False
            return
        state.tracker = self
        try:
            yield True
        finally:
            state.tracker = before

    def _lon_pre(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        with self._as_active() as mine:
            return self._pre(module, args) if mine else None

    def _lon_post(self, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        with self._as_active() as mine:
            return self._post(module, args, out) if mine else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        lat = self._owner
        if lat is None:
            return super().__torch_function__(func, types, args, kwargs)
        # this judge's own code reads the block's sizes (plain); the forward's size reads get the field's from both
        # judges (credit_mpi.nn.judge.shapes: the read itself clears the mark)
        lat.plain_sizes += 1
        try:
            out = super().__torch_function__(func, types, args, kwargs)
            if self.trusted:
                return out
            return self._latitude_follows(func, args, kwargs or {}, out)
        finally:
            lat.plain_sizes -= 1

    def _latitude_follows(self, func, args: tuple, kwargs: dict, out: Any) -> Any:
        """The latitude's placements of what a longitude rule made (a row move, a domain sum): the latitude tracker
        did not see those tensors made (the collectives' kernels run outside the modes).

        A sum over the longitude is whole along it on every block of the grid row, not over the domain: its
        :class:`~credit_mpi.nn.replicated.Replicated` mark (every rank's) is dropped, and it stays the latitude
        band its input was.
        """
        from ..replicated import Replicated
        from .registry import dims_of, op_name, tensors_in

        lat = self._owner
        ins = tensors_in((args, kwargs))
        held = [(t, q) for t in ins if (q := lat.get(t)) is not None]
        if len(held) != 1 or not isinstance(out, torch.Tensor) or any(o is out for o in ins):
            return out
        (x, q), y = held[0], out
        if isinstance(y, Replicated) and not any(isinstance(t, Replicated) for t in ins):
            with torch._C.DisableTorchFunction():
                y = y.as_subclass(torch.Tensor)
        if lat.get(y) is not None:
            return y
        dim = q.dim
        if y.ndim != x.ndim and op_name(func) in ("sum", "mean", "nansum", "nanmean"):  # dims reduced away
            from .registry import argument

            dims = dims_of(argument(args, kwargs, 1, "dim"), x.ndim) or list(range(x.ndim))
            dim = None if dim in dims else dim - sum(d < dim for d in dims)
        if dim is not None and dim < y.ndim and y.shape[dim] == x.shape[q.dim]:
            lat.set(y, q.moved(dim))
        return y

    def _fold_edge_rows(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        return None  # the longitude's edges are periodic: no zero rows folded (a zero pad of it is refused)

    def _check_layer_input(self, module: torch.nn.Module, args: tuple) -> tuple[bool, Sharded | None]:
        """A layer takes blocks whose longitude is their last dim; the latitude's judge decides its local runs."""
        from ..base import DomainParallelModule
        from .registry import conversion_error, tensors_in

        for t in tensors_in(args)[:1]:
            p, want = self.get(t), self.band(t)
            if not isinstance(module, DomainParallelModule) or p is None or p.dim == 0:
                break
            if p != want and self.as_band(t, p) != want:
                from ..rules import traits_of

                identity = traits_of(module).identity
                if identity is not None and identity(module):
                    break
                raise conversion_error(self._path(module), "its forward",
                                       f"its input holds the longitude blocks along {p.describe()} (after a permute "
                                       f"or a reshape), but the layer runs on blocks whose longitude is the last dim")
        return False, None


@contextlib.contextmanager
def judge_longitude(root: torch.nn.Module, manager: Any, inputs: Any):
    """At run time on a grid of more than one column: the longitude's tracker around the forward (else nothing)."""
    if manager is None or manager.domain_parallel_size <= 1 or grid_columns(manager) <= 1:
        yield None
        return
    with LongitudeTracker(root, manager) as lon:
        lon.mark_inputs(inputs)
        yield lon


@contextlib.contextmanager
def judge_forward_on_grid(root: torch.nn.Module, shard_dim: int, manager: Any, inputs: Any):
    """:func:`~credit_mpi.nn.judge.tracker.judge_forward`, and on a grid of more than one column the longitude's
    tracker inside it (the converted forward's judge: ``credit_mpi.nn.base.judged``)."""
    with judge_forward(root, shard_dim, manager, inputs) as tracker:
        if tracker is None:
            yield None
            return
        with judge_longitude(root, manager, inputs):
            yield tracker


base.judged = judge_forward_on_grid
