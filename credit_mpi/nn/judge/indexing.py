"""Indexing rules: selections along one dim, ``x[...]`` slices and writes, and ``F.pad`` of the field's edges.
"""

from __future__ import annotations

from typing import Any

import torch

from ...partition import normalize_dim
from ...transport import paths
from .field_sizes import band_axis, band_layout, field_indices, keep_bands, on_bands, select_rows
from .field_values import field_partner, split_joined
from .longitude import along_longitude
from .registry import Refusal, argument, op_name, rule
from .rows import circular_pad_longitude
from .tracker import Sharded


@rule("narrow", "select", "index_select", "gather", "take_along_dim", "chunk", "split", "tensor_split", "unbind",
       "split_with_sizes", "index_add", "scatter", "scatter_add", "index_copy", "index_fill")
def _indexed(tr, func, args, kwargs, held):
    """An op on one dim: passes when that dim is not the sharded one (``select``/``unbind`` remove it)."""
    op = op_name(func)
    x, p = args[0], tr.get(args[0])
    index = {"chunk": 2, "split": 2, "tensor_split": 2, "split_with_sizes": 2}.get(op, 1)
    dim = argument(args, kwargs, index, "dim", 0 if op in ("chunk", "split", "tensor_split", "unbind", "split_with_sizes") else None)
    if op == "unfold" and "dimension" in kwargs:
        dim = kwargs["dimension"]
    if op in ("split", "split_with_sizes") and p is not None and dim is not None and normalize_dim(int(dim), x.ndim) == p.dim:
        out = split_joined(tr, func, x, p, argument(args, kwargs, 1, "split_size_or_sections",
                                                     argument(args, kwargs, 1, "split_sizes")), p.dim, kwargs)
        if out is not None:  # replicated rows joined to a band, taken apart again (credit_mpi.nn.judge.field_values)
            return out
    if op == "narrow" and p is not None and dim is not None and normalize_dim(int(dim), x.ndim) == p.dim and \
            field_indices(tr) and isinstance(argument(args, kwargs, 2, "start"), int):
        start, length = int(argument(args, kwargs, 2, "start")), int(argument(args, kwargs, 3, "length"))
        rows = sum(band_layout(tr, x, p)) if start < 0 else 0
        local, after = select_rows(tr, x, p, slice(start + rows, start + rows + length), "narrow()")
        out = tr.run(torch.narrow, (x, p.dim, local.start, local.stop - local.start), {}, Sharded(p.dim))
        keep_bands(tr, out, Sharded(p.dim), after)
        return out
    if op == "take_along_dim":
        dim = argument(args, kwargs, 2, "dim")
    if op in ("index_select", "gather", "take_along_dim") and p is not None and dim is not None and \
            normalize_dim(int(dim), x.ndim) == p.dim and on_bands(tr):
        index = argument(args, kwargs, 2 if op != "take_along_dim" else 1, "index" if op != "take_along_dim" else "indices")
        if op != "index_select":
            index = _rows_of(tr, x, p, index, op)
        return take_rows(tr, x, p, index, f"{op}()")
    if p is None or dim is None or normalize_dim(int(dim), x.ndim) == p.dim:
        raise Refusal(f"it selects along the sharded dim (dim={dim}): a band's index is not the field's")
    if op in ("gather", "take_along_dim"):  # along another dim: the index must hold the band's rows (a band), or one row
        index = argument(args, kwargs, 2 if op == "gather" else 1, "index" if op == "gather" else "indices")
        q = tr.get(index)
        if isinstance(index, torch.Tensor) and (q != p if q is not None else (
                index.ndim == x.ndim and index.shape[p.dim] != 1)):
            raise Refusal(f"{op} along dim {dim} with an index that is not a band like its input (its rows along the "
                          f"sharded dim are not the band's): make the index from the band, or give it one row")
    d = normalize_dim(int(dim), x.ndim)
    shift = 1 if op in ("select", "unbind") and d < p.dim else 0
    return tr.run(func, args, kwargs, p.moved(p.dim - shift))


