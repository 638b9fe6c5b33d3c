"""Row moves: ``torch.roll`` along the sharded dim, whole windows for a windowed module, the group layout.

Rules of the judge (:mod:`credit_mpi.nn.judge`) that move rows:

* ``torch.flip`` (``flipud``, ``fliplr``) along the sharded dim reverses
  the whole field's rows (the row map ``flip_along`` of
  :mod:`credit_mpi.ops.rows`: a band's new rows come from the mirrored band);
  along other dims it passes. ``rot90`` in the plane of the sharded dim is
  refused (rows become columns).

* ``torch.roll`` of a band along the sharded dim is the cyclic shift of the
  whole field (:func:`credit_mpi.ops.rows.roll_along`: a band's new rows come
  from one or more other bands), along the other dims it passes; several
  dims at once are split into the two. This is the shift of shifted-window
  attention (Swin): exact with masks made from bands (a mask of every
  window of the field, built in ``__init__``, is refused).
* ``F.unfold`` of a band (every pixel's k x k neighbourhood: neighbourhood
  attention) with stride 1 and "same" padding along the sharded dim takes
  the neighbours' rows from the halo (zeros at the field's edges, as the
  padding); ``Tensor.unfold`` along the sharded dim is refused.
* A module that holds an attribute ``window_size`` (an int, or a sequence
  whose first entry is along the sharded dim: Swin's blocks, CrossFormer's
  attention) and is judged by its forward gets its input bands re-banded to
  whole windows (:func:`credit_mpi.ops.reband.reband`: every band's end
  rounded to a multiple of the window, the rows of a straddling window moved
  to one owner) before its forward runs, and its outputs moved back to the
  input's layout after (when its inputs hold bands of contiguous rows, not
  windows in the batch dim). The forward reads its own input's shape to count its
  windows, so the move has to come before that: a reshape into windows
  cannot re-band a band that is not whole windows (its window count was
  computed from the band), which is why this is a rule at the module's
  boundary, not in the reshape. When the bands are whole windows already,
  nothing moves (one agreement). In ``describe()``'s dry run the same
  layout holds for the forward of the module. The converted model's root
  gets the same (its forward guard enters the root's boundary as the module
  hooks enter every other module's).
* A module whose ``window_size`` counts rows at a stride across the field
  (:data:`STRIDED_WINDOWS`: CrossFormer's long-distance attention, whose
  group ``j`` holds the rows ``i * (H / window) + j``) gets its input bands
  moved to the group layout (:func:`credit_mpi.ops.group_rows.to_groups`:
  the ``H / window`` groups split among the ranks, each rank holding its
  groups' rows window-major) before its forward and its outputs moved back
  to the input's bands after. The forward counts its groups from its
  input's shape, so it runs on whole groups locally; inside it the rows are
  the groups, the middle factor of the dim (``Sharded(dim, window, 1)``).
  A field whose height is not a multiple of the window, or with fewer groups
  than ranks, is refused on every rank before data moves (describe() says so
  too). Inside a band of one group (batch 1) the judge cannot tell the band's
  dim from the batch's; the module's output is then taken in its own layout
  (one unit covers the whole tensor either way), as for a band of one window.

Importing this module registers the rules (:mod:`credit_mpi.nn.judge` imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...grid import grid_of
from ...transport import paths
from .longitude import along_longitude
from .registry import Refusal, argument, conversion_error, dims_of, module_rule, op_name, rule
from .tracker import Sharded, Tracker, tracked_columns

__all__ = ["window_rows", "strided_rows", "STRIDED_WINDOWS", "circular_pad_longitude"]


@rule("flip", "fliplr", "flipud")
def _flip(tr: Tracker, func, args, kwargs, held):
    """Along the sharded dim: the field's rows reversed across bands (the row map ``flip_along``); other dims: local."""
    x, p = args[0], tr.get(args[0])
    op = op_name(func)
    dims = {"fliplr": [1], "flipud": [0]}.get(op) or dims_of(argument(args, kwargs, 1, "dims"), x.ndim)
    if dims is None or p.dim not in dims:
        return tr.run(func, args, kwargs, p)
    if p.outer * p.inner != 1:
        raise Refusal(f"it reverses a dim that holds the bands' rows merged with another dim ({p.describe()}); flip "
                      f"the field before the merge")
    rest = [d for d in dims if d != p.dim]
    y = torch.flip(x, rest) if rest else x
    y = _moved(tr, y, p, "flip_along") if tr.manager is not None else _reported(tr, y, p, "flip_along")
    if tr.manager is None:
        y = torch.flip(y, [p.dim])  # the dry run: the field's own flip (the layout stays)
    tr.set(y, p)
    return y


