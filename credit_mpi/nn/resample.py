"""Resampling on bands: interpolation (``nn.Upsample`` / ``F.interpolate``) and pooling.

Interpolation and adaptive average pooling are separable linear maps: along
the sharded dim they are a matrix ``W`` (``H_out x H``) that this module
obtains from torch itself (the same call on an identity, in float64, so the
source coordinates, ``align_corners``, ``scale_factor`` and the clamping at
the edge rows are torch's own). Each band computes its output rows (the
resampling rule of :mod:`credit_mpi.nn.geometry`) from the input rows with a
non-zero weight (a halo), then lets torch resample the other dims.

Max / average pooling use the window rule like a convolution: rows outside
the field are ``-inf`` (max) or zeros, and the average's divisor is
corrected to the global window count (``count_include_pad``, ``ceil_mode``,
``divisor_override`` exactly as torch).

``AdaptiveAvgPool`` to one row along the sharded dim is a global mean (a
differentiable all-reduce of sums and counts); the result is REPLICATED on
every rank (a :class:`~credit_mpi.nn.replicated.Replicated` tensor: a later
layer computes on it locally, exactly, instead of taking the replicas for
bands): divide a loss computed from it by the domain size so that
:func:`credit_mpi.reduce_gradients` (which sums over the domain) counts it once.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import split
from . import geometry
from ._comm import agree, allgather_stats, check_halo, fetch_rows
from .base import DomainParallelModule, no_empty_band
from .conv import layout_error
from .replicated import replicated
from .rules import layer_rule
from .traffic import acc_itemsize, halo_rule, row_bytes, stats_rule

__all__ = [
    "DomainParallelUpsample",
    "DomainParallelInterpolate",
    "DomainParallelMaxPool1d",
    "DomainParallelMaxPool2d",
    "DomainParallelMaxPool3d",
    "DomainParallelAvgPool1d",
    "DomainParallelAvgPool2d",
    "DomainParallelAvgPool3d",
    "DomainParallelAdaptiveAvgPool1d",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAdaptiveAvgPool3d",
    "resample_matrix",
]

_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")


@functools.lru_cache(maxsize=64)
def resample_matrix(mode: str, size: int, out_size: int | None, scale: float | None, align_corners: bool | None, recompute: bool | None) -> torch.Tensor:
    """``W`` (out x in, float64) of ``F.interpolate`` along one dim (``mode`` of any dimensionality)."""
    eye = torch.eye(size, dtype=torch.float64)
    if mode in ("linear", "bilinear", "trilinear"):
        x, m, extra = eye.reshape(size, 1, size), "linear", ()
    elif mode == "bicubic":
        x, m, extra = eye.reshape(size, 1, size, 1), "bicubic", (1,)
    else:
        x, m, extra = eye.reshape(size, 1, size), mode, ()
    kw = {"mode": m}
    if m in ("linear", "bicubic"):
        kw["align_corners"] = align_corners
    if scale is not None:
        kw["scale_factor"] = (scale,) + tuple(1.0 for _ in extra)
        kw["recompute_scale_factor"] = recompute
    else:
        kw["size"] = (out_size,) + extra
    y = F.interpolate(x, **kw)
    return y.reshape(size, -1).T.contiguous()


@functools.lru_cache(maxsize=64)
def adaptive_matrix(size: int, out_size: int) -> torch.Tensor:
    """``W`` (out x in, float64) of adaptive average pooling along one dim."""
    w = torch.zeros(out_size, size, dtype=torch.float64)
    for i in range(out_size):
        start, stop = (i * size) // out_size, -(-((i + 1) * size) // out_size)
        w[i, start:stop] = 1.0 / (stop - start)
    return w


def _support(w: torch.Tensor) -> list[tuple[int, int]]:
    """Per row of ``w``: the column range ``(lo, hi)`` of its non-zero weights (``(0, 0)`` for a zero row)."""
    rows, cols = torch.nonzero(w, as_tuple=True)  # row-major: each row's columns ascending
    out = [(0, 0)] * w.shape[0]
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        lo, hi = out[r]
        out[r] = (c, c + 1) if hi == 0 else (lo, c + 1)
    return out


def _matrix(key: tuple) -> torch.Tensor:
    """The map along the sharded dim: ``("interp", mode, size, out_size, scale, align_corners, recompute)`` (the
    arguments of :func:`resample_matrix`) or ``("adaptive", size, out_size)``."""
    return resample_matrix(*key[1:]) if key[0] == "interp" else adaptive_matrix(*key[1:])


def _on_band(key: tuple, rows: int, out_rows: int) -> tuple:
    """``key``'s map on a band of ``rows`` rows alone, giving ``out_rows`` rows (a scale as it is, else the size)."""
    if key[0] == "interp":
        mode, _, _, scale, align, recompute = key[1:]
        return ("interp", mode, rows, None if scale is not None else out_rows, scale, align, recompute)
    return ("adaptive", rows, out_rows)


