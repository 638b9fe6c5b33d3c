"""Where the time of a small halo exchange goes (the README's profile table).

    mpiexec -n 2 python benchmarks/profile_halo.py [--shape 4 8 23 90] [--repeats 15]

Times, interleaved on 2+ ranks (median over ``--repeats`` blocks of the
slowest rank's mean per call), the parts of ``halo_exchange(x, 1)`` of a
float32 band: the whole call; the agreement's fixed-size ``Allgather`` of
five int64 alone; the planning (``halo._plan``: local checks, digest,
agreement); the kernel with a ready plan (allocation, copies, packing and
the transport); the transport alone (the raw ``Sendrecv`` pair of packed
edge rows); and the least raw mpi4py halo for comparison. The local,
communication-free parts are also timed on their own (no ``Barrier``):
``describe``, the digest, allocating and filling the padded array.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import numpy as np
from mpi4py import MPI

from credit_mpi import DomainParallelManager, halo_exchange
from credit_mpi import halo as halo_mod
from credit_mpi.manager import domain_of
from credit_mpi.transport import arrays
from credit_mpi.validation import _digest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 8, 23, 90])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args(argv)
    import bench_percall  # the raw halo, in the same folder

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    x = np.random.default_rng(rank).standard_normal(args.shape, dtype=np.float32)
    with DomainParallelManager(None, world.Get_size()) as manager:
        comm = manager.domain_group
        domain = domain_of(manager)
        plan = halo_mod._plan(x, 1, -2, domain, "zero", True)
        header, table = np.zeros(5, np.int64), np.empty((comm.Get_size(), 5), np.int64)
        up, down = plan.prev, plan.next
        first, last = np.ascontiguousarray(x[..., :1, :]), np.ascontiguousarray(x[..., -1:, :])
        a, b = np.empty_like(first), np.empty_like(last)

        def sendrecv_pair():
            comm.Sendrecv(last, halo_mod._rank(down), 0, a, halo_mod._rank(up), 0)
            comm.Sendrecv(first, halo_mod._rank(up), 1, b, halo_mod._rank(down), 1)

        cases = {
            "halo_exchange(x, 1)": lambda: halo_exchange(x, 1, manager=manager),
            "raw mpi4py halo": bench_percall.raw_halo(comm, x),
            "planning (halo._plan, with the agreement)": lambda: halo_mod._plan(x, 1, -2, domain, "zero", True),
            "agreement Allgather (5 int64) alone": lambda: comm.Allgather(header, table),
            "kernel with a ready plan (halo_kernel)": lambda: halo_mod.halo_kernel(x, plan),
            "transport alone (2 Sendrecv of packed rows)": sendrecv_pair,
        }
        times = bench_percall.time_cases(comm, cases, args.repeats, args.number)
        local = {
            "describe(x)": lambda: arrays.describe(x),
            "digest of the call": lambda: _digest(((1, "zero", "mpi", False, 32, 360), ("numpy", "float32", "cpu", 4, (4, 8, 90), 2))),
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
    time.sleep(0)
    raise SystemExit(main())
