"""Where the time of a small halo exchange goes (docs/performance.rst's profile table).

    mpiexec -n 2 python benchmarks/profile_halo.py [--shape 4 8 23 90] [--repeats 21]

Times, interleaved on 2+ ranks in rotating order (median over ``--repeats``
blocks of the slowest rank's mean per call), the parts of ``halo_exchange(x,
1)`` of a float32 band called with the same shape call after call: the whole
call; the kernel with a ready plan (allocation, copies, packing and the
exchange round); the agreement of a repeated call alone (the fixed-size
``Allgather`` of the remembered header, ``_Agreed.repeat``); the least raw
mpi4py halo, and the same raw halo after one ``Allgather`` of five int64
(what any agreement that precedes the data costs). The local,
communication-free parts are also timed on their own (no ``Barrier``, best
of 5): finding the remembered agreement, allocating and filling the padded
array.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np
from mpi4py import MPI

from credit_mpi import DomainParallelManager, halo_exchange
from credit_mpi.cli import bench
from credit_mpi.manager import live_domain_comm
from credit_mpi.ops import halo as halo_op
from credit_mpi.validation import remembered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 8, 23, 90])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args(argv)
    import bench_percall  # the timing loop, in the same folder

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    x = np.random.default_rng(rank).standard_normal(args.shape, dtype=np.float32)
    with DomainParallelManager(None, world.Get_size()) as manager:
        comm = manager.domain_group
        halo_exchange(x, 1, manager=manager)  # remembered from now on
        call = {"halo_width": 1, "dim": -2, "boundary": "zero", "transport": "mpi", "manager": manager}
        key = (halo_op.BANDS.key(x, call), False)  # the engine's key: the op's and the autograd state
        entry = remembered(comm, "halo_exchange", key)
        plan = entry.result
        header, table = np.zeros(5, np.int64), np.empty((comm.Get_size(), 5), np.int64)
        raw = bench.raw_halo(comm, x)

        cases = {
            "halo_exchange(x, 1)": lambda: halo_exchange(x, 1, manager=manager),
            "kernel with a ready plan (halo_kernel)": lambda: halo_op.halo_kernel(x, plan),
            "agreement of a repeated call (repeat)": entry.repeat,
            "raw mpi4py halo": raw,
            "raw mpi4py halo after an Allgather of 5 int64": lambda: (comm.Allgather(header, table), raw()),
        }
        times = bench_percall.time_cases(comm, cases, args.repeats, args.number)
        local = {
            "find the remembered agreement (no MPI)": lambda: remembered(
                live_domain_comm(manager), "halo_exchange", (halo_op.BANDS.key(x, call), False)
            ),
            "allocate + copy band + zero edges": lambda: _alloc_copy(x),
        }
        local_t = {name: min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 for name, fn in local.items()}
    if rank == 0:
        print(f"halo of a {tuple(args.shape)} float32 band, {world.Get_size()} ranks (median of {args.repeats} blocks)")
        for name, t in times.items():
            print(f"  {name:48s} {statistics.median(t) * 1e6:9.1f} us")
        print("local parts (one rank, no communication, best of 5):")
        for name, t in local_t.items():
            print(f"  {name:48s} {t * 1e6:9.1f} us")
    return 0


def _alloc_copy(x):
    shape = list(x.shape)
    shape[-2] += 2
    out = np.empty(shape, x.dtype)
    out[..., 1:-1, :] = x
    out[..., :1, :] = 0
    out[..., -1:, :] = 0
    return out


if __name__ == "__main__":
    raise SystemExit(main())
