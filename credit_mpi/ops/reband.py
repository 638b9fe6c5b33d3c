"""Re-banding: a banded tensor moved to another band layout of the same dim (whole windows), differentiable.

Window attention on bands is local when every band holds whole windows. When
the bands do not line up with the windows (uneven bands, bands that are not
multiples of the window), the rows of a straddling window are moved to one
owner: :func:`whole_windows` rounds every band's end to the nearest multiple
of the window, :func:`reband` moves the rows there (and the way back is
``reband`` to the original sizes). Its adjoint is the move back of the
gradient.

The move itself is written once, :func:`move_rows`, for any map "output row
``j`` of the field is input row ``src(j)``" between two layouts of one dim:
every rank sends each other rank the rows of its band that rank's output
needs, in that rank's order (one ``alltoallv`` of the transport protocol,
:mod:`credit_mpi.transport.moves`: MPI, staged or CUDA-aware, or
torch.distributed; rows that stay are copied by the transport too), and
places what it receives. :mod:`credit_mpi.ops.roll` (the
cyclic shift) is the same move with another map. A permutation's adjoint is
its inverse: the same pairs of index lists with sends and receives swapped.

An op of :mod:`credit_mpi.engine`: every rank's rows along the dim travel in
the agreement (the ``count``), the target layout and the other dims are part
of what is agreed, so a bad input on one rank is the same exception on
every rank and every rank knows every band before data moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from ..engine import Op, run, run_planned
from ..layout import Layout
from ..partition import normalize_dim
from ..transport.moves import transport_name, transport_of
from ..validation import Local

__all__ = ["reband", "rebanded", "whole_windows", "move_rows", "plan_moves", "RowMoves", "check_float", "check_band",
           "transport_key", "join_layouts", "agree_rows", "one_layout", "join_moved", "join_agreements"]

_DTYPES = (torch.float32, torch.float64)


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


class RowMoves(NamedTuple):
    """One rank's side of a row move: what it sends to, and where it puts what it receives from, every rank."""

    send: tuple[np.ndarray, ...]  # per rank: this band's local input rows that rank's output needs, in its order
    recv: tuple[np.ndarray, ...]  # per rank: this band's local output rows that come from that rank, in order
    rows_in: int
    rows_out: int

    def sent_rows(self, rank: int) -> int:
        """Rows this band sends to other ranks (``rank``: this band's; what stays is copied, not sent)."""
        return sum(len(s) for d, s in enumerate(self.send) if d != rank)

    def inverse(self) -> RowMoves:
        """The move back (the adjoint of a permutation of rows): the same pairs, sends and receives swapped."""
        return RowMoves(self.recv, self.send, self.rows_out, self.rows_in)


def plan_moves(sizes_in: tuple[int, ...], sizes_out: tuple[int, ...], src: Callable[[np.ndarray], np.ndarray],
               rank: int) -> RowMoves:
    """``rank``'s :class:`RowMoves` for output row ``j`` (global, layout ``sizes_out``) = input row ``src(j)`` (layout ``sizes_in``)."""
    lay_in, lay_out = Layout.bands(sizes_in), Layout.bands(sizes_out)
    starts_in, starts_out = np.array(lay_in.starts()), np.array(lay_out.starts())
    j = np.arange(sum(sizes_out))
    s = np.asarray(src(j))
    own_in = np.searchsorted(starts_in, s, side="right") - 1  # the last of equal starts: empty bands own nothing
    own_out = np.searchsorted(starts_out, j, side="right") - 1
    n = len(sizes_in)
    mine_in, mine_out = own_in == rank, own_out == rank
    send = tuple(s[mine_in & (own_out == d)] - starts_in[rank] for d in range(n))
    recv = tuple(j[mine_out & (own_in == d)] - starts_out[rank] for d in range(n))
    return RowMoves(send, recv, sizes_in[rank], sizes_out[rank])


def move_rows(t: torch.Tensor, dim: int, moves: RowMoves, transfer: Any) -> torch.Tensor:
    """Apply ``moves`` to ``t`` along ``dim``: one ``alltoallv`` of the rows every rank needs on ``transfer`` (collective).

    ``transfer`` is a transport of :mod:`credit_mpi.transport.moves` (an
    ``MpiMoves`` or a ``TorchMoves``): the rows stay on ``t``'s device.
    """
    moved = t.detach().movedim(dim, 0)
    rest = tuple(moved.shape[1:])
    row_bytes = math.prod(rest) * t.element_size()
    send = moved[_index(moves.send, t.device)]  # a new contiguous tensor, in the receivers' order
    recv = torch.empty((sum(len(r) for r in moves.recv),) + rest, dtype=t.dtype, device=t.device)
    transfer.alltoallv(send, [len(s) * row_bytes for s in moves.send], recv, [len(r) * row_bytes for r in moves.recv])
    out = torch.empty((moves.rows_out,) + rest, dtype=t.dtype, device=t.device)
    out[_index(moves.recv, t.device)] = recv
    return out.movedim(0, dim)