@functools.lru_cache(maxsize=256)
def _plan(key: tuple, sizes: tuple[int, ...], stored: bool) -> tuple[geometry.LayerBands, bool]:
    """The layout of ``_matrix(key) @ x`` on bands ``sizes`` (``stored``: output bands of a size stored for the
    whole field), and whether the call is BAND-LOCAL: no halo row, and every band's rows of the matrix are the same
    map on the band alone (nearest by a whole factor on bands of whole cells), so torch's own call on the band
    computes them, bit for bit. A pure function of agreed values (cached): every rank takes the same branch.
    """
    w = _matrix(key)
    out_size = w.shape[0]
    lay = geometry.resample_layout(list(sizes), out_size, _support(w),
                                   stored_size_bands(len(sizes), out_size) if stored else None)
    return lay, _band_alone(key, w, lay)


def _band_alone(key: tuple, w: torch.Tensor, lay: geometry.LayerBands) -> bool:
    if lay.problem or lay.width:
        return False
    for b in lay.bands:
        rows, out_rows = b.stop - b.start, b.out_stop - b.out_start
        if not rows or not out_rows:
            return False
        try:
            alone = _matrix(_on_band(key, rows, out_rows))
        except (RuntimeError, ValueError):  # torch refuses the call on the band alone: the matrix path
            return False
        if alone.shape != (out_rows, rows) or not torch.equal(alone, w[b.out_start : b.out_stop, b.start : b.stop]):
            return False
    return True


def stored_size_bands(n: int, out_size: int) -> list[int]:
    """The output bands of an interpolation to a size stored for the whole field (a module's ``dp_stored_size``).

    ``F.interpolate(x, size=(image_height, image_width))`` with the height stored in ``__init__``
    asks for the field's rows: its output is a tensor of that many rows like the model's input,
    so it gets their partition over the domain (:func:`credit_mpi.layout.split`, array_split),
    not the resampling rule's (which follows the input's bands).
    """
    return split(out_size, n, uneven=True)


def _rows_plan(module, sizes: list[int], key: tuple) -> tuple[geometry.LayerBands, bool]:
    """:func:`_plan` of ``key`` for input bands ``sizes`` (the output bands a stored size asks for)."""
    return _plan(key, tuple(sizes), bool(module.__dict__.get("dp_stored_size")))


def _input_halo(shape_in, dtype, axis: int, n: int, width: int, grad: bool, quiet: bool = False):
    """The traffic of a halo of the input's rows (zero edges), back when the input requires grad (``quiet``: see
    :func:`credit_mpi.nn.traffic.halo_rule`)."""
    return halo_rule(n, width, row_bytes(shape_in, axis, dtype.itemsize), "zero", grad, quiet)


def _apply_rows(module, x, bands, lay: geometry.LayerBands, w: torch.Tensor):
    """Rows of ``w @ x`` along the sharded axis that this rank owns (layout ``lay``; collective)."""
    if lay.problem:
        raise layout_error(module.dp_path, lay, 1)
    check_halo(module.dp_path, bands.sizes, lay.width, "zero", bands.axis)
    band = lay.bands[bands.rank]
    rows = fetch_rows(x, bands, band.in_lo, band.in_hi, lay.width, module.dp_manager)
    lo, hi = max(band.in_lo, 0), min(band.in_hi, bands.total)
    wb = torch.zeros(band.out_rows, band.in_hi - band.in_lo, dtype=torch.float64)
    wb[:, lo - band.in_lo : hi - band.in_lo] = w[band.out_start : band.out_stop, lo:hi]
    moved = rows.movedim(bands.axis, -1)
    out = moved @ wb.to(dtype=x.dtype, device=x.device).T
    return out.movedim(-1, bands.axis)


