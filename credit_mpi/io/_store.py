"""Opening a store lazily, and describing it so that the ranks of a domain group can agree on it.

Internal to :mod:`credit_mpi.io`: which kind of store a path is, how it is
opened without reading data, and the small fingerprint (sizes, variables,
index coordinates) that ranks agree on before anything else happens.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import xarray as xr
from mpi4py import MPI

from ..agreement import agree_values
from ..manager import DomainParallelManager, get_domain_parallel_manager
from ..validation import comm_label, digest

__all__ = ["StoreNotFoundError"]


class StoreNotFoundError(FileNotFoundError, ValueError):
    """The store named by a path does not exist.

    A :class:`FileNotFoundError` (``except FileNotFoundError`` catches it)
    and a :class:`ValueError`, so that it reaches every rank as itself.
    """


ZARR_MARKERS = ("zarr.json", ".zgroup", ".zmetadata", ".zarray")
NETCDF_SUFFIXES = (".nc", ".nc4", ".netcdf", ".cdf")


def resolve_manager(manager: Any) -> DomainParallelManager | None:
    """The manager to use: the argument, else the singleton, else None (one process)."""
    if manager is None:
        manager = get_domain_parallel_manager()
    if manager is not None and not isinstance(manager, DomainParallelManager):
        raise TypeError(f"manager must be a credit_mpi.DomainParallelManager or None, got {type(manager).__name__}")
    return manager


def domain_layout(manager: DomainParallelManager | None) -> tuple[MPI.Comm | None, int, int]:
    """``(domain communicator or None, domain size, domain rank)``; None for one process."""
    if manager is None or manager.domain_parallel_size <= 1:
        return None, 1, 0
    return manager.domain_group, manager.domain_parallel_size, manager.domain_rank


INCOMPLETE = "credit_mpi_incomplete"  # the store attribute write_bands sets first and removes last


def grid_position(manager: DomainParallelManager | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((rows, cols), (row, col))`` of this rank on the manager's domain grid (``((n, 1), (rank, 0))``: bands)."""
    from ..grid import grid_coords, grid_of

    if manager is None or manager.domain_parallel_size <= 1:
        return (1, 1), (0, 0)
    grid = grid_of(manager, manager.domain_parallel_size)
    return grid, grid_coords(manager.domain_rank, grid)


def check_complete(ds: xr.Dataset, what: str) -> None:
    """ValueError when ``ds`` is a store that :func:`credit_mpi.io.write_bands` did not finish writing."""
    if INCOMPLETE in ds.attrs:
        raise ValueError(
            f"{what} is incomplete: {ds.attrs[INCOMPLETE]} (write_bands sets this attribute first and removes it "
            f"after every rank wrote its rows); write it again"
        )


def agree(comm: MPI.Comm | None, what: str, compute: Callable[[], dict], cleanup: Callable[[], None],
          count: Callable[[dict], int] | None = None) -> tuple[dict, list[int]]:
    """Run ``compute`` on every rank of ``comm`` and require the same result everywhere.

    ``compute`` returns a dict of fields that must be equal on every rank
    (:class:`credit_mpi.agreement.Free` fields excepted). A rank that
    raises, or fields that differ between ranks, are the same exception on
    every rank (after ``cleanup`` ran there): :func:`credit_mpi.agreement.agree_values`
    with :func:`check_same` naming the fields. ``count(desc)`` is one
    integer every rank learns from every other. With ``comm`` None (one
    process) ``compute`` just runs.

    Returns:
        ``(desc, counts)``: this rank's result and every rank's count.
    """
    try:
        if comm is None:
            desc = compute()
            return desc, [0 if count is None else int(count(desc))]
        return agree_values(comm, what, compute, lambda descs: check_same(what, descs, comm), count=count)
    except BaseException:
        cleanup()
        raise


def check_same(what: str, descs: list[dict], comm: MPI.Comm) -> None:
    """ValueError naming each differing field and every rank's value unless all ``descs`` are equal."""
    first = descs[0]
    differ = [key for key in first if any(desc[key] != first[key] for desc in descs)]
    if not differ:
        return
    detail = "; ".join(
        f"{key}: " + ", ".join(f"rank {r}: {_short(desc[key])}" for r, desc in enumerate(descs)) for key in differ
    )
    raise ValueError(
        f"{what}: the ranks of {comm_label(comm)} must pass the same arguments and see the same store, "
        f"but they differ in {', '.join(differ)} ({detail})"
    )


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def store_name(store: Any) -> tuple:
    """What ranks compare to decide that they opened the same store."""
    if isinstance(store, xr.Dataset):
        return ("dataset",)
    if isinstance(store, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(store))
        return ("paths", path) if _has_glob(path) else ("path", path)
    if isinstance(store, (list, tuple)):
        return ("paths", tuple(os.path.abspath(os.fspath(p)) for p in store))
    return ("store", str(store))