@rule("rot90")
def _rot90(tr: Tracker, func, args, kwargs, held):
    """A rotation in the plane of the sharded dim turns rows into columns: refused; in another plane: local."""
    x, p = args[0], tr.get(args[0])
    dims = dims_of(argument(args, kwargs, 2, "dims", [0, 1]), x.ndim)
    if p.dim in dims:
        raise Refusal("it turns the rows of the sharded dim into another dim's")
    return tr.run(func, args, kwargs, p)


@rule("roll")
def _roll(tr: Tracker, func, args, kwargs, held):
    """Along the sharded dim: the field's cyclic shift across bands; along other dims: local."""
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise Refusal("a band as the shifts")
    shifts, dims = argument(args, kwargs, 1, "shifts"), argument(args, kwargs, 2, "dims")
    if dims is None or (isinstance(dims, (tuple, list)) and not dims):
        raise Refusal("torch.roll without dims shifts the flattened tensor (every band's rows mixed with the others')")
    shifts = list(shifts) if isinstance(shifts, (tuple, list)) else [shifts]
    dims = list(dims) if isinstance(dims, (tuple, list)) else [dims]
    if len(shifts) != len(dims):
        return func(*args, **kwargs)  # torch's own error
    along = sum(int(s) for s, d in zip(shifts, dims, strict=True) if d % x.ndim == p.dim)
    rest = [(int(s), d) for s, d in zip(shifts, dims, strict=True) if d % x.ndim != p.dim]
    y = func(x, [s for s, _ in rest], [d for _, d in rest]) if rest else x
    if along and p.outer != 1:
        raise Refusal(f"it rolls a dim that holds the bands' rows merged with another dim ({p.describe()}: windows in "
                   f"the batch); roll the field before the window partition")
    if along and tr.manager is not None:
        y = _moved(tr, y, p, "roll_along", shift=along)
    elif along:  # the dry run: the field's own roll (the layout stays)
        y = func(_reported(tr, y, p, "roll_along", shift=along), along, p.dim)
    elif y is x:
        y = func(x, 0, p.dim)  # a roll by nothing is still a new tensor
    tr.set(y, p)
    return y


