"""Halo exchange along the sharded dimension.

Each rank of a domain group holds a band of rows of a global field. Before a
convolution (or any stencil) it needs ``halo_width`` rows of its neighbours
on both sides. :func:`halo_exchange` returns the local band with those rows
added before and after along ``dim``:

* between ranks, the rows come from the neighbouring bands: the one edge
  swap (:func:`credit_mpi.transport.moves.swap_edges`), one round of at most
  four non-blocking messages (up to the previous rank, down to the next, and
  theirs back), none past the outer edges, so no rank count can deadlock;
  over MPI or, with ``transport="torch"``, the mirrored torch group. Each
  band's first and last ``halo_width`` rows travel packed contiguously (a
  derived datatype could send them in place, but MPICH moves strided types
  several times slower) and land in place in the output: no concatenation;
* at the two outer edges of the domain, ``boundary`` decides:

  ``"zero"``
      zeros (the reference's behaviour).
  ``"periodic"``
      the first and the last rank exchange with each other
      (``numpy.pad(mode="wrap")``, ``torch.nn.functional.pad(mode="circular")``).
  ``"reflect"``
      mirror without repeating the edge row (``mode="reflect"``).
  ``"earth"``
      across the pole, as CREDIT's ``TensorPadding(mode="earth")`` pads a
      global latitude x longitude field: the halo rows are the edge rows
      flipped in latitude and rolled by half the longitudes. The longitude
      is the last dimension; it must be whole on every rank (``dim`` may not
      be the last dimension) and even.

For every boundary the result equals the matching rows of the single-process
padded global field, for even and uneven bands. With no manager (or a domain
size of 1) the input is simply padded. A halo wider than a band that must
supply it raises ``ValueError`` on every rank.

With torch tensors that require grad, the exchange is differentiable (see
:mod:`credit_mpi.autograd`): the backward pass sends halo gradients back to
the ranks that own those rows and adds them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from . import blocks
from .manager import Domain, DomainParallelManager, live_domain_comm
from .partition import (
    HALO_BOUNDARIES,
    check_halo_width,
    halo_edge_rows,
    normalize_dim,
)
from .transport import arrays, moves, rowops
from .validation import Local, agree_cached, check_bands_fit, check_int, check_transport, on_forget, repeat_remembered

__all__ = ["HALO_BOUNDARIES", "halo_exchange"]



def halo_exchange(
    x: Any,
    halo_width: int,
    dim: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    boundary: str = "zero",
    check: bool = True,
    transport: str = "mpi",
) -> Any:
    """Pad the local band with ``halo_width`` rows of its neighbours on both sides.

    Collective over the manager's domain group.

    Args:
        x: This rank's band (numpy array or torch tensor).
        halo_width: Rows to add before and after along ``dim`` (>= 0).
        dim: The sharded dimension (default: -2, latitude in BCHW / BCTHW).
            A pair ``(lat_dim, lon_dim)`` (with ``halo_width`` and
            ``boundary`` optionally pairs too) exchanges the blocks of a 2-D
            ``domain_grid``, corners included (:mod:`credit_mpi.halo2d`).
        manager: DomainParallelManager (uses the global singleton if None; with
            none, or a domain size of 1, the whole field is on this rank).
        boundary: ``"zero"``, ``"periodic"``, ``"reflect"`` or ``"earth"``
            (see the module docstring).
        check: Agree across the domain group on the bands' kind, dtype and
            every dimension but ``dim``, so a mismatch is the same exception
            on every rank. With ``False`` the ranks still agree (in the same
            single ``Allgather`` of a few integers) on everything that decides
            the MPI calls: the width, the boundary, the transport, the bytes
            per row, whether autograd records the exchange, and every band's
            rows (so a halo wider than a band is always caught).
        transport: ``"mpi"`` (default) moves the halo rows with MPI
            point-to-point messages; ``"torch"`` with torch.distributed point-to-point
            over ``manager.torch_domain_group`` (NCCL on GPUs; see
            :func:`credit_mpi.init_torch_distributed`). Bit-identical result.
            The backward pass of the differentiable exchange moves the halo
            gradients the same way; the agreement uses MPI either way.

    Returns:
        A new array of ``x``'s kind, dtype and device, ``2 * halo_width``
        rows longer along ``dim`` (host arrays: memory from the reuse pool
        of :func:`credit_mpi.release_output_pool`).

    Raises:
        ValueError: negative or non-integer ``halo_width``, ``dim`` out of
            range, unknown ``boundary`` or ``transport``, ``"earth"`` without
            the whole (or with an odd) longitude, a halo wider than a band.
        TypeError: unsupported array type, or bands of different kinds.
        DomainParallelError: ranks made different calls (a different width,
            boundary, transport, or a band that requires grad on some ranks only).
    """
    # A repeat of a remembered call: its agreement is one Allgather, nothing else to check or plan.
    key = _call_key(x, halo_width, dim, boundary, transport)
    plan, table = repeat_remembered(live_domain_comm(manager), "halo_exchange", key, check)
    if plan is None:
        domain = blocks.line_domain(manager, dim, halo_width, boundary)
        if domain is None:  # pairs: the 2-D grid's halo, corners included
            from .halo2d import halo_exchange_2d

            return halo_exchange_2d(x, halo_width, dim, manager, boundary, check, transport)
        plan = _plan(x, halo_width, dim, domain, boundary, check, transport, received=table)
    if plan.autograd:  # differentiable path (torch autograd); the same MPI calls
        return _autograd().halo_autograd(x, plan)
    return halo_kernel(x, plan)


def _exchange_agreed(x: Any, halo_width: int, dim: int, manager: Any, boundary: str, sizes: tuple[int, ...]) -> Any:
    """:func:`halo_exchange` (one dim, MPI) with no agreement of its own: the caller's covered it (private).

    For the converted layers of :mod:`credit_mpi.nn`, whose one agreement per
    call covers everything this exchange's would (the band's dtype, device,
    every dim, requires_grad with the grad mode, the layer and so the width
    and boundary, and every band's rows: ``sizes``). The plan is remembered
    per call shape, as :func:`halo_exchange`'s.
    """
    plan = _agreed_plan(x, halo_width, dim, manager, boundary, sizes)
    return _autograd().halo_autograd(x, plan) if plan.autograd else halo_kernel(x, plan)


def _agreed_plan(x: Any, halo_width: int, dim: int, manager: Any, boundary: str, sizes: tuple[int, ...]) -> _Plan:
    """The plan of :func:`_exchange_agreed` (private; remembered per call shape): its ``apply`` and ``adjoint``."""
    key = (id(live_domain_comm(manager)), _call_key(x, halo_width, dim, boundary, "mpi"), sizes)
    plan = _AGREED_PLANS.get(key) if key[1] is not None else None
    if plan is None:
        plan = _plan(x, halo_width, dim, blocks.line_domain(manager, dim), boundary, False, agreed=sizes)
        if key[1] is not None:
            _AGREED_PLANS[key] = plan
            while len(_AGREED_PLANS) > 256:
                _AGREED_PLANS.pop(next(iter(_AGREED_PLANS)))
    return plan


_AGREED_PLANS: dict = {}  # (id(comm), call key, sizes) -> plan; dropped by manager.free() through on_forget


@on_forget
def _forget_agreed_plans(comm: MPI.Comm | None) -> None:
    if comm is None:
        _AGREED_PLANS.clear()
        return
    for key in [key for key, plan in _AGREED_PLANS.items() if key[0] == id(comm) or plan.comm is comm]:
        del _AGREED_PLANS[key]


def _autograd() -> Any:
    """:mod:`credit_mpi.autograd`, imported (with torch) on the first differentiable call.

    Looked up in ``sys.modules`` afterwards: a function-level import costs
    0.85 us per call, this 0.1 us (every differentiable halo pays it).
    """
    module = sys.modules.get(f"{__package__}.autograd")
    if module is None:
        from . import autograd as module
    return module


@dataclass(frozen=True)
class _Plan:
    comm: MPI.Comm
    axis: int
    width: int
    boundary: str
    rows: int  # this rank's band along axis
    prev: int | None
    next: int | None
    outer: int  # product of the dimensions before axis
    row_bytes: int  # bytes of one row of one outer slice
    lon_axis: int  # last dimension (earth only)
    lon: int
    shape: tuple  # this rank's band
    padded: tuple  # the output: the band with 2 * width more rows along axis
    autograd: bool  # torch autograd records the exchange (agreed: its backward is collective too)
    torch_group: Any = None  # transport="torch": the mirrored torch domain group
    # the transport (MpiMoves keeps packed edge rows call after call: a plan is remembered per call shape)
    moves: Any = field(default=None, compare=False, repr=False)

    def apply(self, x: Any) -> Any:
        """The exchange (:func:`halo_kernel`)."""
        return halo_kernel(x, self)

    def adjoint(self, grad: Any) -> Any:
        """Its transpose (:func:`halo_adjoint`): halo gradients sent home and added."""
        return halo_adjoint(grad, self)


def _plan(x, halo_width, dim, domain: Domain, boundary, check, transport="mpi", received=None, agreed=None) -> _Plan:
    comm, n = domain.comm, domain.size

    def local() -> Local:
        blocks.check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)
        info = arrays.describe(x)
        width = check_width(halo_width)
        axis = normalize_dim(dim, len(info.shape))
        _check_boundary(boundary, info.shape, axis)
        if transport == "torch" and n > 1:
            _torch_group(domain)  # a clear error when the bridge is missing
        rest = info.shape[:axis] + info.shape[axis + 1 :]
        calls = (width, boundary, transport, arrays.requires_grad(x), math.prod(info.shape[:axis]),
                 math.prod(info.shape[axis + 1 :]) * info.itemsize)
        same = (info.kind, info.dtype, info.device_type, len(info.shape), rest, axis)
        return Local((info, axis, width, boundary), calls, same, info.shape[axis])

    def explain(locals_: list[Local]) -> None:  # name each rank's band when they do not fit
        check_bands_fit("halo_exchange", [loc.plan for loc in locals_], ("dim", "halo_width", "boundary"), comm,
                        note="; for 'earth' the whole longitude on every rank")

    def finish(plan: tuple, sizes: list[int]) -> _Plan:
        info, axis, width, _ = plan
        check_halo_width(sizes, width, boundary, axis)  # every rank's rows are agreed: every rank raises alike
        prev, nxt = domain.neighbors(boundary == "periodic")
        shape = info.shape
        group = _torch_group(domain) if transport == "torch" and n > 1 else None
        return _Plan(
            comm=comm,
            axis=axis,
            width=width,
            boundary=boundary,
            rows=shape[axis],
            prev=prev,
            next=nxt,
            outer=math.prod(shape[:axis]),
            row_bytes=math.prod(shape[axis + 1 :]) * info.itemsize,
            lon_axis=len(shape) - 1,
            lon=shape[-1],
            shape=shape,
            padded=shape[:axis] + (shape[axis] + 2 * width,) + shape[axis + 1 :],
            autograd=arrays.requires_grad(x),
            torch_group=group,
            moves=moves.MpiMoves(comm) if group is None else _torch_moves().TorchMoves(group),
        )

    if n > 1 and agreed is None:
        # The same call shape as last time skips the local checks and the planning, never the agreement.
        key = _call_key(x, halo_width, dim, boundary, transport)
        return agree_cached(comm, "halo_exchange", key, local, finish, check=check, explain=explain, received=received)
    plan = local().plan  # the whole field is here, or the caller agreed on every band (``agreed``: their rows)
    return finish(plan, list(agreed) if agreed is not None else [plan[0].shape[plan[1]]])


def _call_key(x: Any, halo_width: Any, dim: Any, boundary: Any, transport: Any) -> tuple | None:
    """What decides ``_plan``'s local part on this rank, or None (not remembered: device arrays, torch transport)."""
    array = arrays.cache_key(x)
    if array is None or transport != "mpi":
        return None
    key = (array, type(halo_width), halo_width, type(dim), dim, type(boundary), boundary)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _torch_moves() -> Any:
    """:mod:`credit_mpi.transport.torch_moves` (imports torch: only for ``transport="torch"``)."""
    from .transport import torch_moves

    return torch_moves


