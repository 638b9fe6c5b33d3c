"""write_bands: every rank writes its band into one Zarr store (or one netCDF file).

Chunk policy (why no two ranks ever write the same chunk)
---------------------------------------------------------
Zarr chunks are regular: ``c`` rows along ``dim`` each (the last may be
shorter). A chunk that two ranks wrote would be a race (read-modify-write of
one object), so every chunk has exactly one writer: **the rank that holds the
chunk's first row**. Rank ``r`` writes the rows ``[A(o_r), A(o_{r+1}))``,
where ``o_r`` is its first row and ``A(x)`` rounds ``x`` up to a multiple of
``c`` (at most the total): whole chunks only, and these ranges cut the
dimension into consecutive pieces, one per rank. The rows a rank holds but
does not write (the head of its band, up to the first chunk boundary) go to
the rank that writes them in one ``Alltoallv`` per variable before anything
is written; with the default ``c`` (the largest band) that is a few rows per
rank for uneven bands and nothing at all for even ones. Any chunking works
this way (``chunks=``), also chunks larger than a band (then some ranks write
nothing and send their rows on), which is why the exchange is preferred over
forcing the chunks to the bands: uneven bands (721 rows on 4 ranks: 181, 180,
180, 180) have no regular chunking that fits them except one row per chunk.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr
from mpi4py import MPI

from ..agreement import Free
from ..layout import offsets
from ..manager import DomainParallelManager
from ..validation import allgather_or_raise
from ._store import (
    INCOMPLETE,
    agree,
    domain_layout,
    grid_position,
    is_zarr_dir,
    resolve_manager,
    store_name,
    values_digest,
)

__all__ = ["write_bands", "writer_ranges"]

MODES = ("w", "w-")
NETCDF_SUFFIXES = (".nc", ".nc4", ".netcdf", ".cdf")
# Encoding keys that carry over from the input (the rest describe the source store's layout).
_KEEP_ENCODING = ("dtype", "_FillValue", "missing_value", "scale_factor", "add_offset", "units", "calendar")


def writer_ranges(sizes: list[int], chunk: int | None) -> list[tuple[int, int]]:
    """Rows each rank writes when bands of ``sizes`` go into chunks of ``chunk`` rows.

    ``chunk=None`` means one writer (rank 0) for everything. Otherwise each
    chunk is written by the rank that holds its first row; the ranges are
    whole chunks and cut ``[0, sum(sizes))`` into consecutive pieces.
    """
    total = sum(sizes)
    if chunk is None:
        return [(0, total)] + [(total, total)] * (len(sizes) - 1)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 row, got {chunk}")
    edges = [min(math.ceil(o / chunk) * chunk, total) for o in offsets(sizes)] + [total]
    return list(zip(edges[:-1], edges[1:], strict=True))


def exchange_rows(
    comm: MPI.Comm, array: np.ndarray, axis: int, have: list[tuple[int, int]], want: list[tuple[int, int]]
) -> np.ndarray:
    """Move rows along ``axis`` from the layout ``have`` to the layout ``want`` (one ``Alltoallv``).

    ``array`` holds the rows ``have[rank]`` of a global array; the result
    holds ``want[rank]``. Collective over ``comm``; every rank passes the same
    ``have``, ``want``, dtype and the same shape but along ``axis``.
    """
    rank, n = comm.Get_rank(), comm.Get_size()
    moved = np.moveaxis(array, axis, 0)
    row_shape = moved.shape[1:]
    row_bytes = math.prod(row_shape) * array.dtype.itemsize

    def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        return lo, max(lo, hi)

    h0 = have[rank][0]
    pieces, send_counts = [], []
    for dest in range(n):
        lo, hi = overlap(have[rank], want[dest])
        pieces.append(moved[lo - h0 : hi - h0])
        send_counts.append((hi - lo) * row_bytes)
    recv_counts = [(hi - lo) * row_bytes for lo, hi in (overlap(have[src], want[rank]) for src in range(n))]
    send = np.ascontiguousarray(np.concatenate(pieces, axis=0)) if pieces else moved[:0]
    w0, w1 = want[rank]
    recv = np.empty((w1 - w0, *row_shape), dtype=array.dtype)
    comm.Alltoallv(
        [send.reshape(-1).view(np.uint8), (send_counts, offsets(send_counts)), MPI.BYTE],
        [recv.reshape(-1).view(np.uint8), (recv_counts, offsets(recv_counts)), MPI.BYTE],
    )
    return np.moveaxis(recv, 0, axis)


def write_bands(
    ds_band: xr.Dataset,
    store: Any,
    manager: DomainParallelManager | None = None,
    *,
    dim: str = "latitude",
    mode: str = "w",
    chunks: Mapping[str, int] | None = None,
) -> None:
    """Write every rank's band into one store that reads back as the global dataset.

    Each rank of the domain group passes its band: the same variables,
    dtypes and sizes except along ``dim``, where domain rank ``r``'s rows
    follow rank ``r - 1``'s (any sizes, e.g. what :func:`open_band` or
    :func:`credit_mpi.shard_tensor` gave). Variables without ``dim`` must be
    equal on every rank and are written once.

    Zarr (any path but a ``.nc``/``.nc4``/``.netcdf``/``.cdf`` file, or a
    zarr store object): domain rank 0 creates the store (metadata, the global
    coordinates, the variables without ``dim``), then every rank writes whole
    chunks in parallel; each chunk has exactly one writer (see the module
    notes: the rank holding its first row, after a small row exchange).
    netCDF: the bands go to domain rank 0 (one ``Alltoallv`` per variable),
    which writes the file; it needs the global dataset's memory.

    Collective over the domain group. Everything that could differ between
    ranks (store, mode, dim, chunks, variables, dtypes, the shared
    variables' values) is agreed before anything is written, and each rank
    reads its band (a lazily opened one too) inside that agreement: a
    mistake or a chunk that cannot be read is the same exception on every
    rank and nothing is written. A failure while writing is reported on
    every rank, and the store says it is incomplete: a Zarr store carries
    the attribute ``credit_mpi_incomplete`` from its creation until every
    rank has written its rows (:func:`open_band` and
    :class:`BandDataset` refuse it); a netCDF file is written under a
    temporary name and renamed when whole.

    Latitude bands only: on a domain grid of more than one column
    (``domain_grid=(rows, cols)``) every rank raises a ``ValueError``.

    Args:
        ds_band: This rank's band (an :class:`xarray.Dataset`; lazy is fine).
        store: Where to write: a path or a zarr store object.
        manager: The domain-parallel manager (default: the singleton). With
            none, or a domain of one rank, ``ds_band`` is written as it is.
        dim: The dimension the bands cut (default ``"latitude"``).
        mode: ``"w"`` (replace an existing store) or ``"w-"`` (fail if it exists).
        chunks: Zarr chunk sizes by dimension name; ``dim`` defaults to the
            largest band, the other dimensions to their whole size.

    Raises:
        ValueError: bad arguments, a ``dim`` that ``ds_band`` lacks, ranks
            that passed different stores, variables or shared values.
        TypeError: ``ds_band`` is not a Dataset, a variable has an object dtype.
        credit_mpi.DomainParallelError: a write failed on some rank.
    """
    manager = resolve_manager(manager)
    comm, n, rank = domain_layout(manager)
    (rows, cols), _ = grid_position(manager)
    band_data: dict[str, np.ndarray] = {}

    def plan() -> dict:
        if cols > 1:
            raise ValueError(
                f"write_bands writes latitude bands, but the manager's domain is a {rows}x{cols} latitude x longitude "
                f"grid (each rank a block); write from a manager of latitude bands (domain_grid=None), or gather each "
                f"grid row's blocks along the longitude first"
            )
        if not isinstance(ds_band, xr.Dataset):
            raise TypeError(f"ds_band must be an xarray.Dataset, got {type(ds_band).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(dim, str) or dim not in ds_band.dims:
            raise ValueError(f"dim {dim!r} is not a dimension of ds_band; its dimensions are {sorted(map(str, ds_band.dims))}")
        target = _target(store)
        agreed_chunks = _check_chunks(chunks, ds_band)
        if target[0] == "netcdf" and agreed_chunks:
            raise ValueError(f"chunks= applies to Zarr stores only, not to the netCDF file {target[1]!r}")
        if mode == "w-" and isinstance(target[1], str) and os.path.exists(target[1]):
            raise ValueError(f"store {target[1]!r} exists already and mode='w-'; pass mode='w' to replace it")
        if target[0] == "netcdf" and not os.path.isdir(os.path.dirname(target[1]) or "."):
            raise ValueError(f"the directory of {target[1]!r} does not exist")
        variables = []
        for name, var in ds_band.variables.items():
            if var.dtype.kind == "O":
                raise TypeError(f"variable {name!r} has dtype object; write_bands moves fixed-size dtypes only")
            shape = tuple(int(s) for d, s in zip(var.dims, var.shape, strict=True) if d != dim)
            shared = None if dim in var.dims else values_digest(var.values)
            variables.append((str(name), tuple(map(str, var.dims)), var.dtype.str, shape, shared))
        for name, var in ds_band.variables.items():  # read now: a chunk that cannot be read is everyone's error
            if dim in var.dims and name != dim:
                band_data[name] = np.asarray(var.values)
        index = ds_band.indexes.get(dim)
        return {
            "store": target,
            "mode": mode,
            "dim": dim,
            "chunks": tuple(sorted(agreed_chunks.items())),
            "variables": tuple(sorted(variables)),
            "sizes": tuple(sorted((str(k), int(v)) for k, v in ds_band.sizes.items() if k != dim)),
            "band": (int(ds_band.sizes[dim]), None if index is None else np.asarray(index.values)),
        }

    desc, sizes = agree(comm, "write_bands", lambda: _split_band(plan()), lambda: None, count=lambda d: d["band_rows"].value)
    # every rank's index coordinates (they differ: the band's own rows), gathered once the call is agreed
    index = desc["band_index"].value
    coords = [index] if comm is None else allgather_or_raise(comm, lambda: index)
    target = desc["store"]
    names = [name for name, var in ds_band.variables.items() if dim in var.dims and name != dim]
    if target[0] == "netcdf":
        chunk = None
    else:
        chunk = dict(desc["chunks"]).get(dim, max(max(sizes), 1))
    have = list(zip(offsets(sizes), [o + s for o, s in zip(offsets(sizes), sizes, strict=True)], strict=True))
    want = writer_ranges(sizes, chunk)
    global_index = None if coords[0] is None else np.concatenate(coords)

    if comm is not None and target[0] == "zarr":  # domain rank 0 creates the store; an error is everyone's
        allgather_or_raise(comm, lambda: _create(ds_band, store, dim, sizes, global_index, dict(desc["chunks"]), chunk, mode) if rank == 0 else None)

    moved: dict[str, xr.Variable] = {}
    for name in names:  # the same names, in the same order, on every rank (agreed)
        var = ds_band.variables[name]
        data = band_data[name]
        if comm is not None:
            data = exchange_rows(comm, data, var.dims.index(dim), have, want)
        moved[name] = xr.Variable(var.dims, data)

    def write() -> None:
        start, stop = want[rank]
        if target[0] == "netcdf":
            if rank == 0:  # under a temporary name, renamed when whole: never half a file under the name
                partial = f"{target[1]}.incomplete"
                _global_dataset(ds_band, moved, dim, global_index).to_netcdf(partial, mode="w")
                os.replace(partial, target[1])
        elif comm is None:
            _create(ds_band, store, dim, sizes, global_index, dict(desc["chunks"]), chunk, mode)
            xr.Dataset(moved).to_zarr(store, region={dim: slice(start, stop)}, mode="r+")
        elif stop > start:
            xr.Dataset(moved).to_zarr(store, region={dim: slice(start, stop)}, mode="r+")

    if comm is None:
        write()
        if target[0] == "zarr":
            _mark_complete(store)
        return
    try:
        allgather_or_raise(comm, write)
    except Exception as exc:
        raise type(exc)(f"{exc} (writing {target[1]!r}: the store is incomplete)") from exc
    if target[0] == "zarr":  # every rank wrote its rows: domain rank 0 removes the mark, last
        allgather_or_raise(comm, lambda: _mark_complete(store) if rank == 0 else None)


def _mark_complete(store: Any) -> None:
    """Remove the :data:`INCOMPLETE` attribute of a Zarr store (and consolidate its metadata again)."""
    import zarr

    group = zarr.open_group(store, mode="r+")
    if INCOMPLETE in group.attrs:
        del group.attrs[INCOMPLETE]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(store)


def _split_band(desc: dict) -> dict:
    # the band rows and coordinate values differ between ranks: carried, not compared
    rows, index = desc.pop("band")
    return {**desc, "band_rows": Free(rows), "band_index": Free(index)}


def _target(store: Any) -> tuple[str, Any]:
    if isinstance(store, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(store))
        if path.lower().endswith(NETCDF_SUFFIXES):
            return ("netcdf", path)
        if os.path.isfile(path):
            raise ValueError(f"{path!r} is a file; write_bands writes a Zarr store directory or a .nc file")
        if os.path.isdir(path) and os.listdir(path) and not is_zarr_dir(path):
            raise ValueError(f"{path!r} is a non-empty directory that is not a Zarr store; refusing to replace it")
        return ("zarr", path)
    if isinstance(store, (xr.Dataset, list, tuple)):
        raise TypeError(f"store must be a path or a zarr store object, got {type(store).__name__}")
    return ("zarr", store_name(store)[-1])


def _check_chunks(chunks: Mapping[str, int] | None, ds: xr.Dataset) -> dict:
    if chunks is None:
        return {}
    if not isinstance(chunks, Mapping):
        raise TypeError(f"chunks must be a mapping of dimension name to rows, got {chunks!r}")
    out = {}
    for key, value in chunks.items():
        if key not in ds.dims:
            raise ValueError(f"chunks names {key!r}, not a dimension of ds_band (dimensions: {sorted(map(str, ds.dims))})")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"chunks[{key!r}] must be a positive integer, got {value!r}")
        out[str(key)] = int(value)
    return out


def _create(
    ds_band: xr.Dataset,
    store: Any,
    dim: str,
    sizes: list[int],
    global_index: np.ndarray | None,
    chunks: dict,
    chunk: int,
    mode: str,
) -> None:
    """Write the store's metadata, the global ``dim`` coordinate and the variables without ``dim``."""
    import dask.array as da

    total = sum(sizes)
    variables = {}
    for name, var in ds_band.variables.items():
        if name == dim:
            continue
        encoding = {k: v for k, v in var.encoding.items() if k in _KEEP_ENCODING}
        if dim in var.dims:
            shape = tuple(total if d == dim else s for d, s in zip(var.dims, var.shape, strict=True))
            chunk_shape = tuple(
                min(chunk if d == dim else chunks.get(d, s), max(s, 1)) for d, s in zip(var.dims, shape, strict=True)
            )
            encoding["chunks"] = chunk_shape
            variables[name] = xr.Variable(var.dims, da.zeros(shape, dtype=var.dtype, chunks=chunk_shape), var.attrs, encoding)
        else:
            variables[name] = xr.Variable(var.dims, var.values, var.attrs, encoding)
    coords = {name: variables.pop(name) for name in list(variables) if name in ds_band.coords}
    if global_index is not None:
        var = ds_band.variables[dim]
        coords[dim] = xr.Variable((dim,), global_index, var.attrs, {k: v for k, v in var.encoding.items() if k in _KEEP_ENCODING})
    attrs = {**ds_band.attrs, INCOMPLETE: "write_bands has not finished writing every rank's rows (or a write failed)"}
    template = xr.Dataset(variables, coords=coords, attrs=attrs)
    with warnings.catch_warnings():
        # zarr warns that consolidated metadata is not in the Zarr 3 spec; xarray reads it (no listing
        # of the store on open, no warning), and the region writes that follow do not change metadata
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        template.to_zarr(store, mode=mode, compute=False, consolidated=True)


def _global_dataset(ds_band: xr.Dataset, moved: dict, dim: str, global_index: np.ndarray | None) -> xr.Dataset:
    """Domain rank 0's global dataset for a netCDF file: gathered variables plus the shared ones."""
    variables = {}
    for name, var in ds_band.variables.items():
        if name == dim:
            continue
        data = moved[name].data if name in moved else var.values
        encoding = {k: v for k, v in var.encoding.items() if k in _KEEP_ENCODING}
        variables[name] = xr.Variable(var.dims, data, var.attrs, encoding)
    coords = {name: variables.pop(name) for name in list(variables) if name in ds_band.coords}
    if global_index is not None:
        coords[dim] = xr.Variable((dim,), global_index, ds_band.variables[dim].attrs)
    return xr.Dataset(variables, coords=coords, attrs=ds_band.attrs)
