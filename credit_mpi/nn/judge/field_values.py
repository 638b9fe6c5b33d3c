"""Values of the whole field's size meeting a band: field-sized partners, and replicated rows joined to a band.

A model written for the whole field keeps tensors of the field's size along the sharded dim:

* a **field-sized partner** of an elementwise op: a positional embedding (a Parameter) added to the
  band, a latitude weight buffer multiplied in, coordinates made with ``torch.arange`` /
  ``linspace`` / ``meshgrid`` of the field's rows, a mask of the field's rows given to
  ``torch.where`` / ``masked_fill`` / ``x[mask] = v``. The band takes its own rows of it
  (:func:`field_partner`): the partner narrowed to ``[start, stop)``, the band's rows of the field
  (from every rank's rows, agreed once and then remembered while the inputs repeat:
  :func:`credit_mpi.ops.reband.agree_rows`, no MPI call of its own). A parameter's gradient lands
  on those rows, and ``reduce_gradients`` (a sum over the domain) adds the bands' rows: one
  process's gradient.
* **replicated rows joined to a band** along the sharded dim (coordinate attention: the band's
  rows pooled over the longitude, ``torch.cat``-ed with the longitude's columns pooled over the
  whole field, a 1x1 conv and a BatchNorm over both, then ``torch.split`` back). The join is a
  band of the joined field (:func:`join_replicated`): the replicated rows are owned by the
  last band (first, when they come first), so a layer after it (a BatchNorm's statistics) counts
  them once. The split back (:func:`split_joined`) gives the band's rows and the replicated
  rows, sent from their owner to every rank by one sum over the domain (its backward: the
  gradient of every rank, summed, to the owner).

Every decision before data moves depends on the model's structure and agreed row counts only (the
same on every rank), and describe()'s dry run takes it from every band's layout.
"""

from __future__ import annotations

from typing import Any

import torch

from ...transport import paths
from ..replicated import is_replicated, replicated
from .registry import Refusal
from .tracker import Sharded, Tracker, tracked_columns

__all__ = ["field_partner", "join_replicated", "split_joined"]


def _not_a_band(t: torch.Tensor, rows: int) -> str:
    what = "a replicated tensor (a global mean)" if is_replicated(t) else "a tensor that is not a band (a parameter or buffer, or one made in the forward)"
    return f"it combines a band with {what} of {rows} rows along the sharded dim"


def _agreed(tr: Tracker, band: torch.Tensor, dim: int, what: str) -> tuple[int, ...]:
    """Every rank's entries of ``band`` along ``dim`` (agreed; remembered while the forward's inputs repeat)."""
    from ...ops.reband import agree_rows

    with torch._C.DisableTorchFunction():  # the agreement's own tensor reads are not the model's
        counts = agree_rows([int(band.shape[dim])], [band], dim, tr.manager.domain_group,
                            f"{tr.stack[-1][0]}: {what}", quiet=lambda counts: True)[0]
    return tuple(int(c) for c in counts)