def _per_dim(value, nd):
    if value is None:
        return [None] * nd
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value] * nd


class _InterpolateMixin(DomainParallelModule):
    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> geometry.RowGeometry:
        """The resampling's layout, from the module's own mode / scale (``h_out``: the rows a ``size`` asks for)."""
        sf = _per_dim(self.scale_factor, sd + 1)[sd]
        key = ("interp", self.mode, sum(sizes), h_out if sf is None else None, None if sf is None else float(sf),
               self.align_corners, self.recompute_scale_factor)
        return geometry.RowGeometry(_rows_plan(self, sizes, key)[0])

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """A halo of the input's rows."""
        return _input_halo(shape_in, dtype, axis, n, width, grad, quiet=True)

    def _interp(self, x, size, scale_factor, mode, align_corners, recompute, antialias=False):
        nd = x.ndim - 2
        manager = self.dp_manager

        def axis_of(t):
            if mode not in _MODES:
                raise ValueError(f"{self.dp_path}: interpolation mode {mode!r} has no rule on bands; valid: {_MODES}")
            if antialias:
                raise ValueError(f"{self.dp_path}: antialias=True has no rule on bands")
            if (size is None) == (scale_factor is None):
                raise ValueError(f"{self.dp_path}: give exactly one of size and scale_factor")
            return self.dp_spatial_axis(t, nd, "interpolate")

        sizes, scales = _per_dim(size, nd), _per_dim(scale_factor, nd)

        def plan(b):
            sd = b.axis - 2
            key = ("interp", mode, b.total, sizes[sd], None if scale_factor is None else float(scales[sd]),
                   align_corners, recompute)
            return key, _rows_plan(self, b.sizes, key)

        def quiet(b) -> bool:  # no halo row (nearest by an integer factor on bands of whole cells): no MPI call
            lay = plan(b)[1][0]
            return not lay.problem and not lay.width

        bands = agree(x, axis_of, manager.domain_group, self.dp_path, lambda: (size, scale_factor, mode, align_corners),
                      mode=self.dp_mode(), quiet=quiet)
        sd = bands.axis - 2
        key, (lay, alone) = plan(bands)
        kw = {"mode": mode}
        if mode in ("linear", "bilinear", "bicubic", "trilinear"):
            kw["align_corners"] = align_corners
        if scale_factor is not None:
            kw["recompute_scale_factor"] = recompute
        if alone:  # every band's rows are torch's call on the band alone (agreed: every rank here): that call, whole
            if scale_factor is not None:
                kw["scale_factor"] = tuple(float(s) for s in scales)
            else:
                kw["size"] = tuple(lay.bands[bands.rank].out_rows if i == sd else s for i, s in enumerate(sizes))
            return F.interpolate(x, **kw)
        y = _apply_rows(self, x, bands, lay, _matrix(key))
        if scale_factor is not None:
            kw["scale_factor"] = tuple(1.0 if i == sd else float(s) for i, s in enumerate(scales))
        else:
            kw["size"] = tuple(y.shape[bands.axis] if i == sd else s for i, s in enumerate(sizes))
        if scale_factor is not None and all(float(k) == 1.0 for i, k in enumerate(scales) if i != sd):
            return y
        return F.interpolate(y, **kw)


def _return_indices(module: nn.Module) -> str:
    return "return_indices=True would return band-local indices" if module.return_indices else ""


def _antialias(module: nn.Module) -> str:
    return "antialias has no rule on bands" if getattr(module, "antialias", False) else ""