def _torch_group(domain: Domain) -> Any:
    return domain.manager.torch_group("domain")


def halo_kernel(x: Any, p: _Plan) -> Any:
    """The padded band of an agreed exchange (plain arrays, no autograd)."""
    host = arrays.host_numpy(x) if p.torch_group is None else None
    if host is not None:  # numpy, or a torch CPU tensor through a numpy view of it
        out = _host_halo(np.ascontiguousarray(host), p)
        return out if host is x else arrays.from_host_numpy(x, out)
    w, rows, axis = p.width, p.rows, p.axis
    x = arrays.contiguous(x)  # detached; lazy conjugate / negative views resolved (DLPack cannot carry them)
    out = arrays.empty(x, p.padded)
    rowops.copy_rows(out, axis, w, x)
    if w == 0:
        return out
    if p.prev is not None or p.next is not None:
        # my first w rows go up and my last w rows go down; the neighbours' land below and above my band
        from_next, from_prev = _edges(lambda: arrays.narrow(x, axis, 0, w), lambda: arrays.narrow(x, axis, rows - w, w), p)
        if from_prev is not None:
            rowops.copy_rows(out, axis, 0, from_prev)
        if from_next is not None:
            rowops.copy_rows(out, axis, w + rows, from_next)
    for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
        if neighbour is None:
            _fill_edge(out, x, p, side, at)
    return out


