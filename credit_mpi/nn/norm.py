"""Normalisation layers on bands: statistics of the whole field, exact on uneven bands.

GroupNorm / InstanceNorm / LayerNorm (when the sharded dim is among the
normalised ones) and BatchNorm compute each rank's count, mean and centred
sum of squares (``M2``) of its band, share them in ONE allgather (float64
for float64 input, float32 otherwise), and combine them exactly (Chan et
al.'s pairwise formula: stable, true counts, any band sizes). Group,
Instance and LayerNorm run as one autograd Function (:func:`band_norm`) that
keeps for backward what torch's own kernel keeps on one process (the input,
the weight, the per-group mean and 1/std: no normalised copy), and whose
backward gathers the two per-group sums it needs across the bands in one
allgather; the input and parameter gradients are those of one process
(after :func:`credit_mpi.reduce_gradients`). Once differentiable.

On a 2-D latitude x longitude domain grid (``domain_grid=(rows, cols)``,
``cols > 1``) the blocks are agreed in both dims and the statistics span
every block of the grid (the domain group); LayerNorm must normalise
latitude and longitude together there (longitude alone would need the
statistics of one grid row: refused with ``ConversionError``).

BatchNorm has ``torch.nn.SyncBatchNorm``'s semantics over every rank of the
manager (domain x data parallel; on bands its mode is agreed in eval too, as a
rank in eval mode would skip the statistics the training ranks gather): the batch statistics are those of all
samples of all bands, and the running statistics are updated identically on
every rank (unbiased variance from the global count). This holds for a
domain of size 1 too when there are data-parallel ranks (the one exception
to "a domain of size 1 computes what the original does"); with no manager or
one rank in all it is the original module.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..autograd import check_backward_thread
from ..partition import normalize_dim
from ..validation import Local, agree_cached
from ._comm import _eager, agree, agree_blocks, allgather_stats
from .base import DomainParallelModule
from .base import no_empty_band as _no_empty
from .errors import ConversionError
from .geometry import RowGeometry
from .replicated import is_replicated
from .rules import layer_rule
from .traffic import Traffic, acc_itemsize, stats_rule

__all__ = [
    "DomainParallelGroupNorm",
    "DomainParallelInstanceNorm1d",
    "DomainParallelInstanceNorm2d",
    "DomainParallelInstanceNorm3d",
    "DomainParallelLayerNorm",
    "DomainParallelBatchNorm1d",
    "DomainParallelBatchNorm2d",
    "DomainParallelBatchNorm3d",
    "global_mean_var",
]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def global_mean_var(x: torch.Tensor, dims: list[int], comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and count of ``x`` over ``dims`` on every rank of ``comm`` together (differentiable).

    The reduced dims are removed; the result is in float64 for float64 input, else float32.
    """
    xa = x.to(_acc(x.dtype))
    count = 1
    for d in dims:
        count *= x.shape[d]
    var, mean = torch.var_mean(xa, dim=dims, unbiased=False)
    stats = torch.stack([torch.full_like(mean, float(count)), mean, var * count])
    every = allgather_stats(stats, comm)  # (ranks, 3, ...)
    counts, means, m2 = every[:, 0], every[:, 1], every[:, 2]
    total = counts.sum(0)
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2 + counts * (means - g_mean) ** 2).sum(0)
    return g_mean, g_m2 / total, total


def _normalize(x, mean, var, eps, shape):
    """``(x - mean) / sqrt(var + eps)`` in the statistics' dtype (float32 for bf16/fp16 input).

    The affine step runs in that dtype too and the layer casts its output
    back to ``x.dtype`` last (:func:`_out`), as torch's native norms do under
    autocast: a bf16 input gives a bf16 output, not a float32 one promoted
    by the float32 weight.
    """
    xa = x.to(mean.dtype)
    return (xa - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + eps)


