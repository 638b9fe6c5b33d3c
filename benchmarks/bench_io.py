"""Bytes read per rank and load time of one sample: open_band vs read-all-then-shard_batch.

    mpiexec -n N python benchmarks/bench_io.py [--lat 721 --lon 1440 --channels 70 --chunk 32]

Rank 0 writes a float32 (channels, lat, lon) field to a local Zarr store
(uncompressed, chunks of ``--chunk`` latitude rows, all channels and
longitudes), then every rank loads one sample both ways, three times each
(the page cache is warm after the first write; medians reported):

* ``open_band(store).load()``: only this rank's band;
* ``xr.open_zarr(store).load()`` then ``shard_batch``: what the reference does.

Bytes are counted by a store wrapper that sums the sizes of the chunks it
hands out. Output from rank 0: per rank, bytes and time of each way, and the
bound the issue asks for: ``1.1 * global / n + one chunk row``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import numpy as np
import xarray as xr
import zarr
from mpi4py import MPI

import credit_mpi as cm
from credit_mpi import io as cio


class CountingStore(zarr.storage.WrapperStore):
    """Sums the bytes of every value read through it."""

    def __init__(self, store):
        super().__init__(store)
        self.box = [0]

    def _with_store(self, store):
        copy = super()._with_store(store)
        copy.box = self.box
        return copy

    async def get(self, key, prototype, byte_range=None):
        value = await self._store.get(key, prototype, byte_range)
        if value is not None:
            self.box[0] += len(value)
        return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lat", type=int, default=721)
    parser.add_argument("--lon", type=int, default=1440)
    parser.add_argument("--channels", type=int, default=70)
    parser.add_argument("--chunk", type=int, default=32, help="latitude rows per chunk")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    n = world.Get_size()
    manager = cm.DomainParallelManager(None, n)
    path = world.bcast(os.path.join(tempfile.mkdtemp(prefix="bench_io_"), "field.zarr") if world.rank == 0 else None)
    if world.rank == 0:
        field = np.random.default_rng(0).standard_normal((1, args.channels, args.lat, args.lon), dtype=np.float32)
        ds = xr.Dataset(
            {"x": (("time", "channel", "latitude", "longitude"), field)},
            coords={"latitude": np.linspace(90, -90, args.lat), "longitude": np.arange(args.lon) * 360.0 / args.lon},
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds.to_zarr(
                path, mode="w", consolidated=True,
                encoding={"x": {"chunks": (1, args.channels, args.chunk, args.lon), "compressors": None}},
            )
    world.Barrier()
    chunk_row = args.channels * args.chunk * args.lon * 4
    global_bytes = args.channels * args.lat * args.lon * 4

    def run(way: str) -> tuple[int, float]:
        store = CountingStore(zarr.storage.LocalStore(path))
        world.Barrier()
        t0 = time.perf_counter()
        if way == "band":
            band = cio.open_band(store, manager)["x"].values
        else:
            full = xr.open_zarr(store, chunks=None)["x"].values
            band = cm.shard_batch({"x": full}, manager=manager, uneven=True, check=False)["x"]
        elapsed = time.perf_counter() - t0
        assert band.shape[-2] == cm.partition.band_range(args.lat, n, manager.domain_rank, True)[1] - \
            cm.partition.band_range(args.lat, n, manager.domain_rank, True)[0]
        return store.box[0], elapsed

    results = {}
    for way in ("band", "all"):
        runs = [run(way) for _ in range(args.repeats)]
        results[way] = (runs[-1][0], statistics.median(t for _, t in runs))
    everyone = world.gather(results)
    if world.rank == 0:
        bound = 1.1 * global_bytes / n + chunk_row
        print(f"{n} rank(s), field {args.channels} x {args.lat} x {args.lon} float32 = {global_bytes / 1e6:.1f} MB, "
              f"chunk row {chunk_row / 1e6:.1f} MB, bound 1.1*global/n + chunk row = {bound / 1e6:.1f} MB")
        for r, res in enumerate(everyone):
            (bb, bt), (ab, at) = res["band"], res["all"]
            print(f"  rank {r}: open_band {bb / 1e6:7.1f} MB {bt * 1e3:7.1f} ms | read all + shard_batch "
                  f"{ab / 1e6:7.1f} MB {at * 1e3:7.1f} ms | within bound: {bb <= bound}")
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    manager.free()


if __name__ == "__main__":
    main()
