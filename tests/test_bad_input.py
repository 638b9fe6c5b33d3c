"""Wrong calls across the public API: one clear exception on every rank, no hang.

Each case makes one mistake, on every rank or on some ranks only (the ones a
single rank can see and the others cannot). Every rank runs the call under
``pytest.raises`` with the expected type and a pattern that names the
offending value, so a rank that did not raise, or raised something else,
fails the test (and conftest aborts the job instead of letting it hang).
Afterwards the communicators must still work: the next valid call succeeds
and gives the single-process answer.

Run under MPI on any number of ranks; cases that need two or more ranks in a
domain are skipped on fewer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import DomainParallelError, DomainParallelManager


@dataclass
class Ctx:
    """What a case needs: the world, a live manager over it, this rank."""

    world: MPI.Intracomm
    manager: DomainParallelManager
    make_manager: Callable[..., DomainParallelManager]

    @property
    def n(self) -> int:
        return self.world.Get_size()

    @property
    def r(self) -> int:
        return self.world.Get_rank()


def field(rows: int, cols: int = 3, dtype: Any = np.float32) -> np.ndarray:
    return np.arange(rows * cols, dtype=dtype).reshape(rows, cols)


def torch_or_skip():
    return pytest.importorskip("torch")


# Each case: (name, min ranks, function(ctx) -> (exception type, pattern, thunk)).
CASES: list[tuple[str, int, Callable[[Ctx], tuple[type, str, Callable[[], Any]]]]] = []


def case(min_size: int = 1):
    def register(fn):
        CASES.append((fn.__name__, min_size, fn))
        return fn

    return register


# -- the manager --------------------------------------------------------------


@case()
def manager_world_size_mismatch(c):
    return ValueError, f"world_size={c.n + 1} does not match .* size {c.n}", lambda: DomainParallelManager(c.n + 1, 1)


@case()
def manager_domain_size_not_divisor(c):
    return ValueError, f"domain_parallel_size={c.n + 1} does not divide", lambda: DomainParallelManager(None, c.n + 1)


@case()
def manager_domain_size_zero(c):
    return ValueError, "domain_parallel_size must be >= 1, got 0", lambda: DomainParallelManager(None, 0)


@case()
def manager_domain_size_negative(c):
    return ValueError, "domain_parallel_size must be >= 1, got -2", lambda: DomainParallelManager(None, -2)


@case()
def manager_domain_size_string(c):
    return ValueError, "domain_parallel_size must be an integer, got '1'", lambda: DomainParallelManager(None, "1")


@case()
def manager_domain_size_float(c):
    return ValueError, "domain_parallel_size must be an integer, got 1.0", lambda: DomainParallelManager(None, 1.0)


@case()
def manager_domain_size_bool(c):
    return ValueError, "domain_parallel_size must be an integer, got True", lambda: DomainParallelManager(None, True)


@case()
def manager_shard_dim_string(c):
    return ValueError, "shard_dim must be an integer, got 'lat'", lambda: DomainParallelManager(None, 1, "lat")


@case()
def manager_comm_not_a_comm(c):
    return TypeError, "comm must be an mpi4py intracommunicator, got 'world'", lambda: DomainParallelManager(None, 1, comm="world")


@case()
def manager_comm_null(c):
    return TypeError, "comm must be an mpi4py intracommunicator, got <mpi4py.MPI.Comm", lambda: DomainParallelManager(None, 1, comm=MPI.COMM_NULL)


@case()
def initialize_bad_domain_size(c):
    return ValueError, f"domain_parallel_size={c.n + 1}", lambda: credit_mpi.initialize_domain_parallel(None, c.n + 1)


@case()
def freed_manager_domain_group(c):
    m = c.make_manager()
    m.free()
    return DomainParallelError, "has been freed", lambda: m.domain_group


@case()
def freed_manager_shard(c):
    m = c.make_manager()
    m.free()
    return DomainParallelError, "has been freed", lambda: credit_mpi.shard_tensor(field(2 * c.n), manager=m)


@case()
def freed_manager_gather(c):
    m = c.make_manager()
    m.free()
    return DomainParallelError, "has been freed", lambda: credit_mpi.gather_tensor(field(2), manager=m)


@case(2)
def manager_ranks_disagree(c):
    d = 1 if c.r == 0 else c.n
    return ValueError, "different arguments.*rank 0: .*domain_parallel_size=1", lambda: DomainParallelManager(None, d)


@case(2)
def manager_one_rank_invalid(c):
    d = 0 if c.r == c.n - 1 else 1
    return ValueError, rf"got 0 \[on rank\(s\) {c.n - 1} of", lambda: DomainParallelManager(None, d)


@case(2)
def manager_one_rank_wrong_world_size(c):
    w = c.n + 3 if c.r == 0 else None
    return ValueError, rf"world_size={c.n + 3} .*\[on rank\(s\) 0 of", lambda: DomainParallelManager(w, 1)


# -- shard_tensor ---------------------------------------------------------------


@case(2)
def shard_dim_out_of_range(c):
    return ValueError, r"dim 2 is out of range .* \(valid: -2 to 1\)", lambda: credit_mpi.shard_tensor(field(2 * c.n), 2, c.manager)


@case(2)
def shard_dim_not_int(c):
    return ValueError, "dim must be an integer, got 'H'", lambda: credit_mpi.shard_tensor(field(2 * c.n), "H", c.manager)


@case(2)
def shard_indivisible(c):
    rows = 2 * c.n + 1
    return ValueError, f"^Cannot shard dim 0 of size {rows} evenly across {c.n} .*uneven=True", lambda: credit_mpi.shard_tensor(field(rows), 0, c.manager)


@case(2)
def shard_shape_differs(c):
    rows = 2 * c.n if c.r == 0 else 4 * c.n
    return ValueError, rf"different arrays .*rank 0: numpy float32 \({2 * c.n}, 3\)", lambda: credit_mpi.shard_tensor(field(rows), 0, c.manager, check="collective")


@case(2)
def shard_dtype_differs(c):
    dtype = np.float64 if c.r == 0 else np.float32
    return ValueError, "different arrays .*rank 0: numpy float64", lambda: credit_mpi.shard_tensor(field(2 * c.n, dtype=dtype), 0, c.manager, check="collective")


@case(2)
def shard_ndim_differs(c):
    x = field(2 * c.n)[None] if c.r == 1 else field(2 * c.n)
    return ValueError, rf"different arrays .*rank 1: numpy float32 \(1, {2 * c.n}, 3\)", lambda: credit_mpi.shard_tensor(x, -2, c.manager, check="collective")


@case(2)
def shard_dim_differs(c):
    x = field(2 * c.n, 2 * c.n)
    return ValueError, "different arrays .*dim 0.*dim 1", lambda: credit_mpi.shard_tensor(x, 0 if c.r == 0 else 1, c.manager, check="collective")


@case(2)
def shard_unsupported_type(c):
    return TypeError, "unsupported array type builtins.list", lambda: credit_mpi.shard_tensor([[1.0]] * 2 * c.n, 0, c.manager)


@case(2)
def shard_list_on_one_rank(c):
    x = field(2 * c.n).tolist() if c.r == 0 else field(2 * c.n)
    return TypeError, r"builtins.list.* \[on rank\(s\) 0 of", lambda: credit_mpi.shard_tensor(x, 0, c.manager, check="collective")


@case(2)
def shard_object_dtype(c):
    x = np.empty((2 * c.n, 2), dtype=object)
    return TypeError, "dtype object", lambda: credit_mpi.shard_tensor(x, 0, c.manager)


@case(2)
def shard_scalar_array(c):
    return ValueError, "0-dimensional", lambda: credit_mpi.shard_tensor(np.array(1.0, np.float32), 0, c.manager)


@case(2)
def shard_torch_on_one_rank(c):
    torch = torch_or_skip()
    x = torch.zeros(2 * c.n, 3) if c.r == 0 else np.zeros((2 * c.n, 3), np.float32)
    return ValueError, "different arrays .*rank 0: torch torch.float32", lambda: credit_mpi.shard_tensor(x, 0, c.manager, check="collective")


@case(2)
def shard_batch_indivisible(c):
    batch = {"x": np.zeros((1, 1, 2 * c.n + 1, 3), np.float32), "meta": "ok"}
    return ValueError, rf"^Cannot shard dim -2 of size {2 * c.n + 1} .*\(in batch\['x'\]\)", lambda: credit_mpi.shard_batch(batch, manager=c.manager)


@case(2)
def shard_batch_keys_differ(c):
    batch = {"x": np.zeros((1, 1, 2 * c.n, 3), np.float32)}
    if c.r == 0:
        batch["y"] = np.zeros((1, 1, 2 * c.n, 3), np.float32)
    return ValueError, "different arrays .*rank 0: {'x'.*'y'", lambda: credit_mpi.shard_batch(batch, manager=c.manager, check="collective")


# -- gather_tensor ---------------------------------------------------------------


@case(2)
def gather_shapes_do_not_fit(c):
    x = field(2, 3 if c.r == 0 else 4)
    return ValueError, r"do not fit together along dim 0 .*rank 0: numpy float32 \(2, 3\).*rank 1: numpy float32 \(2, 4\)", lambda: credit_mpi.gather_tensor(x, 0, c.manager)


@case(2)
def gather_dtype_differs(c):
    x = field(2, dtype=np.int32 if c.r == c.n - 1 else np.float32)
    return TypeError, rf"differ in array kind, dtype .*rank {c.n - 1}: numpy int32", lambda: credit_mpi.gather_tensor(x, 0, c.manager)


@case(2)
def gather_ndim_differs(c):
    x = field(2)[None] if c.r == 0 else field(2)
    return ValueError, r"do not fit together .*rank 0: numpy float32 \(1, 2, 3\)", lambda: credit_mpi.gather_tensor(x, -2, c.manager)


@case(2)
def gather_dim_out_of_range_on_one_rank(c):
    d = 5 if c.r == c.n - 1 else 0
    return ValueError, rf"dim 5 is out of range .*\[on rank\(s\) {c.n - 1} of", lambda: credit_mpi.gather_tensor(field(2), d, c.manager)


@case(2)
def gather_unsupported_type(c):
    return TypeError, "unsupported array type builtins.tuple", lambda: credit_mpi.gather_tensor((1.0, 2.0), 0, c.manager)


@case(2)
def gather_torch_on_one_rank(c):
    torch = torch_or_skip()
    x = torch.zeros(2, 3) if c.r == 0 else np.zeros((2, 3), np.float32)
    return TypeError, "differ in array kind.*rank 0: torch torch.float32", lambda: credit_mpi.gather_tensor(x, 0, c.manager)


# -- scatter_tensor ---------------------------------------------------------------


@case(2)
def scatter_root_out_of_range(c):
    return ValueError, rf"root must be a domain rank in 0..{c.n - 1}, got {c.n}", lambda: credit_mpi.scatter_tensor(field(2 * c.n), 0, c.manager, root=c.n)


@case(2)
def scatter_root_string(c):
    return ValueError, "root must be a domain rank .*got '0'", lambda: credit_mpi.scatter_tensor(field(2 * c.n), 0, c.manager, root="0")


@case(2)
def scatter_roots_differ(c):
    return ValueError, "different roots .*rank 0: root=0, uneven=False, rank 1: root=1", lambda: credit_mpi.scatter_tensor(field(2 * c.n), 0, c.manager, root=c.r)


@case(2)
def scatter_root_bad_on_one_rank(c):
    root = -1 if c.r == 1 else 0
    return ValueError, r"got -1 \[on rank\(s\) 1 of", lambda: credit_mpi.scatter_tensor(field(2 * c.n), 0, c.manager, root=root)


@case(2)
def scatter_root_indivisible(c):
    x = field(2 * c.n + 1) if c.r == 0 else None
    return ValueError, rf"size {2 * c.n + 1} evenly .*\[on rank\(s\) 0 of", lambda: credit_mpi.scatter_tensor(x, 0, c.manager)


@case(2)
def scatter_root_unsupported_type(c):
    x = "not an array" if c.r == 0 else None
    return TypeError, r"unsupported array type builtins.str.*\[on rank\(s\) 0 of", lambda: credit_mpi.scatter_tensor(x, 0, c.manager)


# -- halo_exchange ------------------------------------------------------------------


@case(2)
def halo_wider_than_shard(c):
    return ValueError, "halo_width=3 with boundary='zero' does not fit: domain rank 0 holds 2 row", lambda: credit_mpi.halo_exchange(field(2), 3, 0, c.manager)


@case(2)
def halo_unknown_boundary(c):
    return ValueError, "unknown boundary 'polar'; valid:", lambda: credit_mpi.halo_exchange(field(4), 1, 0, c.manager, boundary="polar")


@case(2)
def halo_negative_width(c):
    return ValueError, "halo_width must be >= 0, got -1", lambda: credit_mpi.halo_exchange(field(4), -1, 0, c.manager)


@case(2)
def halo_float_width(c):
    return ValueError, "halo_width must be an integer, got 1.5", lambda: credit_mpi.halo_exchange(field(4), 1.5, 0, c.manager)


@case(2)
def halo_reflect_needs_extra_row(c):
    return ValueError, "halo_width=2 with boundary='reflect' does not fit", lambda: credit_mpi.halo_exchange(field(2), 2, 0, c.manager, boundary="reflect")


@case(2)
def halo_width_differs_on_one_rank(c):
    w = 9 if c.r == c.n - 1 else 1
    return ValueError, rf"do not fit together .*rank {c.n - 1}: .*halo_width 9", lambda: credit_mpi.halo_exchange(field(4), w, 0, c.manager)


@case(2)
def halo_dim_out_of_range(c):
    return ValueError, "dim 4 is out of range", lambda: credit_mpi.halo_exchange(field(4), 1, 4, c.manager)


# -- the test ---------------------------------------------------------------------


def check_still_works(manager: DomainParallelManager, world: MPI.Intracomm, rng) -> None:
    """The next valid calls succeed: a shard -> gather round trip and a fresh split."""
    n = world.Get_size()
    assert world.allreduce(1) == n
    x = rng.standard_normal((2, 3 * n + 1, 5)).astype(np.float32)
    part = credit_mpi.shard_tensor(x, -2, manager, uneven=True)
    np.testing.assert_array_equal(credit_mpi.gather_tensor(part, -2, manager), x)
    with DomainParallelManager(None, n) as fresh:
        part = credit_mpi.scatter_tensor(x if fresh.domain_rank == 0 else None, 1, fresh, uneven=True)
        np.testing.assert_array_equal(part, np.array_split(x, n, axis=1)[fresh.domain_rank])


@pytest.mark.parametrize(
    "name,fn",
    [pytest.param(name, fn, marks=pytest.mark.mpi(min_size=size), id=name) for name, size, fn in CASES],
)
def test_bad_input_raises_on_every_rank(name, fn, make_manager, rng):
    world = MPI.COMM_WORLD
    ctx = Ctx(world, make_manager(), make_manager)
    exc_type, pattern, call = fn(ctx)
    with pytest.raises(exc_type, match=pattern) as info:
        call()
    # The same exception type on every rank (messages may name the rank that saw it).
    assert world.allgather(type(info.value).__name__) == [exc_type.__name__] * world.Get_size()
    check_still_works(ctx.manager, world, rng)


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25, len(CASES)
    assert len({name for name, _, _ in CASES}) == len(CASES)


@pytest.mark.mpi(min_size=1)
def test_before_initialisation_the_calls_are_the_identity(rng):
    """As in the reference: without a manager, shard/gather return the input."""
    credit_mpi.destroy_domain_parallel()
    assert credit_mpi.get_domain_parallel_manager() is None
    x = rng.standard_normal((4, 6))
    assert credit_mpi.shard_tensor(x) is x
    assert credit_mpi.gather_tensor(x) is x
    batch = {"x": x}
    assert credit_mpi.shard_batch(batch) is batch


@pytest.mark.mpi(min_size=1)
def test_failed_initialize_keeps_the_previous_manager(make_manager):
    n = MPI.COMM_WORLD.Get_size()
    good = credit_mpi.initialize_domain_parallel(None, n)
    with pytest.raises(ValueError, match=re.escape(f"domain_parallel_size={n + 1}")):
        credit_mpi.initialize_domain_parallel(None, n + 1)
    assert credit_mpi.get_domain_parallel_manager() is good
    assert not good.freed
    credit_mpi.destroy_domain_parallel()
