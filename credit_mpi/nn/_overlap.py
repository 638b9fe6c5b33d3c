"""A converted convolution's halo, overlapped with its interior rows (issue 26, item 1).

:func:`overlapped_conv` starts the exchange of the edge rows (posted on the
transport protocol's moves object of the converted forward's data path,
:func:`credit_mpi.transport.paths.current`: :class:`~credit_mpi.transport.moves.MpiMoves`
over the domain group, or the mirrored torch group), convolves the output rows whose window lies in the band
(they need no neighbour), then waits for the halo rows and convolves the few
edge rows; the result is the non-overlapped layer's, row for row. Its
backward (:class:`_HaloRows`) sends the halo rows' gradients home with the
halo exchange's edge swap (:func:`~credit_mpi.transport.moves.swap_edges`).
The layer's agreement has already settled every band's rows, the layer and
the autograd state (see ``conv.py``): the messages are decided by agreed
values only. Host (CPU) tensors, ``"zero"`` and ``"periodic"`` boundaries;
anything else takes the plain path.

MPICH (and Open MPI without a progress thread) moves a message larger than
its eager limit only inside an MPI call, so the overlap is real for small
halos and partial for large ones: see docs/performance.rst.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable

from ..autograd import check_backward_thread
from ..transport import paths
from ..transport.moves import RECV, SEND, swap_edges
from ._comm import _eager

# a tag per direction: on 2 periodic bands prev and next are one rank, whose two messages must not swap
_UP, _DOWN, _GRAD_UP, _GRAD_DOWN = 2601, 2602, 2603, 2604


class _Pending:
    """An exchange under way (:meth:`MpiMoves.post <credit_mpi.transport.moves.MpiMoves.post>` or a torch
    transport's ``post``): this band's edge rows sent, the neighbours' being received (zeros where there is none).

    The messages go in :func:`~credit_mpi.transport.moves.swap_edges`' order (the same on every rank: a
    transport that matches messages in issue order, NCCL, pairs them on two periodic bands too).
    """

    def __init__(self, x: torch.Tensor, axis: int, width: int, comm: MPI.Comm, prev: int | None, nxt: int | None,
                 moves: Any):
        self.shape = list(x.shape)
        self.shape[axis] = width
        self.axis, self.width, self.comm, self.prev, self.next, self.moves = axis, width, comm, prev, nxt, moves
        rows = x.shape[axis]
        self.top = torch.zeros(self.shape, dtype=x.dtype)
        self.bottom = torch.zeros(self.shape, dtype=x.dtype)
        self.sent = [x.detach().narrow(axis, 0, width).contiguous(), x.detach().narrow(axis, rows - width, width).contiguous()]
        ops = []
        if prev is not None:
            ops.append((SEND, self.sent[0], prev, _UP))
        if nxt is not None:
            ops += [(RECV, self.bottom, nxt, _UP), (SEND, self.sent[1], nxt, _DOWN)]
        if prev is not None:
            ops.append((RECV, self.top, prev, _DOWN))
        self.posted = moves.post(ops)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.posted.wait()
        return self.top, self.bottom


class _HaloRows(torch.autograd.Function):
    """The neighbours' edge rows of ``x`` (from a :class:`_Pending`); backward: their gradients sent home.

    ``interior`` passes through (the layer's output always uses it): the
    backward then runs on every rank, also on one whose edge rows feed no
    output row (its neighbours wait for its halo gradients, zeros).
    """

    @staticmethod
    def forward(ctx, x, pending, interior):
        ctx.pending, ctx.rows = pending, x.shape[pending.axis]
        return (*pending.finish(), interior.view_as(interior))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_top, g_bottom, g_interior):
        check_backward_thread()
        p = ctx.pending
        # my top halo is prev's last rows: its gradient goes back to prev; prev's bottom one is my first rows'
        from_next, from_prev = swap_edges(p.moves, g_top.contiguous() if p.prev is not None else None,
                                          g_bottom.contiguous() if p.next is not None else None, p.prev, p.next,
                                          tags=(_GRAD_UP, _GRAD_DOWN))
        shape = list(p.shape)
        shape[p.axis] = ctx.rows
        grad = torch.zeros(shape, dtype=g_top.dtype)
        if from_prev is not None:
            grad.narrow(p.axis, 0, p.width).add_(from_prev)
        if from_next is not None:
            grad.narrow(p.axis, ctx.rows - p.width, p.width).add_(from_next)
        return grad, None, g_interior


def split(first: int, width: int, rows: int, n_out: int, stride: int, span: int) -> tuple[int, int] | None:
    """``(j_lo, j_hi)``: the output rows whose window needs no halo row, or None when the split does not pay.

    The window of output ``j`` is rows ``[first + j*stride, first + j*stride + span)`` of the band padded
    with ``width`` rows on each side (the band's own rows: ``[width, width + rows)``).
    """
    j_lo = max(0, -(-(width - first) // stride))
    j_hi = min(n_out, (width + rows - span - first) // stride + 1)
    return (j_lo, j_hi) if j_hi > j_lo else None


@_eager
def overlapped_conv(x: torch.Tensor, conv: Callable[[torch.Tensor], torch.Tensor], axis: int, width: int, first: int,
                    n_out: int, stride: int, span: int, comm: MPI.Comm, neighbours: tuple[Any, Any],
                    parts: tuple[int, int]) -> torch.Tensor:
    """``conv`` of the band padded with ``width`` halo rows, rows ``first...`` on: the interior while the halo travels.

    ``conv`` runs with no padding along ``axis`` and the layer's stride;
    ``parts`` is :func:`split`'s ``(j_lo, j_hi)``. Collective over ``comm``.
    """
    rows = x.shape[axis]
    j_lo, j_hi = parts
    pending = _Pending(x, axis, width, comm, *neighbours, paths.current().moves(comm))
    start = first + j_lo * stride - width  # the band's row of the interior's first window
    interior = conv(x.narrow(axis, start, (j_hi - 1 - j_lo) * stride + span))
    if torch.is_grad_enabled() and x.requires_grad:  # agreed by the layer: every rank's backward sends, or none
        top, bottom, interior = _HaloRows.apply(x, pending, interior)
    else:
        top, bottom = pending.finish()
    out = []
    if j_lo:
        stop = first + (j_lo - 1) * stride + span  # the end of the last top window, in padded rows
        src = torch.cat([top, x.narrow(axis, 0, stop - width)], axis) if stop > width else top
        out.append(conv(src.narrow(axis, first, stop - first)))
    out.append(interior)
    if j_hi < n_out:
        begin = first + j_hi * stride  # the first bottom window's start, in padded rows (>= width)
        end = first + (n_out - 1) * stride + span
        src = torch.cat([x.narrow(axis, begin - width, rows - (begin - width)), bottom], axis)
        out.append(conv(src.narrow(axis, 0, end - begin)))
    return torch.cat(out, axis) if len(out) > 1 else interior
