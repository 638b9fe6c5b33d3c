"""Band IO: read only this rank's band of a Zarr / netCDF store, write one store from every rank.

An optional extra (``pip install "credit-mpi[io]"``: xarray, zarr,
h5netcdf, dask). ``import credit_mpi`` imports none of it; ``import
credit_mpi.io`` imports xarray, and :class:`BandDataset` (torch) loads on
first use.

* :func:`open_band`: this rank's rows of a dimension, lazily (only the
  chunks that overlap the band are read); the rows ``shard_tensor`` gives.
* :func:`write_bands`: every rank writes its band into one Zarr store (one
  writer per chunk) or, through one rank, a netCDF file.
* :class:`BandDataset`: a torch ``Dataset`` of training samples that yields
  what ``shard_batch`` would give from the global sample, reading only the
  band; safe in ``DataLoader`` worker processes (no MPI there).
"""

from __future__ import annotations

from ._store import StoreNotFoundError
from .band import open_band
from .write import write_bands

__all__ = ["open_band", "write_bands", "BandDataset", "StoreNotFoundError"]


def __getattr__(name: str):
    # BandDataset needs torch: load it on first use
    if name == "BandDataset":
        from .dataset import BandDataset

        return BandDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