def _host_halo(x: np.ndarray, p: _Plan) -> np.ndarray:
    """:func:`halo_kernel` of a contiguous numpy band over MPI: byte views, one round of non-blocking messages.

    The output comes from the reuse pool (:func:`~credit_mpi.transport.arrays.pooled_empty`):
    a loop that drops last step's padded band does not first-touch new pages every call.
    """
    w, rows = p.width, p.rows
    out = arrays.pooled_empty(x, p.padded)
    ob, xb = _host_rows(out, p, rows + 2 * w), _host_rows(x, p, rows)
    ob[:, w : w + rows] = xb
    if w == 0:
        return out
    if (p.prev is not None or p.next is not None) and p.outer * p.row_bytes:
        # the edges' byte views straight to the one edge swap (the per-call fast path: no closures)
        moves.swap_edges(p.moves, xb[:, :w], xb[:, rows - w :], p.prev, p.next, into=(ob[:, w + rows :], ob[:, :w]))
    for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
        if neighbour is None:
            if p.boundary == "zero":
                ob[:, at : at + w] = 0  # all-zero bytes are zero in every dtype credit_mpi moves
            else:
                _fill_edge(out, x, p, side, at)
    return out


def _host_rows(x: Any, p: _Plan, rows: int) -> Any:
    """Contiguous host ``x`` as a ``(outer, rows, row_bytes)`` uint8 numpy view, or None (device arrays)."""
    flat = arrays.host_bytes(x)
    return None if flat is None else flat.reshape(p.outer, rows, p.row_bytes)


