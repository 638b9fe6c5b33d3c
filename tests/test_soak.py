"""Soak: thousands of collectives, no growth in memory.

A leak of a derived datatype, a request, a communicator or a Python buffer
per call would show here: after a warm-up, a few thousand shard/gather/scatter/
halo calls must leave the process's resident memory (psutil) and the Python heap
(tracemalloc) where they were, on every rank.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

psutil = pytest.importorskip("psutil")

CALLS = int(os.environ.get("CREDIT_MPI_SOAK_CALLS", "1500"))
# Bounds well above the noise of allocator caching, well below any real leak:
# a leaked 48 KiB output per call would be over 70 MiB after 1500 rounds.
RSS_SLACK = 8 * 2**20
HEAP_SLACK = 256 * 2**10


def one_round(i: int, manager, x: np.ndarray, xu: np.ndarray) -> None:
    n, r = manager.domain_parallel_size, manager.domain_rank
    part = credit_mpi.shard_tensor(x, -2, manager, check=(i % 2 == 0))
    whole = credit_mpi.gather_tensor(part, -2, manager, check=(i % 3 != 0))
    if i % 100 == 0:
        assert np.array_equal(whole, x)
    part = credit_mpi.scatter_tensor(xu if r == 0 else None, -2, manager, uneven=True)
    whole = credit_mpi.gather_tensor(part, -2, manager)
    if i % 100 == 0:
        assert np.array_equal(whole, xu), (n, i)
    boundary = ("zero", "periodic", "reflect", "earth")[i % 4]
    padded = credit_mpi.halo_exchange(part, 2, -2, manager, boundary=boundary, check=(i % 2 == 1))
    if i % 100 == 0:
        assert padded.shape[-2] == part.shape[-2] + 4 and np.array_equal(padded[..., 2:-2, :], part), (n, i)


@pytest.mark.mpi(min_size=2)  # on one rank nothing is communicated
@pytest.mark.world_sizes(2)  # its uneven field is uneven on 2 ranks too; more ranks on 2 cores only make it slower (CI time)
def test_thousands_of_gathers_and_halos_do_not_grow_memory(make_manager):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    manager = make_manager(n)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 8 * n, 64)).astype(np.float32)  # 48*n KiB
    xu = rng.standard_normal((2, 3, 8 * n + n - 1, 64)).astype(np.float32)
    process = psutil.Process()

    for i in range(200):  # warm-up: caches, first-touch pages, lazy MPI state
        one_round(i, manager, x, xu)
    gc.collect()
    tracemalloc.start()
    heap0 = tracemalloc.get_traced_memory()[0]
    rss0 = process.memory_info().rss
    for i in range(CALLS):
        one_round(i, manager, x, xu)
    gc.collect()
    heap1 = tracemalloc.get_traced_memory()[0]
    rss1 = process.memory_info().rss
    tracemalloc.stop()

    growth = world.allgather((rss1 - rss0, heap1 - heap0))
    if os.environ.get("CREDIT_MPI_REPORT") and world.Get_rank() == 0:
        print(
            f"\n[soak] {n} rank(s), {CALLS} rounds x (2 gathers + shard + scatter + halo) = {2 * CALLS} gathers, {CALLS} halos: "
            + ", ".join(f"rank {r}: RSS {d / 2**10:+.0f} KiB, heap {h / 2**10:+.1f} KiB" for r, (d, h) in enumerate(growth)),
            flush=True,
        )
    worst_rss = max(d for d, _ in growth)
    worst_heap = max(h for _, h in growth)
    assert worst_rss < RSS_SLACK and worst_heap < HEAP_SLACK, growth