def _band_rows(tr: Tracker, band: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """``(start, stop, total)``: the band's entries along ``dim`` in the field's (every rank's rows agreed; the run)."""
    counts = _agreed(tr, band, dim, "a field-sized tensor")
    rank = tr.manager.domain_rank
    start = sum(counts[:rank])
    return start, start + counts[rank], sum(counts)


def field_partner(tr: Tracker, band: torch.Tensor, p: Sharded, partner: torch.Tensor, k: int) -> torch.Tensor:
    """``partner`` (not a band, ``partner.shape[k]`` entries along the band's dim ``p.dim``) cut to the band's rows.

    The partner holds the whole field's entries along the sharded dim (rows, or tokens: rows merged
    with the dims after them); the band's own are ``[start, stop)`` of them. Raises :class:`Refusal`
    when it is not the field's size (a tensor made from the band's own rows, another size), when the
    band's rows are merged with the batch (windows), and on a latitude x longitude domain grid.
    """
    rows = partner.shape[k]
    if p.outer != 1:
        raise Refusal(_not_a_band(partner, rows) + " while the band's rows are windows moved into the batch "
                      "(make it from the band, or give it one row along that dim)")
    if tracked_columns(tr) > 1:
        raise Refusal(_not_a_band(partner, rows) + " on a latitude x longitude domain grid (no rule yet)")
    if tr.manager is None:  # the dry run: the band is the whole field
        if rows != band.shape[p.dim]:
            raise Refusal(_not_a_band(partner, rows) + f" that is not the field's size ({band.shape[p.dim]}): "
                          "make it from the band, or give it one row along that dim, or the field's rows")
        return partner
    start, stop, total = _band_rows(tr, band, p.dim)
    if rows != total:  # agreed values and the model's shapes: the same on every rank
        raise Refusal(_not_a_band(partner, rows) + f" that is not the field's size ({total}): make it from the band, "
                      "or give it one row along that dim, or the field's rows")
    return partner.narrow(k, start, stop - start)


# -- replicated rows joined to a band along the sharded dim -------------------------------------------------


def _same_everywhere(t: torch.Tensor) -> bool:
    return is_replicated(t) or isinstance(t, torch.nn.Parameter)


def join_replicated(tr: Tracker, func, args: tuple, kwargs: dict, parts: list, places: list, dim: int) -> torch.Tensor:
    """``torch.cat`` along the sharded dim of one band and tensors every rank holds whole (before or after it).

    The joined field's rows: the field's band rows, then the replicated ones (or those first). As a
    band of it, the last rank holds the replicated rows after its band (the first rank before its
    own), the others their band: each row of the joined field is on one rank, so what follows counts
    it once (a BatchNorm's statistics, a sum). :func:`split_joined` takes them apart again.
    """
    bands = [i for i, q in enumerate(places) if q is not None]
    others = [i for i, q in enumerate(places) if q is None]
    if len(bands) != 1 or places[bands[0]] != Sharded(dim):
        raise Refusal("it joins along the sharded dim more than one band (or rows merged with another dim): no rule")
    b = bands[0]
    if not all(_same_everywhere(parts[i]) for i in others):
        raise Refusal("it joins along the sharded dim a band and a tensor that is not replicated (only rows every "
                      "rank holds whole, a global mean's, or a parameter's, join a band's)")
    if b not in (0, len(parts) - 1):
        raise Refusal("it joins replicated rows on both sides of a band along the sharded dim: no rule")
    if tracked_columns(tr) > 1:
        raise Refusal("it joins replicated rows to a band along the sharded dim on a latitude x longitude domain grid")
    at_end = b == 0
    extra = sum(int(parts[i].shape[dim]) for i in others)
    band = parts[b]
    if tr.manager is None:  # the dry run: the whole joined field; its layout: the band's, the extra rows on one band
        rows = int(band.shape[dim])
        own = tr.layout_of(band)
        sizes = list(own) if own is not None and sum(own) == rows else list(tr.band_sizes(rows))
        sizes[-1 if at_end else 0] += extra
        out = tr.run(func, args, kwargs, Sharded(dim))
        if tr.adopt_layout is None or not tr.adopt_layout(rows + extra, sizes):
            tr.keep_layout(out, sizes)
        tr.joins.append((rows + extra, extra, at_end, tuple(sizes)))
        return out
    rank, size = tr.manager.domain_rank, tr.manager.domain_parallel_size
    counts = _agreed(tr, band, dim, "cat()")  # every rank's rows (the split back checks its input against them)
    owner = (rank == size - 1) if at_end else (rank == 0)
    # every rank's graph the same (the backward's collectives in one order): the others join none of the rows
    with torch._C.DisableTorchFunction():
        plain = [t if i == b else (t.as_subclass(torch.Tensor) if is_replicated(t) else t).narrow(
            dim, 0, int(t.shape[dim]) if owner else 0) for i, t in enumerate(parts)]
    new_args = (plain, *args[1:]) if "tensors" not in kwargs else args
    new_kwargs = {**kwargs, "tensors": plain} if "tensors" in kwargs else kwargs
    out = tr.run(func, new_args, new_kwargs, Sharded(dim))
    tr.joins.append((sum(counts) + extra, extra, at_end, _joined_counts(counts, extra, at_end)))
    return out


def split_joined(tr: Tracker, func, x: torch.Tensor, p: Sharded, sizes: Any, dim: int, kwargs: dict) -> tuple | None:
    """``torch.split(y, [h, r], dim)`` of a band of a joined field (:func:`join_replicated`) back into its parts.

    The band's rows (a band again) and the ``r`` replicated rows (replicated on every rank: the
    owner's, summed over the domain with zeros from the others). Returns None when ``x`` is not
    such a band (the caller refuses).
    """
    if not tr.joins or p != Sharded(dim) or not isinstance(sizes, (list, tuple)) or len(sizes) != 2:
        return None
    height, extra, at_end, info = tr.joins[-1]  # the forward's last join (its structure: the same on every rank)
    if tr.manager is None:  # the dry run: the whole joined field, in the joined layout
        rows = int(x.shape[dim])
        layout = tr.layout_of(x)
        layout = list(layout) if layout is not None and sum(layout) == rows else list(tr.band_sizes(rows))
        if rows != height or tuple(layout) != info:
            raise Refusal(f"it splits along the sharded dim a band of {rows} rows (bands {layout}) where replicated rows "
                          f"were joined to a band of another layout ({list(info)}): no rule")
        owner = len(layout) - 1 if at_end else 0
        for r in range(len(layout)):  # each band's sizes as the run reads them (sizes read from a band: its own)
            mine = [int(v.bands[r]) if getattr(v, "bands", None) is not None else int(v) for v in sizes]
            _check_sizes(mine, at_end, extra, info[r] - (extra if r == owner else 0), rows - extra, r == owner)
        field = rows - extra
        band_part, rest = (x.narrow(dim, 0, field), x.narrow(dim, field, extra)) if at_end else \
            (x.narrow(dim, extra, field), x.narrow(dim, 0, extra))
        _report_split(tr, rest, dim, len(layout))
        layout[-1 if at_end else 0] -= extra
        tr.set(band_part, Sharded(dim))
        if tr.adopt_layout is None or not tr.adopt_layout(field, layout):
            tr.keep_layout(band_part, layout)
        rest = replicated(rest)
        return (band_part, rest) if at_end else (rest, band_part)
    from ...ops.allreduce import agree_domain_sum, domain_sum

    rank, size = tr.manager.domain_rank, tr.manager.domain_parallel_size
    owner = (rank == size - 1) if at_end else (rank == 0)
    counts = _agreed(tr, x, dim, "split()")
    if counts != info:  # agreed values: the same on every rank
        raise Refusal(f"it splits along the sharded dim bands of {list(counts)} rows where replicated rows were "
                      f"joined to bands of {list(info)} rows: no rule")
    mine = int(x.shape[dim]) - (extra if owner else 0)
    _check_sizes([int(v) for v in sizes], at_end, extra, mine, height - extra, owner)
    band_part = x.narrow(dim, 0, mine) if (at_end or not owner) else x.narrow(dim, extra, mine)
    # the owner's rows, zeros elsewhere; every rank's graph the same (the backward's collectives in one order)
    held = extra if owner else 0
    shape = list(x.shape)
    shape[dim] = extra - held
    rest = torch.cat([x.narrow(dim, mine if at_end else 0, held) if owner else x.narrow(dim, 0, 0), x.new_zeros(shape)], dim)
    grad = torch.is_grad_enabled() and x.requires_grad
    comm = tr.manager.domain_group
    plan = agree_domain_sum(tuple(rest.shape), rest.dtype, 0, grad, comm, tr.stack[-1][0],
                            transport=paths.current().transport(comm))  # the converted model's data path
    rest = replicated(domain_sum(rest.contiguous(), plan))
    tr.set(band_part, Sharded(dim))
    return (band_part, rest) if at_end else (rest, band_part)


def _check_sizes(sizes: list[int], at_end: bool, extra: int, band_rows: int, field_rows: int, owner: bool) -> None:
    """A band's split sizes of a joined field: the band's rows (its own, or the field's), then the replicated rows
    (their count; elsewhere than on their owner also 0: a size read from the band, ``y.shape[2] - h``)."""
    head, tail = (sizes[0], sizes[1]) if at_end else (sizes[1], sizes[0])
    if head not in (band_rows, field_rows) or tail not in ((extra,) if owner else (extra, 0)):
        raise Refusal(f"it splits along the sharded dim a band of a field joined with {extra} replicated rows into "
                      f"{sizes}, which are neither the band's rows nor the field's and the replicated ones")


def _joined_counts(counts: tuple, extra: int, at_end: bool) -> tuple:
    """Every rank's rows of the joined field: the band's, the ``extra`` replicated rows on the last (first) rank."""
    owner = len(counts) - 1 if at_end else 0
    return tuple(c + (extra if r == owner else 0) for r, c in enumerate(counts))


def _report_split(tr: Tracker, rest: torch.Tensor, dim: int, ranks: int) -> None:
    """The dry run: the replicated rows' sum over the domain as a row of describe()'s plan."""
    on_move = tr.on_move
    if on_move is None:
        return
    from ..traffic import domain_sum_traffic

    traffic = domain_sum_traffic(tuple(rest.shape), rest.dtype, ranks, rest.requires_grad and torch.is_grad_enabled())
    on_move(tr.stack[-1][0], "domain_sum() of split()", int(rest.shape[dim]), [1] * ranks, [1] * ranks, traffic)
