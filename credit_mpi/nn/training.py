"""Training-loop helpers for latitude bands: weights, loss, metrics and gradient clipping.

A domain group holds one sample cut into latitude bands (the layout of
``shard_tensor(..., uneven=True)``). Everything a trainer computes over the
whole globe has to be rebuilt from the bands so that it equals the
single-process value:

* :func:`latitude_weights`: this rank's rows of the *global* normalised
  cos-latitude weights (``w = cos(lat) / mean(cos(lat))`` over all
  latitudes, as CREDIT and WeatherBench do). No communication.
* :func:`latitude_weighted_mse` / :class:`LatitudeWeightedMSELoss`: this
  band's *share* of the global latitude-weighted MSE. The shares of a domain
  group add up to the single-process loss, so the gradients they produce,
  summed over the domain group and averaged over the data-parallel group by
  :func:`credit_mpi.reduce_gradients`, are the single-process gradients. The
  share is a local computation: no collective sits inside autograd.
* :func:`global_loss`: the loss value for logging (one all-reduce), the
  same float on every rank.
* :func:`latitude_weighted_metrics`: MSE, RMSE and ACC from global
  sufficient statistics (float64 sums, one fused all-reduce), equal to the
  single-process values, not averages of per-band values.
* :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` with the norm
  of the global gradient; every rank scales by the same factor.

Every collective here is over the manager's communicators; with no manager
(and no global one) each function is its single-process version.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..agreement import Free, agree_values
from ..grad_sync import reduce_gradients
from ..grid import grid_coords, grid_of
from ..layout import Layout
from ..manager import DomainParallelManager, get_domain_parallel_manager
from ..ops.allreduce import allreduce_agreed
from ..ops.broadcast import broadcast_agreed
from ..partition import band_sizes, normalize_dim
from ..validation import DomainParallelError, allgather_or_raise, check_int, comm_label, digest

__all__ = [
    "latitude_weights",
    "latitude_weighted_mse",
    "LatitudeWeightedMSELoss",
    "global_loss",
    "latitude_weighted_metrics",
    "clip_grad_norm_",
]

# Relative difference up to which gradient norms count as "the same" across
# ranks in clip_grad_norm_(gradients="reduced"): replicated gradients have
# bitwise-equal norms; partial ones (reduce_gradients not called) differ by far more.
REPLICA_RTOL = 1e-6


# -- latitude weights ----------------------------------------------------


def latitude_weights(
    latitudes: Any,
    manager: DomainParallelManager | None = None,
    *,
    dim: int = -2,
    uneven: bool = True,
    dtype: torch.dtype = torch.float64,
    device: Any = None,
    check: bool = False,
) -> torch.Tensor:
    """This rank's rows of the global normalised cos-latitude weights.

    The global weights are ``w = cos(lat) / mean(cos(lat))`` over *all*
    latitudes (their global mean is 1), computed in float64 from the global
    latitudes on every rank; this rank gets the rows that
    ``shard_tensor(field, dim, manager, uneven=uneven)`` gives it, bit for
    bit the matching slice of the single-process weights. On a latitude x
    longitude domain grid (``domain_grid=(rows, cols)``) they are the rows of
    the rank's grid row (every block of a grid row has the same latitudes).

    Args:
        latitudes: The global latitudes in degrees (a 1-D sequence, numpy
            array or torch tensor, any order, each in [-90, 90]), or their
            count ``nlat`` (an int >= 2): then ``nlat`` equally spaced
            latitudes from 90 to -90 inclusive (ERA5's 721 on a 0.25 degree
            grid).
        manager: DomainParallelManager (the global singleton if None; with
            none, or a domain of size 1, the whole weight vector).
        dim: The sharded (latitude) dimension of the fields the weights will
            multiply, counted from the end (negative, as broadcasting aligns
            from the right). The result has shape ``(rows,) + (1,) * (-dim - 1)``:
            ``(rows, 1)`` for the default -2, so it broadcasts against a
            ``(..., lat, lon)`` band.
        uneven: The band layout: ``True`` as ``shard_tensor(..., uneven=True)``
            (``numpy.array_split``); ``False`` requires ``nlat`` divisible by
            the domain size.
        dtype: dtype of the result (computed in float64, then cast).
        device: torch device of the result.
        check: Agree over the manager's parent communicator that every rank
            passed the same latitudes, ``dim`` and ``uneven`` (one small
            allgather; a mistake raises on every rank). ``False`` (default):
            no communication at all.

    Returns:
        This rank's rows of the weights, shape ``(rows,) + (1,) * (-dim - 1)``.

    Raises:
        ValueError: bad latitudes (not 1-D, outside [-90, 90], not finite,
            all at a pole), a count below 2, ``dim`` not negative, or an
            uneven count with ``uneven=False``.
        TypeError: ``latitudes`` is neither a count nor an array of numbers.
    """
    manager = _resolve(manager)
    n, rank = _latitude_band(manager)

    def plan() -> tuple:
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim >= 0:
            raise ValueError(
                f"latitude_weights: dim must be a negative integer (counted from the end, e.g. -2 for "
                f"(..., lat, lon)), got {dim!r}"
            )
        if not isinstance(uneven, bool):
            raise ValueError(f"latitude_weights: uneven must be True or False, got {uneven!r}")
        lat = _global_latitudes(latitudes)
        sizes = band_sizes(lat.size, n, uneven)
        return lat, sizes

    if check and manager is not None:

        def explain(everyone: list[tuple]) -> None:
            ranks = [r for r, e in enumerate(everyone) if e != everyone[0]]
            raise ValueError(
                f"latitude_weights: rank(s) {ranks} of {comm_label(manager.comm)} passed different latitudes, "
                f"dim or uneven than rank 0 (nlat, dim, uneven: {[e[:3] for e in everyone]}); pass the same "
                "global latitudes on every rank"
            )

        agree_values(manager.comm, "latitude_weights", lambda: _digest(plan()[0], dim, uneven), explain)
    lat, sizes = plan()
    cos = np.cos(np.deg2rad(lat))
    weights = cos / cos.mean()
    layout = Layout.bands(sizes)
    band = np.ascontiguousarray(weights[layout.start(rank) : layout.stop(rank)])
    return torch.from_numpy(band).to(dtype=dtype, device=device).reshape((-1,) + (1,) * (-dim - 1))


def _latitude_band(manager: DomainParallelManager | None) -> tuple[int, int]:
    """``(bands, band)`` of the latitudes: the domain ranks, or on a domain grid its rows and this rank's grid row."""
    if manager is None or manager.domain_parallel_size <= 1:
        return 1, 0
    grid = grid_of(manager, manager.domain_parallel_size)
    return grid[0], grid_coords(manager.domain_rank, grid)[0]


