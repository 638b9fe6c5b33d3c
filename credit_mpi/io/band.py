"""open_band: open this rank's latitude band of a Zarr / netCDF store, lazily."""

from __future__ import annotations

from typing import Any

import xarray as xr

from ..manager import DomainParallelManager
from ..partition import band_range
from ._store import agree, check_dim, close_quietly, describe, domain_layout, open_store, resolve_manager, store_name

__all__ = ["open_band"]


def open_band(
    store: Any,
    manager: DomainParallelManager | None = None,
    *,
    dim: str = "latitude",
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

    Args:
        store: A Zarr store (path or zarr store object), a netCDF file, several
            netCDF files (a list or a glob pattern; :func:`xarray.open_mfdataset`,
            needs dask) or an opened :class:`xarray.Dataset`.
        manager: The domain-parallel manager (default: the singleton).
        dim: The dimension to cut into bands (default ``"latitude"``).
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
    manager = resolve_manager(manager)
    comm, n, rank = domain_layout(manager)
    opened: dict[str, Any] = {}

    def plan() -> dict:
        if not isinstance(uneven, bool):
            raise TypeError(f"uneven must be True or False, got {uneven!r}")
        ds = opened["ds"] = open_store(store, open_kwargs)
        check_dim(ds, dim, f"the store {store_name(store)[-1]!r}")
        return {"store": store_name(store), "dim": dim, "uneven": uneven, **describe(ds)}

    agree(comm, "open_band", plan, lambda: close_quietly(opened.get("ds"), store))
    ds = opened["ds"]
    try:
        start, stop = band_range(ds.sizes[dim], n, rank, uneven)  # same inputs on every rank: same error
    except ValueError:
        close_quietly(ds, store)
        raise
    return ds.isel({dim: slice(start, stop)})