def _index(parts: tuple[np.ndarray, ...], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(device)


class _Plan(NamedTuple):
    dim: int
    comm: MPI.Comm
    moves: RowMoves
    sizes_in: tuple[int, ...] = ()
    sizes_out: tuple[int, ...] = ()
    transfer: Any = None  # the transport the rows move on


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


def check_float(t: Any, path: str, verb: str, name: str = "") -> None:
    """The ops' tensor check: ``t`` a float32/float64 tensor, else the TypeError ``"<path>: <verb> float32/float64 tensors, got ..."``."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
        raise TypeError(f"{path}: {verb} float32/float64 tensors, got {name}{getattr(t, 'dtype', type(t).__name__)}")


def check_band(t: Any, args: dict, verb: str = "moves") -> tuple[int, tuple, str]:
    """The local check of an op along one dim: ``t`` a float tensor (:func:`check_float`), ``dim`` one of its
    dims, ``transport`` a transport; returns ``(axis, the other dims, the transport's name)`` (the last two agreed)."""
    check_float(t, args["path"], verb)
    transport = transport_name(args["transport"], args["path"])
    axis = normalize_dim(args["dim"], t.ndim)
    return axis, tuple(t.shape[:axis]) + tuple(t.shape[axis + 1 :]), transport


def transport_key(t: Any, args: dict, *static: Any) -> Any:
    """The cache key of the ops of a torch tensor over MPI (``static``: the arguments that decide the plan), else None."""
    transport = args["transport"]
    if not isinstance(t, torch.Tensor) or not (isinstance(transport, str) and transport == "mpi"):
        return None
    return (*static, tuple(t.shape), t.dtype)


class Reband(Op):
    """A band along ``dim`` moved to the layout ``sizes`` (or whole windows of ``window`` rows); adjoint: the move back."""

    name = "reband"

    def key(self, t: Any, args: dict) -> Any:
        return transport_key(t, args, args["path"], args["dim"], args["target"])

    def local(self, t: Any, args: dict) -> Local:
        axis, rest, transport = check_band(t, args)
        target = args["target"]
        if sum(v is not None for v in target) != 1:
            raise ValueError(f"{args['path']}: give the target layout as one of sizes=, window= or back=, got "
                             f"{dict(zip(('sizes', 'window', 'back'), target, strict=True))}")
        calls = (args["path"], axis, t.ndim, rest, str(t.dtype), target, transport)
        return Local(axis, calls, (), t.shape[axis])

    def plan(self, axis: int, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        counts = tuple(int(c) for c in counts)
        sizes = _target(counts, *args["target"], args["path"])
        if len(sizes) != len(counts) or sum(sizes) != sum(counts) or min(sizes) < 0:
            raise ValueError(f"{args['path']}: the target band sizes {list(sizes)} are not a layout of the "
                             f"{sum(counts)} rows of the bands {list(counts)} (one size >= 0 per rank, the same total)")
        moves = plan_moves(counts, sizes, lambda j: j, comm.Get_rank())
        return _Plan(axis, comm, moves, counts, sizes, transport_of(args["transport"], comm))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        if p.sizes_in == p.sizes_out:  # the same layout on every rank (agreed): nothing moves
            return t.detach().clone()
        return move_rows(t, p.dim, p.moves, p.transfer)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        if p.sizes_in == p.sizes_out:
            return grad
        return move_rows(grad, p.dim, p.moves.inverse(), p.transfer)


_OP = Reband()


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
    return run(_OP, t, comm, **_reband_args(dim, sizes, window, back, path, transport))


def _reband_args(dim: int, sizes: Any, window: Any, back: Any, path: str, transport: Any) -> dict:
    sizes = None if sizes is None else tuple(int(s) for s in sizes)
    back = None if back is None else (tuple(back[0]), tuple(back[1]))
    return {"dim": dim, "target": (sizes, window, back), "path": path, "transport": transport}


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def rebanded(t: torch.Tensor, dim: int, comm: MPI.Comm, window: int, path: str = "reband", *,
             transport: Any = "mpi") -> tuple:
    """:func:`reband` to whole windows; returns ``(band, sizes before, sizes after)`` (``back=`` takes the two layouts).

    The layouts are those of the agreed plan (:func:`credit_mpi.engine.run_planned`).
    """
    out, plan = run_planned(_OP, t, comm, **_reband_args(dim, None, window, None, path, transport))
    return out, plan.sizes_in, plan.sizes_out


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


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def agree_rows(rows: list[int], tensors: list[torch.Tensor], dim: int, comm: MPI.Comm, path: str,
               quiet: Any = None) -> list[tuple[int, ...]]:
    """Every rank's ``rows`` (a few row counts of this rank's bands), agreed with ``tensors``' other dims, dtypes,
    devices and autograd states (collective: :func:`join_agreements` ``(len(rows))`` fixed-size agreements).

    Up to :data:`JOIN_PER_AGREEMENT` counts travel in one agreement's count; a call seen before is one
    ``Allgather`` of the header per agreement (:func:`credit_mpi.agreement.agree_cached`). Returns, per
    count, every rank's value. ``quiet(counts)``: True when the caller makes no MPI call with these
    (agreed) counts; then a repeat inside a converted forward whose inputs are the last one's skips the
    agreements (:func:`credit_mpi.agreement.quiet_forward`).
    """
    from ..agreement import quiet_known, remember_quiet
    from ..engine import records_grad
    from ..validation import agree_cached

    described = tuple((tuple(t.shape[:dim]) + tuple(t.shape[dim + 1 :]), str(t.dtype), t.device.type, records_grad(t))
                      for t in tensors)
    whole = (path, dim, tuple(rows), described)
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
               path: str) -> torch.Tensor:
    """This rank's band of ``t`` (every rank's rows: ``counts``, agreed by :func:`join_layouts`) in the layout ``sizes``."""
    from ..engine import run_agreed

    return run_agreed(_OP, t, comm, list(counts), **_reband_args(dim, sizes, None, None, f"{path}: re-band to join",
                                                                 "mpi"))
