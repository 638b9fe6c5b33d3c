"""A band convolution that never copies its band: the floor's kernel call plus the halo rows' share on the edge rows.

A convolution is linear in its input, so on a band whose halo rows are zeros
or real rows from the neighbours::

    conv(band with halo) = conv(band, the module's own zero padding along the sharded dim)
                         + conv(strip above) on the first output rows + conv(strip below) on the last ones

where a strip is the received halo rows next to zeros in place of the band's
rows, just long enough for the output rows whose windows reach past the
band's edge (no bias, no padding along the sharded dim). The first term is
exactly the unconverted convolution's call on the band (the floor's kernel);
only the ``2 * width`` edge rows of the band travel
(:data:`credit_mpi.ops.halo.BANDS` on ``[first width rows, last width
rows]``: a small tensor, not a padded copy of the band), and autograd keeps
what the unconverted convolution keeps (the band and the weight) plus the
halo rows. Backward: torch's ``convolution_backward`` on the band as the
floor's, the strips' on the gradient's edge rows (their weight gradients
added, their halo rows' gradients sent home with the exchange's adjoint and
added in place into the input gradient's edge rows). A backward that records
a graph (``create_graph``) recomputes the forward with the recorded exchange
and differentiates it (twice differentiable).

Used where it is exact and simple, decided from the agreed band layout (the
same decision on every rank, :func:`band_edges`); the other layouts keep the
fetched-rows path of :mod:`credit_mpi.nn.conv`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import watchdog
from ..autograd import check_backward_thread
from ..engine import apply_agreed
from ..ops import halo as halo_op
from ..transport import arrays, moves, paths
from ._comm import _eager, _overlap_add_with, bands_halo_plan

__all__ = ["Strip", "BandEdges", "band_edges", "band_conv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class Strip(NamedTuple):
    """The halo rows' share of a band's edge output rows: ``conv(strip, the kernel's taps [tap, tap + taps))``.

    The strip is ``halo`` received rows (from row ``recv`` of the ``4 * width`` exchanged) and ``zeros``
    zero rows in place of the band's (the halo first when ``above``, else the zeros); its convolution
    (no bias, no padding along the sharded dim) gives output rows ``[out_first, out_first + out_rows)``.
    Only the taps that can reach past the band's edge are in the call: the others read band rows,
    which the band's own call covers.
    """

    out_first: int
    out_rows: int
    recv: int
    halo: int
    zeros: int
    above: bool
    tap: int
    taps: int


class BandEdges(NamedTuple):
    """One rank's strips above and below (None: no strip on that side: a zero-padded field edge, or no
    window reaches past it)."""

    rows: int  # the band's output rows (the local conv's, which are the rows it owns)
    top: Strip | None
    bottom: Strip | None


def band_edges(sizes: tuple[int, ...], kernel: int, stride: int, dilation: int, pad: int, width: int,
               periodic: bool, bands: tuple) -> tuple[BandEdges, ...] | None:
    """Every rank's :class:`BandEdges` for symmetric padding ``pad`` along the sharded dim, or None where the split
    is not exact and simple on some rank: a band whose first owned output row is not aligned with its start
    (``out_start * stride != start``), whose local convolution (padding ``pad``) has other rows than it owns, whose
    top and bottom strips meet, or a band smaller than ``width``. Pure arithmetic on agreed values (``bands``:
    the layout's :class:`~credit_mpi.nn.geometry.Band` of each rank): every rank decides alike."""
    span = dilation * (kernel - 1) + 1
    n = len(sizes)
    if not width or pad > width or min(sizes) < width:
        return None
    out = []
    for r, (m, band) in enumerate(zip(sizes, bands, strict=True)):
        if band.out_start * stride != band.start or m + 2 * pad < span:
            return None
        rows = (m + 2 * pad - span) // stride + 1
        if rows != band.out_stop - band.out_start:
            return None
        n_top = min(-(-pad // stride), rows)  # output rows whose windows start above the band
        first_bottom = max(0, -(-(m + pad - span + 1) // stride))  # the first whose window ends below it
        if first_bottom < n_top:
            return None
        top = bottom = None
        if n_top and (r > 0 or periodic):
            taps = min(kernel, -(-pad // dilation))  # taps [0, taps) reach above the band (row 0's: the most)
            length = (n_top - 1) * stride + (taps - 1) * dilation + 1  # from global row start - pad
            halo = min(pad, length)
            top = Strip(0, n_top, width - pad, halo, length - halo, True, 0, taps)
        if first_bottom < rows and (r < n - 1 or periodic):
            tap = max(0, -(-(m + pad - (rows - 1) * stride) // dilation))  # the last row's first tap below the band
            first = first_bottom * stride - pad + tap * dilation  # the strip's first row, from the band's start
            length = (rows - 1 - first_bottom) * stride + (kernel - 1 - tap) * dilation + 1
            zeros = max(0, m - first)
            recv = first + zeros - m  # its first row past the band: the received row of the neighbour below
            if recv + length - zeros > width:
                return None
            bottom = Strip(first_bottom, rows - first_bottom, 3 * width + recv, length - zeros, zeros, False, tap,
                           kernel - tap)
        out.append(BandEdges(rows, top, bottom))
    return tuple(out)


class _Job(NamedTuple):
    """One call's settings (the kernel calls', the strips', the exchange's plan)."""

    edges: BandEdges
    axis: int
    waxis: int  # the weight's dim of the sharded one
    width: int
    stride: tuple[int, ...]
    padding: tuple[int, ...]  # the band's call: the module's padding, the sharded dim's too
    strip_padding: tuple[int, ...]  # the strips' call: none along the sharded dim
    dilation: tuple[int, ...]
    groups: int
    plan: Any  # the edge rows' exchange (None: no rank has a strip)
    again: tuple  # what a recorded backward needs to fetch the band's halo again: (sizes, boundary, manager, the
    # data path, the first fetched row the band's windows read, how many they read)


@_eager
def band_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, edges: tuple[BandEdges, ...],
              rank: int, sizes: tuple[int, ...], axis: int, width: int, boundary: str, manager: Any, stride, padding,
              strip_padding, dilation, groups: int) -> torch.Tensor:
    """The convolution of the band ``x`` (rank ``rank`` of agreed ``sizes`` along ``axis``) with its neighbours' rows
    (``boundary``: ``"zero"`` or ``"periodic"``); ``edges`` from :func:`band_edges`. Collective over the domain group
    (every rank or none calls it, as the layer's agreement decides); differentiable, twice."""
    plan = edge = None
    path = paths.current()  # the converted forward's data path
    if any(e.top or e.bottom for e in edges):  # agreed: every rank exchanges, or none
        edge = _edge_rows(x.detach(), axis, width)
        plan = bands_halo_plan(edge, width, axis, manager, boundary, (2 * width,) * len(sizes), path)
    pad = padding[axis - (x.ndim - len(stride))]
    job = _Job(edges[rank], axis, axis - (x.ndim - weight.ndim), width, tuple(stride), tuple(padding), tuple(strip_padding), tuple(dilation), groups,
               plan, (sizes, boundary, manager, path, width - pad, x.shape[axis] + 2 * pad))
    coming = None if plan is None else _post_edges(edge, plan, x)  # in flight while the band's kernel runs
    received = None if plan is None or coming is not None else _fetch(edge, plan)
    top, bottom = _halo_rows(received, job)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _BandConv.apply(x, weight, bias, top, bottom, job, coming)
    return _compute(x, weight, bias, top, bottom, job, coming)


def _fetch(edge: torch.Tensor, plan: Any) -> torch.Tensor:
    """The band's edge rows (:func:`_edge_rows`) exchanged: ``4 * width`` rows, the neighbours' at both ends."""
    return apply_agreed(halo_op.BANDS, edge, plan)


def _edge_rows(x: torch.Tensor, axis: int, width: int) -> torch.Tensor:
    """``[first width rows, last width rows]`` of ``x`` along ``axis``: what the neighbours need of it."""
    return torch.cat([x.narrow(axis, 0, width), x.narrow(axis, x.shape[axis] - width, width)], axis)


def _halo_rows(received: torch.Tensor | None, job: _Job) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The received rows the strips read (above, below), or None."""
    return tuple(None if st is None or received is None else received.narrow(job.axis, st.recv, st.halo)
                 for st in (job.edges.top, job.edges.bottom))


def _strip(rows: torch.Tensor, st: Strip, axis: int) -> torch.Tensor:
    """The strip's rows: ``rows`` (the halo) and its zero rows, in their order along ``axis``."""
    if not st.zeros:
        return rows
    shape = list(rows.shape)
    shape[axis] = st.zeros
    pad = rows.new_zeros(shape)
    return torch.cat([rows, pad] if st.above else [pad, rows], axis)


def _taps(weight: torch.Tensor, st: Strip, job: _Job) -> torch.Tensor:
    """The kernel's taps along the sharded dim that the strip's call uses (a view)."""
    return weight.narrow(job.waxis, st.tap, st.taps)


def _compute(x, weight, bias, top, bottom, job: _Job, coming: tuple | None = None) -> torch.Tensor:
    """The band's call with the module's padding, the strips' contributions added into its edge rows (``coming``:
    the halo rows in flight, :func:`_post_edges`: taken after the band's call)."""
    return _with_strips(_CONV[weight.ndim - 2](x, weight, bias, job.stride, job.padding, job.dilation, job.groups),
                        weight, *_landed(coming, job, top, bottom), job)[0]


def _with_strips(out, weight, top, bottom, job: _Job) -> tuple:
    """``out`` (the band's call) with the strips' contributions added into its edge rows; ``(out, top, bottom)``."""
    conv = _CONV[weight.ndim - 2]
    for rows, st in ((top, job.edges.top), (bottom, job.edges.bottom)):
        if st is not None:
            out.narrow(job.axis, st.out_first, st.out_rows).add_(
                conv(_strip(rows, st, job.axis), _taps(weight, st, job), None, job.stride, job.strip_padding,
                     job.dilation, job.groups))
    return out, top, bottom


def _landed(coming: tuple | None, job: _Job, top, bottom) -> tuple:
    """The strips' halo rows ``(top, bottom)``: ``top`` and ``bottom`` themselves, or those of ``coming`` once arrived."""
    if coming is None:
        return top, bottom
    _arrived(coming, "band conv: halo rows")
    _, from_next, from_prev, edge, _ = coming
    rows = []
    for st, got, first in ((job.edges.top, from_prev, 0), (job.edges.bottom, from_next, 3 * job.width)):
        if st is None:
            rows.append(None)
            continue
        shape = list(edge.shape)
        shape[job.axis] = job.width
        rows.append(torch.from_numpy(got).view(edge.dtype).view(shape).narrow(job.axis, st.recv - first, st.halo))
    return tuple(rows)


def _post_edges(edge: torch.Tensor, plan: Any, x: torch.Tensor) -> tuple | None:
    """The band's edge rows (:func:`_edge_rows`) on their way to the neighbours (:func:`_in_flight`), or None where
    :func:`_fetch` exchanges them (another data path, device memory)."""
    if not _simple(plan, x):
        return None
    w = edge.shape[plan.phases[0].axis] // 2
    return _in_flight(edge.detach().contiguous(), plan, 0, w, w)


def _simple(plan: Any, x: torch.Tensor) -> bool:
    """True when the exchange of ``plan`` is one phase of zeros or periodic bands over MPI in host memory (the same on
    every rank: the path, the device and the boundary are agreed by the layer). Host memory is what the transport
    takes as such (:func:`credit_mpi.transport.arrays.in_host_memory`): device memory, real or simulated, goes
    through the engine's exchange, which stages it or waits for its stream."""
    if getattr(plan, "torch_group", True) is not None or len(plan.phases) != 1 or not arrays.in_host_memory(x):
        return False
    ph = plan.phases[0]
    return ph.rule.mirror is None and ph.fold is None


def _in_flight(rows_t: torch.Tensor, plan: Any, up: int, down: int, w: int) -> tuple:
    """Post the swap of ``rows_t``'s ``w`` rows from ``up`` (to the previous rank) and from ``down`` (to the next one),
    as bytes: ``(posted, from next, from prev, rows_t, comm)`` (``rows_t`` stays alive until the wait)."""
    ph = plan.phases[0]
    outer, row = ph.outer, ph.inner * rows_t.element_size()  # bytes: bfloat16 too
    rows = arrays.host_bytes(rows_t).reshape(outer, rows_t.shape[ph.axis], row)
    edge = (outer, w, row)
    into = (np.empty(edge, np.uint8) if ph.next is not None else None,
            np.empty(edge, np.uint8) if ph.prev is not None else None)
    posted, from_next, from_prev = moves.post_edges(plan.moves, rows[:, up:up + w], rows[:, down:down + w], ph.prev,
                                                    ph.next, ph.tags, into)
    return posted, from_next, from_prev, rows_t, plan.comm


class _BandConv(torch.autograd.Function):
    """:func:`_compute` keeping the band, the weight and the halo rows (the strips rebuilt in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, top, bottom, job, coming=None):
        ctx.job = job
        out = _CONV[weight.ndim - 2](x, weight, bias, job.stride, job.padding, job.dilation, job.groups)
        out, top, bottom = _with_strips(out, weight, *_landed(coming, job, top, bottom), job)
        ctx.save_for_backward(x, weight, bias, None if top is None else top.clone(),
                              None if bottom is None else bottom.clone())
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, top, bottom = ctx.saved_tensors
        job = ctx.job
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        if torch.is_grad_enabled():  # create_graph: every rank alike (the engine's adjoints assume it too)
            return _differentiable(grad, x, weight, bias, job, (need_x, need_w, need_b))
        axis = job.axis
        home, taps = [], []  # the strips first: their halo rows' gradients travel while the band's kernel runs
        for rows, st in ((top, job.edges.top), (bottom, job.edges.bottom)):
            if st is None:
                continue
            g_s, g_ws, _ = torch.ops.aten.convolution_backward(
                grad.narrow(axis, st.out_first, st.out_rows), _strip(rows, st, axis), _taps(weight, st, job), None,
                list(job.stride), list(job.strip_padding), list(job.dilation), False, [0] * len(job.stride),
                job.groups, [need_x, need_w, False])
            if need_w:
                taps.append((st, g_ws))
            if need_x:
                home.append((st, g_s.narrow(axis, 0 if st.above else st.zeros, st.halo)))
        going = _post_home(home, job, x) if need_x and job.plan is not None else None
        try:
            g_x, g_w, g_b = torch.ops.aten.convolution_backward(
                grad, x, weight, None if bias is None else list(bias.shape), list(job.stride), list(job.padding),
                list(job.dilation), False, [0] * len(job.stride), job.groups, [need_x, need_w, need_b])
        finally:
            if going is not None:  # (also when the kernel raised: the neighbours' messages are taken)
                _arrived(going)
        for st, g_ws in taps:
            g_w.narrow(job.waxis, st.tap, st.taps).add_(g_ws)
        if going is not None:
            _add_home(g_x, going, job)
        elif need_x and job.plan is not None:  # the halo rows' gradients home (every rank: the adjoint is collective)
            g_x = _rows_home(g_x, home, job)
        return g_x, g_w, g_b, None, None, None, None


def _exchanged_rows(home: list, job: _Job, like: torch.Tensor) -> torch.Tensor:
    """The ``4 * width`` exchanged rows' gradient: the strips' halo rows' (``home``), zeros elsewhere."""
    shape = list(like.shape)
    shape[job.axis] = 4 * job.width
    g = like.new_zeros(shape)
    for st, g_halo in home:
        g.narrow(job.axis, st.recv, st.halo).copy_(g_halo)
    return g


def _post_home(home: list, job: _Job, x: torch.Tensor) -> tuple | None:
    """The halo rows' gradients on their way home (:func:`_in_flight`), or None where :func:`_rows_home` does it
    (another data path, device memory)."""
    plan = job.plan
    if not _simple(plan, x):
        return None
    if halo_op.BANDS.backward_calls_mpi(plan):
        check_backward_thread()
    w = job.width
    return _in_flight(_exchanged_rows(home, job, x).detach().contiguous(), plan, 0, 3 * w, w)


def _arrived(going: tuple, what: str = "band conv: halo gradients home") -> None:
    """Wait for :func:`_in_flight`'s messages, under the watchdog's deadline."""
    state = watchdog.STATE
    state.op, state.comm, state.since = what, going[4], watchdog.monotonic()
    try:
        going[0].wait()
    finally:
        state.since = 0.0


def _add_home(g_x: torch.Tensor, going: tuple, job: _Job) -> None:
    """Add the gradients of this band's edge rows that the neighbours read into ``g_x`` (after :func:`_arrived`)."""
    _, from_next, from_prev, _, _ = going
    axis, w, m = job.axis, job.width, g_x.shape[job.axis]
    shape = list(g_x.shape)
    shape[axis] = w
    if from_prev is not None:
        g_x.narrow(axis, 0, w).add_(torch.from_numpy(from_prev).view(g_x.dtype).view(shape))
    if from_next is not None:
        g_x.narrow(axis, m - w, w).add_(torch.from_numpy(from_next).view(g_x.dtype).view(shape))


def _rows_home(g_x: torch.Tensor, home: list, job: _Job) -> torch.Tensor:
    """Send the strips' halo-row gradients to the ranks that own those rows; add what comes back into ``g_x``'s edge rows."""
    axis, w = job.axis, job.width
    g = _exchanged_rows(home, job, g_x)  # only the halo rows' gradients are not zero
    if halo_op.BANDS.backward_calls_mpi(job.plan):
        check_backward_thread()
    back = _overlap_add_with(g, halo_op.BANDS, job.plan)  # the exchange's adjoint: 2 * width rows of this band
    m = g_x.shape[axis]
    g_x.narrow(axis, 0, w).add_(back.narrow(axis, 0, w))
    g_x.narrow(axis, m - w, w).add_(back.narrow(axis, w, w))
    return g_x


def _differentiable(grad, x, weight, bias, job: _Job, need: tuple[bool, bool, bool]) -> tuple:
    """The backward as a recorded graph (a second derivative): the forward recomputed as the fetched rows' path
    computes it (the band's halo fetched with the recorded exchange, the convolution of the padded rows: every rank
    reads every fetched row, so every rank's graph holds the exchange and its adjoint alike), differentiated."""
    sizes, boundary, manager, path, first, count = job.again
    with torch.enable_grad():
        if job.plan is None:  # no rank reads another's rows: the band's call alone
            out = _compute(x, weight, bias, None, None, job)
        else:
            plan = bands_halo_plan(x, job.width, job.axis, manager, boundary, sizes, path)
            rows = _refetch(x, plan).narrow(job.axis, first, count)
            out = _CONV[weight.ndim - 2](rows, weight, bias, job.stride, job.strip_padding, job.dilation, job.groups)
        inputs = [t for t, n in zip((x, weight, bias), need, strict=True) if n]
        grads = iter(torch.autograd.grad(out, inputs, grad, create_graph=True, allow_unused=True))
    return tuple(next(grads) if n else None for n in need) + (None, None, None, None)


@_eager
def _refetch(x: torch.Tensor, plan: Any) -> torch.Tensor:
    """The band with its halo rows (recorded when ``x`` requires grad: its adjoint is collective, every rank alike)."""
    return apply_agreed(halo_op.BANDS, x, plan)