def index_values(tr, index: torch.Tensor, what: str) -> torch.Tensor:
    """``index`` with its values: itself, or in describe()'s dry run (the meta device) the host values of an index
    buffer or of an index the forward made from known values (``Tracker.seen_values``); Refusal when unseen."""
    if not index.is_meta:
        return index
    got = tr.seen_values.get(id(index))
    if got is None or got[0] is not index:
        raise Refusal(f"{what} indexes the sharded dim with a tensor whose values describe() cannot see (made from "
                      f"the band's values, or by an op the dry run does not repeat on the host): make the index from "
                      f"buffers, torch.arange or Python ints")
    return got[1]


def _rows_of(tr, x: torch.Tensor, p: Sharded, index: Any, op: str) -> torch.Tensor:
    """The 1-D field rows of a ``gather`` / ``take_along_dim`` index along the sharded dim that takes the same rows at
    every other position (an ``index_select`` expanded: ``idx.view(1, 1, -1, 1).expand_as(...)``), else Refusal."""
    if not isinstance(index, torch.Tensor) or tr.get(index) is not None:
        raise Refusal(f"{op} along the sharded dim with an index that is a band (the band's rows are not the field's)")
    index = index_values(tr, index, op)
    with torch._C.DisableTorchFunction():
        others = [k for k in range(x.ndim) if k != p.dim]
        if index.ndim != x.ndim or any(index.shape[k] != x.shape[k] for k in others):
            raise Refusal(f"{op} along the sharded dim with an index of shape {tuple(index.shape)}: a rule for an index of "
                          f"the input's other dims only (every position taking the same rows)")
        rows = index.movedim(p.dim, -1).reshape(-1, index.shape[p.dim])
        if rows.shape[0] and not bool((rows == rows[:1]).all()):
            raise Refusal(f"{op} along the sharded dim takes other rows at other positions: no rule on bands (an index "
                          f"that takes the same rows everywhere, index_select's, has one)")
        return rows[0] if rows.shape[0] else index.new_zeros((index.shape[p.dim],))


def take_rows(tr, x: torch.Tensor, p: Sharded, index: Any, what: str) -> torch.Tensor:
    """``x.index_select(p.dim, index)`` with ``index`` the field's rows (1-D ints; a 1-D bool mask of the field's rows).

    A sorted index: each band keeps its share of the selected rows (local, :func:`select_rows`). Out of order or
    repeated: a row move (the row map ``take_rows`` of :mod:`credit_mpi.ops.rows`; its agreement carries the index,
    so an index that differs between ranks is an error on every rank), each band's output as many rows as the
    index holds of its band. Refusal otherwise (a band as the index, another dtype, rows outside the field).
    """
    if not isinstance(index, torch.Tensor) or tr.get(index) is not None:
        raise Refusal(f"{what} indexes the sharded dim with a band (the band's rows are not the field's)")
    index = index_values(tr, index, what)
    sizes = band_layout(tr, x, p)
    total = p.outer * p.inner * sum(sizes)
    with torch._C.DisableTorchFunction():
        if index.dtype == torch.bool and index.ndim == 1:
            if index.shape[0] != total:
                raise Refusal(f"{what} masks the sharded dim with {index.shape[0]} entries where the field has {total}")
            index = index.nonzero().reshape(-1)
        if index.ndim != 1 or index.is_floating_point() or index.dtype == torch.bool or index.is_complex():
            raise Refusal(f"{what} indexes the sharded dim with a {index.dtype} tensor of {index.ndim} dims (a rule for "
                          f"a 1-D index of rows)")
        field = torch.where(index < 0, index + total, index)
        if index.numel() and (int(field.min()) < 0 or int(field.max()) >= total):
            raise Refusal(f"{what} indexes rows outside the field's {total}")
        ordered = field.numel() < 2 or bool((field[1:] >= field[:-1]).all())
        if ordered:  # each band keeps its share of the selected rows: no data moves
            local, after = select_rows(tr, x, p, field, what)
            out = x.index_select(p.dim, local.to(x.device))
    if ordered:
        tr.set(out, Sharded(p.dim))
        keep_bands(tr, out, Sharded(p.dim), after)
        return out
    if p.outer * p.inner != 1:
        raise Refusal(f"{what} takes rows out of order from a dim that holds the bands' rows merged with another "
                      f"({p.describe()})")
    rows = tuple(int(r) for r in field.tolist())
    from ...ops.rows import moves_of

    _, after, moves = moves_of("take_rows", tuple(sizes), tr.stack[-1][0], rows=rows)
    if tr.manager is None:  # the dry run: the field's own selection, the move reported
        from .rows import report_move

        report_move(tr, tr.stack[-1][0], "take_rows()", x, p.dim, tuple(sizes), after, moves)
        with torch._C.DisableTorchFunction():
            out = x.index_select(p.dim, field.to(x.device))
    else:
        from ...ops.rows import take_along

        comm = tr.manager.domain_group
        with torch._C.DisableTorchFunction():  # the move's own tensor calls are not the model's
            out = take_along(x, rows, p.dim, comm, tr.stack[-1][0], transport=paths.current().transport(comm))
    tr.set(out, Sharded(p.dim))
    keep_bands(tr, out, Sharded(p.dim), after)
    return out


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


