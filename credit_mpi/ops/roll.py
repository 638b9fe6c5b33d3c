"""The cyclic shift of a banded tensor along its banded dim (``torch.roll`` across bands), differentiable.

Shifted-window attention (Swin) rolls the field by half a window before the
window partition and back after. On bands, output row ``j`` of the field is
input row ``(j - shift) mod H``: a band's new rows come from one or more
other bands (a shift larger than a band: from several), which
:func:`credit_mpi.ops.reband.move_rows` moves in one ``alltoallv`` of the
transport (MPI, or torch.distributed with ``transport=TorchMoves(group)``). The
layout stays the same (even or uneven bands alike); the adjoint is the roll
back (the same moves, sends and receives swapped). Per rank the forward
sends the rows of its band that land on other bands (all of them once the
shift exceeds the band).

An op of :mod:`credit_mpi.engine`: every rank's rows travel in the
agreement, the shift and the other dims are agreed, so every rank knows every
band before data moves and a rank whose call differs makes every rank raise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from mpi4py import MPI

from ..engine import Op, run
from ..transport.moves import transport_of
from ..validation import Local
from .reband import RowMoves, check_band, move_rows, plan_moves, transport_key

__all__ = ["roll_along"]


class _Plan(NamedTuple):
    dim: int
    comm: MPI.Comm
    moves: RowMoves
    transfer: Any  # the transport the rows move on


class RollAlong(Op):
    """``torch.roll(t, shift, dim)`` of the whole field, each rank holding its band of ``dim``; adjoint: the roll back."""

    name = "roll_along"

    def key(self, t: Any, args: dict) -> Any:
        return transport_key(t, args, args["path"], args["dim"], repr(args["shift"]))

    def local(self, t: Any, args: dict) -> Local:
        axis, rest, transport = check_band(t, args)
        shift = args["shift"]
        if isinstance(shift, bool) or not isinstance(shift, int):
            raise TypeError(f"{args['path']}: shift must be an int, got {shift!r}")
        return Local(axis, (args["path"], axis, t.ndim, rest, str(t.dtype), args["shift"], transport), (), t.shape[axis])

    def plan(self, axis: int, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        sizes = tuple(int(c) for c in counts)
        total, shift = sum(sizes), args["shift"]
        moves = plan_moves(sizes, sizes, lambda j: (j - shift) % max(total, 1), comm.Get_rank())
        return _Plan(axis, comm, moves, transport_of(args["transport"], comm))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        return move_rows(t, p.dim, p.moves, p.transfer)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        return move_rows(grad, p.dim, p.moves.inverse(), p.transfer)


_OP = RollAlong()


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def roll_along(t: torch.Tensor, shift: int, dim: int, comm: MPI.Comm, path: str = "roll_along", *,
               transport: Any = "mpi") -> torch.Tensor:
    """This rank's band of ``torch.roll(field, shift, dim)``, the field banded along ``dim`` over ``comm`` (collective; differentiable).

    Args:
        t: This rank's band (float32 or float64); the other dims equal on every rank.
        shift: Rows to shift by (any int; negative: towards the first row), the same on every rank.
        dim: The banded dim.
        comm: The domain's communicator (bands in rank order).
        path: Named in errors.
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Raises:
        TypeError: ``t`` is not a float32/float64 tensor, or ``shift`` not an int (on every rank alike).
        ValueError: ``dim`` is not a dim of ``t``, ``transport`` not a transport; or the ranks' shifts, other
            dims, dtypes, transports or autograd states differ.
    """
    return run(_OP, t, comm, dim=dim, shift=shift, path=path, transport=transport)
