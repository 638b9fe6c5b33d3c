"""Row moves: a banded tensor's rows moved along its banded dim by a named row map, one op, differentiable.

A row move is a map "output row ``j`` of the field is input row ``src(j)``"
between two band layouts of one dim. Every move of the model side is one:
the cyclic shift (``torch.roll`` across bands), the reversal
(``torch.flip`` along the banded dim), the re-band to whole windows and back
(:mod:`credit_mpi.ops.reband`), the group layout of long attention and back
(:mod:`credit_mpi.ops.group_rows`). Each is a named :class:`RowMap`
(registered with :func:`row_map`, next to its siblings): from every rank's
agreed rows it gives the two layouts and ``src``, plus the note describe()
shows on its plan row. One op, :class:`MoveRows`, runs them all:

* its agreement carries every rank's rows along the dim (the count), the
  map's name and parameters, the other dims, dtype, transport and autograd
  state, so a bad or differing argument on one rank is the same exception on
  every rank before data moves;
* its plan is :func:`plan_moves` of the map: per rank the rows of its band
  each other rank's output needs, in that rank's order;
* its kernel is :func:`move_rows`: one ``alltoallv`` of the transport
  (:mod:`credit_mpi.transport.moves`: MPI, staged or CUDA-aware, or
  torch.distributed), rows that stay copied by the transport too; a map that
  is the identity on the agreed layout moves nothing (a copy);
* its adjoint is the move back (a permutation's adjoint is its inverse: the
  same pairs of index lists, sends and receives swapped).

describe()'s dry run plans the same map (:func:`moves_of`) for its row and
traffic (:func:`credit_mpi.nn.traffic.move_traffic`); the note is the map's
:attr:`RowMap.label`.

Adding a move is a function of the agreed rows and the map's parameters,
decorated with :func:`row_map`, and a one-line public function.
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
from ..transport.moves import transport_of
from ..validation import Local
from .along import check_band, transport_key

__all__ = ["RowMap", "RowMoves", "ROW_MAPS", "row_map", "plan_moves", "move_rows", "moves_of", "move_along",
           "moved_along", "roll_along", "flip_along", "take_along"]


class RowMoves(NamedTuple):
    """One rank's side of a row move: what it sends to, and where it puts what it receives from, every rank."""

    send: tuple[np.ndarray, ...]  # per rank: this band's local input rows that rank's output needs, in its order
    recv: tuple[np.ndarray, ...]  # per rank: this band's local output rows that come from that rank, in order
    rows_in: int
    rows_out: int
    send_repeats: bool = False  # a row sent more than once (a map that repeats rows: ``take_rows`` of a repeated index)
    recv_repeats: bool = False  # a row received more than once (the adjoint of such a map: the gradients are added)

    def sent_rows(self, rank: int) -> int:
        """Rows this band sends to other ranks (``rank``: this band's; what stays is copied, not sent)."""
        return sum(len(s) for d, s in enumerate(self.send) if d != rank)

    def inverse(self) -> RowMoves:
        """The move back (the adjoint of a permutation of rows): the same pairs, sends and receives swapped."""
        return RowMoves(self.recv, self.send, self.rows_out, self.rows_in, self.recv_repeats, self.send_repeats)


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
    mine = s[mine_in]
    repeats = len(np.unique(mine)) != len(mine)  # a map that repeats rows: the adjoint adds their gradients
    return RowMoves(send, recv, sizes_in[rank], sizes_out[rank], repeats)


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
    if moves.recv_repeats:  # the adjoint of a map that repeats rows: each row's gradients added
        out = torch.zeros((moves.rows_out,) + rest, dtype=t.dtype, device=t.device)
        out.index_add_(0, _index(moves.recv, t.device), recv)
        return out.movedim(0, dim)
    whole = sum(len(r) for r in moves.recv) == moves.rows_out  # else rows no input row maps to (an adjoint): zeros
    out = (torch.empty if whole else torch.zeros)((moves.rows_out,) + rest, dtype=t.dtype, device=t.device)
    out[_index(moves.recv, t.device)] = recv
    return out.movedim(0, dim)


