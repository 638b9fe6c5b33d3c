"""Reliability, round 3 (issue 27), the core: one rank's different call is every rank's exception.

MPI tests (run on 1-4 ranks). Each builds its managers with a small
watchdog ``timeout`` (:mod:`credit_mpi.watchdog`): a regression that leaves
ranks waiting aborts the job with the watchdog's report within a minute
instead of hanging until the runner's timeout.

* the 1-D / 2-D decision (a single dim on one rank, a (lat, lon) pair on the
  others) is agreed, on every kind of grid;
* ``allgather_or_raise`` whose ``compute()`` returns an unpicklable value on one rank;
* numpy masked arrays are refused on every rank (their mask would be lost);
* managers dropped without ``free()``: the error names them (tests/watchdog_job.py, a subprocess).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi.validation import DomainParallelError, allgather_or_raise

from .test_agreement import outcome

HANG_S = 60  # the watchdog's deadline in these tests: a hang aborts the job with its report


def grids(n: int) -> list:
    """Every grid of n ranks, and None (no domain_grid: an (n, 1) grid without a Cartesian communicator)."""
    return [None] + [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def same_everywhere(comm: MPI.Comm, fn) -> tuple[str, object]:
    """``fn()``'s outcome, checked to be the same on every rank (the exception type, or success)."""
    kind, value = outcome(fn)
    seen = comm.allgather((kind, value if kind == "error" else None))
    assert all(s == seen[0] for s in seen), seen
    return kind, value


def calls(m, g: np.ndarray, single: bool) -> dict:
    """Each public 2-D-capable call, with a single dim (``single``) or with the (lat, lon) pair."""
    dim = -2 if single else (-2, -1)
    width = 1 if single else (1, 1)
    block = credit_mpi.shard_tensor(g, (-2, -1), m)  # every rank's own block (local)
    return {
        "shard_tensor": lambda: credit_mpi.shard_tensor(g, dim, m, check="collective"),
        "shard_batch": lambda: credit_mpi.shard_batch({"x": g[None]}, dim, dim, m, check="collective"),
        "gather_tensor": lambda: credit_mpi.gather_tensor(block, dim, m),
        "scatter_tensor": lambda: credit_mpi.scatter_tensor(g if m.domain_rank == 0 else None, dim, m),
        "halo_exchange": lambda: credit_mpi.halo_exchange(block, width, dim, m),
        "halo_width_only": lambda: credit_mpi.halo_exchange(block, width, -2, m),  # the pair is in the width only
    }


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("odd_single", [True, False], ids=["one-rank-single", "one-rank-pair"])
def test_one_rank_mixes_1d_and_2d(make_manager, world, odd_single):
    """One rank passes a single dim (or width) where the others pass the pair, or the reverse: the same exception everywhere."""
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid, timeout=HANG_S)
        rows, cols = m.domain_grid
        g = np.arange(2 * 4 * rows * 4 * cols, dtype=np.float64).reshape(2, 4 * rows, 4 * cols)
        odd = m.domain_rank == n - 1
        mine = calls(m, g, single=odd == odd_single)
        for name, call in mine.items():
            kind, value = same_everywhere(world, call)
            assert (kind, value) == ("error", "ValueError"), (grid, name, kind, value)
        # in step: a valid 2-D gather works on every rank afterwards
        block = credit_mpi.shard_tensor(g, (-2, -1), m)
        np.testing.assert_array_equal(credit_mpi.gather_tensor(block, (-2, -1), m), g)


@pytest.mark.mpi(min_size=2)
def test_mixed_forms_message_names_the_ranks(make_manager, world):
    n = world.Get_size()
    m = make_manager(n, timeout=HANG_S)  # no grid: both forms are legal alone
    g = np.zeros((2, 2 * n, 4))
    block = credit_mpi.shard_tensor(g, -2, m)
    dim = -2 if m.domain_rank == 0 else (-2, -1)
    with pytest.raises(ValueError, match=r"gather_tensor: .*single dim .* on rank\(s\) 0 and a \(lat, lon\) pair .* on rank\(s\) 1"):
        credit_mpi.gather_tensor(block, dim, m)


@pytest.mark.mpi(min_size=2)
def test_shard_batch_2d_bad_transport_on_one_rank(make_manager, world):
    """The 2-D shard_batch checks its transport inside the agreement (it used to raise before it on one rank)."""
    n = world.Get_size()
    m = make_manager(n, domain_grid=(1, n), timeout=HANG_S)
    g = np.zeros((1, 2, 4, 4 * n))
    transport = "MPI" if m.domain_rank == n - 1 else "mpi"
    kind, value = same_everywhere(world, lambda: credit_mpi.shard_batch({"x": g}, (-2, -1), (-2, -1), m, check="collective", transport=transport))
    assert (kind, value) == ("error", "ValueError")


class _Unpicklable:
    def __init__(self) -> None:
        self.lock = threading.Lock()


@pytest.fixture
def world_deadline(world):
    """COMM_WORLD's collectives under the tests' short deadline, for this test only."""
    from credit_mpi import watchdog

    watchdog.set_timeout(world, HANG_S)
    yield world
    watchdog.forget_timeout(world)


