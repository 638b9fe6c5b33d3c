"""gather_tensor and halo_exchange: transport="mpi" against transport="torch".

    mpiexec -n 2 python benchmarks/bench_torch_transport.py [--shape 16 720 1440] [--repeats 7] [--backend gloo]

The global field (``--shape``, float32) is sharded along dim -2 over all
ranks (one domain group), then gathered back with each transport, with and
without ``out=`` (a reused output skips allocating and first-touching the
result), plus an uneven case (one more row) and a halo exchange of 2 rows.
For scale, the raw collectives on the same bytes with no placement: one MPI
``Allgather`` and one torch ``all_gather_single`` (``all_gather_into_tensor``
in older torch; left out with NCCL). Every result is checked bit for bit
before timing: the gathers against the global field, the halo exchanges
against the padded global field, the raw collectives against each other
and the stacked bands.

Reported: for each operation, the best over ``--repeats`` of the slowest
rank's time for one call (a barrier before each call).
All measurements live in credit_mpi/cli/bench.py; this script only arranges them.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from credit_mpi import DomainParallelManager, shard_tensor
from credit_mpi.cli import bench
from credit_mpi.partition import band_range


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 720, 1440])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default=None, help="torch backend (default: nccl with CUDA, else gloo)")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    rng = np.random.default_rng(0)
    results = {}
    with DomainParallelManager(None, size) as manager:
        comm = manager.domain_group
        group = bench.torch_group(manager, args.backend)
        backend = dist.get_backend(group)

        def timed(name: str, fn, nbytes: int) -> None:
            results[name] = bench.time_collective(comm, fn, name, nbytes, repeats=args.repeats).best

        for label, rows, uneven in (("even", args.shape[-2], False), ("uneven", args.shape[-2] + 1, True)):
            shape = (*args.shape[:-2], rows, args.shape[-1])
            full = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
            band = shard_tensor(full, -2, manager, uneven=uneven)
            cases = {}
            for transport in ("mpi", "torch"):
                if label == "even":
                    cases[f"gather {transport}"] = bench.credit_gather(band, manager, transport=transport)
                cases[f"gather out= {label} {transport}"] = bench.credit_gather(band, manager, reuse=True, transport=transport)
            bench.verify_identical(comm, full, {name: fn() for name, fn in cases.items()})
            for name, fn in cases.items():
                timed(name, fn, full.numel() * 4)
            if label != "even":
                continue

            raw = {"raw MPI Allgather": bench.raw_allgather(comm, band)}
            if backend != "nccl":
                raw["raw torch all_gather_single"] = bench.raw_torch_allgather(band, group)
            stacked = torch.stack(comm.allgather(band))
            bench.verify_identical(comm, stacked, {name: fn() for name, fn in raw.items()})
            del stacked
            for name, fn in raw.items():
                timed(name, fn, full.numel() * 4)

            halo = {
                f"halo w=2 periodic {transport}": bench.halo_exchange_fn(band, 2, manager, boundary="periodic", transport=transport)
                for transport in ("mpi", "torch")
            }
            start, stop = band_range(rows, size, rank)
            wrapped = torch.cat([full[..., -2:, :], full, full[..., :2, :]], dim=-2)  # numpy.pad(mode="wrap")
            bench.verify_identical(comm, wrapped[..., start : stop + 4, :], {name: fn() for name, fn in halo.items()})
            del wrapped
            for name, fn in halo.items():
                timed(name, fn, band.numel() // band.shape[-2] * (band.shape[-2] + 4) * 4)

    if rank == 0:
        print(f"{size} ranks, float32 {tuple(args.shape)}, backend {backend}")
        for name, seconds in results.items():
            print(f"  {name:32s} {seconds * 1e3:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
