"""Re-banding: a banded tensor moved to another band layout of the same dim (whole windows), differentiable.

Window attention on bands is local when every band holds whole windows. When
the bands do not line up with the windows (uneven bands, bands that are not
multiples of the window), the rows of a straddling window are moved to one
owner: :func:`whole_windows` rounds every band's end to the nearest multiple
of the window, :func:`reband` moves the rows there (and the way back is
``reband`` to the original sizes). Its adjoint is the move back of the
gradient.

The move is the row map ``"reband"`` of :mod:`credit_mpi.ops.rows` (output
row ``j`` is input row ``j``, in another layout), run by its one op
:class:`~credit_mpi.ops.rows.MoveRows`: every rank's rows along the dim
travel in the agreement, the target layout and the other dims are part of
what is agreed, so a bad input on one rank is the same exception on every
rank and every rank knows every band before data moves; a target that is
the layout the band has moves nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from ..agreement import quiet_known, remember_quiet
from ..engine import records_grad, run_agreed
from ..partition import normalize_dim
from ..validation import Local
from .rows import MOVE_ROWS, move_along, moved_along, row_map

__all__ = ["reband", "rebanded", "whole_windows", "join_layouts", "agree_rows", "one_layout", "join_moved", "join_agreements"]


def whole_windows(sizes: list[int] | tuple[int, ...], window: int) -> tuple[int, ...]:
    """The band sizes whose ends are those of ``sizes`` rounded to the nearest multiple of ``window`` (ties up).

    The last band still ends at the field's end (a field that is not whole
    windows keeps its last, partial window on the last band). A band may be
    left with no rows (no window's middle lies in it).
    """
    if window < 1:
        raise ValueError(f"a window must hold at least one row, got {window}")
    total, ends, stop = sum(sizes), [], 0
    for size in sizes:
        stop += size
        ends.append(min(total, (2 * stop + window) // (2 * window) * window))
    ends[-1] = total
    return tuple(e - s for s, e in zip([0] + ends[:-1], ends, strict=True))


def _target(counts: tuple[int, ...], sizes: Any, window: Any, back: Any, path: str) -> tuple[int, ...]:
    """The target layout: ``sizes``; :func:`whole_windows` of ``counts``; or ``back = (moved, original)``.

    ``back``: the move back of a tensor whose bands are proportional to ``moved`` (a re-banded
    tensor, or one made from it at another resolution) to the same proportion of ``original``.
    """
    if sizes is not None:
        return tuple(sizes)
    if window is not None:
        return whole_windows(counts, window)
    moved, original = back
    total, unit = sum(counts), sum(moved)
    if len(moved) != len(counts) or any(c * unit != m * total for c, m in zip(counts, moved, strict=True)) or \
            any(o * total % max(unit, 1) for o in original):
        raise ValueError(f"{path}: the bands {list(counts)} are not those of the re-banded layout {list(moved)} at one "
                         f"resolution, so they cannot be moved back to the layout {list(original)} (the module changed "
                         f"the rows of its windows)")
    return tuple(o * total // max(unit, 1) for o in original)


def _check_target(path: str, target: tuple) -> None:
    if sum(v is not None for v in target) != 1:
        raise ValueError(f"{path}: give the target layout as one of sizes=, window= or back=, got "
                         f"{dict(zip(('sizes', 'window', 'back'), target, strict=True))}")


@row_map("reband", "re-banded to whole windows (ops.reband)", check=_check_target)
def _reband(counts: tuple[int, ...], path: str, target: tuple) -> tuple:
    """The same rows in the target layout (:func:`_target`): output row ``j`` is input row ``j``."""
    sizes = _target(counts, *target, path)
    if len(sizes) != len(counts) or sum(sizes) != sum(counts) or min(sizes) < 0:
        raise ValueError(f"{path}: the target band sizes {list(sizes)} are not a layout of the "
                         f"{sum(counts)} rows of the bands {list(counts)} (one size >= 0 per rank, the same total)")
    return counts, sizes, lambda j: j


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def reband(t: torch.Tensor, dim: int, comm: MPI.Comm, *, sizes: tuple[int, ...] | None = None,
           window: int | None = None, back: tuple | None = None, path: str = "reband",
           transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``t`` along ``dim`` in another layout of the same rows (collective; differentiable).

    Args:
        t: This rank's band (float32 or float64); the other dims equal on every rank.
        dim: The banded dim.
        comm: The domain's communicator (bands in rank order).
        sizes: The target layout (one size per rank, the same total), the same on every rank.
        window: Instead of ``sizes``: :func:`whole_windows` of the current layout (every rank's
            band ends on a multiple of ``window`` rows).
        back: Instead: ``(moved, original)``, the layouts of an earlier re-band (:func:`rebanded`);
            ``t``'s bands (proportional to ``moved``) go back to the same proportion of ``original``.
        path: Named in errors.
        transport: ``"mpi"`` (over ``comm``), or a transport object over the same ranks
            (:func:`credit_mpi.transport.moves.transport_name`), the same kind on every rank.

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``, the target is not a layout of the rows, not one of
            ``sizes``, ``window``, ``back`` given, ``transport`` not a transport, or the ranks' other dims,
            dtypes, targets, transports or autograd states differ.
    """
    return move_along(t, "reband", dim, comm, path, transport=transport, target=_target_of(sizes, window, back))


def _target_of(sizes: Any, window: Any, back: Any) -> tuple:
    sizes = None if sizes is None else tuple(int(s) for s in sizes)
    back = None if back is None else (tuple(back[0]), tuple(back[1]))
    return sizes, window, back


def rebanded(t: torch.Tensor, dim: int, comm: MPI.Comm, window: int, path: str = "reband", *,
             transport: Any = "mpi", quiet: Any = None) -> tuple:
    """:func:`reband` to whole windows; returns ``(band, sizes before, sizes after)`` (``back=`` takes the two layouts).

    The layouts are those of the agreed plan (:func:`credit_mpi.engine.run_planned`). ``quiet(before, after)``
    (as :func:`agree_rows`' ``quiet``): True when the caller makes no MPI call with these (agreed) layouts; then a
    repeat inside a converted forward whose inputs are the last one's skips the agreement and returns ``t`` itself
    (:func:`credit_mpi.agreement.quiet_forward`), answered here, eagerly, as :func:`agree_rows` answers its own.
    """
    if quiet is not None and not torch.compiler.is_compiling():
        known = quiet_known(comm, _windows_key(t, dim, window, path))
        if known is not None:
            return (t, *known[0])
    return _rebanded(t, dim, comm, window, path, transport, quiet)


def _windows_key(t: torch.Tensor, dim: int, window: int, path: str) -> tuple:
    """What decides :func:`rebanded`'s layouts on this rank: the key a quiet repeat is remembered by."""
    return path, "whole windows", dim, window, tuple(t.shape), str(t.dtype), t.device.type, records_grad(t)


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def _rebanded(t: torch.Tensor, dim: int, comm: MPI.Comm, window: int, path: str, transport: Any, quiet: Any) -> tuple:
    """:func:`rebanded` (its quiet repeats too, under torch.compile)."""
    key = _windows_key(t, dim, window, path)
    known = quiet_known(comm, key) if quiet is not None else None
    if known is not None:
        return (t, *known[0])
    out, before, after = moved_along(t, "reband", dim, comm, path, transport=transport,
                                     target=_target_of(None, window, None))
    if quiet is not None and quiet(before, after):
        remember_quiet(comm, key, (before, after))
    return out, before, after


# -- a join of bands (torch.cat / stack over another dim): the parts' layouts agreed, a differing part re-banded -----

JOIN_PER_AGREEMENT = 3  # parts whose rows travel in one agreement's count (21 bits each)
_JOIN_BITS = 63 // JOIN_PER_AGREEMENT
JOIN_MOST_ROWS = (1 << _JOIN_BITS) - 1


def join_agreements(parts: int) -> int:
    """The agreements a join of ``parts`` band parts makes (one per :data:`JOIN_PER_AGREEMENT` parts)."""
    return -(-parts // JOIN_PER_AGREEMENT)


def join_layouts(parts: list[torch.Tensor], dim: int, comm: MPI.Comm, path: str) -> list[tuple[int, ...]]:
    """Every rank's rows of every part along ``dim`` (collective: :func:`join_agreements` fixed-size agreements).

    The join's own agreement: it covers what the re-bands after it need (every part's other dims,
    dtype, device and autograd state equal on every rank), so those run on it
    (:func:`credit_mpi.engine.run_agreed`) with no agreement of their own.
    """
    dim = normalize_dim(dim, parts[0].ndim)
    return agree_rows([int(t.shape[dim]) for t in parts], parts, dim, comm, path, quiet=one_layout)


def one_layout(counts: list[tuple[int, ...]]) -> bool:
    """True when every part has one layout (every rank's rows the same in each): the join moves nothing."""
    return all(c == counts[0] for c in counts)


def _rows_key(rows: list[int], tensors: list[torch.Tensor], dim: int, path: str) -> tuple:
    """What decides :func:`agree_rows`' answer on this rank: the key a quiet repeat is remembered by."""
    described = tuple((tuple(t.shape[:dim]) + tuple(t.shape[dim + 1 :]), str(t.dtype), t.device.type, records_grad(t))
                      for t in tensors)
    return path, dim, tuple(rows), described


def agree_rows(rows: list[int], tensors: list[torch.Tensor], dim: int, comm: MPI.Comm, path: str,
               quiet: Any = None) -> list[tuple[int, ...]]:
    """Every rank's ``rows`` (a few row counts of this rank's bands), agreed with ``tensors``' other dims, dtypes,
    devices and autograd states (collective: :func:`join_agreements` ``(len(rows))`` fixed-size agreements).

    Up to :data:`JOIN_PER_AGREEMENT` counts travel in one agreement's count; a call seen before is one
    ``Allgather`` of the header per agreement (:func:`credit_mpi.agreement.agree_cached`). Returns, per
    count, every rank's value. ``quiet(counts)``: True when the caller makes no MPI call with these
    (agreed) counts; then a repeat inside a converted forward whose inputs are the last one's skips the
    agreements (:func:`credit_mpi.agreement.quiet_forward`): answered here, eagerly, without the graph
    break's wrapper (a WXFormer forward makes ~110 such repeats, 23 us each through the wrapper).
    """
    if quiet is not None and not torch.compiler.is_compiling():
        known = quiet_known(comm, _rows_key(rows, tensors, dim, path))
        if known is not None:
            return known[0]
    return _agreed_rows(rows, tensors, dim, comm, path, quiet)


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def _agreed_rows(rows: list[int], tensors: list[torch.Tensor], dim: int, comm: MPI.Comm, path: str,
                 quiet: Any) -> list[tuple[int, ...]]:
    """:func:`agree_rows` (its quiet repeats too, under torch.compile)."""
    from ..validation import agree_cached  # looked up per call (tests count the agreements)

    whole = _rows_key(rows, tensors, dim, path)
    described = whole[3]
    known = quiet_known(comm, whole) if quiet is not None else None
    if known is not None:
        return known[0]
    out: list[tuple[int, ...]] = []
    for first in range(0, len(rows), JOIN_PER_AGREEMENT):
        group = [int(r) for r in rows[first : first + JOIN_PER_AGREEMENT]]

        def local(group=group, first=first) -> Local:
            if max(group) > JOIN_MOST_ROWS or min(group) < 0:
                raise ValueError(f"{path}: a band of {max(group)} rows (at most {JOIN_MOST_ROWS})")
            count = sum(r << (_JOIN_BITS * i) for i, r in enumerate(group))
            return Local(None, (path, "rows", dim, len(rows), first, described), (), count)

        def finish(plan: Any, counts: list[int], group=group) -> tuple:
            return tuple(tuple((int(c) >> (_JOIN_BITS * i)) & JOIN_MOST_ROWS for c in counts) for i in range(len(group)))

        out += agree_cached(comm, "layer", (path, dim, first, tuple(group), described), local, finish)
    if quiet is not None and quiet(out):
        remember_quiet(comm, whole, out)
    return out


def join_moved(t: torch.Tensor, dim: int, comm: MPI.Comm, counts: tuple[int, ...], sizes: tuple[int, ...],
               path: str, transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``t`` (every rank's rows: ``counts``, agreed by :func:`join_layouts`) in the layout ``sizes``
    (``transport``: what the rows move on, as :func:`reband`'s; the same on every rank: a converted model's data path)."""
    return run_agreed(MOVE_ROWS, t, comm, list(counts), dim=dim, map="reband",
                      params=(("target", _target_of(sizes, None, None)),), path=f"{path}: re-band to join", transport=transport)
