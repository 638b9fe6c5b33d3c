"""credit_mpi.io: band reads, band writes and the training Dataset against one-process references.

Every MPI test builds a small ERA5-like store (descending latitudes, chunks
of 4 rows that do not line up with the bands) from the same seed on every
rank and compares each rank's result with the rows of the global arrays.
"""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")
pytest.importorskip("h5netcdf")
pytest.importorskip("dask")
torch = pytest.importorskip("torch")

import credit_mpi  # noqa: E402
from credit_mpi import io as cio  # noqa: E402
from credit_mpi.io.write import writer_ranges  # noqa: E402
from credit_mpi.partition import band_range  # noqa: E402

from .conftest import run_python  # noqa: E402

H, W, T, LEVELS, CHUNK = 29, 12, 7, 3, 4


def era5_like(seed: int = 7, dtype: str = "float64") -> xr.Dataset:
    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {
            "t": (("time", "level", "latitude", "longitude"), rng.standard_normal((T, LEVELS, H, W)).astype(dtype)),
            "z": (("time", "latitude", "longitude"), rng.standard_normal((T, H, W)).astype("float32")),
            "lsm": (("latitude", "longitude"), rng.random((H, W)).astype(dtype)),
            "level_weight": (("level",), rng.random(LEVELS)),
        },
        coords={
            "latitude": np.linspace(90, -90, H),
            "longitude": np.arange(W) * (360.0 / W),
            "time": np.datetime64("2020-01-01T00") + np.arange(T) * np.timedelta64(6, "h"),
            "level": [500, 700, 850],
        },
        attrs={"source": "synthetic"},
    )


