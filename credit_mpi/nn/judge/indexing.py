"""Indexing rules: selections along one dim, ``x[...]`` slices and writes, and ``F.pad`` of the field's edges.
"""

from __future__ import annotations

from typing import Any

import torch

from ...partition import normalize_dim
from .field_sizes import band_axis, band_layout, field_indices, keep_bands, select_rows
from .field_values import field_partner, split_joined
from .longitude import along_longitude
from .registry import Refusal, argument, op_name, rule
from .rows import circular_pad_longitude
from .tracker import Sharded


@rule("narrow", "select", "index_select", "gather", "chunk", "split", "tensor_split", "unbind",
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
    if p is None or dim is None or normalize_dim(int(dim), x.ndim) == p.dim:
        raise Refusal(f"it selects along the sharded dim (dim={dim}): a band's index is not the field's")
    d = normalize_dim(int(dim), x.ndim)
    shift = 1 if op in ("select", "unbind") and d < p.dim else 0
    return tr.run(func, args, kwargs, p.moved(p.dim - shift))


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