def _rows_item(tr, x: torch.Tensor, p: Sharded, items: list, index: Any) -> torch.Tensor:
    """``x[..., idx, ...]`` with one 1-D index (ints, or a bool mask of the field's rows) at the sharded dim, slices
    elsewhere: the other dims' slices first, then the rows taken (:func:`take_rows`)."""
    with torch._C.DisableTorchFunction():
        index = torch.as_tensor(index, device=x.device) if isinstance(index, list) else index
        basic = tuple(slice(None) if d == p.dim else i for d, i in items)
        y = x[basic]  # slices of the other dims (and None: new dims), the sharded dim whole
    dim = sum(1 for d, i in items if d is not None and d < p.dim and not isinstance(i, int)) + \
        sum(1 for d, _ in items[:[d for d, _ in items].index(p.dim)] if d is None)
    q = Sharded(dim, 1, p.inner)
    tr.set(y, q)
    return take_rows(tr, y, q, index, "x[..., index]")


def _whole(item: Any) -> bool:
    return isinstance(item, slice) and item == slice(None)


@rule("__getitem__", "__setitem__")
def _getitem(tr, func, args, kwargs, held):
    """Indexing that keeps every row of the sharded dim (``x[:, :, :]``, ``x[:, 0]`` of another dim) passes."""
    x, index = args[0], args[1]
    p = tr.get(x)
    if p is None:
        raise Refusal("a band written into a tensor that is not one" if op_name(func) == "__setitem__" else "a band as an index")
    if op_name(func) == "__setitem__" and _whole_mask(x, index):  # x[mask] = v: a masked write of the band's rows
        return _masked_write(tr, func, args, kwargs, p)
    items = _index_dims(x, index)
    if op_name(func) == "__getitem__" and on_bands(tr) and p.outer == 1:
        at = [i for d, i in items if d == p.dim]
        rest = [i for d, i in items if d is not None and d != p.dim]
        if at and isinstance(at[0], (torch.Tensor, list)) and all(isinstance(i, slice) for i in rest):
            return _rows_item(tr, x, p, items, at[0])  # x[:, :, idx]: rows of the field taken by an index
    if any(isinstance(i, (torch.Tensor, list, tuple, bool)) for _, i in items):
        raise Refusal("advanced (tensor or mask) indexing of a band has no rule")
    out_dim, d_out, last, after = None, 0, -1, None
    for k, (d, item) in enumerate(items):
        if d is None:
            d_out += 1
            continue
        last = d
        if d == p.dim:
            if not _whole(item):
                if not (isinstance(item, slice) and field_indices(tr) and op_name(func) == "__getitem__"):
                    raise Refusal(f"it indexes the sharded dim with {item!r}: a row of the field that one band holds")
                local, after = select_rows(tr, x, p, item, f"x[{item.start}:{item.stop}]")  # the band's share
                items[k] = (d, local)
                args = (x, tuple(i for _, i in items), *args[2:])
            out_dim = d_out
        if not isinstance(item, int):
            d_out += 1
    if out_dim is None:  # the sharded dim comes after the last index item
        out_dim = d_out + (p.dim - last - 1)
    if op_name(func) == "__setitem__":
        value = args[2]
        if isinstance(value, torch.Tensor) and tr.get(value) is None and value.numel() > 1:
            vd = out_dim - (x.ndim - value.ndim)
            if vd >= 0 and value.shape[vd] != 1:
                raise Refusal("it writes a tensor that is not a band into a band's rows")
        return func(*args, **kwargs)
    if after is None:
        return tr.run(func, args, kwargs, p.moved(out_dim))
    out = tr.run(func, args, kwargs, Sharded(out_dim))  # the selected rows: a plain band
    keep_bands(tr, out, Sharded(out_dim), after)
    return out