def _global_latitudes(latitudes: Any) -> np.ndarray:
    """The global latitudes (degrees) as a float64 numpy vector, checked."""
    if isinstance(latitudes, bool):
        raise TypeError(f"latitude_weights: latitudes must be a latitude count or an array of degrees, got {latitudes!r}")
    if isinstance(latitudes, numbers.Integral):
        nlat = check_int("latitude_weights: the latitude count", latitudes, minimum=2)
        return np.linspace(90.0, -90.0, nlat)
    if isinstance(latitudes, torch.Tensor):  # a copy: numpy's view would make the caller's storage unresizable
        latitudes = latitudes.detach().cpu().clone().numpy()
    try:
        lat = np.asarray(latitudes)
    except Exception as exc:  # noqa: BLE001 - re-raised as a TypeError naming the value
        raise TypeError(f"latitude_weights: cannot read latitudes {latitudes!r} as an array ({exc})") from None
    if lat.dtype.kind not in "iuf":
        raise TypeError(
            f"latitude_weights: latitudes must be a latitude count or an array of real numbers (degrees), "
            f"got {type(latitudes).__name__} of dtype {lat.dtype}"
        )
    lat = lat.astype(np.float64)
    if lat.ndim != 1 or lat.size < 1:
        raise ValueError(f"latitude_weights: latitudes must be a non-empty 1-D array, got shape {lat.shape}")
    bad = ~np.isfinite(lat) | (np.abs(lat) > 90.0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"latitude_weights: latitudes must be finite degrees in [-90, 90], got {float(lat[i])!r} at index {i}"
        )
    if np.abs(lat).min() == 90.0:
        raise ValueError("latitude_weights: every latitude is at a pole, where cos(lat) = 0: the weights are undefined")
    return lat


def _digest(lat: np.ndarray, dim: int, uneven: bool) -> tuple:
    return (lat.size, dim, uneven, digest(lat.tobytes()))


# -- loss ------------------------------------------------------------------


