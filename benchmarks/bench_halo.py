"""Halo exchange: credit_mpi against raw mpi4py and against the reference's torch.distributed method.

    mpiexec -n 4 python benchmarks/bench_halo.py [--shape 1 16 64 512] [--width 2] [--iters 50]

``--shape`` is each rank's band (B, C, H, W), exchanged along H (dim -2) with
the "zero" boundary (the reference's). Three ways to produce the same
padded band, every one checked to give identical bytes:

* credit_mpi: ``halo_exchange(x, width)`` (with its collective argument
  check, and with ``check=False``);
* raw mpi4py, the least code that gives the same output: allocate, copy the
  interior, pack the edge rows, two ``Sendrecv``, unpack, zero the outer
  edges;
* the reference's method: torch.distributed gloo ``batch_isend_irecv`` of the
  edge rows, then ``torch.cat``.

Reported: the slowest rank's best mean time per exchange over ``--repeats``
runs of ``--iters`` exchanges, and the ratios to credit_mpi.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import credit_mpi


def raw_mpi4py(x: np.ndarray, w: int, comm: MPI.Comm, prev: int, nxt: int) -> np.ndarray:
    n = x.shape[-2]
    out = np.empty(x.shape[:-2] + (n + 2 * w, x.shape[-1]), dtype=x.dtype)
    out[..., w : w + n, :] = x
    up, down = np.ascontiguousarray(x[..., :w, :]), np.ascontiguousarray(x[..., n - w :, :])
    from_next, from_prev = np.zeros_like(up), np.zeros_like(down)
    comm.Sendrecv(up, prev, 0, from_next, nxt, 0)
    comm.Sendrecv(down, nxt, 1, from_prev, prev, 1)
    out[..., :w, :] = from_prev
    out[..., w + n :, :] = from_next
    return out


def torch_gloo(x: torch.Tensor, w: int, prev: int | None, nxt: int | None) -> torch.Tensor:
    top = torch.zeros_like(x[..., :w, :])
    bottom = torch.zeros_like(x[..., :w, :])
    ops = []
    if prev is not None:
        ops += [dist.P2POp(dist.isend, x[..., :w, :].contiguous(), prev), dist.P2POp(dist.irecv, top, prev)]
    if nxt is not None:
        ops += [dist.P2POp(dist.isend, x[..., -w:, :].contiguous(), nxt), dist.P2POp(dist.irecv, bottom, nxt)]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return torch.cat([top, x, bottom], dim=-2)


def timed(comm: MPI.Comm, fn, iters: int, repeats: int) -> float:
    best = float("inf")
    fn()  # warm up
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return comm.allreduce(best, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 16, 64, 512], metavar=("B", "C", "H", "W"))
    parser.add_argument("--width", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    manager = credit_mpi.DomainParallelManager(None, size)
    comm, w = manager.domain_group, args.width
    prev, nxt = manager.domain_neighbor_ranks()
    x = np.random.default_rng(rank).standard_normal(args.shape).astype(args.dtype)
    xt = torch.from_numpy(x)

    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    mine = credit_mpi.halo_exchange(x, w, -2, manager)
    raw = raw_mpi4py(x, w, comm, MPI.PROC_NULL if prev is None else prev, MPI.PROC_NULL if nxt is None else nxt)
    ref = torch_gloo(xt, w, prev, nxt).numpy()
    assert np.array_equal(mine, raw) and np.array_equal(mine, ref), "the three methods disagree"

    pn = MPI.PROC_NULL if prev is None else prev
    nn = MPI.PROC_NULL if nxt is None else nxt
    cases = {
        "credit_mpi.halo_exchange": lambda: credit_mpi.halo_exchange(x, w, -2, manager),
        "credit_mpi (check=False)": lambda: credit_mpi.halo_exchange(x, w, -2, manager, check=False),
        "credit_mpi torch tensor": lambda: credit_mpi.halo_exchange(xt, w, -2, manager, check=False),
        "raw mpi4py Sendrecv": lambda: raw_mpi4py(x, w, comm, pn, nn),
        "torch.distributed gloo": lambda: torch_gloo(xt, w, prev, nxt),
    }
    times = {name: timed(world, fn, args.iters, args.repeats) for name, fn in cases.items()}
    if rank == 0:
        mib = x.nbytes / 2**20
        print(f"halo exchange, {size} ranks, band {tuple(args.shape)} {args.dtype} ({mib:.2f} MiB), width {w}, dim -2")
        base = times["credit_mpi.halo_exchange"]
        for name, t in times.items():
            print(f"  {name:28s} {t * 1e6:10.1f} us   {t / base:5.2f}x of credit_mpi")
        raw_t, gloo_t = times["raw mpi4py Sendrecv"], times["torch.distributed gloo"]
        print(f"  credit_mpi / raw mpi4py:           {base / raw_t:.2f} (check=False: {times['credit_mpi (check=False)'] / raw_t:.2f}; target <= 1.2)")
        print(f"  credit_mpi / torch.distributed:    {base / gloo_t:.2f}")
    dist.destroy_process_group()
    manager.free()


if __name__ == "__main__":
    main()
