"""gather_tensor and halo_exchange: transport="mpi" against transport="torch".

    mpiexec -n 2 python benchmarks/bench_torch_transport.py [--shape 16 720 1440] [--repeats 7] [--backend gloo]

The global field (``--shape``, float32) is sharded along dim -2 over all
ranks (one domain group), then gathered back with each transport, with and
without ``out=`` (a reused output skips allocating and first-touching the
result), plus an uneven case (one more row) and a halo exchange of 2 rows.
For scale, the raw collectives on the same bytes with no placement: one MPI
``Allgather`` and one torch ``all_gather_single``. Every result is checked
bit for bit against the global field before timing.

Reported: for each operation, the best over ``--repeats`` of the slowest
rank's time for one call (a barrier before each call).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, halo_exchange, shard_tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 720, 1440])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default=None, help="torch backend (default: nccl with CUDA, else gloo)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    manager = credit_mpi.init_torch_distributed(credit_mpi.DomainParallelManager(None, comm.Get_size()), args.backend)

    def best(call) -> float:
        times = []
        for _ in range(args.repeats):
            comm.Barrier()
            start = time.perf_counter()
            call()
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return min(times)

    rng = np.random.default_rng(0)
    results = {}
    for label, rows, uneven in (("even", args.shape[-2], False), ("uneven", args.shape[-2] + 1, True)):
        shape = (*args.shape[:-2], rows, args.shape[-1])
        full = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        band = shard_tensor(full, -2, manager, uneven=uneven)
        out = torch.empty_like(full)
        for transport in ("mpi", "torch"):
            assert torch.equal(gather_tensor(band, -2, manager, transport=transport), full)
            if label == "even":
                results[f"gather {transport}"] = best(lambda b=band, t=transport: gather_tensor(b, -2, manager, transport=t))
            results[f"gather out= {label} {transport}"] = best(
                lambda b=band, o=out, t=transport: gather_tensor(b, -2, manager, out=o, transport=t)
            )
        if label == "even":
            flat = band.reshape(-1).view(torch.uint8)
            staging = torch.empty(flat.numel() * comm.Get_size(), dtype=torch.uint8)
            send, recv = flat.numpy(), staging.numpy()
            results["raw MPI Allgather"] = best(lambda s=send, r=recv: manager.domain_group.Allgather(s, r))
            if dist.get_backend(manager.torch_domain_group) != "nccl":
                results["raw torch all_gather_single"] = best(
                    lambda s=flat, r=staging: dist.all_gather_single(r, s, group=manager.torch_domain_group)
                )
            for transport in ("mpi", "torch"):
                results[f"halo w=2 periodic {transport}"] = best(
                    lambda b=band, t=transport: halo_exchange(b, 2, manager=manager, boundary="periodic", transport=t)
                )
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, float32 {tuple(args.shape)}, backend {dist.get_backend()}")
        for name, seconds in results.items():
            print(f"  {name:32s} {seconds * 1e3:9.1f} ms")
    manager.free()


if __name__ == "__main__":
    main()