def latitude_weighted_mse(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor,
    total_rows: int,
    *,
    dim: int = -2,
    total_cols: int | None = None,
) -> torch.Tensor:
    """This band's share of the global latitude-weighted mean squared error.

    ``sum(w * (pred - target) ** 2) / (elements per row * total_rows)``:
    the single-process loss ``mean(w * (pred - target) ** 2)`` is the sum of
    these shares over the domain group, so
    :func:`credit_mpi.reduce_gradients` (sum over the domain group, mean
    over the data-parallel group) turns the band gradients into the
    single-process gradient of the mean over all samples (equal local batch
    sizes on the data-parallel ranks). Local: no communication, an ordinary
    differentiable torch expression. Use :func:`global_loss` for the value.

    Args:
        pred: This rank's band of the prediction.
        target: This rank's band of the target, the shape of ``pred``.
        weights: This rank's rows of the latitude weights
            (:func:`latitude_weights`), shape ``(rows,)`` or the broadcast
            shape ``(rows,) + (1,) * (-dim - 1)``; cast to ``pred``'s dtype
            and device.
        total_rows: The global number of rows along ``dim`` (e.g. 721).
        dim: The sharded dimension of ``pred``.
        total_cols: On a latitude x longitude domain grid, where ``pred`` is a
            block: the global size of its last dim (the longitudes, e.g.
            1440); None: the last dim is whole.

    Returns:
        A scalar tensor: the band's share (0 for a band with no rows).

    Raises:
        ValueError: shapes that do not fit, ``total_rows`` below this band's
            rows or zero elements in the global field.
        TypeError: ``pred``/``target``/``weights`` are not torch tensors.
    """
    axis, rows, w = _band_inputs("latitude_weighted_mse", pred, target, weights, dim)
    total_rows = check_int("latitude_weighted_mse: total_rows", total_rows, minimum=max(rows, 1))
    per_row = math.prod(s for i, s in enumerate(pred.shape) if i != axis)
    if total_cols is not None and axis != pred.ndim - 1:  # a block: a global row holds total_cols longitudes
        cols = check_int("latitude_weighted_mse: total_cols", total_cols, minimum=max(pred.shape[-1], 1))
        per_row = per_row // max(pred.shape[-1], 1) * cols
    if per_row == 0:
        raise ValueError(f"latitude_weighted_mse: the field of shape {tuple(pred.shape)} has no elements to average")
    return (w.to(pred.dtype) * (pred - target) ** 2).sum() / (per_row * total_rows)


class LatitudeWeightedMSELoss(torch.nn.Module):
    """The latitude-weighted MSE as a module: this band's share (see :func:`latitude_weighted_mse`).

    Holds this rank's weights (a buffer, so ``.to(device)`` moves them) and
    the global row count. With no manager or a domain of size 1 it is the
    ordinary single-process loss ``mean(w * (pred - target) ** 2)``.

    Args:
        latitudes: Global latitudes in degrees or their count (as
            :func:`latitude_weights`).
        manager: DomainParallelManager (the global singleton if None).
        dim: The sharded (latitude) dimension, negative.
        uneven: Band layout, as ``shard_tensor(..., uneven=uneven)``.
        check: Agree on the latitudes across ranks once, at construction.
        longitudes: The global longitude count; needed on a latitude x
            longitude domain grid of more than one column (each rank holds a
            block of the longitudes), where the weights are its grid row's.
    """

    weights: torch.Tensor

    def __init__(
        self,
        latitudes: Any,
        manager: DomainParallelManager | None = None,
        *,
        dim: int = -2,
        uneven: bool = True,
        check: bool = False,
        longitudes: int | None = None,
    ) -> None:
        super().__init__()
        weights = latitude_weights(latitudes, manager, dim=dim, uneven=uneven, check=check)
        self.register_buffer("weights", weights, persistent=False)
        self.total_rows = _global_latitudes(latitudes).size
        self.dim = dim
        resolved = _resolve(manager)
        grid = (1, 1) if resolved is None or resolved.domain_parallel_size <= 1 else grid_of(resolved, resolved.domain_parallel_size)
        if grid[1] > 1 and longitudes is None:
            raise ValueError(
                f"LatitudeWeightedMSELoss: on a {grid[0]}x{grid[1]} latitude x longitude domain grid each rank holds "
                f"a block of the longitudes; pass longitudes= (the global longitude count) so that the blocks' "
                f"shares add up to the global mean"
            )
        self.total_cols = None if grid[1] == 1 else check_int("LatitudeWeightedMSELoss: longitudes", longitudes, minimum=1)

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This band's share of the global loss."""
        return latitude_weighted_mse(pred, target, self.weights, self.total_rows, dim=self.dim, total_cols=self.total_cols)