@rule("unfold")
def _unfold(tr: Tracker, func, args, kwargs, held):
    """``F.unfold`` (every pixel's k x k neighbourhood: neighbourhood attention) through the halo; ``Tensor.unfold``
    along another dim passes, along the sharded dim it is refused (the neighbours' rows are missing)."""
    x, p = args[0], tr.get(args[0])
    if p is None:
        raise Refusal("a band as unfold's argument")
    if func is not torch.nn.functional.unfold:  # Tensor.unfold(dimension, size, step): a new last dim, the rest kept
        if argument(args, kwargs, 1, "dimension") % x.ndim == p.dim:
            raise Refusal("Tensor.unfold along the sharded dim reads the neighbours' rows (use F.unfold with padding: its "
                       "rule takes them from the halo)")
        return tr.run(func, args, kwargs, p)
    kernel, dilation, padding, stride = (_pair(argument(args, kwargs, i, n, d)) for i, n, d in
                                         ((1, "kernel_size", None), (2, "dilation", 1), (3, "padding", 0), (4, "stride", 1)))
    if x.ndim != 4 or p.dim != 2 or p.outer * p.inner != 1:
        raise Refusal(f"F.unfold of a tensor whose bands are along {p.describe()} has no rule (bands along the rows of "
                   f"a (batch, channels, rows, columns) tensor)")
    if stride[0] != 1 or 2 * padding[0] != dilation[0] * (kernel[0] - 1):
        raise Refusal(f"F.unfold with kernel {kernel[0]}, dilation {dilation[0]}, padding {padding[0]}, stride {stride[0]} "
                   f"along the sharded dim has no rule (only stride 1 and padding (dilation * (kernel - 1)) / 2: "
                   f"as many neighbourhoods as rows)")
    width = padding[0]
    if not tr.rows_ok(x.shape[p.dim], 1, width):
        raise Refusal(f"every band needs at least {width} rows for a halo of {width} rows")
    rest = {"kernel_size": tuple(kernel), "dilation": tuple(dilation), "stride": tuple(stride)}
    if tr.manager is not None and width:
        if grid_of(tr.manager, tr.manager.domain_parallel_size)[1] > 1:
            raise Refusal("F.unfold along the sharded dim has no rule on a latitude x longitude domain grid yet")
        from ...halo import halo_exchange

        x = halo_exchange(x, width, dim=2, manager=tr.manager, boundary="zero",  # the field's edges: zeros, as padding
                          transport="mpi" if paths.current() is paths.MPI_PATH else "torch")
        y = func(x, padding=(0, padding[1]), **rest)
    else:
        y = func(x, padding=tuple(padding), **rest)
    columns = (args[0].shape[3] + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    tr.set(y, Sharded(2, 1, columns))  # (batch, channels x k x k, rows x columns): tokens of the band's rows
    return y


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 2


# -- what the dry run tells describe() of each row move (its plan row and traffic) -------------------


def _moved(tr: Tracker, t: torch.Tensor, p: Sharded, name: str, **params: Any) -> torch.Tensor:
    """At run time: band ``t`` moved by the row map ``name`` of :mod:`credit_mpi.ops.rows` along ``p.dim`` (on a grid:
    along the longitude, among the blocks of the grid row)."""
    if tracked_columns(tr) > 1 and not along_longitude(tr):
        raise Refusal(f"the row move {name}() along the sharded dim has no rule on a latitude x longitude domain grid "
                      f"yet")
    from ...ops.rows import move_along

    comm = tr.manager.domain_group
    with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's (the latitude's judge sees none)
        return move_along(t, name, p.dim, comm, tr.stack[-1][0], transport=paths.current().transport(comm), **params)


def _reported(tr: Tracker, t: torch.Tensor, p: Sharded, name: str, **params: Any) -> torch.Tensor:
    """In the dry run: the row map ``name``'s move of ``t`` reported to describe() (its plan row and traffic); returns
    ``t`` (the caller applies the torch function to the field)."""
    if tracked_columns(tr) > 1 and not along_longitude(tr):
        raise Refusal(f"the row move {name}() along the sharded dim has no rule on a latitude x longitude domain grid "
                      f"yet")
    from ...ops.rows import moves_of

    sizes_in, sizes_out, moves = moves_of(name, tuple(dim_sizes(tr, t, p)), tr.stack[-1][0], **params)
    report_move(tr, tr.stack[-1][0], f"{name}()", t, p.dim, sizes_in, sizes_out, moves)
    return t