def _edges(up: Callable[[], Any], down: Callable[[], Any], p: _Plan, into: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:
    """The plan's edge swap (:func:`~credit_mpi.transport.moves.swap_edges`): ``(from_next, from_prev)``.

    ``up()`` goes to the previous rank, ``down()`` to the next; they make the
    edge arrays and are called only when that neighbour exists. The halo
    exchange does this forward (a band's edge rows) and backward (the halo
    rows' gradients, sent home), over the plan's transport. The edge rows
    travel packed contiguously: a derived datatype could send them in place,
    but MPICH moves such strided types several times slower than the same
    contiguous bytes, and packing ``2 * width`` rows costs little.
    """
    if p.prev is None and p.next is None or p.outer * p.row_bytes == 0:
        return None, None
    up_edge = up() if p.prev is not None else None
    down_edge = down() if p.next is not None else None
    return moves.swap_edges(p.moves, up_edge, down_edge, p.prev, p.next, into=into)


def _fill_edge(out: Any, x: Any, p: _Plan, side: str, at: int) -> None:
    if p.boundary == "zero":
        rowops.fill_rows(out, p.axis, at, p.width, 0)
        return
    start = halo_edge_rows(p.boundary, p.rows, p.width, side)
    halo = rowops.flipped_rows(x, p.axis, start, p.width)
    if p.boundary == "earth":
        halo = rowops.roll(halo, p.lon // 2, p.lon_axis)
    rowops.copy_rows(out, p.axis, at, halo)


def halo_adjoint(grad: Any, p: _Plan) -> Any:
    """The adjoint of :func:`halo_kernel`: the band's gradient, with halo gradients sent home and added.

    ``grad`` has the padded shape. Every halo row of the forward pass is a
    copy of some band row (or a constant); its gradient is added to that
    row on the rank that owns it.
    """
    host = arrays.host_numpy(grad) if p.torch_group is None else None
    if host is not None and host is not grad:  # a torch CPU tensor: the numpy code on a view of it
        return arrays.from_host_numpy(grad, halo_adjoint(host, p))
    w, rows, axis = p.width, p.rows, p.axis
    grad = arrays.contiguous(grad)
    gx = rowops.clone_rows(grad, axis, w, rows)
    if w == 0:
        return gx
    # the halo above came from the previous rank's last rows, the halo below from the next rank's first rows
    if host is not None:  # numpy over MPI: the halo rows go home from byte views, in one round
        from_next, from_prev = _host_edges_home(grad, p)
    else:
        from_next, from_prev = _edges(lambda: arrays.narrow(grad, axis, 0, w), lambda: arrays.narrow(grad, axis, w + rows, w), p)
    if from_next is not None:
        rowops.add_rows(gx, axis, rows - w, from_next)
    if from_prev is not None:
        rowops.add_rows(gx, axis, 0, from_prev)
    if p.boundary in ("reflect", "earth"):
        for side, neighbour, at in (("before", p.prev, 0), ("after", p.next, w + rows)):
            if neighbour is None:
                back = rowops.flipped_rows(grad, axis, at, w)
                if p.boundary == "earth":
                    back = rowops.roll(back, -(p.lon // 2), p.lon_axis)
                rowops.add_rows(gx, axis, halo_edge_rows(p.boundary, rows, w, side), back)
    return gx


def _host_edges_home(grad: np.ndarray, p: _Plan) -> tuple[Any, Any]:
    """:func:`_edges` of the adjoint for a contiguous numpy ``grad``: ``(from_next, from_prev)`` as new arrays."""
    w = p.width
    gb = _host_rows(grad, p, p.rows + 2 * w)
    edge = p.shape[: p.axis] + (w,) + p.shape[p.axis + 1 :]
    from_next = np.empty(edge, grad.dtype) if p.next is not None else None
    from_prev = np.empty(edge, grad.dtype) if p.prev is not None else None
    into = [None if e is None else _host_rows(e, p, w) for e in (from_next, from_prev)]
    _edges(lambda: gb[:, :w], lambda: gb[:, w + p.rows :], p, into=(into[0], into[1]))
    return from_next, from_prev


def check_width(width: Any) -> int:
    return check_int("halo_width", width, minimum=0)


def check_boundary_name(boundary: Any) -> str:
    if boundary not in HALO_BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; valid: {', '.join(map(repr, HALO_BOUNDARIES))}")
    return boundary


def _check_boundary(boundary: Any, shape: tuple, axis: int) -> None:
    if check_boundary_name(boundary) != "earth":
        return
    if axis == len(shape) - 1:
        raise ValueError(
            f"boundary='earth' needs the full longitude (the last dimension) on every rank, "
            f"but dim={axis} is the last dimension of a {len(shape)}-dimensional array; "
            f"shard along latitude (e.g. dim=-2)"
        )
    lon = shape[-1]
    if lon % 2:
        raise ValueError(
            f"boundary='earth' rolls the halo by half the longitudes, so the longitude count "
            f"(last dimension) must be even, got {lon}"
        )