def global_loss(
    loss: Any,
    manager: DomainParallelManager | None = None,
    *,
    data_parallel: bool = True,
) -> float:
    """The global loss value for logging: the sum of the bands' shares, averaged over the samples.

    Collective over the manager's parent communicator: one ``Allreduce``
    of ``data_parallel_size + 2`` doubles (a sum per domain group and two
    counters), so a non-scalar loss or a different ``data_parallel`` on one
    rank is one ``ValueError`` on every rank. The result is the same float on
    every rank (of the domain group, without ``data_parallel``); it carries
    no gradient (the gradient path is the share itself).

    Args:
        loss: This rank's share (a scalar tensor or a number), e.g. from
            :class:`LatitudeWeightedMSELoss`.
        manager: DomainParallelManager (the global singleton if None; with
            none, ``float(loss)``).
        data_parallel: Also average over the data-parallel group (the loss of
            the whole global batch, as ``reduce_gradients`` sees it);
            ``False``: sum over this domain group only (this sample's loss).

    Returns:
        The global loss as a Python float.

    Raises:
        ValueError: a rank passed a loss that is not a single number.
    """
    manager = _resolve(manager)
    error = None
    try:
        value = _scalar(loss)
    except (TypeError, ValueError) as exc:
        value, error = math.nan, exc
    if manager is None:
        if error is not None:
            raise error
        return value
    if not isinstance(data_parallel, bool) and error is None:
        error = ValueError(f"data_parallel must be True or False, got {data_parallel!r}")
    # One Allreduce over every rank: slot g sums domain group g's shares (that sample's loss), and two
    # counters carry the errors and the data_parallel flags, so a mistake on one rank raises everywhere.
    comm, groups = manager.comm, manager.data_parallel_size
    buf = np.zeros(groups + 2)
    buf[manager.domain_group_index] = value
    buf[groups] = error is not None
    buf[groups + 1] = data_parallel is True
    buf = allreduce_agreed(buf, comm)  # its agreement is in the buffer: the counters carry every rank's errors and flags
    if buf[groups]:
        mine = f"this rank: {error}" if error is not None else "this rank's arguments were fine"
        raise ValueError(
            f"global_loss: {int(buf[groups])} rank(s) of {comm_label(comm)} passed a loss that is not a single "
            f"number or a bad data_parallel ({mine}); pass each rank's scalar loss share"
        )
    if 0 < buf[groups + 1] < comm.Get_size():
        raise ValueError(
            f"global_loss: {int(buf[groups + 1])} of the {comm.Get_size()} ranks of {comm_label(comm)} passed "
            "data_parallel=True, the others False; pass the same on every rank"
        )
    if data_parallel:
        return float(buf[:groups].sum() / groups)
    return float(buf[manager.domain_group_index])


def _scalar(loss: Any) -> float:
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
        return float(loss.detach().cpu().double())
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise ValueError(f"the loss must be a scalar tensor or a real number, got {type(loss).__name__}")
    return float(loss)


# -- metrics ---------------------------------------------------------------

_STATS = ("w", "se", "p", "t", "pp", "tt", "pt")