def circular_pad_longitude(tr: Tracker, func, args: tuple, kwargs: dict, p: Sharded, pad: list, pair: int) -> torch.Tensor:
    """``F.pad(x, ..., mode="circular")`` of the longitude on a grid: the field's periodic padding.

    The first block of the grid row gains the ``before`` columns at the end of the field, the last block the
    ``after`` columns at its start (the row map ``circular_halo_along`` of :mod:`credit_mpi.ops.rows`: one
    ``Alltoallv`` among the blocks of the grid row, differentiable, then a local ``cat``); the other dims'
    padding runs first, as the forward asked (judged by the latitude's tracker).
    """
    x, before, after = args[0], pad[2 * pair], pad[2 * pair + 1]
    others = [0 if i in (2 * pair, 2 * pair + 1) else v for i, v in enumerate(pad)]
    y = func(x, others, mode="circular") if any(others) else x
    if tr.manager is not None:
        halo = _moved(tr, y, p, "circular_halo_along", before=before, after=after)
        lat = getattr(tr, "_owner", None)
        if lat is not None and (q := lat.get(y)) is not None:
            lat.set(halo, q)  # the latitude's rows of the band it came from (made where the modes do not look)
        rank, last = tr.manager.domain_rank, tr.manager.domain_parallel_size - 1
        parts = ([halo.narrow(p.dim, 0, before)] if rank == 0 else []) + [y] + (
            [halo.narrow(p.dim, halo.shape[p.dim] - after, after)] if rank == last else [])
        out = torch.cat(parts, p.dim) if len(parts) > 1 else y.clone()
        tr.set(out, p)
        return out
    rows = y.shape[p.dim]
    _reported(tr, y, p, "circular_halo_along", before=before, after=after)
    out = tr.run(func, args, kwargs, p)  # the dry run: the field's own padding
    sizes = tr.band_sizes(rows) if tr.band_sizes is not None else [rows]
    padded = [s + (before if i == 0 else 0) + (after if i == len(sizes) - 1 else 0) for i, s in enumerate(sizes)]
    if tr.adopt_layout is not None and not tr.adopt_layout(rows + before + after, padded):
        tr.keep_layout(out, padded)  # another layout than an earlier tensor of that height's
    return out


