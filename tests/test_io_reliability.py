"""Reliability of band IO and the latitude weights (issue 27): no rank waits, nothing is written half, blocks on a grid.

Each MPI test runs inside :func:`tests.bounded.bounded` (a hang ends the job in
seconds, naming the test).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
pytest.importorskip("zarr")
pytest.importorskip("h5netcdf")
pytest.importorskip("dask")
torch = pytest.importorskip("torch")

from credit_mpi import io as cio  # noqa: E402
from credit_mpi.nn import LatitudeWeightedMSELoss, latitude_weighted_mse, latitude_weights  # noqa: E402
from credit_mpi.partition import band_range  # noqa: E402

from .bounded import bounded  # noqa: E402
from .test_io import H, W, era5_like, store  # noqa: E402, F401 - the fixtures, through request (shared_dir: conftest)

GRIDS = ((2, 2), (1, 4))  # (4, 1) is latitude bands: tests/test_io.py


def same_failure_everywhere(comm, fn) -> tuple[str, str]:
    """Call ``fn``: it must raise on every rank of ``comm``, the same type and message everywhere."""
    try:
        fn()
        got = ("nothing", "")
    except Exception as exc:  # noqa: BLE001 - compared below
        got = (type(exc).__name__, str(exc))
    everyone = comm.allgather(got)
    assert got[0] != "nothing" and everyone == [got] * comm.Get_size(), everyone
    return got


@pytest.mark.mpi(min_size=2)
def test_unreadable_chunk_on_one_rank_is_everyones_error(request, make_manager):
    """A lazily opened band whose chunk cannot be read on the last rank only: every rank raises the same error before
    any row moves, and nothing is written."""
    src, folder = request.getfixturevalue("store"), request.getfixturevalue("shared_dir")
    comm = MPI.COMM_WORLD
    manager = make_manager()
    if comm.Get_rank() == 0:  # the last chunk of lsm's rows: only the last rank's band reads it
        for path in glob.glob(os.path.join(src, "lsm", "c", str((H - 1) // 4), "*")):
            with open(path, "wb") as f:
                f.write(b"not a chunk")
    comm.Barrier()
    band = cio.open_band(src, manager)
    out = os.path.join(folder, "out.zarr")
    with bounded("unreadable chunk"):
        same_failure_everywhere(manager.domain_group, lambda: cio.write_bands(band, out, manager))
    assert not os.path.exists(out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_failed_write_leaves_a_store_that_says_incomplete(suffix, request, make_manager, monkeypatch):
    """A write that fails on the last rank: the same error everywhere; the Zarr store says it is incomplete and
    open_band / BandDataset refuse it; a netCDF file is never there half. Written again, it opens."""
    src, folder = request.getfixturevalue("store"), request.getfixturevalue("shared_dir")
    manager = make_manager()
    band = cio.open_band(src, manager)
    out = os.path.join(folder, f"out{suffix}")

    def boom(*args, **kwargs):
        raise OSError("injected: disk full")

    with monkeypatch.context() as patch:
        if manager.domain_rank == manager.domain_parallel_size - 1:
            patch.setattr(xr.Dataset, "to_zarr", boom)
        if manager.domain_rank == 0:
            patch.setattr(xr.Dataset, "to_netcdf", boom)
        with bounded("failed write"):
            _, message = same_failure_everywhere(manager.domain_group, lambda: cio.write_bands(band, out, manager))
    assert "injected: disk full" in message and "incomplete" in message
    with bounded("open an incomplete store"):
        if suffix == ".zarr":
            for open_ in (lambda: cio.open_band(out, manager), lambda: cio.BandDataset(out, ["t"], manager)):
                _, message = same_failure_everywhere(manager.domain_group, open_)
                assert "is incomplete" in message and "write it again" in message, message
        else:
            assert not os.path.exists(out)
        cio.write_bands(band, out, manager)
        again = cio.open_band(out, manager)
        assert "credit_mpi_incomplete" not in again.attrs
        np.testing.assert_array_equal(again["t"].values, band["t"].values)


def grid_manager(make_manager, grid):
    if MPI.COMM_WORLD.Get_size() != grid[0] * grid[1]:
        pytest.skip(f"a {grid[0]}x{grid[1]} grid needs {grid[0] * grid[1]} ranks")
    return make_manager(grid[0] * grid[1], domain_grid=grid)


def block_of(manager, h=H, w=W) -> tuple[slice, slice]:
    rows, cols = manager.domain_grid
    row, col = manager.domain_coords
    return slice(*band_range(h, rows, row, True)), slice(*band_range(w, cols, col, True))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("grid", GRIDS)
def test_open_band_and_dataset_give_the_block_on_a_grid(grid, request, make_manager):
    """On a grid each rank gets its block: the latitudes of its grid row and the longitudes of its grid column."""
    manager = grid_manager(make_manager, grid)
    src = request.getfixturevalue("store")
    lat, lon = block_of(manager)
    whole = era5_like()
    with bounded("open a block"):
        band = cio.open_band(src, manager)
        np.testing.assert_array_equal(band["t"].values, whole["t"].values[..., lat, lon])
        np.testing.assert_array_equal(band["level_weight"].values, whole["level_weight"].values)
        ds = cio.BandDataset(src, ["t", "z"], manager, static_variables=["lsm"])
    sample = ds[1]
    np.testing.assert_array_equal(sample["x"][:3, 0].numpy(), whole["t"].values[1][:, lat, lon])
    np.testing.assert_array_equal(sample["static"][0, 0].numpy(), whole["lsm"].values[lat, lon])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("grid", [(2, 2), (1, 4)])
def test_write_bands_refuses_a_grid(grid, request, make_manager):
    """Blocks written as bands would repeat the latitudes: every rank raises the same ValueError, nothing written."""
    manager = grid_manager(make_manager, grid)
    src, folder = request.getfixturevalue("store"), request.getfixturevalue("shared_dir")
    out = os.path.join(folder, "grid.zarr")
    with bounded("write on a grid"):
        block = cio.open_band(src, manager).drop_vars("longitude")
        kind, message = same_failure_everywhere(manager.domain_group, lambda: cio.write_bands(block, out, manager))
    assert kind == "ValueError" and f"{grid[0]}x{grid[1]}" in message and "domain_grid=None" in message, message
    assert not os.path.exists(out)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("grid", GRIDS)
def test_latitude_weights_and_loss_on_a_grid(grid, make_manager):
    """The weights are the rows of the rank's grid row; the blocks' loss shares add up to the one-process loss."""
    manager = grid_manager(make_manager, grid)
    lat, lon = block_of(manager, 13, 10)
    full = latitude_weights(13)
    torch.testing.assert_close(latitude_weights(13, manager), full[lat], rtol=0, atol=0)
    gen = torch.Generator().manual_seed(3)
    pred, target = torch.randn(2, 3, 13, 10, generator=gen, dtype=torch.float64), torch.randn(2, 3, 13, 10, generator=gen, dtype=torch.float64)
    want = latitude_weighted_mse(pred, target, full, 13)
    loss = LatitudeWeightedMSELoss(13, manager, longitudes=10)
    share = loss(pred[..., lat, lon], target[..., lat, lon])
    total = manager.domain_group.allreduce(float(share))
    assert abs(total - float(want)) < 1e-12
    if grid[1] > 1:
        with pytest.raises(ValueError, match="longitudes="):
            LatitudeWeightedMSELoss(13, manager)
    if grid[0] > 1:  # the whole weight vector for a block: the hint says what to check, not what was done
        with pytest.raises(ValueError, match="grid row") as info:
            latitude_weighted_mse(pred[..., lat, lon], target[..., lat, lon], full, 13)
        assert "this rank's band (or block)" in str(info.value)