def latitude_weighted_metrics(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor,
    manager: DomainParallelManager | None = None,
    *,
    climatology: torch.Tensor | None = None,
    dim: int = -2,
    channel_dim: int | None = 1,
    batch_dim: int = 0,
    per_sample: bool = False,
    data_parallel: bool = False,
    centered_acc: bool = False,
    check: bool = True,
) -> dict[str, torch.Tensor]:
    """Latitude-weighted MSE, RMSE and ACC per channel, equal to the single-process values.

    Each rank sums its band's weighted sufficient statistics
    (``sum w``, ``sum w e^2`` and, with a climatology, ``sum w a_p``,
    ``sum w a_t``, ``sum w a_p^2``, ``sum w a_t^2``, ``sum w a_p a_t`` for
    the anomalies ``a = x - climatology``) over every dimension but the
    channel (and the batch, with ``per_sample``), accumulated in float64
    (the elementwise products in the fields' dtype, float32 at least, so no
    float64 copy of a field is made); one fused ``Allreduce``
    adds them over the domain group (or over every rank, with
    ``data_parallel``), and the metrics are formed from the global sums:

    * ``mse = S_we2 / S_w``, ``rmse = sqrt(mse)``;
    * ``acc = S_pt / sqrt(S_pp * S_tt)`` (WeatherBench 2's uncentered
      anomaly correlation), or with ``centered_acc`` the Pearson correlation
      of the anomalies around their weighted means.

    Without ``per_sample`` the samples are pooled (one RMSE over all points
    of all samples). CREDIT and WeatherBench 2 average per-sample RMSEs
    instead: take ``per_sample=True`` and average the rows yourself.
    Collective over the manager's parent communicator (the agreement of
    ``check``; the sums go over the domain group, or every rank with
    ``data_parallel``); the results are identical on every rank that shares
    them. Not differentiable (the values are for logging and validation).

    Args:
        pred: This rank's band of the prediction (e.g. ``(B, C, lat, lon)``
            or ``(B, C, T, lat, lon)``).
        target: This rank's band of the target, the shape of ``pred``.
        weights: This rank's latitude weights (:func:`latitude_weights`),
            shape ``(rows,)`` or ``(rows,) + (1,) * (-dim - 1)``.
        manager: DomainParallelManager (the global singleton if None; with
            none, the single-process metrics).
        climatology: This rank's band of the climatology (shard it like the
            fields), broadcastable to ``pred``; with it the result has
            ``"acc"``.
        dim: The sharded (latitude) dimension of ``pred``.
        channel_dim: The variable/channel dimension (one value per channel),
            or None for one value over all channels.
        batch_dim: The sample dimension (used with ``per_sample``).
        per_sample: One value per sample and channel, shape ``(B, C)``,
            reduced over the domain group only (the samples of other
            data-parallel ranks are other samples). Not with ``data_parallel``.
        data_parallel: Pool the samples of every data-parallel rank too (the
            metric over the global batch; one ``Allreduce`` over the parent
            communicator instead of the domain group).
        centered_acc: ACC around the weighted mean anomaly (Pearson) instead
            of the uncentered anomaly correlation.
        check: Agree first (one small allgather over the parent
            communicator) on the flags and the shapes of the statistics, so a
            mistake on one rank is one exception on every rank. ``False``
            saves that collective; a local mistake then raises on that rank
            only, and the others wait in the ``Allreduce``.

    Returns:
        ``{"mse", "rmse"[, "acc"]}``: float64 CPU tensors of shape ``(C,)``
        (``(B, C)`` with ``per_sample``; without the ``C`` axis when
        ``channel_dim`` is None).

    Raises:
        ValueError: shapes that do not fit, bad dims, ``per_sample`` with
            ``data_parallel``; on every rank when ``check``.
        TypeError: the inputs are not torch tensors.
    """
    manager = _resolve(manager)
    if manager is None:
        comm = None
    else:
        comm = manager.comm if data_parallel else manager.domain_group

    def local() -> tuple:
        if not all(isinstance(flag, bool) for flag in (per_sample, data_parallel, centered_acc)):
            raise ValueError(
                "latitude_weighted_metrics: per_sample, data_parallel and centered_acc must be True or False, got "
                f"{per_sample!r}, {data_parallel!r}, {centered_acc!r}"
            )
        if per_sample and data_parallel:
            raise ValueError(
                "latitude_weighted_metrics: per_sample=True keeps one value per local sample, which the other "
                "data-parallel ranks do not hold; pass data_parallel=False (or per_sample=False to pool all samples)"
            )
        stats = _sufficient_stats(pred, target, weights, climatology, dim, channel_dim, batch_dim, per_sample)
        return stats, (tuple(stats.shape), climatology is not None, per_sample, data_parallel, centered_acc)

    if manager is not None and manager.comm.Get_size() > 1 and check:
        stats = _agree_metrics(manager, local, data_parallel)
    else:
        stats = local()[0]
    if comm is not None and comm.Get_size() > 1:
        stats = allreduce_agreed(stats, comm)  # agreed above (check=True) or trusted (check=False)
    s = dict(zip(_STATS, torch.from_numpy(stats), strict=False))
    out = {"mse": s["se"] / s["w"]}
    out["rmse"] = out["mse"].sqrt()
    if climatology is not None:
        if centered_acc:
            mp, mt = s["p"] / s["w"], s["t"] / s["w"]
            cov = s["pt"] / s["w"] - mp * mt
            var_p, var_t = s["pp"] / s["w"] - mp * mp, s["tt"] / s["w"] - mt * mt
            out["acc"] = cov / (var_p * var_t).sqrt()
        else:
            out["acc"] = s["pt"] / (s["pp"] * s["tt"]).sqrt()
    if channel_dim is None:
        out = {k: v[..., 0] for k, v in out.items()}
    return out


