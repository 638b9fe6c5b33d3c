"""The collectives of the model-side layers, in one place.

* :func:`agree` - every rank's band of a layer input (one fixed-size
  ``Allgather`` through :func:`credit_mpi.validation.agree_cached`: a bad
  input on one rank is the same exception on every rank). Layers learn the
  band layout here at run time, remembered per call shape.
* :func:`fetch_rows` - the global input rows ``[lo, hi)`` a band needs, from
  :func:`credit_mpi.halo_exchange` (differentiable) plus the module's own
  padding at the global edges.
* :func:`allgather_stats` - a differentiable allgather of small statistics
  (backward: the gradients summed over the ranks): the op
  :mod:`credit_mpi.ops.statistics` under the layer's agreement.
* :func:`overlap_add` - the adjoint of a halo exchange (transposed
  convolutions), an op of the engine whose adjoint is the exchange
  (differentiable twice).
* the data path (:mod:`credit_mpi.transport.paths`): every function here
  that moves data moves it on the converted forward's path
  (:func:`credit_mpi.transport.paths.current`: MPI, or the torch group of
  ``convert_to_domain_parallel(..., transport="torch")``); the agreements
  are MPI's whatever the path.
* :func:`share_failure` / :func:`forward_done` - the converted model's
  forward ends in one agreement, and a rank-local exception anywhere inside
  it takes part in the agreement the other ranks are in (the next layer's
  or that last one): the same exception on every rank, not a wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from mpi4py import MPI

from ..agreement import agreed_already, quiet_known, remember_quiet
from ..blocks import decode_block, encode_block, grid_comm
from ..engine import Op, agreed_plan, apply_agreed
from ..grid import grid_coords, grid_of
from ..halo import exchange_agreed
from ..layout import Layout
from ..manager import domain_of, live_domain_comm
from ..ops import halo as halo_op
from ..ops.halo import Plan2d
from ..ops.statistics import gather_agreed
from ..partition import check_halo_width
from ..transport import paths
from ..transport.moves import MpiMoves
from ..validation import DomainParallelError, Local, agree_cached, comm_label
from ..validation import agree as agree_once


def _eager(fn: Callable) -> Callable:
    """Run ``fn`` eagerly under ``torch.compile``: a graph break, the collective outside the traced graph.

    Dynamo would trace into the MPI plumbing (numpy views of tensors, pooled
    buffers, mpi4py calls), which it cannot (FakeTensor "setStorage ... out of
    bounds" errors under ``aot_eager``); with the collectives left eager, the
    torch ops between them still compile.
    """
    return torch.compiler.disable(fn, recursive=True)


@dataclass(frozen=True)
class Bands:
    """The agreed band layout of one layer input along ``axis``."""

    sizes: list[int]
    rank: int
    axis: int

    @property
    def start(self) -> int:
        return Layout.bands(self.sizes).start(self.rank)

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def total(self) -> int:
        return sum(self.sizes)


@_eager
def agree(x: torch.Tensor, axis_of: Callable[[torch.Tensor], int], comm: MPI.Comm, path: str, extra: Callable[[], Any] | None = None,
          *, mode: tuple = (True, ""), quiet: Callable[[Bands], bool] | None = None) -> Bands:
    """Every rank's rows of ``x`` along ``axis_of(x)`` (collective over ``comm``).

    ``axis_of`` runs the layer's local checks and returns the sharded axis;
    ``extra`` returns more arguments that must be equal on every rank;
    ``mode`` is the layer's (``DomainParallelModule.dp_mode()``: the
    training flag and the module's settings; agreed with the autograd state:
    a rank in eval mode while the others train raises on every rank).
    Raises (on every rank alike) when a rank's checks fail or when the bands
    differ in anything but their rows along the axis.

    One fixed-size agreement (:func:`credit_mpi.validation.agree_cached`:
    an ``Allgather`` of five int64 per rank, every call); the band layout of
    a call shape seen before is remembered, so a layer called with the same
    shapes step after step does not plan again. A change on any rank is
    still seen by every rank (its header differs).

    ``quiet(bands)``: True when the layer makes no MPI call with these (agreed) bands (a 1x1 conv, a
    pooling whose windows stay in the band). Inside a converted forward whose inputs are the last
    one's on every rank, such a call seen before skips its agreement
    (:func:`credit_mpi.agreement.quiet_forward` says why every rank skips the same calls).
    """

    def describe(axis: int) -> tuple:
        shape = tuple(x.shape)
        grad = bool(torch.is_grad_enabled() and x.requires_grad)
        return (axis, shape[:axis] + shape[axis + 1 :], str(x.dtype), x.device.type, grad, extra() if extra else None,
                mode, path)

    def local() -> Local:
        axis = axis_of(x)
        mine = describe(axis)
        # the layer's path too: two layers with the same input must not agree with each other
        return Local(mine, (*mine[:5], repr(mine[5]), *mine[6:]), (), x.shape[axis])

    def explain(locals_: list[Local]) -> None:
        _misfit(path, comm, locals_, "bands", "axis", "the sharded one")

    def finish(plan: tuple, sizes: list[int]) -> Bands:
        return Bands(sizes, comm.Get_rank(), plan[0])

    key = None
    try:  # the layer's own checks run every call (local, cheap); a failure is carried into the agreement
        key = (path, x.shape, describe(axis_of(x)))
        hash(key)
    except Exception:  # noqa: BLE001 - local() raises it again inside the agreement, on every rank
        key = None
    known = quiet_known(comm, key) if quiet is not None else None
    if known is not None:
        return known[0]
    bands = agree_cached(comm, "layer", key, local, finish, explain=explain)
    if quiet is not None and quiet(bands):
        remember_quiet(comm, key, bands)
    return bands


@_eager
def share_failure(comm: MPI.Comm, exc: Exception) -> NoReturn:
    """Raise ``exc`` (raised on this rank inside a converted forward) on every rank of ``comm`` (collective).

    The other ranks are in the next layer's agreement or in
    :func:`forward_done` (every layer starts with one, and the forward ends
    with one); this rank joins it with "I failed", and every rank raises the
    same exception (the agreement's). When every rank raised this very
    exception it is raised as it is; an exception that came out of an
    agreement (:func:`agreed_already`) is raised on every rank already.
    """
    if agreed_already(exc):
        raise exc

    def fail() -> Local:
        raise exc

    try:
        agree_once(comm, "layer", fail)
    except Exception as agreed:  # noqa: BLE001 - always: fail() raised
        shared = agreed
    else:  # pragma: no cover - agree raises when local() does
        raise AssertionError("agree returned after a failure")
    everyone = ", ".join(str(r) for r in range(comm.Get_size()))
    if str(shared) == f"{exc} [on rank(s) {everyone} of {comm_label(comm)}]":
        raise exc
    raise shared from exc


@_eager
def forward_start(comm: MPI.Comm, mine: tuple, last: tuple | None, transport: str = "mpi") -> bool:
    """The first agreement of a converted forward (one fixed-size ``Allgather``): True on every rank when every
    rank's inputs (``mine``: their description) are those of its last forward (``last``), so the layers that
    make no MPI call may skip their agreements (:func:`credit_mpi.agreement.quiet_forward`). ``transport``: the
    name of the model's data path (:mod:`credit_mpi.transport.paths`), agreed here: a rank converted with
    another transport raises on every rank before any data moves."""
    _, counts = agree_once(comm, "layer", lambda: Local(None, ("forward start", transport), (), int(mine == last)))
    return all(counts)


@_eager
def forward_done(comm: MPI.Comm) -> None:
    """The last agreement of a converted forward (one fixed-size ``Allgather``): meets a rank that failed after its last layer."""
    agree_once(comm, "layer", lambda: Local(None, ("forward done",)))


def _misfit(path: str, comm: MPI.Comm, locals_: list[Local], pieces: str, axis: str, sharded: str) -> None:
    """The layer agreements' ``explain``: name every rank's input when the bands (or blocks) do not fit together."""
    plans = [loc.plan for loc in locals_]
    if not all(isinstance(e, tuple) and len(e) == 8 and e[7] == path for e in plans):
        where = [e[7] if isinstance(e, tuple) and len(e) == 8 else e for e in plans]
        raise DomainParallelError(
            f"ranks of {comm_label(comm)} are in different steps of the model (different layers, a replicated input "
            f"on some ranks only, a model converted differently, or different code paths); per rank: {where}"
        )
    detail = "; ".join(
        f"rank {r}: {axis} {e[0]}, other dims {e[1]}, {e[2]} on {e[3]}, requires_grad={e[4]}, "
        + f"training={e[6][0]} ({e[6][1]})"
        + (f", {e[5]}" if e[5] is not None else "")
        for r, e in enumerate(plans)
    )
    raise ValueError(
        f"{path}: the {pieces} do not fit together across {comm_label(comm)} (the same dtype, device type, "
        f"requires_grad, training mode and every dimension but {sharded} are needed on every rank): {detail}"
    )


def check_halo(path: str, sizes: list[int], width: int, boundary: str, axis: int) -> None:
    """:func:`credit_mpi.partition.check_halo_width` with the layer named (agreed sizes: raises on every rank)."""
    try:
        check_halo_width(sizes, width, boundary, axis)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


@_eager
def fetch_rows(
    x: torch.Tensor,
    bands: Bands,
    lo: int,
    hi: int,
    width: int,
    manager: Any,
    boundary: str = "zero",
    fill: float | None = None,
) -> torch.Tensor:
    """Global rows ``[lo, hi)`` along ``bands.axis`` for this rank (collective over the domain group).

    ``width`` is the agreed symmetric halo (>= the rows needed on either
    side on every rank). Rows outside ``[0, total)`` are the boundary's:
    ``"zero"``, ``"periodic"``, ``"reflect"`` (as halo_exchange), or
    ``"replicate"`` (the edge row repeated), or ``fill`` when given.
    """
    axis, a, total = bands.axis, bands.start, bands.total
    exchange = "zero" if boundary == "replicate" else boundary
    # the layer's agreement (``bands``) covered what the exchange's would: one agreement per layer call
    path = paths.current()
    if not width:
        padded = x
    elif path is paths.MPI_PATH or exchange_agreed is not _EXCHANGE_AGREED:  # (local_halos: its stand-in)
        padded = exchange_agreed(x, width, axis, manager, exchange, tuple(bands.sizes))
    else:
        padded = _exchange_on(path, x, width, axis, manager, exchange, tuple(bands.sizes))
    first = lo - (a - width)
    # the whole padded band as it is when that is the window (narrow's backward would copy the gradient into zeros)
    rows = padded if first == 0 and hi - lo == padded.shape[axis] else padded.narrow(axis, first, hi - lo)
    if boundary == "replicate" or fill is not None:
        low, high = max(0, -lo), max(0, hi - total)
        if low or high:
            parts = []
            if low:
                edge = x.narrow(axis, 0, 1) if fill is None else torch.full_like(x.narrow(axis, 0, 1), fill)
                parts.append(edge.expand(*[low if d == axis else -1 for d in range(x.ndim)]))
            parts.append(rows.narrow(axis, low, rows.shape[axis] - low - high))
            if high:
                last = x.narrow(axis, x.shape[axis] - 1, 1)
                edge = last if fill is None else torch.full_like(last, fill)
                parts.append(edge.expand(*[high if d == axis else -1 for d in range(x.ndim)]))
            rows = torch.cat(parts, axis)
    return rows


_EXCHANGE_AGREED = exchange_agreed


def bands_halo_plan(x: torch.Tensor, width: int, axis: int, manager: Any, boundary: str, sizes: tuple[int, ...],
                    path: paths.DataPath | None = None) -> Any:
    """The halo exchange's plan for bands ``sizes`` of ``x`` (agreed by the calling layer: no agreement of its own,
    remembered per call shape), its moves on ``path`` (None: the converted forward's)."""
    comm = live_domain_comm(manager) or domain_of(manager).comm
    plan = agreed_plan(halo_op.BANDS, x, comm, sizes, halo_width=width, dim=axis, boundary=boundary, transport="mpi",
                       manager=manager)
    return (path or paths.current()).rebind(plan, comm)


def _exchange_on(path: paths.DataPath, x: torch.Tensor, width: int, axis: int, manager: Any, boundary: str,
                 sizes: tuple[int, ...]) -> torch.Tensor:
    """:func:`credit_mpi.halo.exchange_agreed` on ``path`` (not MPI): the same agreed plan, its moves the path's."""
    return apply_agreed(halo_op.BANDS, x, bands_halo_plan(x, width, axis, manager, boundary, sizes, path))


@_eager
def allgather_stats(t: torch.Tensor, comm: MPI.Comm, path: paths.DataPath | None = None) -> torch.Tensor:
    """Stack every rank's ``t`` (float32/float64) along a new first dim; differentiable.

    The backward sums the gradient over the ranks (each rank's loss is its
    share of the global loss, as :func:`credit_mpi.reduce_gradients` assumes).
    The op :mod:`credit_mpi.ops.statistics`, run with the calling layer's
    agreement (it covers the shape, dtype, device and autograd state of ``t``). ``path``: the data path
    (None: the converted forward's, :func:`credit_mpi.transport.paths.current`; a backward outside the
    forward passes the one its forward saw).
    """
    return gather_agreed(t, comm, (path or paths.current()).transport(comm))


class _Transposed(Op):
    """An op's adjoint run as an op of its own (its adjoint: the op's kernel), routed by the engine like any op.

    The transposed convolutions' overlap-add is the adjoint of the halo
    exchange with a zero boundary; its backward the exchange itself, and the
    engine's autograd Function records either way round (double backward
    included). No agreement of its own: the layer's covers the exchange's.
    The watchdog names the phases as the halo's (the forward is its backward).
    """

    def __init__(self, op: Op) -> None:
        self.op = op
        self.data_phase, self.backward_phase = op.backward_phase, op.data_phase

    def kernel(self, y: torch.Tensor, plan: Any) -> torch.Tensor:
        return self.op.adjoint(y, plan)

    def adjoint(self, grad: torch.Tensor, plan: Any) -> torch.Tensor:
        return self.op.kernel(grad.contiguous(), plan)

    def backward_calls_mpi(self, plan: Any) -> bool:
        return self.op.backward_calls_mpi(plan)


_OVERLAP_ADD = {id(op): _Transposed(op) for op in (halo_op.BANDS, halo_op.BLOCKS)}


def _overlap_add_with(y: torch.Tensor, op: Any, plan: Any) -> torch.Tensor:
    """``op``'s adjoint of ``y`` through the engine (differentiable when autograd records it: agreed by the layer,
    from its input and weight, so every rank records it or none)."""
    return apply_agreed(_OVERLAP_ADD[id(op)], y, plan)


@_eager
def overlap_add(y: torch.Tensor, rows: int, width: int, axis: int, manager: Any, sizes: tuple[int, ...]) -> torch.Tensor:
    """``y`` holds ``rows + 2*width`` rows (``width`` before and after the own ``rows``): add the outer ones to the neighbours'.

    The adjoint of :func:`credit_mpi.halo_exchange` with a zero boundary
    (rows beyond the global edges are dropped). ``sizes`` are every rank's
    own rows, agreed by the caller (a transposed layer's one agreement
    covers the exchange's). Collective over the domain group; differentiable.
    """
    if not width:
        return y
    own = y.detach().narrow(axis, width, rows)
    return _overlap_add_with(y, halo_op.BANDS, bands_halo_plan(own, width, axis, manager, "zero", tuple(sizes)))


# --------------------------------------------------------------------------- the 2-D domain grid


@dataclass(frozen=True)
class Blocks:
    """The agreed block layout of one layer input on a ``rows x cols`` domain grid.

    ``heights[i]`` are the latitude rows of grid row ``i``, ``widths[j]`` the
    longitudes of grid column ``j``; this rank sits at ``(row, col)``;
    ``axes`` are the (latitude, longitude) axes of the input.
    """

    heights: list[int]
    widths: list[int]
    row: int
    col: int
    axes: tuple[int, int]

    @property
    def y0(self) -> int:
        """First global latitude row of this rank's block."""
        return Layout.bands(self.heights).start(self.row)

    @property
    def x0(self) -> int:
        """First global longitude of this rank's block."""
        return Layout.bands(self.widths).start(self.col)

    @property
    def sizes(self) -> list[int]:
        """Every domain rank's element count of one (latitude x longitude) slice (row-major ranks)."""
        return [h * w for h in self.heights for w in self.widths]


@_eager
def agree_blocks(
    x: torch.Tensor,
    axes_of: Callable[[torch.Tensor], tuple[int, int]],
    manager: Any,
    path: str,
    extra: Callable[[], Any] | None = None,
    *,
    mode: tuple = (True, ""),
) -> Blocks:
    """Every rank's block of ``x`` on the manager's 2-D domain grid (collective over the domain group).

    ``axes_of`` runs the layer's local checks and returns the (latitude,
    longitude) axes; ``extra`` returns more arguments that must be equal on
    every rank, ``mode`` the layer's (as in :func:`agree`). Raises (on every rank alike) when a rank's checks fail, when
    the blocks differ in anything but their two grid dims, or when they do
    not tile the globe (every block of a grid row needs the same latitude
    rows, every block of a grid column the same longitudes).
    """
    comm = manager.domain_group
    grid = grid_of(manager, comm.Get_size())

    def describe(axes: tuple[int, int]) -> tuple:
        shape = tuple(x.shape)
        rest = tuple(s for i, s in enumerate(shape) if i not in axes)
        grad = bool(torch.is_grad_enabled() and x.requires_grad)
        return axes, rest, str(x.dtype), x.device.type, grad, extra() if extra else None, mode, path

    def local() -> Local:
        ay, ax = axes_of(x)
        mine = describe((ay, ax))
        # the fixed-size agreement of every collective: one count per rank carries the block's (rows, cols)
        return Local(mine, (*mine[:5], repr(mine[5]), *mine[6:]), (), encode_block(tuple(x.shape), ay, ax))

    def explain(locals_: list[Local]) -> None:
        _misfit(path, comm, locals_, "blocks", "axes", "the two grid dims")

    def finish(mine: tuple, counts: list[int]) -> Blocks:  # deterministic in the agreed values: raises on every rank alike
        everyone = [(*mine[:6], decode_block(c)) for c in counts]
        rows, cols = grid
        table = [[everyone[i * cols + j][6] for j in range(cols)] for i in range(rows)]
        heights = [table[i][0][0] for i in range(rows)]
        widths = [table[0][j][1] for j in range(cols)]
        if any(table[i][j] != (heights[i], widths[j]) for i in range(rows) for j in range(cols)):
            raise ValueError(
                f"{path}: the blocks of the {rows}x{cols} domain grid do not tile a global field (every block of a grid "
                f"row needs the same latitude rows, every block of a grid column the same longitudes); (rows, cols) of "
                f"each block, grid row by grid row: {table}"
            )
        row, col = grid_coords(comm.Get_rank(), grid)
        return Blocks(heights, widths, row, col, everyone[0][0])

    key = None
    try:  # as agree(): the layer's checks run every call; the block layout of a call shape seen before is remembered
        key = ("blocks", path, x.shape, describe(axes_of(x)))
        hash(key)
    except Exception:  # noqa: BLE001 - local() raises it again inside the agreement, on every rank
        key = None
    return agree_cached(comm, "layer", key, local, finish, explain=explain)


@_eager
def fetch_block(
    x: torch.Tensor,
    blocks: Blocks,
    lat: tuple[int, int],
    lon: tuple[int, int],
    width: tuple[int, int],
    manager: Any,
    boundary: tuple[str, str],
) -> torch.Tensor:
    """Global latitude rows ``lat = (lo, hi)`` x longitudes ``lon = (lo, hi)`` for this rank (collective).

    ``width`` is the agreed ``(hy, hx)`` halo (at least what any rank needs
    on either side); ``boundary`` the (latitude, longitude) boundaries of
    :func:`credit_mpi.halo_exchange` (``"zero"``, ``"periodic"``,
    ``"reflect"``), or ``"replicate"`` in a dim (the edge row/column repeated,
    corners included: the index is clamped into the field). Differentiable.
    """
    ay, ax = blocks.axes
    hy, hx = width
    exchange = tuple("zero" if b == "replicate" else b for b in boundary)
    padded = x
    if hy or hx:
        plan = _grid_plan(x, blocks.heights, blocks.widths, (hy, hx), (ay, ax), manager, exchange)
        padded = apply_agreed(halo_op.BLOCKS, x, plan)
    spans = (
        (ay, lat, blocks.y0, hy, sum(blocks.heights), boundary[0]),
        (ax, lon, blocks.x0, hx, sum(blocks.widths), boundary[1]),
    )
    for axis, (lo, hi), start, w, total, bnd in spans:
        if bnd == "replicate":
            index = torch.arange(lo, hi, device=x.device).clamp(0, total - 1) - (start - w)
            padded = padded.index_select(axis, index)
        else:
            padded = padded.narrow(axis, lo - (start - w), hi - lo)
    return padded


@_eager
def overlap_add_2d(y: torch.Tensor, own: tuple[int, int], width: tuple[int, int], axes: tuple[int, int], manager: Any,
                   heights: tuple[int, ...], widths: tuple[int, ...]) -> torch.Tensor:
    """The 2-D :func:`overlap_add`: ``y`` holds this block's ``own`` (rows, cols) plus ``width`` (hy, hx) on every side.

    The outer rows, columns and corners are added to the neighbours' blocks
    (the adjoint of the 2-D halo exchange with zero boundaries: what falls
    beyond the global edges is dropped). ``heights`` / ``widths`` are every
    block's own rows / columns, agreed by the caller. Collective over the
    domain grid; differentiable.
    """
    if not any(width):
        return y
    block = y.detach().narrow(axes[0], width[0], own[0]).narrow(axes[1], width[1], own[1])
    plan = _grid_plan(block, heights, widths, width, axes, manager, ("zero", "zero"))
    return _overlap_add_with(y, halo_op.BLOCKS, plan)  # agreed by the layer: every rank or none


def _grid_plan(x: torch.Tensor, heights, widths, width: tuple[int, int], axes: tuple[int, int], manager: Any,
               boundary: tuple[str, str]) -> Plan2d:
    """The 2-D halo exchange's plan for blocks the caller's agreement settled (no agreement of its own).

    The layer's agreement covers what the exchange's would: every block's
    rows and columns, the dtype, device, every other dim and the autograd
    state (the halo widths are checked here against the agreed blocks).
    """
    check_halo_width(list(heights), width[0], boundary[0], axes[0])  # agreed sizes: every rank raises alike
    check_halo_width(list(widths), width[1], boundary[1], axes[1])
    domain = domain_of(manager)
    grid = grid_of(manager, domain.size)
    comm = grid_comm(domain)
    row, col = grid_coords(domain.rank, grid)
    plan = Plan2d(comm, grid, row, col, axes[0], axes[1], width[0], width[1], boundary[0], boundary[1], tuple(x.shape),
                  tuple(heights), tuple(widths), None, MpiMoves(comm))
    return paths.current().rebind(plan, comm)  # the converted forward's data path (its peers: the domain ranks)
