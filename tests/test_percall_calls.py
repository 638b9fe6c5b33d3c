"""The per-call fast path stays short: credit_mpi's Python calls per repeated call, counted (no timing).

Issue 23's must-show is that ``benchmarks/bench_percall.py``'s ratios are
not worse than before the engine; on a loaded machine time is noise, but the
number of Python function calls credit_mpi makes per repeated call is not,
and it is what the engine's layers add. Each path is warmed up (its
agreement and plan remembered), then one call is counted with
``sys.setprofile``: only frames of credit_mpi's own modules (torch's and
numpy's internals are theirs to change). The budgets are what the path made
when they were set, plus a little room; a change that needs more should say
why here.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import credit_mpi
from credit_mpi import DomainParallelManager, gather_tensor, halo_exchange

_PACKAGE = os.path.dirname(credit_mpi.__file__) + os.sep

# per-path budgets of credit_mpi calls per repeated call; at the time of writing, on 2, 3 and 4 ranks:
# halo_exchange 22, HaloExchange forward + backward 53, gather_tensor 28, 29, 30 (one band message a peer);
# gather_tensor of a torch CPU tensor 32 (the numpy path and the torch checks)
BUDGETS = {"halo_exchange": 24, "HaloExchange fwd+bwd": 56, "gather_tensor": 33, "gather_tensor torch": 34}


def _count(fn, calls: int = 4) -> float:
    """credit_mpi's Python calls per call of ``fn`` (after warm-up: the remembered fast path)."""
    for _ in range(3):
        fn()
    seen = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            seen[0] += 1

    sys.setprofile(profile)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return seen[0] / calls


def _paths(manager, rank):
    x = np.random.default_rng(rank).standard_normal((4, 8, 23, 90), dtype=np.float32)
    paths = {"halo_exchange": lambda: halo_exchange(x, 1, manager=manager),
             "gather_tensor": lambda: gather_tensor(x, manager=manager)}
    torch = pytest.importorskip("torch")
    xt = torch.from_numpy(x.copy())
    paths["gather_tensor torch"] = lambda: gather_tensor(xt, manager=manager)
    module = credit_mpi.HaloExchange(1, manager=manager)
    xg = torch.from_numpy(x).clone().requires_grad_(True)
    g = torch.ones((4, 8, 25, 90))

    def fwd_bwd():
        module(xg).backward(g)
        xg.grad = None

    paths["HaloExchange fwd+bwd"] = fwd_bwd
    return paths


@pytest.mark.mpi
def test_repeated_calls_stay_within_their_python_call_budget():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        pytest.skip("the fast path of a domain of several ranks (one rank pads and returns locally)")
    with DomainParallelManager(None, world.Get_size()) as manager:
        counts = {name: _count(fn) for name, fn in _paths(manager, world.Get_rank()).items()}
    worst = {name: max(world.allgather(n)) for name, n in counts.items()}  # every rank asserts the same
    over = {name: n for name, n in worst.items() if n > BUDGETS[name]}
    assert not over, f"credit_mpi Python calls per repeated call over budget: {over} (budgets {BUDGETS}, all {worst})"
