"""Convolutions and transposed convolutions on latitude bands (1-D, 2-D, 3-D).

Each rank computes exactly the global output rows it owns (the rules are in
:mod:`credit_mpi.nn.geometry`): it fetches the input rows those need from its
neighbours (:func:`credit_mpi.halo_exchange`, differentiable), with the
module's own padding at the global edges (``zeros``; ``circular`` - the
first and last bands exchange; ``reflect``; ``replicate`` - the edge row),
pads the other spatial dims locally like the module, and runs the
convolution with no padding along the sharded dim. Transposed convolutions
compute their band's full contribution and add the rows that fall on the
neighbours' output rows there (overlap-add), then the bias.

On a 2-D latitude x longitude domain grid (``domain_grid=(rows, cols)``,
``cols > 1``) the same happens in both of the last two dims at once: the
layer agrees on every rank's block, fetches its window with the 2-D halo
(:func:`credit_mpi.halo_exchange` with pairs: corners included; the
module's padding mode at the edges, ``circular`` wrapping the longitude),
and computes exactly its own output block (the ownership rule of
:mod:`credit_mpi.nn.geometry` in each dim). Transposed convolutions add
their overlap to the neighbouring blocks, corners included.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..manager import domain_of
from ..partition import check_halo_width
from . import geometry
from ._comm import agree, agree_blocks, check_halo, fetch_block, fetch_rows, overlap_add, overlap_add_2d
from ._overlap import overlapped_conv, split
from .band_conv import BandEdges, band_conv, band_edges
from .base import DomainParallelModule
from .base import layout_refusal as layout_error
from .rules import layer_rule
from .traffic import halo_rule, row_bytes

__all__ = [
    "DomainParallelConv1d",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose1d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
    "ConvSpec",
    "conv_paddings",
    "fold_edge_rows",
    "halo_conv",
]

#: Overlap a band convolution's halo exchange with its interior rows (:mod:`credit_mpi.nn._overlap`).
#: Set it alike on every rank (it is part of each layer's agreement: a rank that differs raises on every rank).
OVERLAP = False
_local_halos = False  # within local_halos(): the band convs take the fetched rows' path (its exchange stood in)

_BOUNDARY = {"zeros": "zero", "circular": "periodic", "reflect": "reflect", "replicate": "replicate"}
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_paddings(module: nn.Module) -> list[tuple[int, int]]:
    """``(before, after)`` padding of each spatial dim of a convolution (``"same"``/``"valid"`` resolved like torch).

    Zero rows folded in from an ``F.pad`` of the sharded dim just before the layer (``dp_edge_rows``,
    see :func:`fold_edge_rows`) are part of the padding: the layer's ownership rule then anchors its
    output rows on the unpadded field, so branches padded differently (WXFormer's CrossEmbed
    branches) give their outputs one band layout.
    """
    return list(_paddings(tuple(module.kernel_size), tuple(module.dilation), _hashable(module.padding),
                          module.__dict__.get("dp_edge_rows")))


def _hashable(padding):
    return padding if isinstance(padding, str) else tuple(padding)


@functools.lru_cache(maxsize=256)
def _paddings(kernel: tuple[int, ...], dilation: tuple[int, ...], padding, edge) -> tuple[tuple[int, int], ...]:
    """:func:`conv_paddings` of a module's settings."""
    nd = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            out = [(0, 0)] * nd
        else:
            out = []
            for k, d in zip(kernel, dilation, strict=True):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
    else:
        out = [(p, p) for p in padding]
    if edge is not None:
        sd, before, after, others = edge[0], edge[1], edge[2], edge[3:]
        out[sd] = (out[sd][0] + before, out[sd][1] + after)
        for i in range(nd):  # the other dims' folded zeros (an F.pad list: the last dim first)
            k = 2 * (nd - 1 - i)
            if i != sd and k + 1 < len(others):
                out[i] = (out[i][0] + others[k], out[i][1] + others[k + 1])
    return tuple(out)