def _sufficient_stats(pred, target, weights, climatology, dim, channel_dim, batch_dim, per_sample) -> np.ndarray:
    """The band's float64 sums, shape ``(k, C)`` or ``(k, B, C)`` (k = 2, or 7 with a climatology)."""
    name = "latitude_weighted_metrics"
    axis, _, w = _band_inputs(name, pred, target, weights, dim)
    ndim = pred.ndim
    keep = []
    if per_sample:
        b = _axis(name, "batch_dim", batch_dim, ndim)
        keep.append(b)
    if channel_dim is not None:
        c = _axis(name, "channel_dim", channel_dim, ndim)
        keep.append(c)
    if axis in keep or len(set(keep)) != len(keep):
        raise ValueError(
            f"{name}: dim={dim}, batch_dim={batch_dim} and channel_dim={channel_dim} must name different "
            f"dimensions of the {ndim}-dimensional fields"
        )
    if climatology is not None:
        if not isinstance(climatology, torch.Tensor):
            raise TypeError(f"{name}: climatology must be a torch tensor, got {type(climatology).__name__}")
        try:
            fits = torch.broadcast_shapes(climatology.shape, pred.shape) == pred.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"{name}: climatology of shape {tuple(climatology.shape)} does not broadcast to this band's "
                f"shape {tuple(pred.shape)}; shard it along dim {dim} like the fields"
            )
    # Sum over every dimension but the kept ones and the latitude (in float64), then weight the rows:
    # one product with the weights per statistic, not per element. Elementwise work stays in the
    # fields' dtype (float32 at least), so no float64 copies of the fields are made.
    other = [i for i in range(ndim) if i not in keep and i != axis]
    left = sorted([*keep, axis])  # the dims a sum over `other` leaves, in order
    wv = w.detach().reshape(-1).double()
    work = torch.promote_types(pred.dtype, torch.float32)
    p, t = pred.detach().to(work), target.detach().to(work)

    def total(x: torch.Tensor) -> torch.Tensor:
        x = x.sum(dim=other, dtype=torch.float64) if other else x.double()
        x = x.movedim(left.index(axis), -1) @ wv  # the kept dims remain, in their order
        if per_sample and channel_dim is not None and keep[0] > keep[1]:
            x = x.transpose(0, 1)  # (batch, channel)
        return x if channel_dim is not None else x.unsqueeze(-1)

    squared_errors = total((p - t) ** 2)
    count = math.prod(pred.shape[i] for i in other)
    sums = [torch.full_like(squared_errors, float(wv.sum()) * count), squared_errors]
    if climatology is not None:
        clim = climatology.detach().to(device=p.device, dtype=work)
        ap, at = p - clim, t - clim
        sums += [total(ap), total(at), total(ap * ap), total(at * at), total(ap * at)]
    return np.ascontiguousarray(torch.stack(sums).cpu().numpy())


def _axis(fn: str, label: str, value: Any, ndim: int) -> int:
    try:
        return normalize_dim(value, ndim)
    except ValueError as exc:
        raise ValueError(f"{fn}: {label}: {exc}") from None


