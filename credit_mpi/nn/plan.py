"""``describe``: the plan of a converted model before the first step (no MPI, no data).

A dry run of the model on the meta device (global shapes, no memory, no
communication) records each layer that runs on bands; the band layout of
each layer input is followed from the first input's layout (``array_split``
of the sharded dim over ``domain_size`` ranks) through the layers' ownership
rules (:mod:`credit_mpi.nn.geometry`). Tensors are matched by their global
height along the sharded dim (a UNet's skip connection and the upsampled path
must have the same height, and then must have the same layout).

Each row also carries what every rank sends in that layer call, forward and
backward, and its agreements (:mod:`credit_mpi.nn.traffic`): the dry run
tracks which tensors require grad (the parameters do; the input when
``requires_grad``), so a layer whose input needs no gradient sends nothing
backward, as in the run. The rules' own moves (a re-band to whole windows, a roll
across bands, the group layout, a gathered operand of a hand-written attention)
and a trusted module's own ``HaloExchange`` are rows of their own, with their
traffic.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..grid import check_grid, grid_of
from ..layout import offsets
from ..partition import band_sizes, check_halo_width, normalize_dim
from .base import DomainParallelModule, guard_forward
from .convert import _convert, check_custom
from .errors import ConversionError
from .judge import attention
from .judge.attention import learned_mask, sdpa_path
from .judge.pointwise import VALUE_CALLS
from .judge.recompute import checked_dry_run, checked_report
from .judge.registry import Refusal
from .judge.tracker import Tracker
from .outside import check_output
from .replicated import is_replicated, replicated
from .traffic import (
    AGREEMENT_BYTES,
    Traffic,
    alltoall_traffic,
    gather_traffic,
    halo_traffic,
    join_traffic,
    layer_traffic,
    ring_traffic,
)

__all__ = ["describe", "Plan", "PlanRow", "GridPlan"]

# The layouts of attention across bands (credit_mpi.nn.judge.attention.sdpa_path): what describe() says, its traffic.
_ATTENTION_LAYOUTS = {
    "gather": ("K and V gathered (allgather_along)", gather_traffic),
    "alltoall": ("all-to-all to heads and back (ops.alltoall)", alltoall_traffic),
    "ring": ("a ring of K/V bands (ops.ring)", ring_traffic),
}


# What describe() says of each gather and join of the rules (credit_mpi.nn.judge.rows, credit_mpi.nn.judge.attention);
# a row move's note is its row map's label (credit_mpi.ops.rows.ROW_MAPS, next to the map).
_MOVES = {
    "allgather_along()": "a product's operand gathered (every band's tokens)",
    "allgather_along(counts)": "every rank's token count (the offsets of a mask in the field's coordinates)",
    "cat()": "a join of bands: every part's layout agreed (ops.reband.join_layouts)",
    "cat() re-band": "a join of bands: the parts of another layout than the first-made part's re-banded to it",
    "interpolate(size=)": "interpolated to a band's size: the rows agreed (re-banded to that band's layout)",
    "domain_sum()": "a sum or mean over the sharded dim: the bands' partial sums added (one Allreduce), replicated",
    "pencil_transpose()": "a transform over the sharded dim: the split moved to another dim, one all-to-all (ops.transpose)",
}


@dataclass(frozen=True)
class PlanRow:
    """One layer call of the plan.

    ``halo_before``/``halo_after`` are the most rows any band reads from its
    neighbours (for transposed layers: the output rows it adds to them);
    ``stride`` the offset alignment that keeps layouts matched; ``min_rows``
    the band height every rank needs; ``exact`` whether the layout runs;
    ``traffic`` what each rank sends in this call (one :class:`Traffic` per
    rank; None for a layer without a traffic rule, and on a 2-D grid).
    """

    path: str
    kind: str
    rows_in: int
    rows_out: int
    bands_in: tuple[int, ...]
    bands_out: tuple[int, ...]
    halo_before: int
    halo_after: int
    stride: int
    min_rows: int
    exact: bool
    note: str = ""
    traffic: tuple[Traffic, ...] | None = field(default=None, compare=False)  # rows compare by their geometry


@dataclass
class Plan:
    """The plan of a model on ``domain_size`` bands (``rows``: one :class:`PlanRow` per layer call)."""

    domain_size: int
    input_shape: tuple[int, ...]
    rows: list[PlanRow] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when every layer runs exactly on this layout."""
        return all(r.exact for r in self.rows)

    @property
    def traffic(self) -> tuple[Traffic, ...] | None:
        """What each rank sends in one repeated forward and backward (every layer, and the forward's first and last
        agreements; a layer that makes no MPI call skips its agreement in a repeated step).

        None when a layer has no traffic rule (or on a refused layer).
        """
        if any(r.traffic is None for r in self.rows):
            return None
        end = Traffic(agreements=2) if self.domain_size > 1 else Traffic()
        total = [end] * self.domain_size
        for r in self.rows:
            total = [a + b for a, b in zip(total, r.traffic, strict=True)]
        return tuple(total)

    def __str__(self) -> str:
        head = ("layer", "type", "rows in->out", "halo -/+", "stride", "min rows", "exact", "sends fwd/bwd",
                "msgs fwd/bwd", "agree", "note")
        lines = [
            (r.path, r.kind, f"{r.rows_in}->{r.rows_out}", f"{r.halo_before}/{r.halo_after}", str(r.stride),
             str(r.min_rows), "yes" if r.exact else "NO", *_traffic_cells(r.traffic), r.note)
            for r in self.rows
        ]
        total = self.traffic
        if total is not None and self.rows:
            lines.append(("total", "", "", "", "", "", "", *_traffic_cells(total),
                          f"the most any rank sends; agreements: {AGREEMENT_BYTES} B x (ranks - 1) each"))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [f"plan for input {tuple(self.input_shape)} on {self.domain_size} band(s): "
               + ("runs exactly" if self.exact else "does NOT run exactly")]
        out += [fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
        out += [fmt.format(*line).rstrip() for line in lines]
        return "\n".join(out)


@dataclass
class GridPlan:
    """The plan of a model on a ``rows x cols`` latitude x longitude domain grid: one :class:`Plan` per grid dim.

    ``latitude`` follows the latitude blocks (``rows`` bands of dim -2),
    ``longitude`` the longitude blocks (``cols`` bands of dim -1); a layer
    runs exactly on the grid when it does in both.
    """

    domain_grid: tuple[int, int]
    latitude: Plan
    longitude: Plan

    @property
    def exact(self) -> bool:
        """True when every layer runs exactly in both grid dims."""
        return self.latitude.exact and self.longitude.exact

    def __str__(self) -> str:
        rows, cols = self.domain_grid
        head = (f"plan for input {tuple(self.latitude.input_shape)} on a {rows}x{cols} latitude x longitude grid: "
                + ("runs exactly" if self.exact else "does NOT run exactly"))
        lat = str(self.latitude).split("\n", 1)[1]
        lon = str(self.longitude).split("\n", 1)[1]
        return f"{head}\nlatitude ({rows} block row(s), dim -2):\n{lat}\nlongitude ({cols} block column(s), dim -1):\n{lon}"


def _traffic_cells(traffic: tuple[Traffic, ...] | None) -> tuple[str, str, str]:
    """The table's traffic cells: the most any rank sends, forward/backward (bytes, messages), and agreements."""
    if traffic is None:
        return "?", "?", "?"
    if not traffic:
        return "0/0", "0/0", "0"
    most = [max(t.as_tuple()[i] for t in traffic) for i in range(5)]
    return f"{_size(most[0])}/{_size(most[2])}", f"{most[1]}/{most[3]}", str(most[4])


def _size(n: int) -> str:
    """Bytes as B / KiB / MiB (three significant digits)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def describe(model: nn.Module, input_shape: tuple[int, ...], domain_size: int | None = None, manager=None,
             shard_dim: int = -2, *, domain_grid: tuple[int, int] | None = None,
             custom_converters: dict | None = None, requires_grad: bool = False) -> Plan | GridPlan:
    """The plan of ``model`` (converted or not) for a global input of ``input_shape`` on ``domain_size`` bands.

    Args:
        model: A model, converted or not (it is not modified).
        input_shape: The GLOBAL input shape.
        domain_size: Number of bands (default: the manager's domain size, else 1).
        manager: A DomainParallelManager to take the domain size (and its ``domain_grid``) from.
        shard_dim: The sharded dim (default -2).
        domain_grid: ``(rows, cols)`` of a latitude x longitude domain grid (default: the manager's).
        custom_converters: What :func:`~credit_mpi.nn.convert_to_domain_parallel` takes (the plan is
            that of the model converted with them).
        requires_grad: Whether the input requires grad (the backward traffic of the layers before the
            first one with parameters: a batch of data needs no gradient, the default).

    Returns:
        A :class:`Plan` (``print(plan)`` shows the table; ``plan.exact``; ``plan.rows``; ``plan.traffic``:
        what each rank sends in one step, see :mod:`credit_mpi.nn.traffic`); on a grid of more than one
        column a :class:`GridPlan` (one plan per grid dim, no traffic yet).

    Raises:
        ConversionError: the model has a module without a rule (on a grid: without a block rule).
        ValueError: ``domain_grid`` is not a pair of positive ints, or ``shard_dim`` is not -2 on a grid.
    """
    custom = check_custom(custom_converters)
    if domain_grid is None and manager is not None and manager.domain_parallel_size > 1:
        domain_grid = grid_of(manager, manager.domain_parallel_size)
    if domain_grid is not None:
        try:
            size = int(domain_grid[0]) * int(domain_grid[1])
        except (TypeError, ValueError, IndexError, KeyError):
            size = 0  # check_grid names what is wrong
        grid = check_grid(domain_grid, size)
        if grid[1] > 1:
            if normalize_dim(shard_dim, len(input_shape)) != len(input_shape) - 2:
                raise ValueError(f"on a {grid[0]}x{grid[1]} domain grid the blocks split the last two dims, so shard_dim "
                                 f"must be -2 (latitude), got {shard_dim}")
            standin = SimpleNamespace(domain_parallel_size=grid[0] * grid[1], domain_grid=grid)
            _convert(copy.deepcopy(model, _memo(model, manager)).to("meta"), "", standin, shard_dim, custom)  # refusals only
            return GridPlan(grid, _plan(model, input_shape, grid[0], manager, -2, custom, requires_grad, grid),
                            _plan(model, input_shape, grid[1], manager, -1, custom, requires_grad, grid))
        domain_size = grid[0] if domain_size is None else domain_size
    if domain_size is None:
        domain_size = manager.domain_parallel_size if manager is not None else 1
    return _plan(model, input_shape, domain_size, manager, shard_dim, custom, requires_grad)


def _memo(model: nn.Module, manager) -> dict:
    """Managers (communicators) are not copied with the model."""
    memo = {id(manager): None} if manager is not None else {}
    for m in model.modules():
        if isinstance(m, DomainParallelModule) and m.dp_manager is not None:
            memo[id(m.dp_manager)] = None
    return memo


def _plan(model: nn.Module, input_shape: tuple[int, ...], domain_size: int, manager, shard_dim: int, custom: dict,
          requires_grad: bool = False, grid: tuple[int, int] | None = None) -> Plan:
    # no manager anywhere, the root's forward guard included: the dry run makes no MPI call
    dry = guard_forward(_convert(copy.deepcopy(model, _memo(model, manager)), "", None, shard_dim, custom), None)
    indices = {n: b for n, b in dry.named_buffers() if not (b.is_floating_point() or b.is_complex())}
    dry = dry.to("meta")
    seen = {id(b): (b, indices[n]) for n, b in dry.named_buffers() if n in indices}  # index buffers' values
    axis = normalize_dim(shard_dim, len(input_shape))
    rec = _Recorder(Plan(domain_size, tuple(input_shape)), shard_dim, grid,
                    {input_shape[axis]: band_sizes(input_shape[axis], domain_size, uneven=True)})
    _halo_rows(dry, rec.plan, rec.sizes_of, grid)
    try:  # every torch function of the forward judged as the run judges it (credit_mpi.nn.judge)
        _dry_forward(dry, input_shape, requires_grad, rec, seen)
    except ConversionError as exc:  # a function without a rule: the run raises this on every rank
        if not hasattr(exc, "refused"):
            raise
        path, op, why = exc.refused
        rec.add(path, op, 0, 0, (), (), exact=False, note=f"refused: {why}", traffic=None)
    except Exception as exc:
        unseen = _unseen_values_error(rec.plan, exc)
        if unseen is None:
            raise
        raise unseen from exc
    return rec.plan


def _dry_forward(dry: nn.Module, input_shape: tuple[int, ...], requires_grad: bool, rec: _Recorder,
                 seen: dict | None = None) -> None:
    """The converted copy's forward on the meta device, under a :class:`Tracker` whose hooks are ``rec``'s."""
    # grad on (meta tensors: no memory, no compute): a layer sees whether its input requires grad
    with torch.enable_grad(), Tracker(dry, rec.shard_dim, None, rec.sizes_of, rec.layer, judge=rec.n > 1 or bool(rec.grid and rec.grid[1] > 1),
                                      adopt_layout=rec.adopt) as tracker, _DryRun(tracker, checked_report(tracker, rec.attention), rec.value):
        rec.tracker = tracker
        tracker.seen_values.update(seen or {})  # the index buffers' host values (the meta device has none)
        dtype = next((p.dtype for p in dry.parameters() if p.is_floating_point()), torch.get_default_dtype())
        x = torch.empty(input_shape, device="meta", dtype=dtype, requires_grad=requires_grad)
        tracker.on_move = rec.moved  # the rules' row moves and gathers (credit_mpi.nn.judge.rows, .attention)
        tracker.grid = rec.grid  # the domain grid (the rules without one on a grid refuse it in the dry run too)
        tracker.on_join, tracker.on_conflict = rec.joined, rec.conflict  # joins of bands; bands of two layouts combined
        tracker.plan_rows = rec.plan.rows  # what a module's forward communicated (judge.rows: a band of no window)
        checked_dry_run(tracker)  # a move inside a custom autograd Function refused as the run does (judge.recompute)
        tracker.mark_inputs(x)
        out = dry(x)
        tracker.trusted += 1  # the output's placement, as the run checks it (credit_mpi.nn.outside)
        try:
            check_output(tracker, out)
        finally:
            tracker.trusted -= 1


def _unseen_values_error(plan: Plan, exc: Exception) -> ConversionError | None:
    """The forward raised in the dry run after reading values it could not see (zeros stood in): the error that says
    so (None when it read none)."""
    reads = [f"{r.path} ({r.kind})" for r in plan.rows if r.kind.rstrip("()") in VALUE_CALLS]
    if not reads:
        return None
    return ConversionError(
        f"describe(): the forward raised {type(exc).__name__}: {exc} after reading {len(reads)} value(s) that the "
        f"dry run (the meta device: shapes, no data) cannot see: {', '.join(reads)}; it went on with zeros (False "
        f"for bool, True for torch.equal / allclose). The run reads the real values; to plan this forward, let "
        f"the check pass on a meta tensor (e.g. skip it when t.is_meta) or make it outside forward"
    )


def _module_path(path: str) -> str:
    """"path (Type)" (a tracker's stack entry): the module's path, as the layers' rows name it."""
    return path.rsplit(" (", 1)[0]


class _Recorder:
    """The rows of one dry run: the tracker's hooks (a layer's call, a rule's move, a join, an attention, a value read)
    each append what the run does there, and the band layout of every height seen so far (``layouts``)."""

    def __init__(self, plan: Plan, shard_dim: int, grid: tuple[int, int] | None, layouts: dict[int, list[int]]) -> None:
        self.plan, self.n, self.shard_dim, self.grid, self.layouts = plan, plan.domain_size, shard_dim, grid, layouts
        self.tracker: Tracker | None = None

    def add(self, path: str, kind: str, rows_in: int, rows_out: int, bands_in, bands_out, *, exact: bool, note: str,
            traffic, min_rows: int = 0) -> None:
        """A row with no halo and no stride (a rule's move, a join, a refusal, a replicated input)."""
        self.plan.rows.append(PlanRow(path=path, kind=kind, rows_in=rows_in, rows_out=rows_out, bands_in=tuple(bands_in),
                                      bands_out=tuple(bands_out), halo_before=0, halo_after=0, stride=1,
                                      min_rows=min_rows, exact=exact, note=note, traffic=traffic))

    def sizes_of(self, rows: int) -> list[int]:
        return list(self.layouts.get(rows) or band_sizes(rows, self.n, uneven=True))

    def adopt(self, rows: int, sizes: list[int]) -> bool:
        return list(self.layouts.setdefault(rows, list(sizes))) == list(sizes)

    def layer(self, mod, args, out):
        """A layer's call: its row (halo, layouts, traffic); its output's layout kept (or replicated, as the run)."""
        x = args[0]
        ax = _layer_axis(mod, x.ndim)
        if is_replicated(x):  # a replicated input (a global mean's, on every rank): the layer computes on it locally
            self._replicated_input(mod, x, out, ax)
            return None
        own = self.tracker.layout_of(x)
        row = _row(mod, tuple(x.shape), tuple(out.shape), self.layouts, self.n, self.grid,
                   None if self.grid else self._traffic_of(mod, x, out),
                   own if own is not None and sum(own) == x.shape[ax] else None)
        self.plan.rows.append(row)
        if _replicates(mod, x.shape, out.shape, ax):
            return replicated(out)  # as the run: what is computed from it alone is replicated too
        for t in tree_flatten(out)[0]:  # its own layout (a join re-bands it where an earlier tensor of its height differs)
            if isinstance(t, torch.Tensor) and row.bands_out:
                self.tracker.keep_layout(t, list(row.bands_out))
        return None

    def _replicated_input(self, mod, x, out, ax: int) -> None:
        h_in, h_out = x.shape[ax], out.shape[ax]
        traffic = None if self.grid else _tuple(layer_traffic(mod, (), (), x.dtype, 0, self.n, 0, False, False, local=True))
        self.add(mod.dp_path, type(mod).__name__.replace("DomainParallel", ""), h_in, h_out, (h_in,) * self.n,
                 (h_out,) * self.n, exact=True, note="replicated input: computed locally", traffic=traffic)

    def _traffic_of(self, mod, x, out):
        """``traffic(width)``: what each rank sends in this layer call for a halo of ``width`` rows."""
        def traffic(width: int) -> tuple[Traffic, ...] | None:
            return _tuple(layer_traffic(mod, tuple(x.shape), tuple(out.shape), x.dtype, normalize_dim(self.shard_dim, x.ndim),
                                        self.n, width, x.requires_grad,
                                        bool(getattr(getattr(mod, "weight", None), "requires_grad", False))))

        return traffic

    def attention(self, tracker, q, k, v, gqa=False, mask_grad=False):
        """Attention over every band's tokens (the run gathers K and V): a row of its own, in the calling module."""
        places = [tracker.get(t) for t in (q, k, v)]
        if self.grid or self.n == 1 or tracker.trusted or any(
                p is None or p.dim != t.ndim - 2 for t, p in zip((q, k, v), places, strict=True)):
            return  # inside a trusted module (not judged), windows in the batch dim (no gather); the rule refuses the rest
        p = places[1]
        counts = [p.inner * s for s in self.sizes_of(k.shape[-2] // p.inner)]
        layout = sdpa_path(q, k, v, self.n, gqa, attention.SDPA_PATH, mask_grad)  # as the run decides it
        how, traffic = _ATTENTION_LAYOUTS[layout]
        moved = traffic((k,) if v is k else (k, v), counts, self.n) if layout == "gather" else traffic(q, k, v, counts, self.n)
        self.add(_module_path(tracker.stack[-1][0]), "scaled_dot_product_attention()", k.shape[-2], q.shape[-2], counts,
                 counts, exact=True, note=how, traffic=tuple(moved), min_rows=1)

    def joined(self, path: str, parts: list, dim: int, sizes: list, target: list, kind: str = "cat()") -> None:
        """A join of band parts (the run agrees their layouts, re-bands each that differs), or an interpolation to a
        band's size re-banded to that band's layout: a row of its own."""
        differ = [k for k, s in enumerate(sizes) if s != target]
        if self.grid and differ:  # the run keeps the local check on a latitude x longitude grid (no re-band there yet)
            raise Refusal(f"it joins bands of {parts[0].shape[dim]} rows in different layouts ({sizes}), which has no "
                          f"re-band rule on a latitude x longitude domain grid yet")
        note = _MOVES[kind if kind != "cat()" else "cat() re-band" if differ else "cat()"]
        traffic = None if self.grid else tuple(join_traffic(parts, dim, sizes, target, self.n))
        rows = parts[0].shape[dim]
        self.add(_module_path(path), kind, rows, rows, sizes[differ[0]] if differ else target, target, exact=True,
                 note=note, traffic=traffic)

    def conflict(self, path: str, kind: str, rows: int, one: list, other: list) -> None:
        """An op (not a join) of two bands of one height in different layouts: the run fails where their rows differ."""
        self.add(_module_path(path), kind, rows, rows, one, other, exact=False, traffic=None,
                 note=f"it combines bands of {rows} rows in different layouts ({one} and {other}): only a join "
                      f"(torch.cat, torch.stack) re-bands them; the run fails on the ranks whose rows differ")

    def moved(self, path: str, kind: str, rows: int, sizes_in, sizes_out, traffic) -> None:
        """A row move or gather of a rule (re-band, roll, group layout, a product's operand): a row of its own."""
        self.add(_module_path(path), kind, rows, rows, sizes_in, sizes_out, exact=True,
                 note=_move_note(kind), traffic=None if self.grid else tuple(traffic))

    def value(self, tracker, op: str, t) -> object:
        """A value read from a tensor every rank holds whole (the run reads the same on each, exact): a row saying
        the dry run could not see it, and a stand-in (zeros) to go on with."""
        what = "a replicated tensor" if is_replicated(t) else "a tensor that is not a band"
        got = _stand_in(op, t)
        shown = repr(got) if isinstance(got, (bool, int, float, complex)) else "zeros"
        self.add(_module_path(tracker.stack[-1][0]), f"{op}()", 0, 0, (), (), exact=True,
                 note=f"reads a value of {what} {tuple(t.shape)} (the same on every rank in the run): not seen on the "
                      f"meta device, the dry run went on with {shown} (a branch on it may differ)",
                 traffic=None if self.grid else (Traffic(),) * self.n)
        return got


def _halo_rows(dry: nn.Module, plan: Plan, sizes_of, grid) -> None:
    """Every :class:`~credit_mpi.nn.HaloExchange` of the dry copy (a trusted module's own) pads the field locally and
    is a row of the plan: the bands it reads from (a halo wider than a band is refused, as the run does), its traffic."""
    from .exchange import HaloExchange

    n = plan.domain_size

    def row(path, mod, args, out):
        x = args[0]
        ax = normalize_dim(mod.dim, x.ndim)
        sizes, w = sizes_of(x.shape[ax]), mod.halo_width
        problem = _halo_problem(sizes, w, mod.boundary, ax) if n > 1 else None
        counted = mod.boundary in ("zero", "periodic", "reflect")  # "earth" crosses the poles: no rule here yet
        traffic = None if grid or problem or not counted else tuple(
            halo_traffic(tuple(x.shape), x.dtype, ax, n, w, mod.boundary == "periodic", x.requires_grad) if n > 1 else ())
        plan.rows.append(PlanRow(path=path, kind="HaloExchange", rows_in=x.shape[ax], rows_out=out.shape[ax],
                                 bands_in=tuple(sizes), bands_out=tuple(s + 2 * w for s in sizes), halo_before=w,
                                 halo_after=w, stride=1, min_rows=w, exact=problem is None,
                                 note=problem or f"a halo of {w} row(s) (its own agreement)", traffic=traffic))

    def padded(mod, x):  # the shape of the one-rank padding (its rows' values do not matter on meta)
        ax = normalize_dim(mod.dim, x.ndim)
        edge = list(x.shape)
        edge[ax] = mod.halo_width
        with torch._C.DisableTorchFunction():
            zeros = x.new_zeros(edge)
            return torch.cat([zeros, x, zeros], ax)

    for path, mod in dry.named_modules():
        if isinstance(mod, HaloExchange):
            mod.forward = lambda x, m=mod: padded(m, x)
            mod.register_forward_hook(lambda m, a, o, p=path or "<root>": row(p, m, a, o))


class _DryRun(TorchFunctionMode):
    """In the dry run, above the :class:`Tracker`: ``on_call(tracker, q, k, v)`` before each attention it judges.

    A tensor the forward made on the host (``torch.linspace(...)`` without ``device=``) joins the dry run's
    meta tensors on the meta device, as it joins the bands on their device in the run.

    A Python value read from a meta tensor (``.item()``, ``bool(t)``, ``t.tolist()``: a data-dependent check)
    has no data to read: a band's goes on to the tracker, which refuses it as the run does; any other's (a
    parameter, a buffer, a global mean: the same value on every rank, which the run lets through) is
    ``on_value(tracker, op, t)``'s stand-in, and a row of the plan.
    """

    def __init__(self, tracker: Tracker, on_call, on_value) -> None:
        super().__init__()
        self.tracker, self.on_call, self.on_value = tracker, on_call, on_value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in VALUE_CALLS and any(t.is_meta for t in tensors) and (
                self.tracker.trusted or all(self.tracker.get(t) is None for t in tensors)):
            return self.on_value(self.tracker, name, tensors[0])
        if any(t.is_meta for t in tensors) and any(not t.is_meta and t.ndim for t in tensors):
            args, kwargs = tree_map(self._to_meta, (args, kwargs))
        if name == "__getitem__" and len(args) == 2:
            args = (args[0], self._masks_as_rows(args[1]))
        if name == "scaled_dot_product_attention":
            named = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(("query", "key", "value", "attn_mask"))]
            self.on_call(self.tracker, *named[:3], bool(args[7] if len(args) > 7 else kwargs.get("enable_gqa", False)),
                         learned_mask(named[3]))
        out = func(*args, **kwargs)
        if tensors and all(not (t.is_floating_point() or t.is_complex()) for t in tensors):
            self._shadow(func, args, kwargs, out)
        return out

    def _masks_as_rows(self, item):
        """``x[..., mask]`` with a bool mask whose host values are known: the mask as the rows it keeps (meta has no
        ``nonzero``: its values decide the output's shape), one index tensor a dim of the mask, as torch reads it."""
        items = item if isinstance(item, tuple) else (item,)
        out, changed = [], False
        for it in items:
            got = self.tracker.seen_values.get(id(it)) if isinstance(it, torch.Tensor) and it.is_meta and \
                it.dtype == torch.bool else None
            if got is None or got[0] is not it:
                out.append(it)
                continue
            for rows in got[1].nonzero().unbind(1):
                m = rows.to("meta")
                self.tracker.seen_values[id(m)] = (m, rows)
                out.append(m)
            changed = True
        if not changed:
            return item
        return tuple(out) if isinstance(item, tuple) or len(out) != 1 else out[0]

    def _to_meta(self, t):
        m = _to_meta(t)
        if m is not t and not (t.is_floating_point() or t.is_complex()):  # an index made on the host: its values kept
            self.tracker.seen_values[id(m)] = (m, t)
        return m

    def _shadow(self, func, args, kwargs, out) -> None:
        """An op of integer and bool tensors whose host values are known (index buffers, indices made in the forward):
        the same op on the host values, kept for the meta outputs (a rule that takes the field's rows reads them)."""
        seen, missing = self.tracker.seen_values, []

        def host(t):
            if not isinstance(t, torch.Tensor) or not t.is_meta:
                return t
            got = seen.get(id(t))
            if got is None or got[0] is not t:
                missing.append(t)
                return t
            return got[1]

        host_args, host_kwargs = tree_map(host, (args, kwargs))
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_meta]
        if missing or not outs or any(o.numel() > 1 << 20 for o in outs):
            return
        try:
            with torch._C.DisableTorchFunction():
                values = [v for v in tree_flatten(func(*host_args, **host_kwargs))[0] if isinstance(v, torch.Tensor)]
        except Exception:  # noqa: BLE001 - an op the host cannot repeat: its values stay unseen
            return
        if len(values) == len(outs):
            for o, v in zip(outs, values, strict=True):
                seen[id(o)] = (o, v)



def _stand_in(op: str, t: torch.Tensor):
    """What a value read gives in the dry run, where a meta tensor has no data: zeros (``False`` for ``bool``; a
    comparison of two tensors, ``torch.equal`` / ``allclose``, ``True``: the check passes)."""
    if op in ("equal", "allclose"):
        return True
    if op in ("numpy", "__array__"):
        import numpy as np

        return np.zeros(tuple(t.shape), dtype=str(t.dtype).replace("torch.", "").replace("bfloat16", "float32"))
    zero = False if op in ("__bool__", "is_nonzero") or t.dtype == torch.bool else (0 if op in ("__int__", "__index__") or
                                                                    not t.is_floating_point() else 0.0)
    if op == "tolist":
        out = zero
        for n in reversed(t.shape):
            out = [copy.deepcopy(out) for _ in range(n)] if isinstance(out, list) else [out] * n
        return out
    return complex(zero) if op == "__complex__" else zero


def _to_meta(t):
    """A host tensor of the forward's own on the meta device (the dry run's); everything else as it is."""
    if isinstance(t, torch.Tensor) and not t.is_meta and t.ndim:
        with torch._C.DisableTorchFunction():
            return t.to("meta")
    return t


def _halo_problem(sizes: list[int], width: int, boundary: str | None, axis: int) -> str | None:
    """What the run's halo check (:func:`credit_mpi.partition.check_halo_width`) refuses, or None."""
    if boundary in (None, "replicate"):
        return None  # the edge row repeated, or an overlap-add: no halo check in the run
    try:
        check_halo_width(sizes, width, boundary, axis)
    except ValueError as exc:
        return str(exc)
    return None


def _layer_axis(mod, ndim: int) -> int:
    """The sharded axis of a layer's ``ndim``-dimensional input, as the layer's forward takes it (its own
    ``shard_dim`` against its own input: not the model input's axis, whose ndim a reshape may have changed)."""
    return normalize_dim(mod.dp_shard_dim, ndim)


def _replicates(mod, shape_in, shape_out, ax: int) -> bool:
    """True when ``mod``'s output is replicated on every rank (a global mean along the sharded axis ``ax``), the
    judgement of the layer's forward (``dp_replicated`` of its input's and output's rows along its own axis)."""
    return len(shape_out) == len(shape_in) and mod.dp_replicated(shape_in[ax], shape_out[ax])


def _move_note(kind: str) -> str:
    """describe()'s note of a rule's row move or gather ``kind`` ("roll_along()": its row map's label)."""
    from ..ops.rows import ROW_MAPS

    name = kind.split()[0]
    row_map = ROW_MAPS.get(name.removesuffix("()"))
    return row_map.label if row_map is not None else _MOVES.get(name, "")


def _tuple(traffic: list[Traffic] | None) -> tuple[Traffic, ...] | None:
    return None if traffic is None else tuple(traffic)


def _row(mod, shape_in, shape_out, layouts, n, grid=None, traffic=None, sizes=None) -> PlanRow:
    """The plan row of one layer call, on the layer's own axis and spatial dim; ``traffic(width)`` its per-rank traffic
    for the layout's halo ``width`` (exact rows).

    ``sizes``: the input's own layout (the dry run follows it per tensor), else its height's.
    """
    ax = _layer_axis(mod, len(shape_in))
    h_in, h_out = shape_in[ax], shape_out[ax]
    note = ""
    sizes = layouts.get(h_in) if sizes is None else sizes
    if sizes is None:
        sizes = band_sizes(h_in, n, uneven=True)
        note = "input layout assumed (array_split); "
    sd = mod.dp_spatial_index(len(shape_in), ax)  # the layer's own geometry (an unbatched input counts from the end)
    kind = type(mod).__name__.replace("DomainParallel", "")
    geo = mod.dp_geometry(sizes, sd, h_out)
    lay, stride, out_sizes, boundary = geo.layout, geo.stride, sizes, geo.boundary
    note += geo.note
    refused = mod.dp_refusal(n, grid)
    if refused:
        return PlanRow(path=mod.dp_path, kind=kind, rows_in=h_in, rows_out=h_out, bands_in=tuple(sizes),
                       bands_out=tuple(sizes), halo_before=0, halo_after=0, stride=1, min_rows=1, exact=False, note=refused)
    if lay is None:
        exact = all(s > 0 for s in sizes)
        row = PlanRow(path=mod.dp_path, kind=kind, rows_in=h_in, rows_out=h_out, bands_in=tuple(sizes),
                      bands_out=tuple(out_sizes), halo_before=0, halo_after=0, stride=1, min_rows=1, exact=exact,
                      note=note, traffic=traffic(0) if exact and traffic else None)
    else:
        out_sizes = lay.out_sizes
        before = max(max(b.before for b in lay.bands), 0)
        after = max(max(b.after for b in lay.bands), 0)
        problem = lay.problem or _halo_problem(sizes, lay.width, boundary, ax)
        exact = problem is None
        if not exact:
            note += problem
        elif stride > 1 and any(o % stride for o in offsets(sizes)):
            note += f"offsets {offsets(sizes)} not multiples of {stride}: exact, but a transposed layer will not restore them"
        row = PlanRow(path=mod.dp_path, kind=kind, rows_in=h_in, rows_out=h_out, bands_in=tuple(sizes),
                      bands_out=tuple(out_sizes), halo_before=before, halo_after=after, stride=stride,
                      min_rows=lay.min_rows, exact=exact, note=note,
                      traffic=traffic(lay.width) if exact and traffic else None)
    if mod.dp_replicated(h_in, h_out):
        return row  # replicated, not a band layout
    if h_out in layouts and layouts[h_out] != list(out_sizes) and h_out != 1:
        # the output's own layout (followed per tensor): a join with the earlier tensor re-bands it
        extra = f"output bands {list(out_sizes)}, an earlier {h_out}-row tensor's {layouts[h_out]}"
        row = PlanRow(**{**row.__dict__, "note": f"{row.note}; {extra}" if row.note else extra})
    layouts.setdefault(h_out, list(out_sizes))
    return row
