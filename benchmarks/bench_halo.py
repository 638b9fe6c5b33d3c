"""Halo exchange: credit_mpi against raw mpi4py and against the reference's torch.distributed method.

    mpiexec -n 4 python benchmarks/bench_halo.py [--shape 1 16 64 512] [--width 2] [--iters 50]

``--shape`` is each rank's band (B, C, H, W), exchanged along H (dim -2) with
the "zero" boundary (the reference's). Three ways to produce the same
padded band, every one checked to give identical bytes before timing:

* credit_mpi: ``halo_exchange(x, width)`` (with its collective argument
  check, and with ``check=False``; numpy and a torch tensor);
* raw mpi4py, the least code that gives the same output: allocate, copy the
  interior, pack the edge rows, two ``Sendrecv``, unpack, zero the outer
  edges;
* the reference's method: torch.distributed gloo ``batch_isend_irecv`` of the
  edge rows, then ``torch.cat`` (left out when torch is not installed).

Reported: the best over ``--repeats`` runs of the slowest rank's mean time
per exchange over ``--iters`` exchanges, and the ratios to credit_mpi.
All measurements live in credit_mpi/cli/bench.py; this script only arranges them.
"""

from __future__ import annotations

import argparse

from mpi4py import MPI

from credit_mpi import DomainParallelManager
from credit_mpi.cli import bench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 16, 64, 512], metavar=("B", "C", "H", "W"))
    parser.add_argument("--width", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    world = MPI.COMM_WORLD
    size, w = world.Get_size(), args.width
    have_torch = world.allreduce(bench.torch_available(), op=MPI.LAND)
    with DomainParallelManager(None, size) as manager:
        comm = manager.domain_group
        b, c, h, lon = args.shape
        x = bench.local_field((b, c, h * size, lon), -2, comm, seed=0).astype(args.dtype, copy=False)
        cases = {
            "credit_mpi.halo_exchange": bench.halo_exchange_fn(x, w, manager),
            "credit_mpi (check=False)": bench.halo_exchange_fn(x, w, manager, check=False),
        }
        if have_torch:
            import torch

            xt = torch.from_numpy(x)
            cases["credit_mpi torch tensor"] = bench.halo_exchange_fn(xt, w, manager, check=False)
        cases["raw mpi4py Sendrecv"] = bench.raw_halo(comm, x, w)
        if have_torch:
            cases["torch.distributed gloo"] = bench.gloo_halo_cat(xt, w, bench.gloo_group(manager))

        results = {name: fn() for name, fn in cases.items()}
        bench.verify_identical(comm, results["credit_mpi.halo_exchange"], results)
        del results
        padded = x.nbytes // h * (h + 2 * w)
        rep = {"repeats": args.repeats, "number": args.iters, "warmup": 1}
        times = {name: bench.time_collective(comm, fn, name, padded, **rep).best for name, fn in cases.items()}

    if world.Get_rank() == 0:
        mib = x.nbytes / 2**20
        print(f"halo exchange, {size} ranks, band {tuple(args.shape)} {args.dtype} ({mib:.2f} MiB), width {w}, dim -2")
        base = times["credit_mpi.halo_exchange"]
        for name, t in times.items():
            print(f"  {name:28s} {t * 1e6:10.1f} us   {t / base:5.2f}x of credit_mpi")
        raw_t = times["raw mpi4py Sendrecv"]
        print(f"  credit_mpi / raw mpi4py:           {base / raw_t:.2f} (check=False: {times['credit_mpi (check=False)'] / raw_t:.2f}; target <= 1.2)")
        if have_torch:
            print(f"  credit_mpi / torch.distributed:    {base / times['torch.distributed gloo']:.2f}")
        else:
            print("  torch is not installed: the torch rows are left out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