def _whole_mask(x: torch.Tensor, index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.ndim == x.ndim


def _masked_write(tr, func, args, kwargs, p):
    """``x[mask] = v`` with a mask of ``x``'s dims: the band's mask (made from the band), or the field's cut to its rows.

    A value that is a tensor must be a scalar (one value for every selected element): the selected
    elements of a band are not the field's in order.
    """
    x, mask, value = args[0], args[1], args[2]
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise Refusal("it writes a tensor into the elements a mask selects (a band's selected elements are not the "
                      "field's in order): write a scalar, or use torch.where")
    q = tr.get(mask)
    if q is None and mask.shape[p.dim] != 1:
        mask = field_partner(tr, x, p, mask, p.dim)
    elif q is not None and q != p:
        raise Refusal(f"it writes through a mask whose bands are along {q.describe()}, into bands along {p.describe()}")
    return func(x, mask, value, *args[3:], **kwargs)


@rule("pad")
def _pad(tr, func, args, kwargs, held):
    """Padding of other dims passes; constant padding of the sharded dim pads the global edges only (first and last band)."""
    x, p = args[0], tr.get(args[0])
    pad = list(argument(args, kwargs, 1, "pad"))
    pair = x.ndim - 1 - p.dim
    if not (2 * pair + 1 < len(pad) and (pad[2 * pair] or pad[2 * pair + 1])):
        return tr.run(func, args, kwargs, p)
    before, after = pad[2 * pair], pad[2 * pair + 1]
    mode = argument(args, kwargs, 2, "mode", "constant")
    if mode == "circular" and along_longitude(tr) and min(before, after) >= 0 and p.outer * p.inner == 1:
        return circular_pad_longitude(tr, func, args, kwargs, p, pad, pair)  # the longitude is periodic: its halo
    if mode != "constant" or before < 0 or after < 0 or p.outer * p.inner != 1:
        raise Refusal(f"F.pad(mode={mode!r}) of the sharded dim by {[before, after]} has no rule (only constant padding "
                   f"of the field's edges: the rows next to a band are the neighbours')")
    rows = x.shape[p.dim]
    value = argument(args, kwargs, 3, "value", None)
    if not value:  # zeros: a convolution that takes it folds the rows in (Tracker._fold_edge_rows)
        others = [0 if i in (2 * pair, 2 * pair + 1) else v for i, v in enumerate(pad)]
        out = _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows)
        tr.record(out).edge_pad = (x, (before, after), others)
        return out
    return _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows)


def _padded(tr, func, args, kwargs, p, x, pad, pair, before, after, rows):
    """``F.pad`` of the sharded dim as a band: the field's edges only (the first band's top, the last band's bottom)."""
    if tr.manager is not None:  # the run: the first band pads the field's first edge, the last band its last
        band, _, of = band_axis(tr)
        if of is not None and not along_longitude(tr):
            raise Refusal("F.pad of the latitude has no rule on a latitude x longitude domain grid yet (the longitude's "
                          "edges have one)")
        last = tr.manager.domain_parallel_size - 1 if of is None or along_longitude(tr) else max(of)
        pad[2 * pair], pad[2 * pair + 1] = (int(before) if band == 0 else 0), (int(after) if band == last else 0)
        rest = [a for i, a in enumerate(args) if i > 1]
        return tr.run(func, (x, tuple(pad), *rest), {k: v for k, v in kwargs.items() if k != "pad"}, p)
    sizes = list(band_layout(tr, x, p)) if tr.band_sizes is not None else [rows]
    padded = [s + (before if i == 0 else 0) + (after if i == len(sizes) - 1 else 0) for i, s in enumerate(sizes)]
    out = tr.run(func, args, kwargs, p)
    if tr.adopt_layout is not None and not tr.adopt_layout(rows + before + after, padded):
        tr.keep_layout(out, padded)  # another layout than an earlier tensor of that height's (a join re-bands it)
    return out