def dim_sizes(tr: Tracker, t: torch.Tensor, p: Sharded) -> list[int]:
    """In the dry run: every band's entries along ``p.dim`` of ``t`` (rows times the merged inner ones)."""
    return [p.outer * p.inner * s for s in tr.band_sizes(t.shape[p.dim] // (p.outer * p.inner))]


def report_move(tr: Tracker, path: str, kind: str, t: torch.Tensor, dim: int, sizes_in, sizes_out, moves_of,
                moves: bool = True) -> None:
    """In the dry run: a row move of ``t`` along ``dim`` (``moves_of(rank)``: that rank's RowMoves) for describe()'s plan
    (``tr.on_move``, set by :func:`credit_mpi.nn.describe`; absent elsewhere)."""
    on_move = tr.on_move
    if on_move is None:
        return
    from ..traffic import move_traffic, row_bytes

    traffic = move_traffic(moves_of, len(sizes_in), row_bytes(tuple(t.shape), dim, t.element_size()), t.requires_grad,
                           moves)
    on_move(path, kind, t.shape[dim], sizes_in, sizes_out, traffic)


# -- whole windows at the boundary of a windowed module ---------------------------------------------


# A module's window_size counts rows at a stride across the field (not a window of contiguous rows) when
# one of its attributes has one of these values: attribute name -> values. Extend it for another model's
# grid attention whose groups are ``rows i * (H / window) + j`` (the group layout of credit_mpi.ops.group_rows).
STRIDED_WINDOWS: dict[str, frozenset] = {
    "attn_type": frozenset({"long"}),  # CREDIT's CrossFormer Attention (crossformer, wxformer): long-distance
}


def _strided(module: torch.nn.Module) -> bool:
    return any(_plain_attribute(module, name) in values for name, values in STRIDED_WINDOWS.items())


def _plain_attribute(module: torch.nn.Module, name: str) -> Any:
    """``module.name``, None when absent: asked of every module a forward enters, so a missing one is found absent
    without ``nn.Module.__getattr__``'s exception (a parameter, buffer or submodule of that name is no int or str)."""
    found = module.__dict__.get(name, _ABSENT)
    if found is not _ABSENT:
        return found
    return getattr(module, name, None) if hasattr(type(module), name) else None


_ABSENT = object()


def _window_size(module: torch.nn.Module) -> int | None:
    """``module.window_size`` along the sharded dim (an int or a sequence's first entry) when it is an int >= 2."""
    size = _plain_attribute(module, "window_size")
    if isinstance(size, (tuple, list)) and size:
        size = size[0]
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        return None
    return size


def window_rows(module: torch.nn.Module) -> int | None:
    """The rows of ``module``'s windows along the sharded dim (its ``window_size``: an int or its first entry), or None.

    None for a module of :data:`STRIDED_WINDOWS` (its ``window_size`` counts rows at a stride: see
    :func:`strided_rows`) and for a window of one row (nothing to re-band).
    """
    return None if _strided(module) else _window_size(module)


def strided_rows(module: torch.nn.Module) -> int | None:
    """The rows of each group of a module of :data:`STRIDED_WINDOWS` (its ``window_size``), or None.

    None for a window of one row: each group is one row, already on its band.
    """
    return _window_size(module) if _strided(module) else None


def _enter(tr: Tracker, module: torch.nn.Module, args: tuple) -> tuple[tuple, Callable[[Any], Any]] | None:
    """Re-band the band arguments of a windowed module to whole windows (or move them to the group layout of a
    strided one); returns the new args and the way back."""
    if (groups := strided_rows(module)) is not None:
        return _enter_groups(tr, module, args, groups)
    window = window_rows(module)
    if window is None:
        return None
    bands = [(i, a, p) for i, a in enumerate(args) if (p := tr.get(a)) is not None]
    if not bands or any(p.dim == 0 or p.outer != 1 for _, _, p in bands):
        return None  # windows in the batch dim already (Swin's window attention), or rows that are not contiguous
    if tr.manager is None:
        return _enter_dry_run(tr, args, bands, window, tr._path(module))
    return _run_enter(tr, args, bands, window, tr._path(module))


def _run_enter(tr: Tracker, args: tuple, bands: list, window: int, path: str):
    from ... import watchdog
    from ...ops.reband import rebanded

    comm, new_args, layout = tr.manager.domain_group, list(args), None
    with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's
        for i, a, p in bands:
            # whole windows already, with no empty band: a repeat in a converted forward skips the agreement
            new_args[i], sizes_in, sizes_out = rebanded(a, p.dim, comm, window * p.inner, f"{path}: whole windows",
                                                        transport=paths.current().transport(comm), quiet=_moves_nothing)
            empty = _empty_bands(sizes_out)  # the same on every rank: the layouts are agreed
            layout = layout or (sizes_out, sizes_in)  # back= (moved, original)
            if empty and sizes_out[comm.Get_rank()] == 0:
                new_args[i] = _with_phantom_window(new_args[i], p, window)
            tr.set(new_args[i], p)
    dim, seq = bands[0][2].dim, watchdog.STATE.seq - tr.size_agreements  # (field-size agreements move no data)

    def leave(out: Any) -> Any:
        out = _map_bands(tr, out, lambda t, q: _one_unit(tr, t, q, dim, window, Sharded(dim)))
        if empty:  # every rank alike: each made the same collectives (in step), or the agreement already raised
            if watchdog.STATE.seq - tr.size_agreements != seq:
                raise _communicating_with_empty_bands(path, window, layout, bands[0][2].inner)
            if sizes_out[comm.Get_rank()] == 0:
                out = _map_bands(tr, out, lambda t, q: _drop_phantom_window(tr, t, q))
        if layout[0] == layout[1]:  # whole windows already: nothing moved, nothing to move back
            return out
        return _map_bands(tr, out, lambda t, q: _move_back(tr, t, q, layout, path))

    return tuple(new_args), leave


def _moves_nothing(sizes_in, sizes_out) -> bool:
    """A re-band to whole windows that keeps the layout and leaves no band empty: the module's call makes no MPI call
    of the rule's (no rows move there or back, no phantom window)."""
    return tuple(sizes_in) == tuple(sizes_out) and not _empty_bands(sizes_out)


def _empty_bands(sizes_out) -> list[int]:
    """The ranks a re-band to whole windows leaves with no window (none when the field itself has no rows)."""
    return [r for r, s in enumerate(sizes_out) if s == 0] if sum(sizes_out) else []


def _with_phantom_window(t: torch.Tensor, p: Sharded, window: int) -> torch.Tensor:
    """A band of no window extended by one window of zeros: the module's forward reads its window count from its
    input's shape (CREDIT's ``rearrange(..., h=height // wsz)`` divides by a count of 0), so it runs on one window
    whose output :func:`_drop_phantom_window` drops. Joined to ``t`` by a ``cat`` so that the backward reaches the re-band's."""
    shape = list(t.shape)
    shape[p.dim] = window * p.inner
    return torch.cat([t, t.new_zeros(shape)], dim=p.dim)


def _drop_phantom_window(tr: Tracker, t: torch.Tensor, q: Sharded) -> torch.Tensor:
    """The phantom window's output dropped: a band of no rows (its parameters' gradients zero, not None)."""
    with torch._C.DisableTorchFunction():
        y = t.narrow(q.dim, 0, 0)
    tr.set(y, q)
    return y


def _communicates(row) -> bool:
    """A row of describe()'s plan whose layer or move makes a collective on some rank (or whose traffic is unknown)."""
    return row.traffic is None or any(t.agreements or t.forward_messages or t.backward_messages for t in row.traffic)


def _communicating_with_empty_bands(path: str, window: int, layout: tuple, inner: int) -> Exception:
    """A module whose forward communicates cannot run with a band of no window: the phantom window's zeros would
    take part in its collectives (a roll across bands, a halo). The same refusal in describe()'s dry run."""
    moved, original = ([s // inner for s in sizes] for sizes in layout)
    return conversion_error(path, "reband()", f"re-banded to whole windows of {window} rows, the bands {list(original)} become "
                   f"{list(moved)} (a band with no window), and its forward communicates across bands (a roll, a "
                   f"halo, a gather); use at most {sum(1 for s in moved if s)} rank(s), or a field of at least "
                   f"{len(moved)} windows")


def _move_back(tr: Tracker, t: torch.Tensor, q: Sharded, layout: tuple, path: str) -> torch.Tensor:
    from ...ops.reband import reband

    if q.outer != 1:
        raise conversion_error(path, "its output", f"it returns the bands merged with another dim ({q.describe()}), "
                      f"which cannot be moved back to its input's bands")
    with torch._C.DisableTorchFunction():
        comm = tr.manager.domain_group
        y = reband(t, q.dim, comm, back=layout, path=f"{path}: back from whole windows",
                   transport=paths.current().transport(comm))
    tr.set(y, q)
    return y


def _map_bands(tr: Tracker, out: Any, fn: Callable) -> Any:
    """``out`` with every tensor that holds bands replaced by ``fn(tensor, placement)`` (tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        q = tr.get(out)
        return out if q is None else fn(out, q)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_map_bands(tr, o, fn) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_map_bands(tr, o, fn) for o in out)
    if isinstance(out, dict):
        return {k: _map_bands(tr, v, fn) for k, v in out.items()}
    return out


def _enter_dry_run(tr: Tracker, args: tuple, bands: list, window: int, path: str) -> tuple[tuple, Callable[[Any], Any]]:
    """The dry run: the module's forward sees the re-banded layout (at the input's height, and heights that divide it
    or are multiples of it; its band arguments hold it, as the run's re-banded ones: a residual ``shortcut = x``
    added after the windows is in it); the way back restores the input's layout. Each move is reported as the run
    makes it. Returns the arguments the forward gets and the way back."""
    from ...ops.reband import whole_windows
    from .field_sizes import keep_bands

    _, a, p = bands[0]
    rows, old = a.shape[p.dim] // p.inner, tr.band_sizes
    new = list(whole_windows(list(old(rows)), window))
    layout, new_args = None, list(args)
    for i, b, q in bands:  # the run: each band argument re-banded to whole windows (of window x inner entries)
        sizes_in = dim_sizes(tr, b, q)
        sizes_out = list(whole_windows(sizes_in, window * q.inner))
        layout = layout or (sizes_out, sizes_in)
        report_move(tr, path, "reband()", b, q.dim, sizes_in, sizes_out, _identity_moves(sizes_in, sizes_out),
                    sizes_in != sizes_out)
        if q.outer == 1 and sizes_in != sizes_out:  # the forward's own tensor: in the re-banded layout
            with torch._C.DisableTorchFunction():
                new_args[i] = b.view_as(b)
            tr.set(new_args[i], q)
            keep_bands(tr, new_args[i], q, tuple(s // q.inner for s in sizes_out))
    empty, rows_before = _empty_bands(layout[0]), len(tr.plan_rows)
    new = [s or window for s in new] if empty else new  # the run: an empty band runs one phantom window

    def sizes_of(h: int) -> list[int]:
        if h == rows:
            return new
        if h and rows % h == 0 and all(s % (rows // h) == 0 for s in new):
            return [s // (rows // h) for s in new]
        if rows and h % rows == 0:
            return [s * (h // rows) for s in new]
        return old(h)

    def leave(out: Any) -> Any:
        tr.band_sizes = old
        if empty and any(_communicates(r) for r in tr.plan_rows[rows_before:]):
            raise _communicating_with_empty_bands(path, window, layout, p.inner)
        return _map_bands(tr, out, _as_moved_back)

    def _as_moved_back(t: torch.Tensor, q: Sharded) -> torch.Tensor:
        # the run moves an output back to the input's bands and then takes windows merged back
        # (rows x inner) as a band (no layout to compare at run time): the dry run the same
        if q.outer == 1:
            moved, original = layout
            height, unit = t.shape[q.dim], max(sum(moved), 1)
            here, there = [m * height // unit for m in moved], [o * height // unit for o in original]
            if moved != original:  # the run's move back: the same proportion of the input's layout
                report_move(tr, path, "reband() back", t, q.dim, here, there, _identity_moves(here, there))
            tr.set(t, Sharded(q.dim))
            if sum(there) == height:  # the input's layout, as the run's move back gives it
                keep_bands(tr, t, Sharded(q.dim), tuple(there))
        return t

    tr.band_sizes = sizes_of
    return tuple(new_args), leave


def _identity_moves(sizes_in: list[int], sizes_out: list[int]) -> Callable[[int], Any]:
    from ...ops.rows import plan_moves

    return lambda r: plan_moves(tuple(sizes_in), tuple(sizes_out), lambda j: j, r)


# -- the group layout at the boundary of a module that attends rows at a stride --------------------

_LONG = "long-distance attention (rows at a stride across the field)"


def _enter_groups(tr: Tracker, module: torch.nn.Module, args: tuple, window: int):
    """Move the band arguments of a strided module to the group layout; returns the new args and the way back."""
    bands = [(i, a, p) for i, a in enumerate(args) if (p := tr.get(a)) is not None]
    if not bands or any(p.outer * p.inner != 1 or p.dim == 0 for _, _, p in bands):
        return None  # not plain bands (the judge says what its forward does with them)
    path, new_args, layout = tr._path(module), list(args), None
    if tr.manager is not None and grid_of(tr.manager, tr.manager.domain_parallel_size)[1] > 1:
        raise conversion_error(path, _LONG, "no rule on a latitude x longitude domain grid yet")
    for i, a, p in bands:
        if tr.manager is None:
            from ...ops.group_rows import group_layout_problem

            if (why := group_layout_problem(a.shape[p.dim], window, len(tr.band_sizes(a.shape[p.dim])), 1)):
                raise conversion_error(path, _LONG, why)
            layout = _dry_groups(tr, a, p, window, path)
            with torch._C.DisableTorchFunction():
                new_args[i] = a.view_as(a)  # the dry run: the field's shape; the rows are now its groups
        else:
            new_args[i], layout = _to_groups(tr, a, p, window, path)
        tr.set(new_args[i], Sharded(p.dim, window, 1))
    old, dim = tr.band_sizes, bands[0][2].dim
    if old is not None:  # the dry run: the groups split as the move splits them
        from ...layout import split

        height = bands[0][1].shape[dim]
        n = len(old(height))
        tr.band_sizes = lambda h: split(h, n, uneven=True) if h == height // window else old(h)

    def leave(out: Any) -> Any:
        tr.band_sizes = old
        group = Sharded(dim, window, 1)
        out = _map_bands(tr, out, lambda t, q: _one_unit(tr, t, q, dim, window, group))
        return _map_bands(tr, out, lambda t, q: _from_groups(tr, t, q, window, layout, path, dim))

    return tuple(new_args), leave


class _DryGroups(tuple):
    """The dry run's layout of a move to groups: ``(moves_of(rank), bands, groups)`` (the way back reports its traffic)."""


def _dry_groups(tr: Tracker, a: torch.Tensor, p: Sharded, window: int, path: str) -> _DryGroups:
    """The dry run's move of ``a`` to the group layout, reported; returns what the move back needs."""
    from ...ops.group_rows import group_sizes, group_source
    from ...ops.rows import plan_moves

    height = a.shape[p.dim]
    bands = tuple(tr.band_sizes(height))
    groups = group_sizes(height, window, len(bands))
    src = group_source(height, window, len(bands))
    moves_of = lambda r: plan_moves(bands, groups, src, r)  # noqa: E731
    report_move(tr, path, "to_groups()", a, p.dim, bands, groups, moves_of)
    return _DryGroups((moves_of, bands, groups))


def _to_groups(tr: Tracker, a: torch.Tensor, p: Sharded, window: int, path: str) -> tuple:
    from ...ops.group_rows import NoGroupLayout, grouped

    try:
        with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's
            comm = tr.manager.domain_group
            return grouped(a, p.dim, window, comm, f"{path}: to the group layout", least=1,
                           transport=paths.current().transport(comm))
    except NoGroupLayout as exc:  # raised on every rank alike, before data moves (the height is agreed first)
        raise conversion_error(path, _LONG, exc.why) from None


def _one_unit(tr: Tracker, t: torch.Tensor, q: Sharded, dim: int, rows: int, placement: Sharded) -> torch.Tensor:
    """``t``, placed as ``placement`` when this band holds one unit (a window, a group: ``rows`` rows along ``dim``,
    or none) and ``q`` says "one row" (at run time).

    A reshape of a band of one unit cannot tell its dim from other dims of size one (the batch of one
    sample: the judge picks one of them); a placement of one row covers the whole tensor either way,
    so it is the module's own placement of one unit as well.
    """
    if (q != placement and t.ndim > dim and t.shape[dim] in (0, rows) and t.shape[q.dim] in (0, q.outer * q.inner)
            and tr.manager is not None):
        tr.set(t, placement)
    return t


def _from_groups(tr: Tracker, t: torch.Tensor, q: Sharded, window: int, layout: tuple | None, path: str, dim: int):
    """An output of the module in the group layout moved back to the input's bands (the dry run: relabelled)."""
    if q != Sharded(dim, window, 1):
        raise conversion_error(path, "its output", f"it returns bands along {q.describe()}, not in the group layout its "
                      f"input had ({Sharded(dim, window, 1).describe()}), which cannot be moved back to its input's bands")
    with torch._C.DisableTorchFunction():
        if layout is None or isinstance(layout, _DryGroups):
            if layout is not None:
                moves_of, bands, groups = layout
                report_move(tr, path, "from_groups()", t, q.dim, groups, bands, lambda r: moves_of(r).inverse())
            y = t.view_as(t)
        else:
            from ...ops.group_rows import from_groups

            comm = tr.manager.domain_group
            y = from_groups(t, q.dim, window, layout, comm, f"{path}: back from the group layout",
                            transport=paths.current().transport(comm))
    tr.set(y, Sharded(q.dim))
    return y


module_rule(_enter)