@pytest.mark.mpi(min_size=1)
def test_allgather_or_raise_unpicklable_on_one_rank(world_deadline):
    world = world_deadline
    n = world.Get_size()
    odd = world.Get_rank() == n - 1
    kind, value = same_everywhere(world, lambda: allgather_or_raise(world, lambda: _Unpicklable() if odd else 1))
    assert (kind, value) == ("error", "TypeError")
    with pytest.raises(TypeError, match=rf"compute\(\) returned a _Unpicklable, which cannot be pickled .*rank\(s\) {n - 1}"):
        allgather_or_raise(world, lambda: _Unpicklable() if odd else 1)
    assert allgather_or_raise(world, lambda: {"rank": world.Get_rank()}) == [{"rank": r} for r in range(n)]
    assert allgather_or_raise(world, lambda: b"x" * world.Get_rank()) == [b"x" * r for r in range(n)]


@pytest.mark.mpi(min_size=2)
def test_masked_arrays_are_refused_everywhere(make_manager, world):
    """A masked array would lose its mask: refused, with the way out, on every rank (also when one rank passes one).

    (On a domain of one rank shard, gather and scatter return their input
    itself, mask included: nothing is lost there.)
    """
    n = world.Get_size()
    m = make_manager(n, timeout=HANG_S)
    g = np.arange(2 * 2 * n * 3, dtype=np.float64).reshape(2, 2 * n, 3)
    masked = np.ma.masked_greater(g, 5.0)
    odd = world.Get_rank() == n - 1
    mine = masked if odd else g
    for call in (
        lambda: credit_mpi.shard_tensor(mine, -2, m, check="collective"),
        lambda: credit_mpi.gather_tensor(mine[:, :2], -2, m),
        lambda: credit_mpi.halo_exchange(mine[:, :2], 1, -2, m),
        lambda: credit_mpi.scatter_tensor(masked if m.domain_rank == 0 else None, -2, m),
        lambda: credit_mpi.shard_batch({"x": mine[None]}, manager=m, check="collective"),
    ):
        assert same_everywhere(world, call) == ("error", "TypeError")
    with pytest.raises(TypeError, match=r"masked array.*np\.ma\.getdata.*filled"):
        credit_mpi.gather_tensor(masked[:, :2], -2, m)
    with pytest.raises(TypeError, match="masked array"):  # a local shard: this rank alone, the same message
        credit_mpi.shard_tensor(masked, -2, m)
    # the way out works: the data and the mask, each as a plain array
    block = credit_mpi.shard_tensor(np.ma.getdata(masked), -2, m)
    mask = credit_mpi.shard_tensor(np.ma.getmaskarray(masked), -2, m)
    back = np.ma.MaskedArray(credit_mpi.gather_tensor(block, -2, m), credit_mpi.gather_tensor(mask, -2, m))
    assert np.array_equal(back.mask, masked.mask) and np.array_equal(back.data, masked.data)


@pytest.mark.mpi(min_size=1)
def test_agreed_errors_still_raise_domain_parallel_error(world_deadline):
    """Unchanged: a compute() error that is not portable becomes a DomainParallelError on every rank."""
    world = world_deadline

    def compute():
        if world.Get_rank() == 0:
            raise KeyError("nope")
        return 1

    with pytest.raises(DomainParallelError, match="nope"):
        allgather_or_raise(world, compute)


@pytest.mark.mpi(min_size=1)
def test_the_watchdog_makes_one_private_communicator(make_manager, world):
    """Managers on sub-communicators of a world manager's parent add no communicator for the watchdog's queries."""
    from credit_mpi import watchdog

    make_manager(world.Get_size(), timeout=HANG_S)
    before = len(watchdog._PRIVATES)
    sub = world.Split(world.Get_rank() % 2)
    try:
        for _ in range(3):
            make_manager(1, comm=sub, timeout=HANG_S)
        assert len(watchdog._PRIVATES) == before <= 1
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_manager_timeouts_must_agree(world):
    """The watchdog's deadline is a constructor argument like the others: different values are every rank's ValueError."""
    timeout = 30 if world.Get_rank() == 0 else 60
    with pytest.raises(ValueError, match=r"different arguments to DomainParallelManager.*timeout=30.0.*timeout=60.0"):
        credit_mpi.DomainParallelManager(None, world.Get_size(), timeout=timeout)
    bad = -1 if world.Get_rank() == 0 else 60
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0.*rank\(s\) 0"):
        credit_mpi.DomainParallelManager(None, world.Get_size(), timeout=bad)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["halo_exchange", "gather_tensor"])
def test_remembered_1d_call_meets_a_pair_on_one_rank(make_manager, world, op):
    """The per-call fast path (a remembered 1-D call: one Allgather) meets the odd rank's 2-D call: every rank raises."""
    n = world.Get_size()
    m = make_manager(n, timeout=HANG_S)
    g = np.arange(2 * 3 * n * 4, dtype=np.float64).reshape(2, 3 * n, 4)
    band = credit_mpi.shard_tensor(g, -2, m)

    def call(dim):
        return credit_mpi.halo_exchange(band, 1, dim, m) if op == "halo_exchange" else credit_mpi.gather_tensor(band, dim, m)

    expected = call(-2).copy()
    np.testing.assert_array_equal(call(-2), expected)  # remembered now
    dim = (-2, -1) if m.domain_rank == n - 1 else -2
    assert same_everywhere(world, lambda: call(dim)) == ("error", "ValueError")
    np.testing.assert_array_equal(call(-2), expected)  # in step again