def write_zarr(ds: xr.Dataset, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.chunk({"latitude": CHUNK, "time": 1}).to_zarr(path, mode="w", consolidated=True)


@pytest.fixture
def store(shared_dir):
    path = os.path.join(shared_dir, "era5.zarr")
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_zarr(era5_like(), path)
    MPI.COMM_WORLD.Barrier()
    return path


def rows(ds: xr.Dataset, name: str, start: int, stop: int) -> np.ndarray:
    var = ds[name]
    return var.isel(latitude=slice(start, stop)).values if "latitude" in var.dims else var.values


class RecordingStore(zarr.storage.WrapperStore):
    """Records every key read and written through it."""

    def __init__(self, store):
        super().__init__(store)
        self.read, self.written = [], []

    def _with_store(self, store):  # zarr makes read-only / reopened copies: they record into the same lists
        copy = super()._with_store(store)
        copy.read, copy.written = self.read, self.written
        return copy

    async def get(self, key, prototype, byte_range=None):
        self.read.append(key)
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        self.read.extend(key for key, _ in key_ranges)
        return await self._store.get_partial_values(prototype, key_ranges)

    async def _get_many(self, requests):
        requests = list(requests)
        self.read.extend(key for key, *_ in requests)
        async for item in self._store._get_many(requests):
            yield item

    async def set(self, key, value):
        self.written.append(key)
        return await self._store.set(key, value)

    async def set_if_not_exists(self, key, value):
        self.written.append(key)
        return await self._store.set_if_not_exists(key, value)

    async def _set_many(self, values):
        values = list(values)
        self.written.extend(key for key, _ in values)
        await self._store._set_many(values)


def lat_chunks(keys, name: str, axis: int) -> set:
    """Latitude chunk indices of the chunk keys of variable ``name`` (zarr 3 keys: name/c/i/j/...)."""
    out = set()
    for key in keys:
        parts = key.split("/")
        if parts[0] == name and len(parts) > 2 and parts[1] == "c":
            out.add(int(parts[2 + axis]))
    return out


# -- open_band ---------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_open_band_equals_global_rows(make_manager, store):
    m = make_manager()
    n, r = m.domain_parallel_size, m.domain_rank
    ref = era5_like()
    for uneven in (True, False) if H % n == 0 else (True,):
        band = cio.open_band(store, m, uneven=uneven)
        start, stop = band_range(H, n, r, uneven)
        assert band.sizes["latitude"] == stop - start
        for name in ref.variables:
            np.testing.assert_array_equal(band[name].values, rows(ref, name, start, stop), err_msg=name)
        # the rows shard_tensor gives for the same dimension of the global array
        np.testing.assert_array_equal(
            band["t"].values, credit_mpi.shard_tensor(ref["t"].values, dim=2, manager=m, uneven=True)
        )
        assert band.attrs == ref.attrs
        band.close()


@pytest.mark.mpi(min_size=1)
def test_open_band_reads_only_band_chunks(make_manager, store):
    m = make_manager()
    start, stop = band_range(H, m.domain_parallel_size, m.domain_rank, True)
    recorder = RecordingStore(zarr.storage.LocalStore(store))
    band = cio.open_band(recorder, m)
    before = list(recorder.read)
    assert not lat_chunks(before, "t", 2) and not lat_chunks(before, "z", 1)  # opening reads no data chunk
    band.load()
    wanted = set(range(start // CHUNK, (stop - 1) // CHUNK + 1))
    assert lat_chunks(recorder.read, "t", 2) == wanted
    assert lat_chunks(recorder.read, "z", 1) == wanted
    assert lat_chunks(recorder.read, "lsm", 0) == wanted
    np.testing.assert_array_equal(band["t"].values, rows(era5_like(), "t", start, stop))


@pytest.mark.mpi(min_size=1)
def test_open_band_netcdf_file_and_files(make_manager, shared_dir):
    m = make_manager()
    ref = era5_like()
    single = os.path.join(shared_dir, "era5.nc")
    parts = [os.path.join(shared_dir, f"era5_{k}.nc") for k in range(2)]
    if MPI.COMM_WORLD.Get_rank() == 0:
        ref.to_netcdf(single)
        ref.isel(time=slice(0, 3)).to_netcdf(parts[0])
        ref.isel(time=slice(3, None)).to_netcdf(parts[1])
    MPI.COMM_WORLD.Barrier()
    start, stop = band_range(H, m.domain_parallel_size, m.domain_rank, True)
    minimal = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}  # statics stay static
    for source, kwargs in ((single, {}), (parts, minimal), (os.path.join(shared_dir, "era5_*.nc"), minimal)):
        band = cio.open_band(source, m, **kwargs)
        for name in ref.variables:
            np.testing.assert_array_equal(band[name].values, rows(ref, name, start, stop), err_msg=f"{source}: {name}")
        band.close()


# -- write_bands --------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chunks", [None, {"latitude": 4, "time": 2}, {"latitude": 13}])
def test_write_bands_round_trip(make_manager, shared_dir, dtype, chunks):
    m = make_manager()
    ref = era5_like(dtype=dtype)
    start, stop = band_range(H, m.domain_parallel_size, m.domain_rank, True)
    band = ref.isel(latitude=slice(start, stop))
    path = os.path.join(shared_dir, "out.zarr")
    recorder = RecordingStore(zarr.storage.LocalStore(path))
    cio.write_bands(band, recorder, m, chunks=chunks)
    back = xr.open_zarr(path).load()
    xr.testing.assert_identical(back, ref)
    assert back["t"].dtype == np.dtype(dtype)
    # no chunk was written by two ranks, and every chunk of t was written
    mine = {k for k in recorder.written if "/c/" in k}
    everyone = MPI.COMM_WORLD.allgather(mine)
    for a in range(len(everyone)):
        for b in range(a):
            assert not everyone[a] & everyone[b], (a, b, everyone[a] & everyone[b])
    lat_chunk = (chunks or {}).get("latitude", band_range(H, m.domain_parallel_size, 0, True)[1])
    t_chunks = {k for keys in everyone for k in keys if k.startswith("t/c/")}
    assert len(t_chunks) == -(-T // (chunks or {}).get("time", T)) * -(-H // lat_chunk)
    nc = os.path.join(shared_dir, "out.nc")
    cio.write_bands(band, nc, m)
    with xr.open_dataset(nc) as back_nc:
        xr.testing.assert_identical(back_nc.load(), ref)


@pytest.mark.mpi(min_size=1)
def test_write_bands_of_open_band(make_manager, store, shared_dir):
    m = make_manager()
    band = cio.open_band(store, m)
    out = os.path.join(shared_dir, "copy.zarr")
    cio.write_bands(band, out, m, mode="w-")
    xr.testing.assert_identical(xr.open_zarr(out).load(), era5_like())


def test_writer_ranges_one_writer_per_chunk():
    for total in range(0, 40):
        for n in range(1, 6):
            sizes = [len(a) for a in np.array_split(np.arange(total), n)]
            offsets = np.cumsum([0] + sizes)
            for chunk in (1, 3, 4, 7, max(max(sizes), 1), 50):
                ranges = writer_ranges(sizes, chunk)
                assert ranges[0][0] == 0 and ranges[-1][1] == total
                for (_, a1), (b0, _) in zip(ranges[:-1], ranges[1:], strict=True):
                    assert a1 == b0
                for r, (a, b) in enumerate(ranges):
                    assert (a % chunk == 0 or a == total) and (b % chunk == 0 or b == total)
                    for first in range(a, b, chunk):  # each chunk's writer holds its first row
                        assert offsets[r] <= first < offsets[r + 1]
    assert writer_ranges([3, 2, 2], None) == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        writer_ranges([3], 0)


# -- BandDataset --------------------------------------------------------------


def global_sample(ref: xr.Dataset, i: int, history: int, forecast: int) -> dict:
    """The global sample built with numpy alone: channels t(levels) then z."""
    times = slice(i, i + history + forecast)
    t = ref["t"].values[times]  # (T, L, H, W)
    z = ref["z"].values[times][:, None].astype(t.dtype)
    data = np.concatenate([t, z], axis=1).swapaxes(0, 1)  # (C, T, H, W)
    return {
        "x": torch.from_numpy(np.ascontiguousarray(data[:, :history])),
        "y": torch.from_numpy(np.ascontiguousarray(data[:, history:])),
        "static": torch.from_numpy(ref["lsm"].values[None, None].copy()),
        "index": i,
    }


def assert_same_sample(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value or torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key


@pytest.mark.mpi(min_size=1)
def test_band_dataset_yields_shard_batch_of_global_sample(make_manager, store):
    m = make_manager()
    ref = era5_like()
    start, stop = band_range(H, m.domain_parallel_size, m.domain_rank, True)
    ds = cio.BandDataset(store, ["t", "z"], m, static_variables=["lsm"], history=2, forecast=2)
    assert len(ds) == T - 3 and ds.channels == LEVELS + 1
    for i in range(len(ds)):
        want = global_sample(ref, i, 2, 2)
        assert_same_sample(ds[i], credit_mpi.shard_batch(want, manager=m, uneven=True))
        narrowed = {k: v.narrow(-2, start, stop - start) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
        assert_same_sample(ds[i], narrowed)
    # a DataLoader batch is shard_batch of the global batch (5-D x/y/static, 1-D index)
    loader = torch.utils.data.DataLoader(ds, batch_size=2)
    batch = next(iter(loader))
    global_batch = torch.utils.data.default_collate([global_sample(ref, i, 2, 2) for i in range(2)])
    assert batch["x"].ndim == 5
    assert_same_sample(batch, credit_mpi.shard_batch(global_batch, manager=m, uneven=True))
    # a time slice by labels, forecast 0
    sub = cio.BandDataset(store, ["z"], m, history=1, forecast=0, time_slice=slice("2020-01-01T06", None))
    assert len(sub) == T - 1 and sorted(sub[0]) == ["index", "x"]
    np.testing.assert_array_equal(sub[0]["x"].numpy()[0, 0], ref["z"].values[1, start:stop])


@pytest.mark.mpi(min_size=1)
@pytest.mark.world_sizes(1, 2)  # spawning workers costs the same per rank; the band logic is tested on 1-4 elsewhere
def test_band_dataset_spawn_workers(make_manager, store):
    m = make_manager()
    ds = cio.BandDataset(store, ["t", "z"], m, static_variables=["lsm"], history=2, forecast=1)
    plain = list(torch.utils.data.DataLoader(ds, batch_size=2))
    workers = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    got = list(workers)
    assert len(got) == len(plain)
    for a, b in zip(got, plain, strict=True):
        assert_same_sample(a, b)


@pytest.mark.mpi(min_size=1)
def test_band_dataset_sampler_over_data_parallel_group(make_manager, store):
    world = MPI.COMM_WORLD
    m = make_manager(2 if world.Get_size() % 2 == 0 else world.Get_size())
    ds = cio.BandDataset(store, ["z"], m, history=1, forecast=1)
    sampler = ds.sampler(shuffle=True, seed=3, drop_last=True)
    sampler.set_epoch(1)
    mine = list(sampler)
    everyone = world.allgather((m.dp_rank, mine))
    by_replica = {}
    for dp_rank, indices in everyone:
        by_replica.setdefault(dp_rank, indices)
        assert by_replica[dp_rank] == indices  # every band of one replica: the same samples
    seen = [i for indices in by_replica.values() for i in indices]
    assert len(seen) == len(set(seen))  # replicas: different samples
    assert len(by_replica) == m.dp_world_size


def test_band_dataset_pickle_does_not_initialise_mpi(tmp_path):
    path = str(tmp_path / "s.zarr")
    write_zarr(era5_like(), path)
    ds = cio.BandDataset(path, ["t"], None, history=1, forecast=1)
    blob = pickle.dumps(ds)
    code = (
        "import pickle, sys\n"
        f"ds = pickle.loads({blob!r})\n"
        "from mpi4py import MPI\n"
        "assert 'credit_mpi.io.dataset' in sys.modules\n"
        "assert not MPI.Is_initialized(), 'unpickling initialised MPI'\n"
        "print(ds[1]['x'].shape)\n"
    )
    out = run_python(code)
    assert out.stdout.strip() == f"torch.Size([{LEVELS}, 1, {H}, {W}])"
    np.testing.assert_array_equal(pickle.loads(blob)[1]["y"].numpy()[:, 0], era5_like()["t"].values[2])


def test_import_credit_mpi_imports_no_io_library():
    out = run_python(
        "import sys, credit_mpi\n"
        "print(sorted(m for m in ('xarray', 'zarr', 'h5netcdf', 'h5py', 'dask', 'torch') if m in sys.modules))"
    )
    assert out.stdout.strip() == "[]"


# -- bad input: the same error on every rank, nothing written ------------------


@pytest.mark.mpi(min_size=1)
def test_bad_input_same_error_everywhere(make_manager, store, shared_dir):
    m = make_manager()
    with pytest.raises(ValueError, match="dim 'lat' is not a dimension"):
        cio.open_band(store, m, dim="lat")
    missing = os.path.join(shared_dir, "nope.zarr")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cio.open_band(missing, m)
    with pytest.raises(ValueError, match="does not exist"):
        cio.BandDataset(missing, ["t"], m)
    with pytest.raises(ValueError, match="variable 'q' is not in the store"):
        cio.BandDataset(store, ["t", "q"], m)
    with pytest.raises(ValueError, match="needs history"):
        cio.BandDataset(store, ["t"], m, history=T, forecast=1)
    band = era5_like().isel(latitude=slice(0, 1))
    out = os.path.join(shared_dir, "bad.zarr")
    with pytest.raises(ValueError, match="dim 'lat' is not a dimension of ds_band"):
        cio.write_bands(band, out, m, dim="lat")
    with pytest.raises(ValueError, match="mode must be one of"):
        cio.write_bands(band, out, m, mode="a")
    with pytest.raises(ValueError, match="chunks names 'lat'"):
        cio.write_bands(band, out, m, chunks={"lat": 2})
    assert not os.path.exists(out)
    cio.write_bands(band, out, m)
    with pytest.raises(ValueError, match="exists already"):
        cio.write_bands(band, out, m, mode="w-")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_fail_together(make_manager, store, shared_dir):
    m = make_manager()
    r = m.domain_rank
    other = os.path.join(shared_dir, "other.zarr")
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_zarr(era5_like(seed=8), other)
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(ValueError, match="differ in store"):
        cio.open_band(other if r == 1 else store, m)
    with pytest.raises(ValueError, match="differ in arguments"):
        cio.BandDataset(store, ["z", "t"] if r == 1 else ["t", "z"], m)
    with pytest.raises(ValueError, match="differ in uneven"):
        cio.open_band(store, m, uneven=r != 1)
    ref = era5_like()
    start, stop = band_range(H, m.domain_parallel_size, r, True)
    band = ref.isel(latitude=slice(start, stop))
    out = os.path.join(shared_dir, "half.zarr")
    with pytest.raises(ValueError, match="differ in store"):
        cio.write_bands(band, os.path.join(shared_dir, "elsewhere.zarr") if r == 1 else out, m)
    with pytest.raises(ValueError, match="differ in variables"):
        cio.write_bands(band.drop_vars("z") if r == 1 else band, out, m)
    with pytest.raises(ValueError, match="differ in variables"):  # a shared variable with other values
        cio.write_bands(band.assign(level_weight=band.level_weight * 2) if r == 1 else band, out, m)
    MPI.COMM_WORLD.Barrier()
    assert not os.path.exists(out) and not os.path.exists(os.path.join(shared_dir, "elsewhere.zarr"))