def _out(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's output in the input's dtype (a no-op for float32/float64 input)."""
    return y.to(x.dtype)


class _BandNorm(torch.autograd.Function):
    """Normalise over ``dims`` with the statistics of every band, then the affine step: what backward needs, nothing more.

    Saved for backward: the input, the weight and the per-group mean and
    ``1/sqrt(var + eps)`` (what torch's own ``native_group_norm`` keeps on
    one process); the normalised value is recomputed in backward rather
    than kept (composing the step from autograd ops would keep it, the
    centred input and the affine product: ~3x the input per layer).
    The backward's cross-band sums (of the gradient and of the gradient
    times the normalised value, per group) are one ``Allgather`` of every
    rank's partial sums added in rank order: the forward's pattern, the
    same bits on every rank. The weight and bias gradients are this band's
    share (summed over the ranks by :func:`credit_mpi.reduce_gradients`, as
    every parameter's). Once differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dims, eps, comm):
        mean, var, total = global_mean_var(x, dims, comm)
        keep = [1 if d in dims else s for d, s in enumerate(x.shape)]
        mean = mean.reshape(keep)
        rstd = torch.rsqrt(var.reshape(keep) + eps)
        y = _affine((x.to(mean.dtype) - mean) * rstd, weight, bias)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.dims, ctx.comm, ctx.count = dims, comm, float(total.reshape(-1)[0])
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        return _out(y, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        check_backward_thread()
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x.to(mean.dtype) - mean) * rstd
        g = grad.to(mean.dtype)
        gx = gw = gb = None
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (g * xhat).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            gb = g.sum_to_size(ctx.bias[0]).to(ctx.bias[1])
        if ctx.needs_input_grad[0]:  # x.requires_grad is agreed by the layer: every rank gathers or none
            gh = g if weight is None else g * weight
            mine = torch.stack([gh.sum(ctx.dims, keepdim=True), (gh * xhat).sum(ctx.dims, keepdim=True)])
            sums = allgather_stats(mine, ctx.comm).sum(0) / ctx.count
            gx = (rstd * (gh - sums[0] - xhat * sums[1])).to(x.dtype)
        return gx, gw, gb, None, None, None


@_eager
def band_norm(x: torch.Tensor, weight, bias, dims: list[int], eps: float, comm) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the statistics over ``dims`` of every rank of ``comm``.

    ``weight`` / ``bias`` (or None) broadcast against ``x`` (this band's
    rows of them); the result has ``x``'s dtype, the arithmetic is in the
    statistics' (float32 for bf16/fp16 input). Collective over ``comm``,
    in the backward too (when ``x`` requires grad). See :class:`_BandNorm`
    for what it keeps for backward.
    """
    return _BandNorm.apply(x, weight, bias, sorted(d % x.ndim for d in dims), float(eps), comm)


def _affine(y: torch.Tensor, weight, bias) -> torch.Tensor:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y



_GLOBAL_STATS = RowGeometry(note="global statistics: one allgather")  # the bands kept, the statistics over all of them


def _group_traffic(n: int, groups: int, dtype: torch.dtype, grad: bool):
    """Per group a mean, a variance and a count gathered forward; two sums gathered backward."""
    acc = acc_itemsize(dtype)
    return stats_rule(n, 3 * groups * acc, 2 * groups * acc, grad)


def _running_stats(module: nn.Module) -> str:
    return "InstanceNorm with track_running_stats=True has no rule on bands yet" if module.track_running_stats else ""


@layer_rule(nn.GroupNorm)
class DomainParallelGroupNorm(DomainParallelModule, nn.GroupNorm):
    """``nn.GroupNorm`` over the whole field (see the module docstring)."""

    def dp_geometry(self, sizes, sd, h_out=None):  # noqa: D102
        return _GLOBAL_STATS

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):  # noqa: D102
        return _group_traffic(n, shape_in[0] * self.num_groups, dtype, grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        manager = self.dp_manager

        def axis_of(t):
            if t.ndim < 3:
                raise ValueError(f"{self.dp_path} (GroupNorm): needs an (N, C, *spatial) input, got shape {tuple(t.shape)}")
            if self.dp_on_grid():
                return self.dp_grid_axes(t, t.ndim - 2, "GroupNorm")
            return self.dp_spatial_axis(t, t.ndim - 2, "GroupNorm")

        _no_empty(self.dp_path, _agreed_sizes(self, x, axis_of))
        n, c, g = x.shape[0], x.shape[1], self.num_groups
        xs = x.reshape(n, g, c // g, *x.shape[2:])
        shape = [1, g, c // g] + [1] * (x.ndim - 2)
        w, b = (self.weight.reshape(shape), self.bias.reshape(shape)) if self.affine else (None, None)
        return band_norm(xs, w, b, list(range(2, xs.ndim)), self.eps, manager.domain_group).reshape(x.shape)


class _InstanceNormMixin(DomainParallelModule):
    _nd = 2

    def dp_geometry(self, sizes, sd, h_out=None):  # noqa: D102
        return _GLOBAL_STATS

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """Per (sample, channel) statistics; the running statistics (eval) are pointwise: nothing, no agreement."""
        if not self.training and self.track_running_stats:
            return lambda rank: Traffic()
        return _group_traffic(n, shape_in[0] * shape_in[1], dtype, grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x) or (not self.training and self.track_running_stats):
            return super().forward(x)  # running statistics: a pointwise map (refused at conversion on bands)
        manager, nd = self.dp_manager, self._nd

        def axis_of(t):
            if t.ndim != nd + 2:
                raise ValueError(f"{self.dp_path} (InstanceNorm{nd}d): needs a batched (N, C, *spatial) input on bands, got shape {tuple(t.shape)}")
            if self.track_running_stats:
                raise ConversionError(f"{self.dp_path}: InstanceNorm with track_running_stats=True is not supported in training on bands")
            if self.dp_on_grid():
                return self.dp_grid_axes(t, nd, f"InstanceNorm{nd}d")
            return self.dp_spatial_axis(t, nd, f"InstanceNorm{nd}d")

        _no_empty(self.dp_path, _agreed_sizes(self, x, axis_of))
        shape = [1, x.shape[1]] + [1] * nd
        w, b = (self.weight.reshape(shape), self.bias.reshape(shape)) if self.affine else (None, None)
        return band_norm(x, w, b, list(range(2, x.ndim)), self.eps, manager.domain_group)


@layer_rule(nn.InstanceNorm1d, grid=False, refuses=_running_stats)
class DomainParallelInstanceNorm1d(_InstanceNormMixin, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` over the whole field."""

    _nd = 1


@layer_rule(nn.InstanceNorm2d, refuses=_running_stats)
class DomainParallelInstanceNorm2d(_InstanceNormMixin, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` over the whole field."""

    _nd = 2


@layer_rule(nn.InstanceNorm3d, refuses=_running_stats)
class DomainParallelInstanceNorm3d(_InstanceNormMixin, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` over the whole field."""

    _nd = 3


@layer_rule(nn.LayerNorm)
class DomainParallelLayerNorm(DomainParallelModule, nn.LayerNorm):
    """``nn.LayerNorm``: global statistics when the sharded dim is normalised, else the local module.

    The affine weight and bias (shaped like the normalised dims) are applied
    to this band's rows of them.
    """

    def dp_geometry(self, sizes, sd, h_out=None):  # noqa: D102
        return _GLOBAL_STATS

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """Statistics over the normalised dims when they include the sharded one; else the local module (nothing)."""
        k = len(self.normalized_shape)
        if axis < len(shape_in) - k:
            return lambda rank: Traffic()
        return _group_traffic(n, math.prod(shape_in[: len(shape_in) - k]), dtype, grad)

    def dp_refusal(self, n, grid):
        """The longitude alone normalised has no rule on a grid of more than one column."""
        if grid is None or grid[1] <= 1 or len(self.normalized_shape) >= 2:
            return ""
        return (f"normalized_shape {tuple(self.normalized_shape)} normalises the longitude only: no rule on a "
                f"{grid[0]}x{grid[1]} grid (the run raises ConversionError)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        if self.dp_on_grid():
            return self._grid_forward(x)
        k = len(self.normalized_shape)
        axis = self.dp_shard_dim % x.ndim if -x.ndim <= self.dp_shard_dim < x.ndim else None
        if axis is None or axis < x.ndim - k:
            return super().forward(x)  # the sharded dim is not normalised: local
        manager = self.dp_manager

        def axis_of(t):
            tail, want = list(t.shape[t.ndim - k :]), list(self.normalized_shape)
            sd = axis - (t.ndim - k)
            if tail[:sd] + tail[sd + 1 :] != want[:sd] + want[sd + 1 :]:
                raise ValueError(f"{self.dp_path} (LayerNorm): input shape {tuple(t.shape)} does not end in normalized_shape {tuple(self.normalized_shape)}")
            return axis

        bands = agree(x, axis_of, manager.domain_group, self.dp_path, mode=self.dp_mode())
        _no_empty(self.dp_path, bands.sizes)
        sd = axis - (x.ndim - k)
        if bands.total != self.normalized_shape[sd]:
            raise ValueError(
                f"{self.dp_path} (LayerNorm): the bands hold {bands.total} rows along dim {axis} in all, "
                f"normalized_shape {tuple(self.normalized_shape)} expects {self.normalized_shape[sd]}"
            )
        rows = (bands.start, bands.sizes[bands.rank])
        w, b = (None if p is None else p.narrow(sd, *rows) for p in (self.weight, self.bias))
        return band_norm(x, w, b, list(range(x.ndim - k, x.ndim)), self.eps, manager.domain_group)

    def _grid_forward(self, x: torch.Tensor) -> torch.Tensor:
        """On a 2-D grid: statistics over the whole grid when latitude and longitude are both normalised."""
        manager, k = self.dp_manager, len(self.normalized_shape)

        def axes_of(t):
            if k < 2:
                rows, cols = self.dp_grid()
                raise ConversionError(
                    f"{self.dp_path} (LayerNorm): normalized_shape {tuple(self.normalized_shape)} normalises the "
                    f"longitude only, whose statistics span one grid row of the {rows}x{cols} domain grid: no rule "
                    f"yet; normalise latitude and longitude together or use latitude bands (domain_grid=None)"
                )
            if t.ndim < k:
                raise ValueError(f"{self.dp_path} (LayerNorm): input shape {tuple(t.shape)} has fewer dims than normalized_shape {tuple(self.normalized_shape)}")
            ay, ax = self.dp_grid_axes(t, k, "LayerNorm")
            if list(t.shape[t.ndim - k : ay]) != list(self.normalized_shape[: k - 2]):
                raise ValueError(f"{self.dp_path} (LayerNorm): input shape {tuple(t.shape)} does not end in normalized_shape {tuple(self.normalized_shape)}")
            return ay, ax

        blocks = agree_blocks(x, axes_of, manager, self.dp_path, mode=self.dp_mode())
        _no_empty(self.dp_path, blocks.sizes)
        if (sum(blocks.heights), sum(blocks.widths)) != tuple(self.normalized_shape[-2:]):
            raise ValueError(
                f"{self.dp_path} (LayerNorm): the blocks hold {sum(blocks.heights)} x {sum(blocks.widths)} "
                f"(latitude x longitude) in all, normalized_shape {tuple(self.normalized_shape)} expects "
                f"{tuple(self.normalized_shape[-2:])}"
            )
        h, wd = x.shape[-2], x.shape[-1]
        w, b = (None if p is None else p.narrow(k - 2, blocks.y0, h).narrow(k - 1, blocks.x0, wd) for p in (self.weight, self.bias))
        return band_norm(x, w, b, list(range(x.ndim - k, x.ndim)), self.eps, manager.domain_group)


class _BatchNormMixin(DomainParallelModule):
    dp_local_agreements = 0  # on a replicated input: the local module, no agreement

    def dp_geometry(self, sizes, sd, h_out=None):  # noqa: D102
        return _GLOBAL_STATS

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """Per channel sums gathered, a reduce-scatter backward; the running statistics (eval): the agreement only."""
        if not self.training and self.track_running_stats:
            return lambda rank: Traffic(agreements=1)
        c = shape_in[1] * acc_itemsize(dtype)
        return stats_rule(n, 3 * c, 3 * c, grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or not self.track_running_stats
        m = self.dp_manager
        if m is None or m.world_size == 1:  # SyncBatchNorm over data parallel ranks too
            return super().forward(x)
        if not use_batch and m.domain_parallel_size == 1:
            return super().forward(x)  # SyncBatchNorm's eval: local (one data-parallel rank may evaluate alone)
        comm = _batch_comm(m, x)
        if comm is None:
            return super().forward(x)  # a replicated input and no data-parallel ranks: local is exact

        def local() -> Local:
            self._check_input_dim(x)
            # the mode is agreed in eval too: an eval rank skips the statistics the training ranks gather
            mine = (x.ndim, x.shape[1], str(x.dtype), x.device.type, bool(torch.is_grad_enabled() and x.requires_grad),
                    bool(self.training), bool(self.track_running_stats))
            return Local(mine, mine, (), _rows(self, x))

        def explain(locals_: list[Local]) -> None:
            raise ValueError(
                f"{self.dp_path} (BatchNorm): the ranks' inputs differ in ndim, channels, dtype, device, requires_grad "
                f"or mode (ndim, channels, dtype, device, requires_grad, training, track_running_stats per rank): "
                f"{[loc.plan for loc in locals_]}; call model.train() / model.eval() on every rank"
            )

        try:  # the call's description decides local(): a repeated call is one Allgather of the remembered header
            key = ("BatchNorm", self.dp_path, x.ndim, x.shape[1], str(x.dtype), x.device.type,
                   bool(torch.is_grad_enabled() and x.requires_grad), bool(self.training), bool(self.track_running_stats),
                   _rows(self, x))
        except Exception:  # noqa: BLE001 - local() raises it again inside the agreement, on every rank
            key = None
        agree_cached(comm, "layer", key, local, lambda plan, rows: _no_empty(self.dp_path, rows), explain=explain)
        if not use_batch:
            return super().forward(x)  # the running statistics: a pointwise map
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        dims = [0] + list(range(2, x.ndim))
        mean, var, total = global_mean_var(x, dims, comm)  # every rank of the manager: domain x data parallel
        if self.training and self.track_running_stats:
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                unbiased = var * (total / (total - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, -1] + [1] * (x.ndim - 2)
        y = _normalize(x, mean, var, self.eps, shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return _out(y, x)


@layer_rule(nn.BatchNorm1d, batch_statistics=True)
class DomainParallelBatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` with SyncBatchNorm semantics over the manager's ranks."""


@layer_rule(nn.BatchNorm2d, batch_statistics=True)
class DomainParallelBatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with SyncBatchNorm semantics over the manager's ranks."""


@layer_rule(nn.BatchNorm3d, batch_statistics=True)
class DomainParallelBatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` with SyncBatchNorm semantics over the manager's ranks."""


def _rows(layer: DomainParallelModule, x: torch.Tensor) -> int:
    """This rank's rows along the sharded dim (BatchNorm's agreement refuses a band of none on every rank)."""
    return x.shape[normalize_dim(layer.dp_shard_dim, x.ndim)] if x.ndim >= 3 else 1


def _batch_comm(manager, x: torch.Tensor):
    """Where BatchNorm's statistics (and its agreement) live: the domain group when it is every rank, else all ranks.

    One communicator for a pure domain-parallel job, so that the forward's
    failure agreement (on the domain group) meets a rank waiting here; a
    replicated input counts once per data-parallel rank (None: no other rank).
    """
    if is_replicated(x):
        return manager.data_parallel_group if manager.data_parallel_size > 1 else None
    return manager.domain_group if manager.data_parallel_size == 1 else manager.comm


def _agreed_sizes(layer: DomainParallelModule, x: torch.Tensor, axis_of) -> list[int]:
    """Agree on every rank's band (latitude bands) or block (a 2-D grid): each rank's rows / elements per slice."""
    manager = layer.dp_manager
    if layer.dp_on_grid():
        return agree_blocks(x, axis_of, manager, layer.dp_path, mode=layer.dp_mode()).sizes
    return agree(x, axis_of, manager.domain_group, layer.dp_path, mode=layer.dp_mode()).sizes