def _band_inputs(fn: str, pred: Any, target: Any, weights: Any, dim: int) -> tuple[int, int, torch.Tensor]:
    """Check a band's prediction, target and weights; returns (axis, rows, weights shaped to broadcast)."""
    for label, value in (("pred", pred), ("target", target), ("weights", weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: {label} must be a torch tensor, got {type(value).__name__}")
    if pred.shape != target.shape:
        raise ValueError(f"{fn}: pred and target differ in shape: {tuple(pred.shape)} vs {tuple(target.shape)}")
    axis = _axis(fn, "dim", dim, pred.ndim)
    rows = pred.shape[axis]
    trailing = pred.ndim - 1 - axis
    want = (rows,) + (1,) * trailing
    if tuple(weights.shape) not in ((rows,), want):
        raise ValueError(
            f"{fn}: weights of shape {tuple(weights.shape)} do not fit this band: it has {rows} row(s) along "
            f"dim {dim} of a {tuple(pred.shape)} field, so the weights must have shape {(rows,)} or {want}; "
            f"latitude_weights gives the rows of this rank's band (on a domain grid: of its grid row) for the "
            f"layout of shard_tensor with the same manager and uneven, so check that pred is this rank's band "
            f"(or block) along dim {dim}"
        )
    return axis, rows, weights.reshape(want).to(device=pred.device)


def _agree_metrics(manager: DomainParallelManager, local: Any, data_parallel: bool) -> np.ndarray:
    """latitude_weighted_metrics' agreement over every rank: this rank's statistics, or the same ValueError.

    Every rank's flags must be equal (ranks that disagreed on data_parallel
    would reduce over different communicators); the statistics' shape must be
    equal within the ranks that reduce together (every rank with
    ``data_parallel``, else the domain group), so it rides in the
    agreement's counts (a digest per rank) and only the ranks of a group that
    differs raise, as the sums are per group.
    """
    comm = manager.comm
    box: list = []

    def compute() -> tuple:
        box.append(local())
        shape, *flags = box[0][1]
        return (Free(shape), *flags)  # the shape is compared per group below, through the counts

    def explain(everyone: list[tuple]) -> None:
        raise _metrics_mismatch(comm, [(e[0].value, *e[1:]) for e in everyone])

    _, shapes = agree_values(comm, "latitude_weighted_metrics", compute, explain,
                             count=lambda value: digest(repr(value[0].value).encode()))
    members = range(len(shapes)) if data_parallel else manager.domain_groups()[manager.domain_group_index]
    groups = [range(len(shapes))] if data_parallel else manager.domain_groups()
    if any(len({shapes[r] for r in group}) > 1 for group in groups):  # every rank sees it: every rank takes the round
        everyone = allgather_or_raise(comm, lambda: box[0][1])
        if len({shapes[r] for r in members}) > 1:
            raise _metrics_mismatch(comm, everyone)
    return box[0][0]


def _metrics_mismatch(comm: Any, everyone: list[tuple]) -> ValueError:
    detail = "; ".join(
        f"rank {r}: statistics {e[0]}, climatology {e[1]}, per_sample {e[2]}, data_parallel {e[3]}, "
        f"centered_acc {e[4]}"
        for r, e in enumerate(everyone)
    )
    return ValueError(
        f"latitude_weighted_metrics: ranks of {comm_label(comm)} disagree (the same channels, the "
        f"same samples with per_sample, a climatology on all or none, the same flags): {detail}"
    )


# -- gradient clipping -------------------------------------------------------

GRADIENTS = ("reduced", "partial")


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    manager: DomainParallelManager | None = None,
    *,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    gradients: str = "reduced",
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm of the global gradient, the same on every rank.

    The global gradient is what :func:`credit_mpi.reduce_gradients` makes of
    the ranks' gradients: summed over the domain group (each band holds a
    partial gradient), averaged over the data-parallel group.

    * ``gradients="reduced"`` (default; call it after ``reduce_gradients``,
      the natural place in a training loop): the gradients are replicated,
      so the global norm is the local one. The ranks still agree (one small
      allgather of the parameter set and the norm): a different set of
      gradients, or norms that differ by more than :data:`REPLICA_RTOL`
      (``reduce_gradients`` was not called), is an error on every rank. Every
      rank scales by rank 0's norm.
    * ``gradients="partial"`` (before ``reduce_gradients``): the norm of the
      *sum* is needed, not the sum of norms, so a copy of the gradients is
      reduced (as much traffic as ``reduce_gradients`` itself) to take the
      norm; the partial gradients are then scaled, and ``reduce_gradients``
      afterwards gives the clipped global gradient (scaling commutes with the
      sum). Use it only when the clipping must happen before the reduction.

    The norm and the scaling are torch's (``max_norm / (norm + 1e-6)``,
    clamped at 1), so the result equals ``torch.nn.utils.clip_grad_norm_``
    on the single-process gradient. With no manager it *is* torch's.
    Collective over the manager's parent communicator.

    Args:
        parameters: Tensors (or one tensor) whose ``.grad`` to clip, the
            same model on every rank; parameters without a gradient are skipped.
        max_norm: Largest allowed norm (a real number >= 0).
        manager: DomainParallelManager (the global singleton if None).
        norm_type: Order of the norm (a real number or ``"inf"``).
        error_if_nonfinite: Raise a ``RuntimeError`` (on every rank) when the
            global norm is nan or inf, as torch does.
        foreach: Passed on to torch's norm and scaling kernels.
        gradients: ``"reduced"`` or ``"partial"``, see above.

    Returns:
        The global norm (a scalar tensor, before clipping), identical on every rank.

    Raises:
        ValueError: bad arguments, or ranks hold gradients for different
            parameters, dtypes, sizes or devices (on every rank).
        DomainParallelError: ``gradients="reduced"`` but the gradients are
            not replicated (on every rank).
        RuntimeError: a non-finite norm with ``error_if_nonfinite``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    manager = _resolve(manager)
    grads = [p.grad for p in params if p.grad is not None]

    def args() -> tuple:
        if gradients not in GRADIENTS:
            raise ValueError(f"clip_grad_norm_: gradients must be 'reduced' or 'partial', got {gradients!r}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be a real number >= 0, got {max_norm!r}")
        try:
            order = float(norm_type)
        except (TypeError, ValueError):
            order = math.nan
        if isinstance(norm_type, bool) or math.isnan(order):
            raise ValueError(f"clip_grad_norm_: norm_type must be a real number or 'inf', got {norm_type!r}")
        if not isinstance(error_if_nonfinite, bool):
            raise ValueError(f"clip_grad_norm_: error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
        return float(max_norm), order, error_if_nonfinite, gradients

    if manager is None:
        max_norm_, order, _, _ = args()
        norm = _total_norm(grads, order, foreach)
        return _clip(params, grads, max_norm_, norm, order, error_if_nonfinite, foreach)

    comm = manager.comm
    signature = [(i, str(p.grad.dtype), p.grad.numel(), p.grad.device.type) for i, p in enumerate(params) if p.grad is not None]

    mine: list[torch.Tensor] = []  # this rank's norm (reduced): the dtype and device of the result

    def local() -> tuple:
        agreed = args()
        if gradients == "reduced":
            mine.append(_total_norm(grads, agreed[1], foreach))
        return agreed, signature

    where = comm_label(comm)

    def explain(everyone: list[tuple]) -> None:
        for r, (agreed, sig) in enumerate(everyone):
            if agreed != everyone[0][0]:
                raise ValueError(
                    f"clip_grad_norm_: rank {r} of {where} passed (max_norm, norm_type, error_if_nonfinite, gradients) "
                    f"= {agreed}, rank 0 {everyone[0][0]}; pass the same arguments on every rank"
                )
            if sig != everyone[0][1]:
                raise ValueError(
                    f"clip_grad_norm_: rank {r} of {where} holds gradients for different parameters, dtypes, sizes or "
                    "device types than rank 0; run the same model and backward pass on every rank"
                )

    # the agreement's one count per rank carries each rank's norm (its float64 bits): no second round
    (agreed, _), bits = agree_values(comm, "clip_grad_norm_", local, explain, count=lambda _: _norm_bits(mine))
    max_norm_, order, _, _ = agreed
    if gradients == "reduced":
        norms = [float(np.int64(b).view(np.float64)) for b in bits]
        if not all(_same(n, norms[0]) for n in norms):
            raise DomainParallelError(
                f"clip_grad_norm_: the gradient norms differ across {where} ({norms}): the gradients are not "
                "replicated. Call credit_mpi.reduce_gradients first, or pass gradients='partial' to clip before it"
            )
        value, local_norm = norms[0], mine[0]
    else:
        copies = [SimpleNamespace(grad=g.detach().clone()) for g in grads]
        reduce_gradients(copies, manager, check=False)  # the set was agreed above
        local_norm = _total_norm([c.grad for c in copies], order, foreach)
        # the same float on every rank, whatever the order of MPI's sums did (the set was agreed above)
        value = float(broadcast_agreed(np.array([float(local_norm)]), comm)[0])
    norm = torch.tensor(value, dtype=local_norm.dtype, device=local_norm.device)
    return _clip(params, grads, max_norm_, norm, order, error_if_nonfinite, foreach)


def _norm_bits(mine: list) -> int:
    """This rank's norm as the int64 of its float64 bits (0 without one): what the agreement's count carries."""
    return int(np.float64(float(mine[0])).view(np.int64)) if mine else 0


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=REPLICA_RTOL, abs_tol=0.0)


def _total_norm(grads: list[torch.Tensor], order: float, foreach: bool | None) -> torch.Tensor:
    """torch's total gradient norm (``torch.nn.utils.get_total_norm``, or the same computation before torch 2.6)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, order, False, foreach)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, order).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), order)


def _clip(params, grads, max_norm: float, norm: torch.Tensor, order: float, error_if_nonfinite: bool, foreach):
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {order} of the gradients is non-finite ({float(norm)}), "
            "so it cannot be clipped; set error_if_nonfinite=False to scale anyway"
        )
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip_with_norm is not None:
        clip_with_norm(params, max_norm, norm, foreach)
    elif grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return norm


def _resolve(manager: DomainParallelManager | None) -> DomainParallelManager | None:
    return get_domain_parallel_manager() if manager is None else manager