def is_zarr_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in ZARR_MARKERS)


def open_store(store: Any, open_kwargs: Mapping[str, Any]) -> xr.Dataset:
    """Open ``store`` lazily (no data read; ``chunks=None`` unless given: xarray's lazy arrays, no dask).

    ``store`` is an opened :class:`xarray.Dataset`, a Zarr store path or
    store object, a netCDF file, or several netCDF files (a list or a glob
    pattern, through :func:`xarray.open_mfdataset`).
    """
    kwargs = dict(open_kwargs)
    if isinstance(store, xr.Dataset):
        if kwargs:
            raise ValueError(f"open keyword arguments {sorted(kwargs)} cannot apply to an already opened xarray.Dataset")
        return store
    if isinstance(store, (list, tuple)) or (isinstance(store, (str, os.PathLike)) and _has_glob(os.fspath(store))):
        if isinstance(store, (list, tuple)):
            paths = [os.fspath(p) for p in store]
        else:
            paths = sorted(glob.glob(os.fspath(store)))
        if not paths:
            raise StoreNotFoundError(f"no files match {store!r} (a list of netCDF files or a glob pattern)")
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise StoreNotFoundError(f"file(s) {missing} do not exist (of the netCDF files {paths})")
        return xr.open_mfdataset(paths, **kwargs)
    if isinstance(store, (str, os.PathLike)):
        path = os.fspath(store)
        if not os.path.exists(path):
            raise StoreNotFoundError(
                f"store {path!r} does not exist (expected a Zarr store directory, a netCDF file, "
                f"a list of netCDF files or a glob pattern)"
            )
        kwargs.setdefault("chunks", None)
        engine = kwargs.get("engine")
        if engine == "zarr" or (engine is None and os.path.isdir(path)):
            if not is_zarr_dir(path):
                raise ValueError(f"{path!r} is a directory but not a Zarr store (it has none of {ZARR_MARKERS})")
            kwargs.pop("engine", None)
            return xr.open_zarr(path, **kwargs)
        return xr.open_dataset(path, **kwargs)
    kwargs.setdefault("chunks", None)
    return xr.open_zarr(store, **kwargs)


def check_dim(ds: xr.Dataset, dim: Any, what: str) -> None:
    """ValueError unless ``dim`` is a dimension of ``ds``."""
    if not isinstance(dim, str):
        raise TypeError(f"dim must be a dimension name (str), got {dim!r}")
    if dim not in ds.dims:
        raise ValueError(f"dim {dim!r} is not a dimension of {what}; its dimensions are {sorted(map(str, ds.dims))}")


def values_digest(values: Any) -> str:
    """A short digest of an array's values (for ranks to compare coordinates without sending them)."""
    array = np.asarray(values)
    if array.dtype.kind == "O":
        data = "\0".join(map(repr, array.ravel().tolist())).encode()
    else:
        data = np.ascontiguousarray(array).tobytes()
    return f"{digest(str((array.dtype.str, array.shape)).encode() + data) & (1 << 64) - 1:016x}"


def describe(ds: xr.Dataset) -> dict:
    """Sizes, variables (dims, dtype) and a digest of every index coordinate: what ranks compare."""
    return {
        "sizes": tuple(sorted((str(k), int(v)) for k, v in ds.sizes.items())),
        "variables": tuple(sorted((str(name), tuple(map(str, var.dims)), str(var.dtype)) for name, var in ds.variables.items())),
        "indexes": tuple(sorted((str(name), values_digest(index.values)) for name, index in ds.indexes.items())),
    }


def close_quietly(ds: xr.Dataset | None, store: Any) -> None:
    """Close a dataset this module opened (never one the caller passed in)."""
    if ds is not None and ds is not store:
        try:
            ds.close()
        except Exception:  # noqa: BLE001 - closing after another error; that error is what matters
            pass