def _index(parts: tuple[np.ndarray, ...], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(device)


# -- the named row maps ---------------------------------------------------------------------------------------------

#: ``(sizes_in, sizes_out, src)`` of a map, from every rank's agreed rows (raise ValueError: every rank raises it)
Layouts = tuple[tuple[int, ...], tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


class RowMap(NamedTuple):
    """A named row move: its layouts and source rows, its local check, what describe() says of it."""

    name: str  # the agreement's and the plan row's name ("roll_along": the row "roll_along()")
    label: str  # describe()'s note on its plan row
    layouts: Callable[..., Layouts]  # layouts(counts, path, **params)
    check: Callable[..., None]  # check(path, **params): the local check of the parameters (before the agreement)


#: name -> :class:`RowMap` (every move of :mod:`credit_mpi.ops`; filled by :func:`row_map`)
ROW_MAPS: dict[str, RowMap] = {}


def _no_check(path: str, **params: Any) -> None:
    """A map whose parameters need no local check."""


def row_map(name: str, label: str, check: Callable[..., None] = _no_check):
    """Register ``layouts(counts, path, **params) -> (sizes_in, sizes_out, src)`` as the row map ``name``.

    ``counts`` are every rank's agreed rows along the dim; ``src(j)`` the input row (global) of
    output row ``j``; ``check(path, **params)`` raises TypeError/ValueError for a bad parameter on
    this rank (every rank raises it: the agreement shares it). Raises ValueError for a name taken.
    """
    def register(layouts: Callable[..., Layouts]) -> Callable[..., Layouts]:
        if name in ROW_MAPS:
            raise ValueError(f"the row map {name!r} is registered already ({ROW_MAPS[name].layouts.__qualname__})")
        ROW_MAPS[name] = RowMap(name, label, layouts, check)
        return layouts

    return register


def _check_int(path: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{path}: {name} must be an int, got {value!r}")


@row_map("roll_along", "the field's cyclic shift across bands (ops.rows)",
         check=lambda path, shift: _check_int(path, "shift", shift))
def _roll(counts: tuple[int, ...], path: str, shift: int) -> Layouts:
    """``torch.roll(field, shift)``: output row ``j`` is input row ``(j - shift) mod H``; the layout stays."""
    total = max(sum(counts), 1)
    return counts, counts, lambda j: (j - shift) % total


@row_map("flip_along", "the field's rows reversed across bands (ops.rows)")
def _flip(counts: tuple[int, ...], path: str) -> Layouts:
    """``torch.flip(field)``: output row ``j`` is input row ``H - 1 - j``; the layout stays."""
    last = sum(counts) - 1
    return counts, counts, lambda j: last - j


def _check_pads(path: str, before: int, after: int) -> None:
    for name, value in (("before", before), ("after", after)):
        _check_int(path, name, value)
        if value < 0:
            raise ValueError(f"{path}: a circular pad of {name}={value} rows; give rows >= 0")


@row_map("circular_halo_along", "the rows a circular pad of the field adds: the first band's from the last rows, "
         "the last band's from the first rows (ops.rows)", check=_check_pads)
def _circular_halo(counts: tuple[int, ...], path: str, before: int, after: int) -> Layouts:
    """The rows ``F.pad(field, (before, after), mode="circular")`` adds along the dim, alone: the first band receives
    the field's last ``before`` rows, the last band its first ``after`` rows, the others none (each input row
    goes to at most one band, so the adjoint is the move back; the caller joins them to its band)."""
    total = sum(counts)
    if before + after > total:
        raise ValueError(f"{path}: a circular pad of {before} + {after} rows of a field of {total} rows (each row "
                         f"padded once at most)")
    out = [0] * len(counts)
    out[0] += before
    out[-1] += after
    return counts, tuple(out), lambda j: np.where(j < before, total - before + j, j - before)


def _check_rows(path: str, rows: tuple) -> None:
    if not isinstance(rows, tuple) or any(isinstance(r, bool) or not isinstance(r, int) for r in rows):
        raise TypeError(f"{path}: rows must be a tuple of ints (the field's rows to take), got {rows!r}")


@row_map("take_rows", "the field's rows an index takes, moved across bands; each band keeps as many rows as it "
         "holds of the index (ops.rows)", check=_check_rows)
def _take(counts: tuple[int, ...], path: str, rows: tuple) -> Layouts:
    """``field.index_select(dim, rows)``: output row ``j`` is input row ``rows[j]`` (out of order, repeated); the
    output's band ``r`` has as many rows as ``rows`` holds of band ``r``'s (a sorted index: every row stays)."""
    total = sum(counts)
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= total):
        raise ValueError(f"{path}: rows {int(idx.min())}..{int(idx.max())} of a field of {total} rows; give rows in "
                         f"[0, {total})")
    starts = np.array(Layout.bands(counts).starts())
    owner = np.searchsorted(starts, idx, side="right") - 1
    out = tuple(int((owner == r).sum()) for r in range(len(counts)))
    return counts, out, lambda j: idx[j]


def moves_of(name: str, counts: tuple[int, ...], path: str = "", **params: Any) -> tuple[tuple, tuple, Callable]:
    """``(sizes_in, sizes_out, rank -> RowMoves)`` of the map ``name`` on the layout ``counts`` (no MPI: describe()'s plan)."""
    sizes_in, sizes_out, src = ROW_MAPS[name].layouts(tuple(int(c) for c in counts), path or name, **params)
    return sizes_in, sizes_out, lambda rank: plan_moves(sizes_in, sizes_out, src, rank)


# -- the op ---------------------------------------------------------------------------------------------------------


class _Plan(NamedTuple):
    dim: int
    comm: MPI.Comm
    moves: RowMoves
    sizes_in: tuple[int, ...]
    sizes_out: tuple[int, ...]
    transfer: Any  # the transport the rows move on
    identity: bool  # the map moves no row on this layout (every rank alike: decided from the agreed rows)


def _is_identity(sizes_in: tuple, sizes_out: tuple, src: Callable) -> bool:
    j = np.arange(sum(sizes_out))
    return sizes_in == sizes_out and bool(np.array_equal(np.asarray(src(j)), j))


class MoveRows(Op):
    """A band along ``dim`` moved by the row map ``map`` (its ``params``); adjoint: the move back."""

    name = "move_rows"

    def key(self, t: Any, args: dict) -> Any:
        # repr: a parameter of another type that compares equal (a window of 3.0) is another call (the check raises)
        return transport_key(t, args, args["path"], args["dim"], args["map"], repr(args["params"]))

    def local(self, t: Any, args: dict) -> Local:
        axis, rest, transport = check_band(t, args)
        name, params = args["map"], args["params"]
        if name not in ROW_MAPS:
            raise ValueError(f"{args['path']}: no row map {name!r}; registered: {sorted(ROW_MAPS)}")
        ROW_MAPS[name].check(args["path"], **dict(params))
        calls = (args["path"], axis, t.ndim, rest, str(t.dtype), name, repr(params), transport)
        return Local(axis, calls, (), t.shape[axis])

    def plan(self, axis: int, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        counts = tuple(int(c) for c in counts)
        sizes_in, sizes_out, src = ROW_MAPS[args["map"]].layouts(counts, args["path"], **dict(args["params"]))
        moves = plan_moves(sizes_in, sizes_out, src, comm.Get_rank())
        return _Plan(axis, comm, moves, sizes_in, sizes_out, transport_of(args["transport"], comm),
                     _is_identity(sizes_in, sizes_out, src))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        if p.identity:  # nothing moves on any rank (agreed): a copy, as the move would give
            return t.detach().clone()
        return move_rows(t, p.dim, p.moves, p.transfer)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        if p.identity:
            return grad
        return move_rows(grad, p.dim, p.moves.inverse(), p.transfer)


MOVE_ROWS = MoveRows()


def _args(name: str, dim: int, path: str, transport: Any, params: dict) -> dict:
    return {"dim": dim, "map": name, "params": tuple(sorted(params.items())), "path": path or name,
            "transport": transport}


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def move_along(t: torch.Tensor, name: str, dim: int, comm: MPI.Comm, path: str = "", *, transport: Any = "mpi",
               **params: Any) -> torch.Tensor:
    """This rank's band of the field moved by the row map ``name`` along ``dim`` (collective; differentiable).

    Args:
        t: This rank's band (float32 or float64); the other dims equal on every rank.
        name: A registered row map (:data:`ROW_MAPS`).
        dim: The banded dim.
        comm: The domain's communicator (bands in rank order).
        path: Named in errors (default: the map's name).
        transport: ``"mpi"`` (over ``comm``), or a transport object over the same ranks
            (:func:`credit_mpi.transport.moves.transport_name`), the same kind on every rank.
        params: The map's parameters (hashable), the same on every rank.

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor, or a parameter of the wrong type (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``, ``name`` no row map, the map refuses the layout, or the
            ranks' parameters, other dims, dtypes, transports or autograd states differ.
    """
    return run(MOVE_ROWS, t, comm, **_args(name, dim, path, transport, params))


@torch.compiler.disable(recursive=True)
def moved_along(t: torch.Tensor, name: str, dim: int, comm: MPI.Comm, path: str = "", *, transport: Any = "mpi",
                **params: Any) -> tuple:
    """:func:`move_along`, returning ``(band, sizes before, sizes after)``: the layouts of the agreed plan."""
    out, plan = run_planned(MOVE_ROWS, t, comm, **_args(name, dim, path, transport, params))
    return out, plan.sizes_in, plan.sizes_out


def roll_along(t: torch.Tensor, shift: int, dim: int, comm: MPI.Comm, path: str = "roll_along", *,
               transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``torch.roll(field, shift, dim)``, the field banded along ``dim`` over ``comm`` (collective;
    differentiable): a band's new rows come from one or more other bands (Swin's shifted windows); the layout stays.

    Raises:
        TypeError: ``shift`` not an int; otherwise as :func:`move_along`.
    """
    return move_along(t, "roll_along", dim, comm, path, transport=transport, shift=shift)


def flip_along(t: torch.Tensor, dim: int, comm: MPI.Comm, path: str = "flip_along", *,
               transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``torch.flip(field, (dim,))`` (collective; differentiable); the layout stays.

    Raises:
        As :func:`move_along`.
    """
    return move_along(t, "flip_along", dim, comm, path, transport=transport)


def take_along(t: torch.Tensor, rows: tuple, dim: int, comm: MPI.Comm, path: str = "take_along", *,
               transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``field.index_select(dim, rows)`` (collective; differentiable): the rows an index takes out of
    order or repeated, each band's output as many rows as the index holds of its band; a repeated row's gradients
    are added.

    Raises:
        TypeError: ``rows`` not a tuple of ints; ValueError: a row outside the field; otherwise as :func:`move_along`.
    """
    return move_along(t, "take_rows", dim, comm, path, transport=transport, rows=rows)