def fold_edge_rows(module: nn.Module, edge: tuple[int, ...] | None) -> None:
    """Set (``(sd, before, after)``) or clear (None) the zero rows a convolution adds at the field's edges of spatial dim ``sd``.

    The function-level tracker folds ``F.pad(x, zeros)`` of the sharded dim into the next
    convolution (padding only the first and last band would shift every band's start, and with
    it the output rows each band owns): for the length of one call, then cleared. ``(sd, before,
    after, *others)``: the same pad's zeros of the other spatial dims too (``others`` an ``F.pad``
    list, the last dim first, its ``sd`` entries zero), so the band is not copied to pad them.
    """
    if edge is None:
        module.__dict__.pop("dp_edge_rows", None)
    else:
        module.__dict__["dp_edge_rows"] = tuple(int(v) for v in edge)


def _edge_padded(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` with the folded edge rows (:func:`fold_edge_rows`) as zeros: the original forward's input on one band."""
    edge = module.__dict__.get("dp_edge_rows")
    if edge is None:
        return x
    sd, before, after, others = edge[0], edge[1], edge[2], list(edge[3:])
    nd = len(module.kernel_size)
    pad = others + [0] * max(0, 2 * nd - len(others))
    pad[2 * (nd - 1 - sd)], pad[2 * (nd - 1 - sd) + 1] = before, after
    return F.pad(x, pad)


def conv_layout(module: nn.Module, sizes: list[int], sd: int) -> geometry.LayerBands:
    """The window layout of ``module`` along spatial dim ``sd`` for bands ``sizes``."""
    before, after = conv_paddings(module)[sd]
    return geometry.conv_layout(sizes, module.kernel_size[sd], module.stride[sd], module.dilation[sd], before, after)


def transposed_layout(module: nn.Module, sizes: list[int], sd: int) -> geometry.LayerBands:
    """The transposed layout of ``module`` along spatial dim ``sd``."""
    return geometry.transposed_layout(
        sizes, module.kernel_size[sd], module.stride[sd], module.dilation[sd], module.padding[sd], module.output_padding[sd]
    )


class ConvSpec(NamedTuple):
    """The settings of a band convolution's kernel call (the sharded dim unpadded: its halo rows are fetched)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int


class BandPlan(NamedTuple):
    """What a band convolution does for one agreed band layout: decided once, remembered (:func:`band_plan`)."""

    layout: geometry.LayerBands  # every rank's window (``layout.problem``: why it has none)
    boundary: str  # the halo's outer edge (:data:`credit_mpi.partition.BOUNDARIES`, or ``"replicate"``)
    halo_fits: bool  # the halo fits the bands (else the layer raises check_halo's error, on every rank)
    pad: tuple[list[int], str] | None  # ``F.pad`` of the other spatial dims (argument, mode), or None
    spec: ConvSpec  # the kernel call's settings (the sharded dim unpadded)
    edges: tuple[BandEdges, ...] | None  # every rank's edge strips: the band conv that copies no band
    # (credit_mpi.nn.band_conv), or None (that split is not exact and simple here: the fetched rows' path)
    padding: tuple[int, ...]  # the band conv's kernel call: the module's padding, the sharded dim's too


@functools.lru_cache(maxsize=1024)
def band_plan(kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], groups: int, padding,
              padding_mode: str, edge, sizes: tuple[int, ...], sd: int) -> BandPlan:
    """The :class:`BandPlan` of a convolution with these settings on bands ``sizes`` (sharded spatial dim ``sd``): a pure function of agreed values, so a layer called step after step with the same
    bands plans once (no geometry, halo check or padding arithmetic per call)."""
    nd = len(kernel)
    pads = _paddings(kernel, dilation, padding, edge)
    before, after = pads[sd]
    lay = geometry.conv_layout(list(sizes), kernel[sd], stride[sd], dilation[sd], before, after)
    boundary = _BOUNDARY[padding_mode]
    fits = True
    if not lay.problem and boundary != "replicate":
        try:
            check_halo_width(list(sizes), lay.width, boundary, sd)
        except ValueError:
            fits = False
    conv_padding = [0] * nd
    pad = None
    if padding_mode == "zeros":
        conv_padding = [0 if i == sd else pads[i][0] for i in range(nd)]
        if any(pads[i][0] != pads[i][1] for i in range(nd) if i != sd):  # "same" with an even kernel
            pad = (_pad_arg(list(pads), sd, nd, skip_symmetric=True), "constant")
            conv_padding = [0 if i == sd or pads[i][0] != pads[i][1] else pads[i][0] for i in range(nd)]
    elif any(p != (0, 0) for i, p in enumerate(pads) if i != sd):
        pad = (_pad_arg(list(pads), sd, nd), padding_mode)
    edges = None
    if not lay.problem and fits and pad is None and before == after and boundary in ("zero", "periodic"):
        edges = band_edges(sizes, kernel[sd], stride[sd], dilation[sd], before, lay.width, boundary == "periodic",
                           lay.bands)
    return BandPlan(lay, boundary, fits, pad, ConvSpec(tuple(stride), tuple(conv_padding), tuple(dilation), groups),
                    edges, tuple(before if i == sd else p for i, p in enumerate(conv_padding)))


class _EdgeRows(torch.autograd.Function):
    """Copies of the first ``top`` and last ``bottom`` rows of ``rows`` along ``axis`` (the fetched halo rows).

    What a band convolution keeps of its padded input besides the band itself: the padded tensor is not
    kept (its storage is freed after the forward). Backward: the rows' gradients in place, zeros between;
    it runs in a second backward only (:class:`_HaloConv` sends the first one's gradient to ``rows``).
    """

    @staticmethod
    def forward(ctx, rows, axis, top, bottom):
        n = rows.shape[axis]
        ctx.axis, ctx.shape = axis, rows.shape
        ctx.set_materialize_grads(False)
        return rows.narrow(axis, 0, top).clone(), rows.narrow(axis, n - bottom, bottom).clone()

    @staticmethod
    def backward(ctx, g_top, g_bottom):
        if g_top is None and g_bottom is None:
            return None, None, None, None
        shape = list(ctx.shape)
        if g_top is None:
            g_top = g_bottom.new_zeros([0 if d == ctx.axis else s for d, s in enumerate(shape)])
        if g_bottom is None:
            g_bottom = g_top.new_zeros([0 if d == ctx.axis else s for d, s in enumerate(shape)])
        shape[ctx.axis] -= g_top.shape[ctx.axis] + g_bottom.shape[ctx.axis]
        return torch.cat([g_top, g_top.new_zeros(shape), g_bottom], ctx.axis), None, None, None


class _HaloConv(torch.autograd.Function):
    """``conv(rows)`` that keeps ``top``, ``mid`` and ``bottom`` (``rows`` = their concatenation along ``axis``) for backward.

    ``mid`` is a view of the band, which the unconverted convolution keeps too; ``top`` and ``bottom`` are
    the halo rows (:class:`_EdgeRows`). Backward rebuilds ``rows`` and runs torch's own convolution
    backward (``aten.convolution_backward``: the kernel ``F.conv*``'s backward runs, so the numbers are
    the same); the input gradient goes to ``rows`` (on to the halo exchange's adjoint, as the plain
    convolution's does). Twice differentiable: the backward is torch ops on the saved pieces, which are
    joined to ``x`` (``mid`` a view of it, the halo rows through the exchange).
    """

    @staticmethod
    def forward(ctx, rows, top, mid, bottom, weight, bias, axis, spec):
        ctx.axis, ctx.spec, ctx.bias_sizes = axis, spec, None if bias is None else list(bias.shape)
        ctx.save_for_backward(top, mid, bottom, weight)
        return _CONV[weight.ndim - 2](rows, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)

    @staticmethod
    def backward(ctx, grad):
        top, mid, bottom, weight = ctx.saved_tensors
        spec, axis = ctx.spec, ctx.axis
        need = ctx.needs_input_grad
        rows = torch.cat([top, mid, bottom], axis)
        g_in, g_w, g_b = torch.ops.aten.convolution_backward(
            grad, rows, weight, ctx.bias_sizes, list(spec.stride), list(spec.padding), list(spec.dilation), False,
            [0] * len(spec.stride), spec.groups, [need[0], need[4], need[5] and ctx.bias_sizes is not None])
        return g_in, None, None, None, g_w, g_b, None, None


def halo_conv(x: torch.Tensor, rows: torch.Tensor, first: int, axis: int, weight: torch.Tensor,
              bias: torch.Tensor | None, spec: ConvSpec) -> torch.Tensor:
    """The convolution of ``rows`` (the band ``x`` with its fetched halo: ``rows``' row ``i`` is the band's row ``first + i``).

    The output is ``conv(rows)``'s, and autograd keeps what the unconverted convolution keeps on the band
    (a view of ``x``) plus the halo rows, not the padded copy. The kernel of a band convolution, callable
    on its own (the function-level rules run ``F.conv*`` on bands through it).
    """
    n, m = rows.shape[axis], x.shape[axis]
    lo, hi = max(first, 0), min(first + n, m)
    recorded = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad
                                            or (bias is not None and bias.requires_grad))
    unbatched = rows.ndim != weight.ndim  # (C, H, W): torch's convolution_backward takes batched inputs only
    if hi <= lo or not recorded or unbatched or torch.is_autocast_enabled(x.device.type):  # nothing kept, or autocast
        return _CONV[weight.ndim - 2](rows, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)
    top = lo - first
    top_rows, bottom_rows = _EdgeRows.apply(rows, axis, top, n - top - (hi - lo))
    return _HaloConv.apply(rows, top_rows, x.narrow(axis, lo, hi - lo), bottom_rows, weight, bias, axis, spec)


class _ConvMixin(DomainParallelModule):
    _nd = 2

    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> geometry.RowGeometry:
        """A window layout with a halo past the edges as ``padding_mode`` pads."""
        return geometry.RowGeometry(self._plan(sizes, sd).layout, self.stride[sd], _BOUNDARY[self.padding_mode])

    def dp_no_halo(self, sizes: list[int], sd: int) -> bool:
        """No row of another band is read (a 1x1 conv): the remembered plan's answer."""
        lay = self._plan(sizes, sd).layout
        return not lay.problem and not lay.width

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """A halo of the input's rows forward; its gradients home backward (the input requires grad)."""
        return halo_rule(n, width, row_bytes(shape_in, axis, dtype.itemsize), _BOUNDARY[self.padding_mode], grad, quiet=True)

    def _plan(self, sizes, sd: int) -> BandPlan:
        """:func:`band_plan` of this module's settings."""
        return band_plan(tuple(self.kernel_size), tuple(self.stride), tuple(self.dilation), self.groups,
                         _hashable(self.padding), self.padding_mode, self.__dict__.get("dp_edge_rows"), tuple(sizes),
                         sd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(_edge_padded(self, x))
        if self.dp_on_grid():
            return self._grid_forward(x)
        manager, nd = self.dp_manager, self._nd
        overlap = bool(OVERLAP)  # agreed with the input: it decides the exchange's MPI calls
        edge = self.__dict__.get("dp_edge_rows")
        bands = agree(x, lambda t: self.dp_spatial_axis(t, nd, type(self).__name__), manager.domain_group, self.dp_path,
                      extra=lambda: ("overlap", overlap, edge), mode=self.dp_mode(),
                      quiet=lambda b: self.dp_no_halo(b.sizes, b.axis - (x.ndim - nd)))
        axis = bands.axis
        sd = axis - (x.ndim - nd)
        plan = self._plan(bands.sizes, sd)  # remembered: the agreed values decide it (every rank alike)
        lay, boundary = plan.layout, plan.boundary
        if lay.problem:
            raise layout_error(self.dp_path, lay, self.stride[sd])
        if not plan.halo_fits:  # agreed sizes: raises on every rank
            check_halo(self.dp_path, bands.sizes, lay.width, boundary, axis)
        band = lay.bands[bands.rank]
        if overlap and lay.width and boundary in ("zero", "periodic") and x.device.type == "cpu":
            span = self.dilation[sd] * (self.kernel_size[sd] - 1) + 1
            every = [split(b.in_lo - (b.start - lay.width), lay.width, b.stop - b.start, b.out_stop - b.out_start,
                           self.stride[sd], span) for b in lay.bands]
            if all(every):  # decided from the agreed layout: every rank overlaps, or none does
                neighbours = domain_of(manager).neighbors(boundary == "periodic")
                return overlapped_conv(x, functools.partial(self._conv_rows, plan), axis, lay.width,
                                       band.in_lo - (bands.start - lay.width), band.out_stop - band.out_start,
                                       self.stride[sd], span, manager.domain_group, neighbours, every[bands.rank])
        if (plan.edges is not None and not overlap and not _local_halos and x.ndim == self.weight.ndim
                and not torch.is_autocast_enabled(x.device.type)):  # agreed plan, input and flags: every rank alike
            spec = plan.spec
            return band_conv(x, self.weight, self.bias, plan.edges, bands.rank, tuple(bands.sizes), axis, lay.width,
                             boundary, manager, spec.stride, plan.padding, spec.padding, spec.dilation, spec.groups)
        rows = fetch_rows(x, bands, band.in_lo, band.in_hi, lay.width, manager, boundary)
        if not lay.width or plan.pad is not None:  # the rows are x's own (a view), or padded again in another dim
            return self._conv_rows(plan, rows)
        return halo_conv(x, rows, band.in_lo - bands.start, axis, self.weight, self.bias, plan.spec)

    def _conv_rows(self, plan: BandPlan, rows: torch.Tensor) -> torch.Tensor:
        """The convolution of fetched rows (the sharded dim's halo in, no padding along it): the other dims padded like the module."""
        if plan.pad is not None:
            rows = F.pad(rows, plan.pad[0], mode=plan.pad[1])
        spec = plan.spec
        return _CONV[self._nd](rows, self.weight, self.bias, spec.stride, spec.padding, spec.dilation, spec.groups)

    def _grid_forward(self, x: torch.Tensor) -> torch.Tensor:
        """On a 2-D grid: fetch the (latitude, longitude) window of this block's output block, then convolve."""
        manager, nd = self.dp_manager, self._nd
        blocks = agree_blocks(x, lambda t: self.dp_grid_axes(t, nd, type(self).__name__), manager, self.dp_path, mode=self.dp_mode())
        ay, ax = blocks.axes
        sy, sx = ay - (x.ndim - nd), ax - (x.ndim - nd)
        lays = (conv_layout(self, blocks.heights, sy), conv_layout(self, blocks.widths, sx))
        boundary = _BOUNDARY[self.padding_mode]
        for what, lay, sd, sizes, axis in (("latitude", lays[0], sy, blocks.heights, ay),
                                           ("longitude", lays[1], sx, blocks.widths, ax)):
            if lay.problem:
                raise layout_error(f"{self.dp_path} ({what} blocks {sizes})", lay, self.stride[sd])
            if boundary != "replicate":
                check_halo(f"{self.dp_path} ({what} blocks)", sizes, lay.width, boundary, axis)
        by, bx = lays[0].bands[blocks.row], lays[1].bands[blocks.col]
        rows = fetch_block(x, blocks, (by.in_lo, by.in_hi), (bx.in_lo, bx.in_hi), (lays[0].width, lays[1].width),
                           manager, (boundary, boundary))
        pads = conv_paddings(self)
        skip = {sy, sx}
        conv_padding = [0] * nd
        if self.padding_mode == "zeros":
            conv_padding = [0 if i in skip else pads[i][0] for i in range(nd)]
            if any(pads[i][0] != pads[i][1] for i in range(nd) if i not in skip):  # "same" with an even kernel
                rows = F.pad(rows, _pad_arg(pads, skip, nd, skip_symmetric=True))
                conv_padding = [0 if i in skip or pads[i][0] != pads[i][1] else pads[i][0] for i in range(nd)]
        elif any(p != (0, 0) for i, p in enumerate(pads) if i not in skip):
            rows = F.pad(rows, _pad_arg(pads, skip, nd), mode=self.padding_mode)
        return _CONV[nd](rows, self.weight, self.bias, self.stride, conv_padding, self.dilation, self.groups)


def _pad_arg(pads: list[tuple[int, int]], sd: int | set[int], nd: int, skip_symmetric: bool = False) -> list[int]:
    skip = sd if isinstance(sd, set) else {sd}
    arg: list[int] = []
    for i in reversed(range(nd)):
        before, after = pads[i]
        if i in skip or (skip_symmetric and before == after):
            arg += [0, 0]
        else:
            arg += [before, after]
    return arg


class _ConvTransposeMixin(DomainParallelModule):
    _nd = 2

    def dp_geometry(self, sizes: list[int], sd: int, h_out: int | None = None) -> geometry.RowGeometry:
        """A transposed layout, its output rows overlap-added across bands (no halo check: ``boundary`` None)."""
        return geometry.RowGeometry(transposed_layout(self, sizes, sd), 1, None)

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """The overlap-add of the output's rows forward; back whenever the input or the weight requires grad."""
        return halo_rule(n, width, row_bytes(shape_out, axis, dtype.itemsize), None, grad or weight_grad, quiet=True)

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x, output_size)
        if self.dp_on_grid():
            return self._grid_forward(x, output_size)
        manager, nd = self.dp_manager, self._nd

        def axis_of(t: torch.Tensor) -> int:
            if output_size is not None:
                raise ValueError(f"{self.dp_path}: output_size is not supported on bands; set output_padding on the module")
            if self.padding_mode != "zeros":
                raise ValueError(f"{self.dp_path}: padding_mode={self.padding_mode!r} (torch supports only 'zeros')")
            return self.dp_spatial_axis(t, nd, type(self).__name__)

        bands = agree(x, axis_of, manager.domain_group, self.dp_path, self._records, mode=self.dp_mode(),
                      quiet=lambda b: self.dp_no_halo(b.sizes, b.axis - (x.ndim - nd)))
        axis = bands.axis
        sd = axis - (x.ndim - nd)
        lay = self.dp_geometry(bands.sizes, sd).layout
        if lay.problem:
            raise layout_error(self.dp_path, lay, 1)
        band = lay.bands[bands.rank]
        padding = [0 if i == sd else self.padding[i] for i in range(nd)]
        output_padding = [0 if i == sd else self.output_padding[i] for i in range(nd)]
        # y holds output rows [in_lo, in_hi); overlap_add wants [out_start - width, out_stop + width)
        w = lay.width
        before = band.in_lo - (band.out_start - w)
        after = (band.out_stop + w) - band.in_hi
        if not w and not before and not after:  # agreed layout: no row overlaps a neighbour's (kernel == stride)
            return _CONV_T[nd](x, self.weight, self.bias, self.stride, padding, output_padding, self.groups, self.dilation)
        y = _CONV_T[nd](x, self.weight, None, self.stride, padding, output_padding, self.groups, self.dilation)
        pad = [0, 0] * (x.ndim - 1 - axis) + [before, after]
        y = F.pad(y, pad)
        out = overlap_add(y, band.out_rows, w, axis, manager, lay.out_sizes)
        if self.bias is not None:
            out = out + self.bias.view([-1] + [1] * nd).to(out.dtype)  # autocast: a bf16 output stays bf16
        return out

    def _records(self) -> tuple[str, bool]:
        """Part of the agreement: whether the overlap-add's backward runs (the weight's requires_grad decides it too)."""
        return "weight requires_grad", bool(self.weight.requires_grad)

    def _grid_forward(self, x: torch.Tensor, output_size: list[int] | None) -> torch.Tensor:
        """On a 2-D grid: this block's full contribution, the overlap added to the neighbouring blocks (corners too)."""
        manager, nd = self.dp_manager, self._nd

        def axes_of(t: torch.Tensor) -> tuple[int, int]:
            if output_size is not None:
                raise ValueError(f"{self.dp_path}: output_size is not supported on blocks; set output_padding on the module")
            if self.padding_mode != "zeros":
                raise ValueError(f"{self.dp_path}: padding_mode={self.padding_mode!r} (torch supports only 'zeros')")
            return self.dp_grid_axes(t, nd, type(self).__name__)

        blocks = agree_blocks(x, axes_of, manager, self.dp_path, self._records, mode=self.dp_mode())
        ay, ax = blocks.axes
        sy, sx = ay - (x.ndim - nd), ax - (x.ndim - nd)
        lays = (transposed_layout(self, blocks.heights, sy), transposed_layout(self, blocks.widths, sx))
        for what, lay, sizes in (("latitude", lays[0], blocks.heights), ("longitude", lays[1], blocks.widths)):
            if lay.problem:
                raise layout_error(f"{self.dp_path} ({what} blocks {sizes})", lay, 1)
        skip = {sy, sx}
        padding = [0 if i in skip else self.padding[i] for i in range(nd)]
        output_padding = [0 if i in skip else self.output_padding[i] for i in range(nd)]
        y = _CONV_T[nd](x, self.weight, None, self.stride, padding, output_padding, self.groups, self.dilation)
        # y holds output rows [in_lo, in_hi) in each grid dim; overlap_add_2d wants [out_start - width, out_stop + width)
        # (the grid dims are the last two: F.pad's first pair is longitude, the second latitude)
        by, bx = lays[0].bands[blocks.row], lays[1].bands[blocks.col]
        wy, wx = lays[0].width, lays[1].width
        pad = [bx.in_lo - (bx.out_start - wx), (bx.out_stop + wx) - bx.in_hi,
               by.in_lo - (by.out_start - wy), (by.out_stop + wy) - by.in_hi]
        own, width = (by.out_rows, bx.out_rows), (wy, wx)
        y = F.pad(y, pad)
        out = overlap_add_2d(y, tuple(own), tuple(width), (ay, ax), manager, lays[0].out_sizes, lays[1].out_sizes)
        if self.bias is not None:
            out = out + self.bias.view([-1] + [1] * nd).to(out.dtype)  # autocast: a bf16 output stays bf16
        return out


@layer_rule(nn.Conv1d, grid=False, folds_edge_rows=True)
class DomainParallelConv1d(_ConvMixin, nn.Conv1d):
    """``nn.Conv1d`` on bands (see the module docstring)."""

    _nd = 1


@layer_rule(nn.Conv2d, folds_edge_rows=True)
class DomainParallelConv2d(_ConvMixin, nn.Conv2d):
    """``nn.Conv2d`` on bands (see the module docstring)."""

    _nd = 2


@layer_rule(nn.Conv3d, folds_edge_rows=True)
class DomainParallelConv3d(_ConvMixin, nn.Conv3d):
    """``nn.Conv3d`` on bands (see the module docstring)."""

    _nd = 3


@layer_rule(nn.ConvTranspose1d, grid=False)
class DomainParallelConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` on bands (overlap-add across band boundaries)."""

    _nd = 1


@layer_rule(nn.ConvTranspose2d)
class DomainParallelConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` on bands (overlap-add across band boundaries)."""

    _nd = 2


@layer_rule(nn.ConvTranspose3d)
class DomainParallelConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` on bands (overlap-add across band boundaries)."""

    _nd = 3


# The reference's name for a conv with circular padding: the same class here (padding_mode="circular" decides).
DomainParallelPeriodicConv2d = DomainParallelConv2d


@contextlib.contextmanager
def local_halos() -> Iterator[None]:
    """Within: the converted layers' halos are a local zero pad of the same shape (no message; a benchmark's baseline).

    The layers still agree and their norms still gather statistics: the
    step differs from the real one by the halo messages alone (what
    overlapping them can hide). Transposed convolutions drop their overlap
    instead of adding it to the neighbours. Every rank alike (no result is exact).
    """
    global overlap_add, _local_halos
    from . import _comm

    def pad(x, width, axis, manager, boundary, sizes):
        return F.pad(x, [0, 0] * (x.ndim - 1 - axis) + [width, width])

    def drop(y, rows, width, axis, manager, sizes):
        return y.narrow(axis, width, rows)

    saved = _comm.exchange_agreed, overlap_add, _local_halos
    _comm.exchange_agreed, overlap_add, _local_halos = pad, drop, True
    try:
        yield
    finally:
        _comm.exchange_agreed, overlap_add, _local_halos = saved
