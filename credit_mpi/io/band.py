"""open_band: open this rank's latitude band of a Zarr / netCDF store, lazily."""

from __future__ import annotations

from typing import Any

import xarray as xr

from ..manager import DomainParallelManager
from ..partition import band_range
from . import _store

__all__ = ["open_band"]


def open_band(
    store: Any,
    manager: DomainParallelManager | None = None,
    *,
    dim: str = "latitude",
    lon_dim: str = "longitude",
    uneven: bool = True,
    **open_kwargs: Any,
) -> xr.Dataset:
    """Open this rank's band of ``dim`` from a store, without reading anything else.

    The rows are exactly those that ``shard_tensor(x, dim=<axis of dim>,
    uneven=uneven)`` gives this rank for the global field (same
    :mod:`credit_mpi.partition` layout), so ``open_band(store)[v].values``
    equals ``shard_tensor(open(store)[v].values, ...)``. The dataset is
    lazy: reading a variable reads only the chunks that overlap the band.
    Variables without ``dim`` come back whole; coordinates along ``dim`` are
    this rank's.

    Collective over the manager's domain group: the ranks open the store and
    agree (one small allgather) that they passed the same store, ``dim`` and
    ``uneven`` and see the same sizes, variables and index coordinates; any
    mistake is the same exception on every rank. With no manager (and no
    singleton) or a domain of one rank, the whole store comes back.

    On a latitude x longitude domain grid (``domain_grid=(rows, cols)``,
    ``cols > 1``) the rank gets its block: the latitude band of its grid row
    (``rows`` bands of ``dim``) and the longitude band of its grid column
    (``cols`` bands of ``lon_dim``), what ``shard_tensor`` with the
    (latitude, longitude) dims gives. A store that :func:`write_bands` did
    not finish (a write failed on some rank) is refused with a ``ValueError``.

    Args:
        store: A Zarr store (path or zarr store object), a netCDF file, several
            netCDF files (a list or a glob pattern; :func:`xarray.open_mfdataset`,
            needs dask) or an opened :class:`xarray.Dataset`.
        manager: The domain-parallel manager (default: the singleton).
        dim: The dimension to cut into bands (default ``"latitude"``).
        lon_dim: The longitude dimension, cut too on a grid of more than one column.
        uneven: Allow a size that the domain size does not divide
            (``numpy.array_split`` layout), as in :func:`credit_mpi.shard_tensor`.
        **open_kwargs: Passed to :func:`xarray.open_zarr` /
            :func:`xarray.open_dataset` / :func:`xarray.open_mfdataset`
            (``chunks`` defaults to ``None``: lazy arrays without dask).

    Returns:
        This rank's band as a lazy :class:`xarray.Dataset`.

    Raises:
        credit_mpi.io.StoreNotFoundError: the path does not exist (a
            ``FileNotFoundError`` and a ``ValueError``).
        ValueError: ``dim`` is not a dimension of the store, its size is not
            divisible and ``uneven`` is false, or the ranks passed different
            stores or arguments.
        TypeError: ``dim`` is not a string or ``manager`` not a manager.
    """
    manager = _store.resolve_manager(manager)
    comm, _, _ = _store.domain_layout(manager)
    opened: dict[str, Any] = {}

    def plan() -> dict:
        if not isinstance(uneven, bool):
            raise TypeError(f"uneven must be True or False, got {uneven!r}")
        ds = opened["ds"] = _store.open_store(store, open_kwargs)
        what = f"the store {_store.store_name(store)[-1]!r}"
        _store.check_dim(ds, dim, what)
        _store.check_complete(ds, what)
        if cols > 1:
            _store.check_dim(ds, lon_dim, f"{what} (a {rows}x{cols} domain grid cuts the longitude too: pass lon_dim=)")
        return {"store": _store.store_name(store), "dim": dim, "lon_dim": lon_dim if cols > 1 else None, "uneven": uneven,
                **_store.describe(ds)}

    (rows, cols), (row, col) = _store.grid_position(manager)
    _store.agree(comm, "open_band", plan, lambda: _store.close_quietly(opened.get("ds"), store))
    ds = opened["ds"]
    try:  # same inputs on every rank: same error
        cut = {dim: slice(*band_range(ds.sizes[dim], rows, row, uneven))}
        if cols > 1:
            cut[lon_dim] = slice(*band_range(ds.sizes[lon_dim], cols, col, uneven))
    except ValueError:
        _store.close_quietly(ds, store)
        raise
    return ds.isel(cut)