@layer_rule(nn.Upsample, grid=False, refuses=_antialias)
class DomainParallelUpsample(_InterpolateMixin, nn.Upsample):
    """``nn.Upsample`` on bands, exact including the edge rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        return self._interp(x, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor)


class DomainParallelInterpolate(_InterpolateMixin, nn.Module):
    """``F.interpolate`` as a module, on bands (the reference's name); the arguments are F.interpolate's."""

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None, *, manager=None, shard_dim: int = -2) -> None:
        super().__init__()
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor
        if manager is None:
            from ..manager import get_domain_parallel_manager

            manager = get_domain_parallel_manager()
        self.dp_manager, self.dp_shard_dim, self.dp_path = manager, shard_dim, "DomainParallelInterpolate"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor)
        return self._interp(x, self.size, self.scale_factor, self.mode, self.align_corners, self.recompute_scale_factor)


_MAX_POOL = {2: torch.ops.aten.max_pool2d_with_indices, 3: torch.ops.aten.max_pool3d_with_indices}
_MAX_POOL_BACKWARD = {2: torch.ops.aten.max_pool2d_with_indices_backward,
                      3: torch.ops.aten.max_pool3d_with_indices_backward}


class _MaxPoolRows(torch.autograd.Function):
    """Max pooling of fetched rows that keeps the indices alone for backward, as torch's kernel on the band does
    (its input, which the layer before keeps anyway, is not copied: the fetched rows are freed after the forward).

    ``edges``: how many of the first and last rows lie past the field's edges; they are set to -inf here (the
    exchange's zeros, in place: no copy of the rows), so their gradient is zero as a padded -inf row's is.
    Backward: torch's own ``max_pool*_with_indices_backward`` (the same kernel ``F.max_pool*``'s backward runs).
    """

    @staticmethod
    def forward(ctx, rows, axis, edges, window, ceil_mode):
        r = _edges_to_minus_inf(rows.detach(), axis, edges)
        out, idx = _MAX_POOL[len(window[0])](r, *window, ceil_mode)
        ctx.save_for_backward(idx)
        ctx.shape, ctx.window, ctx.ceil_mode = rows.shape, window, ceil_mode
        return out

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        shape_of = grad.new_empty(ctx.shape)  # read for its shape (and layout) only: the kernel's output starts at zero
        g = _MAX_POOL_BACKWARD[len(ctx.window[0])](grad, shape_of, *ctx.window, ctx.ceil_mode, idx)
        return g, None, None, None, None


def max_pool_rows(rows: torch.Tensor, axis: int, edges: tuple[int, int], window: tuple[list, list, list, list],
                  ceil_mode: bool) -> torch.Tensor:
    """``F.max_pool*`` of fetched rows (``window``: kernel, stride, padding, dilation per spatial dim), the first
    ``edges[0]`` and last ``edges[1]`` rows along ``axis`` (past the field's edges) counted as -inf.

    Recorded (the input requires grad): :class:`_MaxPoolRows`, which keeps the indices only. Else torch's
    pooling (no indices), the edge rows -inf in place (rows past an edge are the exchange's fresh output).
    """
    nd = len(window[0])
    if torch.is_grad_enabled() and rows.requires_grad:
        if nd == 1:  # torch's 1-D pooling is its 2-D kernel on one row (the sharded dim is the last)
            window2 = tuple([first, *w] for first, w in zip((1, 1, 0, 1), window, strict=True))
            return _MaxPoolRows.apply(rows.unsqueeze(-2), axis % rows.ndim + 1, edges, window2, ceil_mode).squeeze(-2)
        return _MaxPoolRows.apply(rows, axis, edges, window, ceil_mode)
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]  # not recorded: the rows are the exchange's, fresh
    return fn(_edges_to_minus_inf(rows, axis, edges), *window, ceil_mode)


def _edges_to_minus_inf(rows: torch.Tensor, axis: int, edges: tuple[int, int]) -> torch.Tensor:
    """``rows`` with its first ``edges[0]`` and last ``edges[1]`` rows along ``axis`` (past the field's edges: the
    exchange's zeros) set to -inf in place (no copy), as a max pool's padding counts them."""
    low, high = edges
    if low:
        rows.narrow(axis, 0, low).fill_(float("-inf"))
    if high:
        rows.narrow(axis, rows.shape[axis] - high, high).fill_(float("-inf"))
    return rows


class _PoolMixin(DomainParallelModule):
    _nd = 2
    _max = True

    def _windows(self) -> tuple[list, list, list, list]:
        """Per spatial dim: kernel, stride, padding, dilation."""
        k, s, p = (_per_dim(v, self._nd) for v in (self.kernel_size, self.stride or self.kernel_size, self.padding))
        return k, s, p, _per_dim(getattr(self, "dilation", 1), self._nd)

    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> geometry.RowGeometry:
        """A window layout (zero edges, ``ceil_mode`` as the module)."""
        k, s, p, d = self._windows()
        return geometry.RowGeometry(geometry.conv_layout(sizes, k[sd], s[sd], d[sd], p[sd], p[sd], self.ceil_mode), s[sd])

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """A halo of the input's rows."""
        return _input_halo(shape_in, dtype, axis, n, width, grad, quiet=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        nd, manager = self._nd, self.dp_manager

        def axis_of(t):
            if getattr(self, "return_indices", False):
                raise ValueError(f"{self.dp_path}: return_indices=True has no rule on bands (the indices would be local)")
            return self.dp_spatial_axis(t, nd, type(self).__name__)

        bands = agree(x, axis_of, manager.domain_group, self.dp_path, mode=self.dp_mode(),
                      quiet=lambda b: self.dp_no_halo(b.sizes, b.axis - (x.ndim - nd)))
        axis = bands.axis
        sd = axis - (x.ndim - nd)
        k, s, p, d = self._windows()
        geo = self.dp_geometry(bands.sizes, sd)
        lay = geo.layout
        if lay.problem:
            raise layout_error(self.dp_path, lay, geo.stride)
        check_halo(self.dp_path, bands.sizes, lay.width, geo.boundary, axis)
        band = lay.bands[bands.rank]
        pad = [0 if i == sd else p[i] for i in range(nd)]
        if self._max:  # the rows past the field's edges (zeros from the exchange) are -inf, set inside the pooling
            rows = fetch_rows(x, bands, band.in_lo, band.in_hi, lay.width, manager)
            edges = (max(0, -band.in_lo), max(0, band.in_hi - bands.total))
            return max_pool_rows(rows, axis, edges, (k, s, pad, d), self.ceil_mode)
        rows = fetch_rows(x, bands, band.in_lo, band.in_hi, lay.width, manager)
        fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
        args = (rows, k, s, pad, self.ceil_mode, self.count_include_pad)
        y = fn(*args) if nd == 1 else fn(*args, self.divisor_override)
        if getattr(self, "divisor_override", None):
            return y
        # the local divisor counted k rows along the sharded dim; torch's counts the global window
        counts = []
        for i in range(band.out_start, band.out_stop):
            start = s[sd] * i - p[sd]
            stop = min(start + k[sd], bands.total + p[sd])
            if not self.count_include_pad:
                start, stop = max(start, 0), min(stop, bands.total)
            counts.append(k[sd] / (stop - start))
        factor = torch.tensor(counts, dtype=x.dtype, device=x.device).reshape([-1] + [1] * (x.ndim - 1 - axis))
        return y * factor


@layer_rule(nn.MaxPool1d, grid=False, refuses=_return_indices)
class DomainParallelMaxPool1d(_PoolMixin, nn.MaxPool1d):
    """``nn.MaxPool1d`` on bands."""

    _nd = 1


@layer_rule(nn.MaxPool2d, grid=False, refuses=_return_indices)
class DomainParallelMaxPool2d(_PoolMixin, nn.MaxPool2d):
    """``nn.MaxPool2d`` on bands."""

    _nd = 2


@layer_rule(nn.MaxPool3d, grid=False, refuses=_return_indices)
class DomainParallelMaxPool3d(_PoolMixin, nn.MaxPool3d):
    """``nn.MaxPool3d`` on bands."""

    _nd = 3


@layer_rule(nn.AvgPool1d, grid=False)
class DomainParallelAvgPool1d(_PoolMixin, nn.AvgPool1d):
    """``nn.AvgPool1d`` on bands."""

    _nd, _max = 1, False


@layer_rule(nn.AvgPool2d, grid=False)
class DomainParallelAvgPool2d(_PoolMixin, nn.AvgPool2d):
    """``nn.AvgPool2d`` on bands."""

    _nd, _max = 2, False


@layer_rule(nn.AvgPool3d, grid=False)
class DomainParallelAvgPool3d(_PoolMixin, nn.AvgPool3d):
    """``nn.AvgPool3d`` on bands."""

    _nd, _max = 3, False


class _AdaptiveAvgMixin(DomainParallelModule):
    _nd = 2

    def dp_replicated(self, h_in: int, h_out: int) -> bool:
        """True for the global mean (one output row of several): replicated on every rank."""
        return h_out == 1 and h_in > 1

    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> geometry.RowGeometry:
        """The bands kept (same rows), the global mean, or an averaging matrix's layout."""
        h_in = sum(sizes)
        if self.dp_replicated(h_in, h_out):
            return geometry.RowGeometry(note="global mean: one allgather, output replicated")
        if h_out == h_in:
            return geometry.RowGeometry()
        return geometry.RowGeometry(_plan(("adaptive", h_in, h_out), tuple(sizes), False)[0])

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """The global mean: sums gathered, a reduce-scatter backward; else a halo of the input's rows (none kept)."""
        if self.dp_replicated(shape_in[axis], shape_out[axis]):
            b = math.prod(shape_out) * acc_itemsize(dtype)
            return stats_rule(n, b, b, grad)
        return _input_halo(shape_in, dtype, axis, n, width, grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        nd, manager = self._nd, self.dp_manager
        bands = agree(x, lambda t: self.dp_spatial_axis(t, nd, type(self).__name__), manager.domain_group, self.dp_path, mode=self.dp_mode())
        no_empty_band(self.dp_path, bands.sizes)  # agreed: an empty band would fail alone, the others in the mean's allgather
        axis = bands.axis
        sd = axis - (x.ndim - nd)
        out = _per_dim(self.output_size, nd)
        fn = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[nd]
        keep = [x.shape[axis] if i == sd else (x.shape[x.ndim - nd + i] if o is None else o) for i, o in enumerate(out)]
        if out[sd] is None or out[sd] == bands.total:
            return fn(x, keep)
        if self.dp_replicated(bands.total, out[sd]):  # the global mean along the sharded dim: replicated on every rank
            return replicated(self._global_mean(x, bands, sd, keep, fn).to(x.dtype))
        key = ("adaptive", bands.total, out[sd])
        lay, alone = _plan(key, tuple(bands.sizes), False)
        if alone:  # every band's windows are its own (agreed: every rank here): torch's pooling of the band
            keep[sd] = lay.bands[bands.rank].out_rows
            return fn(x, keep)
        y = _apply_rows(self, x, bands, lay, _matrix(key))
        keep[sd] = y.shape[axis]
        return fn(y, keep)

    def _global_mean(self, x: torch.Tensor, bands, sd: int, keep: list[int], fn) -> torch.Tensor:
        """The mean over the sharded dim (and torch's windows in the others) from this band's sums: one allgather.

        Sums keep nothing for backward (their gradient is the output's, expanded), as torch's own
        global mean (``adaptive_avg_pool`` to 1 x 1 is ``x.mean``) does: an output of one element
        per plane (scSE's channel squeeze) is one sum over the band's spatial dims; otherwise the
        band's row sum, then torch's pooling of the other dims on that one row.
        """
        nd, axis = self._nd, bands.axis
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        others = [x.ndim - nd + i for i in range(nd) if i != sd]
        if all(keep[i] == 1 for i in range(nd) if i != sd):
            local, count = x.sum([axis, *others], keepdim=True, dtype=acc), bands.total * math.prod(x.shape[d] for d in others)
        else:
            local, count = fn(x.sum(axis, keepdim=True, dtype=acc), [1 if i == sd else keep[i] for i in range(nd)]), bands.total
        return allgather_stats(local, self.dp_manager.domain_group).sum(0) / count


@layer_rule(nn.AdaptiveAvgPool1d, grid=False)
class DomainParallelAdaptiveAvgPool1d(_AdaptiveAvgMixin, nn.AdaptiveAvgPool1d):
    """``nn.AdaptiveAvgPool1d`` on bands."""

    _nd = 1


@layer_rule(nn.AdaptiveAvgPool2d, grid=False)
class DomainParallelAdaptiveAvgPool2d(_AdaptiveAvgMixin, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` on bands."""

    _nd = 2


@layer_rule(nn.AdaptiveAvgPool3d, grid=False)
class DomainParallelAdaptiveAvgPool3d(_AdaptiveAvgMixin, nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` on bands."""

    _nd = 3
