"""An MPI job that fails on purpose in the middle of a sequence of collectives.

Launched by tests/test_faults.py under mpiexec (not collected by pytest):

    mpiexec -n N python tests/fault_job.py MODE [--rank R] [--step K] [--no-abort]

Every rank runs ten steps of shard -> gather -> scatter -> allreduce over one
domain group; at step K, rank R fails according to MODE. The test checks that
the job ends promptly with a non-zero status (or with 0 for the modes that
must not abort) instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import numpy as np
from mpi4py import MPI

import credit_mpi

MODES = ["none", "raise", "raise-all", "thread", "sys-exit", "os-exit", "kill", "library-error", "caught"]


def fail(mode: str, x: np.ndarray, manager) -> None:
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: failing with {mode}", flush=True)
    if mode == "raise":
        raise RuntimeError(f"injected failure on rank {MPI.COMM_WORLD.Get_rank()}")
    if mode == "thread":
        worker = threading.Thread(target=lambda: 1 / 0, name="loader")
        worker.start()
        worker.join()
    if mode == "sys-exit":
        sys.exit(3)
    if mode == "os-exit":
        os._exit(5)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=4)
    parser.add_argument("--no-abort", action="store_true")
    args = parser.parse_args()
    if not args.no_abort:
        credit_mpi.abort_on_exception()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    manager = credit_mpi.initialize_domain_parallel(None, n)
    x = np.arange(2 * n * 3 * 5, dtype=np.float32).reshape(2, 3 * n, 5)
    for step in range(10):
        if step == args.step:
            if args.mode == "raise-all" or (rank == args.rank and args.mode != "library-error"):
                fail("raise" if args.mode == "raise-all" else args.mode, x, manager)
            if args.mode in ("library-error", "caught"):
                # One rank passes a wrong shape: the library raises on every rank.
                bad = x[:, :-1] if rank == args.rank else x
                try:
                    credit_mpi.shard_tensor(bad, -2, manager, check="collective")
                except ValueError:
                    if args.mode != "caught":
                        raise
                    print(f"rank {rank}: caught the agreed error, going on", flush=True)
        part = credit_mpi.shard_tensor(x, -2, manager)
        assert np.array_equal(credit_mpi.gather_tensor(part, -2, manager), x)
        part = credit_mpi.scatter_tensor(x if manager.domain_rank == 0 else None, -2, manager)
        assert world.allreduce(float(part.sum())) == float(x.sum())
    credit_mpi.destroy_domain_parallel()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
