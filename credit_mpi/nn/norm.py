"""Normalisation layers on bands: statistics of the whole field, exact on uneven bands.

GroupNorm / InstanceNorm / LayerNorm (when the sharded dim is among the
normalised ones) and BatchNorm compute each rank's count, mean and centred
sum of squares (``M2``) of its band, share them in ONE allgather (float64
for float64 input, float32 otherwise), and combine them exactly (Chan et
al.'s pairwise formula: stable, true counts, any band sizes). All four run
as one autograd Function (:func:`band_norm`) on torch's fused CPU kernels
(the band's moments in one pass, the output in one pass) that keeps for
backward what torch's own kernel keeps on one process (the input, the
weight, the per-group mean and variance: no normalised copy), and whose
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
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..autograd import check_backward_thread
from ..partition import normalize_dim
from ..transport import paths
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


def _combine(every):
    """Global mean, biased variance and count from every rank's ``(count, mean, M2)`` rows (Chan et al., in rank order).

    ``every`` is a torch tensor (differentiable) or a numpy array (the norms' statistics, on host): the same arithmetic.
    """
    counts, means, m2 = every[:, 0], every[:, 1], every[:, 2]
    total = counts.sum(0)
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2 + counts * (means - g_mean) ** 2).sum(0)
    return g_mean, g_m2 / total, total


def global_mean_var(x: torch.Tensor, dims: list[int], comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and count of ``x`` over ``dims`` on every rank of ``comm`` together (differentiable).

    The reduced dims are removed; the result is in float64 for float64 input, else float32.
    """
    xa = x.to(_acc(x.dtype))
    count = 1
    for d in dims:
        count *= x.shape[d]
    var, mean = torch.var_mean(xa, dim=dims, unbiased=False)
    return _combine(allgather_stats(torch.stack([torch.full_like(mean, float(count)), mean, var * count]), comm))


def _host(t: torch.Tensor) -> np.ndarray:
    """A small statistic as a numpy array in host memory (where it is gathered and combined: a few values per group).

    Only of the layer's own tensors: numpy's view makes a tensor's storage unresizable."""
    t = t.detach() if t.requires_grad else t
    return (t if t.is_cpu else t.cpu()).numpy()


def _on(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host statistic as a flat tensor on ``like``'s device (no copy on the host)."""
    t = torch.from_numpy(np.ascontiguousarray(a).reshape(-1))
    return t if like.is_cpu else t.to(like.device)


def _gathered(rows: np.ndarray, comm, path=None) -> np.ndarray:
    """Every rank's ``rows`` stacked along a new first dim: one ``Allgather`` on the data path (the layer agreed it)."""
    return _host(allgather_stats(torch.from_numpy(rows), comm, path))


def _band_stats(mean: np.ndarray, var: np.ndarray, count: int, groups: int | None):
    """The statistics this band contributes: per group, or (BatchNorm) per channel, the samples combined as the ranks are."""
    if groups is not None or mean.shape[0] == 1:
        return mean, var, count
    counts = np.full_like(mean, count)
    mean, var, _ = _combine(np.stack([counts, mean, var * count], 1))
    return mean.reshape(1, -1), var.reshape(1, -1), count * counts.shape[0]


def _per_channel(a: np.ndarray, channels: int) -> np.ndarray:
    """A per-group statistic ``(N | 1, G)`` repeated over each group's channels: ``(N | 1, C)``."""
    return a if a.shape[1] == channels else np.repeat(a, channels // a.shape[1], axis=1)


def _per_group(a: np.ndarray, groups: int | None) -> np.ndarray:
    """Per ``(sample, channel)`` sums ``(N | 1, C)`` added over each group: the statistics' shape."""
    if groups is None:
        return a.sum(0, keepdims=True)
    return a.reshape(a.shape[0], groups, -1).sum(-1)


def _channel_rows(t: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """``t`` ``(N, C, S)`` as torch's batch-norm kernels see it: one channel per row of the per-channel statistics.

    Statistics per channel (BatchNorm, or one sample): ``t`` itself; per sample and channel: ``(1, N * C, S)``, a view.
    """
    n, c, _ = t.shape
    return t.reshape(1, n * c, -1) if per_sample else t


def _per_row(p: torch.Tensor | None, rows: int, acc: torch.dtype) -> torch.Tensor | None:
    """A per-channel weight or bias (or None) for :func:`_channel_rows`' ``rows`` samples of rows, in ``acc``."""
    if p is None:
        return None
    p = p if p.dtype == acc else p.to(acc)
    return p.repeat(rows) if rows > 1 else p


class _Stats(NamedTuple):
    """The global statistics per channel of :func:`_channel_rows`' rows: on host (``mean``, ``var``, shape
    ``(N | 1, C)``) and as the kernels take them (``mean_t``, ``var_t``: flat, on the input's device)."""

    mean: np.ndarray
    var: np.ndarray
    mean_t: torch.Tensor
    var_t: torch.Tensor
    per_sample: bool


def _stats(mean: np.ndarray, var: np.ndarray, c: int, like: torch.Tensor) -> _Stats:
    """:class:`_Stats` of per-group ``mean`` / ``var`` for ``c`` channels (per sample when ``mean`` has a row each)."""
    mean, var = _per_channel(mean, c), _per_channel(var, c)
    return _Stats(mean, var, _on(mean, like), _on(var, like), mean.shape[0] > 1)


def _normalise(xa, out, st: _Stats, w, b, eps: float):
    """``(xa - mean) / sqrt(var + eps) * w + b`` per channel (``w``, ``b`` per row of :func:`_channel_rows`, or None), into ``out``.

    ``out`` is contiguous (its rows a view). One fused pass: torch's batch-norm kernel in eval mode, the statistics
    given as its running ones (the arithmetic of torch's CPU Batch and
    GroupNorm outputs, ``x * scale + shift``).
    """
    none = xa.new_empty(0)
    torch.ops.aten.native_batch_norm.out(_channel_rows(xa, st.per_sample), w, b, st.mean_t, st.var_t, False, 0.0,
                                         eps, out=_channel_rows(out, st.per_sample), save_mean=none, save_invstd=none)
    return out


def _channel_sums(gh: torch.Tensor, xa: torch.Tensor, st: _Stats, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ``(sample | 1, channel)``: the sums of ``gh`` and of ``gh * (xa - mean) * rstd`` (one fused pass, torch's kernel).

    Statistics of one row per channel give per-channel sums over the samples too (BatchNorm); per sample, per sample
    and channel.
    """
    _, dsx, db = torch.ops.aten.native_batch_norm_backward(
        _channel_rows(gh, st.per_sample), _channel_rows(xa, st.per_sample), None, st.mean_t, st.var_t, None, None,
        False, eps, [False, True, True])
    return db.reshape(st.mean.shape), dsx.reshape(st.mean.shape)


def _elementwise_view(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` ``(rows, 1, S)`` as ``(rows, *p.shape)``: an elementwise weight or bias ``p`` (this band's part, maybe a
    strided view of the parameter) broadcasts against it as it is, no copy."""
    return t.reshape(t.shape[0], *p.shape)


def _row_sum(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` ``(rows, 1, S)`` summed over the rows, shaped ``shape`` (one row: ``t`` itself, no pass)."""
    return t.reshape(shape) if t.shape[0] == 1 else t.sum((0, 1)).reshape(shape)


class _BandNorm(torch.autograd.Function):
    """Normalise ``x`` (``(N, C, S)``) with the statistics of every band, then the affine step: torch's arithmetic and memory.

    The statistics are per channel over the samples (``groups`` None:
    BatchNorm) or per sample and group of channels (Group, Instance and
    LayerNorm, the last as ``(rows, 1, normalised)``); ``weight`` / ``bias``
    are per channel, ``ew`` / ``eb`` a weight and bias of ``S`` elements
    (LayerNorm's, this band's part). Each band's mean and variance is one
    fused pass (torch's group-norm kernel), every rank's
    ``(count, mean, M2)`` one ``Allgather`` combined in rank order (Chan et
    al.: exact on uneven bands, the same bits on every rank); the output is
    one fused pass ``x * scale + shift`` per channel (torch's batch-norm
    kernel in eval mode with the global statistics, written into the
    statistics kernel's buffer: no fresh memory touched). The few values per
    group (the band's statistics, their combination, the backward's sums)
    are worked on host as numpy arrays, where they are gathered: a handful of
    microsecond steps, not a dozen tensor ops. Saved for
    backward: the input, the weight and the per-group mean and variance
    (what torch's own kernels keep on one process). The backward's
    per-channel sums of the gradient and of the gradient times the
    normalised value are one fused pass (torch's batch-norm backward
    kernel); their per-group totals one ``Allgather`` added in rank order;
    the input gradient two passes (``xhat * b + c`` by the eval-mode
    batch-norm kernel, then ``+ g * a``, per-channel ``a``, ``b``, ``c``).
    torch's fused SyncBatchNorm kernels (``batch_norm_stats``,
    ``batch_norm_elemt``, ``batch_norm_backward_reduce`` / ``_elemt``) are
    CUDA-only: these are the CPU kernels that do the same passes. The weight and bias gradients are this band's
    share (summed over the ranks by :func:`credit_mpi.reduce_gradients`).
    ``on_stats(mean, var, count)`` (BatchNorm's running statistics) sees
    the global statistics. Once differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, ew, eb, groups, eps, comm, on_stats, nc):
        acc, (n, c) = _acc(x.dtype), nc
        xa = x.to(acc).contiguous()  # a band view: a copy
        g, s = c if groups is None else groups, xa.numel() // (n * c) if n * c else 0
        # the band's moments in one stable pass (torch's group-norm kernel); its output buffer (the band normalised
        # with its own statistics: x's shape, memory already touched) is where the output pass writes (no view: an
        # in-place op after the layer costs what it costs on torch's). The variance from the kernel's
        # 1/sqrt(var + eps): exact to round-off relative to var + eps, all the normalisation uses.
        y, mean, rstd = torch.native_group_norm(xa, None, None, n, c, s, g, eps)
        mean, var = _host(mean).reshape(n, g), np.maximum(_host(rstd).reshape(n, g) ** -2 - eps, 0)
        mean, var, count = _band_stats(mean, var, c // g * s, groups)
        mean, var, total = _combine(_gathered(np.stack([np.full_like(mean, count), mean, var * count]), comm))
        if on_stats is not None:
            on_stats(*(_on(a, x) for a in (mean, var, total)))  # on the module's device, as its running statistics
        st = _stats(mean, var, c, x)
        xa, out = xa.view(n, c, -1), y.view(n, c, -1)
        rows = n if st.per_sample else 1
        _normalise(xa, out, st, _per_row(weight, rows, acc), _per_row(bias, rows, acc), eps)
        if ew is not None or eb is not None:  # in place, one pass; the (narrowed) parameters broadcast, not copied
            yv = _elementwise_view(out, ew if ew is not None else eb)
            if ew is None:
                yv.add_(eb.to(acc))
            elif eb is None:
                yv.mul_(ew.to(acc))
            else:
                torch.addcmul(eb.to(acc), yv, ew.to(acc), out=yv)
        ctx.save_for_backward(x, weight, ew)
        ctx.st, ctx.groups, ctx.comm, ctx.eps, ctx.count, ctx.nc = st, groups, comm, eps, float(total.flat[0]), nc
        ctx.path = paths.current()  # the backward's gather moves on the forward's data path
        ctx.eb = None if eb is None else (eb.shape, eb.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        check_backward_thread()
        x, weight, ew = ctx.saved_tensors
        (n, c), st, eps = ctx.nc, ctx.st, ctx.eps
        acc = st.mean_t.dtype
        xa, g = x.to(acc).reshape(n, c, -1), grad.to(acc).reshape(n, c, -1)
        gx = gw = gb = gew = geb = None
        if ew is not None and ctx.needs_input_grad[3]:  # xhat in one fused pass, times g in place, summed over the rows
            xg = _normalise(xa, torch.empty(xa.shape, dtype=acc, device=xa.device), st, None, None, eps).mul_(g)
            gew = _row_sum(xg, ew.shape).to(ew.dtype)
        if ctx.eb is not None and ctx.needs_input_grad[4]:
            geb = _row_sum(g, ctx.eb[0]).to(ctx.eb[1])
        gh = g if ew is None else (_elementwise_view(g, ew) * ew.to(acc)).view(g.shape)
        need_w = weight is not None and ctx.needs_input_grad[1]
        need_b = ctx.needs_input_grad[2]
        if not (need_w or need_b or ctx.needs_input_grad[0]):
            return gx, gw, gb, gew, geb, None, None, None, None, None
        db, dsx = _channel_sums(gh, xa, st, eps)
        if need_w:
            gw = dsx.sum(0).to(weight.dtype)
        if need_b:
            gb = db.sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:  # x.requires_grad is agreed by the layer: every rank gathers or none
            db, dsx = _host(db), _host(dsx)
            # a copy: numpy's view of a tensor makes its storage unresizable, and a parameter's may be freed and
            # gathered again (FSDP2's unsharded parameters)
            w = 1 if weight is None else _host(weight.detach().to(acc, copy=True))
            mine = np.stack([_per_group(db * w, ctx.groups), _per_group(dsx * w, ctx.groups)])
            sums = _gathered(mine, ctx.comm, ctx.path).sum(0) / np.asarray(ctx.count, mine.dtype)
            rstd = 1 / np.sqrt(st.var + np.asarray(eps, mine.dtype))
            s1, s2 = _per_channel(sums[0], c), _per_channel(sums[1], c)
            # gx = rstd * (w g - s1 - xhat s2): xhat * (-rstd s2) - rstd s1 in one fused pass, then + (rstd w) g
            gx = _normalise(xa, torch.empty(xa.shape, dtype=acc, device=xa.device), st, _on(-rstd * s2, x),
                            _on(-rstd * s1, x), eps)
            gx = gx.addcmul_(gh, _on(rstd * w, x).view(*st.mean.shape, 1)).to(x.dtype).view(x.shape)
        return gx, gw, gb, gew, geb, None, None, None, None, None


@_eager
def band_norm(x: torch.Tensor, weight, bias, groups: int | None, eps: float, comm, elementwise=(None, None), on_stats=None,
              rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Normalise ``x`` ``(N, C, *rest)`` with the statistics of every rank of ``comm``, then the affine step.

    ``groups`` None: per channel over the samples and ``rest`` (BatchNorm);
    else per sample and group of ``C / groups`` consecutive channels.
    ``weight`` / ``bias`` (or None) are per channel; ``elementwise`` a
    weight and bias (or None) shaped like ``rest`` (this band's part). The
    result has ``x``'s dtype and shape, the arithmetic is in the
    statistics' (float32 for bf16/fp16 input). Collective over ``comm``, in
    the backward too (when ``x`` requires grad). See :class:`_BandNorm`
    for what it keeps for backward. ``rows``: ``(N, C)`` to read ``x`` as instead (LayerNorm's rows and one channel).
    The output is no view (of ``x``'s shape, made by the Function): an in-place op after the norm (an
    inplace ReLU) is one op in backward, as after torch's norms, not a view's rebase.
    """
    n, c = (x.shape[0], x.shape[1]) if rows is None else rows
    ew, eb = elementwise
    return _BandNorm.apply(x, weight, bias, ew, eb, groups, float(eps), comm, on_stats, (n, c))


_GLOBAL_STATS = RowGeometry(note="global statistics: one allgather")  # the bands kept, the statistics over all of them


def _layer_norm(x: torch.Tensor, k: int, weight, bias, eps: float, comm) -> torch.Tensor:
    """LayerNorm over the last ``k`` dims on bands: one group per leading index, the (narrowed) affine elementwise."""
    rows = math.prod(x.shape[: x.ndim - k])
    return band_norm(x, None, None, 1, eps, comm, elementwise=(weight, bias), rows=(rows, 1))


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
        w, b = (self.weight, self.bias) if self.affine else (None, None)
        return band_norm(x, w, b, self.num_groups, self.eps, manager.domain_group)


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
        w, b = (self.weight, self.bias) if self.affine else (None, None)
        return band_norm(x, w, b, x.shape[1], self.eps, manager.domain_group)


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


def _normalises_other_dims(layer: nn.LayerNorm, x: torch.Tensor, dim: int) -> bool:
    """True when ``dim`` of ``x`` is none of the dims a LayerNorm normalises (its last ``len(normalized_shape)``)."""
    return 0 <= dim < x.ndim - len(layer.normalized_shape)


@layer_rule(nn.LayerNorm, local_on=_normalises_other_dims)
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
        return _layer_norm(x, k, w, b, self.eps, manager.domain_group)

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
        return _layer_norm(x, k, w, b, self.eps, manager.domain_group)


class _BatchNormMixin(DomainParallelModule):
    dp_local_agreements = 0  # on a replicated input: the local module, no agreement

    def dp_geometry(self, sizes, sd, h_out=None):  # noqa: D102
        return _GLOBAL_STATS

    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """The band norms' traffic with a group per channel; the running statistics (eval): the agreement only."""
        if not self.training and self.track_running_stats:
            return lambda rank: Traffic(agreements=1)
        return _group_traffic(n, shape_in[1], dtype, grad)

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
        on_stats = None
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            on_stats = self._update_running_stats
        w, b = (self.weight, self.bias) if self.affine else (None, None)
        return band_norm(x, w, b, None, self.eps, comm, on_stats=on_stats)  # every rank of the manager: domain x data parallel

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        """torch's update from the global batch statistics: the unbiased variance from the global count."""
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            mean, var, total = mean.reshape(-1), var.reshape(-1), total.reshape(-1)
            unbiased = var * (total / (total - 1))
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


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
