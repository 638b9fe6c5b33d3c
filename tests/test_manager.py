"""DomainParallelManager on real ranks: layout, neighbours, errors, freeing."""

import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import manager as manager_module

from .conftest import domain_sizes


def members(comm, parent):
    """Parent-communicator ranks of every member of ``comm``, in ``comm``'s rank order."""
    return comm.Get_group().Translate_ranks(list(range(comm.Get_size())), parent.Get_group())


def expected_layout(rank, size, d):
    """The reference's layout, worked out independently: consecutive domain groups."""
    domain = [r for r in range(size) if r // d == rank // d]
    dp = [r for r in range(size) if r % d == rank % d]
    prev = rank - 1 if rank % d > 0 else None
    nxt = rank + 1 if rank % d < d - 1 else None
    return domain, dp, (prev, nxt)


@pytest.mark.mpi(min_size=1)
def test_layout_for_every_domain_size(world, make_manager):
    rank, size = world.Get_rank(), world.Get_size()
    for d in domain_sizes(size):
        m = make_manager(d)
        domain, dp, neighbors = expected_layout(rank, size, d)
        assert m.world_size == size and m.domain_parallel_size == d
        assert m.data_parallel_size == m.dp_world_size == size // d
        assert m.domain_world_size == m.domain_group.Get_size() == d
        assert members(m.domain_group, world) == domain
        assert members(m.data_parallel_group, world) == dp
        assert m.domain_rank == m.domain_group.Get_rank() == domain.index(rank)
        assert m.dp_rank == m.data_parallel_group.Get_rank() == dp.index(rank)
        assert m.neighbor_ranks() == neighbors
        assert m.is_first_domain_rank == (neighbors[0] is None)
        assert m.is_last_domain_rank == (neighbors[1] is None)
        prev, nxt = m.domain_neighbor_ranks()
        assert (prev, nxt) == tuple(None if r is None else domain.index(r) for r in neighbors)
        assert m.domain_groups()[m.domain_group_index] == domain
        assert m.data_parallel_groups()[m.domain_rank] == dp
        assert m.shard_dim == -2


@pytest.mark.mpi(min_size=8)
def test_spec_eight_rank_example(world, make_manager):
    m = make_manager(2)
    assert m.domain_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.data_parallel_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    all_domain = world.allgather(members(m.domain_group, world))
    all_dp = world.allgather(members(m.data_parallel_group, world))
    assert sorted(map(tuple, all_domain)) == [(0, 1)] * 2 + [(2, 3)] * 2 + [(4, 5)] * 2 + [(6, 7)] * 2
    assert sorted(set(map(tuple, all_dp))) == [(0, 2, 4, 6), (1, 3, 5, 7)]


@pytest.mark.mpi(min_size=2)
def test_parent_communicator_other_than_world(world, make_manager):
    """Inside an existing MPI code: the manager lives on a sub-communicator."""
    rank = world.Get_rank()
    half = world.Split(color=rank % 2, key=rank)
    try:
        m = make_manager(half.Get_size(), comm=half)
        assert m.comm is half and m.rank == half.Get_rank()
        assert members(m.domain_group, half) == list(range(half.Get_size()))
        prev, nxt = m.neighbor_ranks()
        assert prev == (None if half.Get_rank() == 0 else half.Get_rank() - 1)
        assert nxt == (None if half.Get_rank() == half.Get_size() - 1 else half.Get_rank() + 1)
        m.free()
    finally:
        half.Free()


@pytest.mark.mpi(min_size=1)
def test_world_size_none_and_explicit_agree(world, make_manager):
    m = credit_mpi.DomainParallelManager(world.Get_size(), 1)
    try:
        assert m.world_size == world.Get_size() and m.domain_rank == 0
    finally:
        m.free()


@pytest.mark.mpi(min_size=1)
def test_world_size_mismatch_names_both_numbers(world):
    size = world.Get_size()
    with pytest.raises(ValueError, match=rf"world_size={size + 1} does not match the communicator size {size}"):
        credit_mpi.DomainParallelManager(size + 1, 1)


@pytest.mark.mpi(min_size=2)
def test_indivisible_domain_size_lists_valid_sizes(world):
    size = world.Get_size()
    with pytest.raises(ValueError, match=rf"domain_parallel_size={size + 1} does not divide world_size={size}"):
        credit_mpi.DomainParallelManager(None, size + 1)


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_arguments_fail_everywhere(world):
    d = 1 if world.Get_rank() == 0 else world.Get_size()
    with pytest.raises(ValueError, match="ranks passed different arguments"):
        credit_mpi.DomainParallelManager(None, d)
    # The parent communicator still works afterwards.
    assert world.allreduce(1) == world.Get_size()


@pytest.mark.mpi(min_size=2)
def test_bad_value_on_one_rank_fails_everywhere(world):
    d = 0 if world.Get_rank() == 1 else 1
    with pytest.raises(ValueError, match=r"domain_parallel_size must be >= 1, got 0 \[on rank\(s\) 1 of MPI_COMM_WORLD\]"):
        credit_mpi.DomainParallelManager(None, d)


@pytest.mark.mpi(min_size=1)
def test_free_and_context_manager(world):
    with credit_mpi.DomainParallelManager(None, world.Get_size()) as m:
        assert not m.freed and m.domain_group.Get_size() == world.Get_size()
    assert m.freed
    with pytest.raises(credit_mpi.DomainParallelError, match="has been freed"):
        _ = m.domain_group
    with pytest.raises(credit_mpi.DomainParallelError, match="has been freed"):
        credit_mpi.gather_tensor(__import__("numpy").zeros((2, 2)), manager=m) if world.Get_size() > 1 else m.data_parallel_group
    m.free()  # a second free is a no-op


@pytest.mark.mpi(min_size=1)
def test_singleton_lifecycle(world):
    assert credit_mpi.get_domain_parallel_manager() is None
    first = credit_mpi.initialize_domain_parallel(world.Get_size(), 1)
    assert credit_mpi.get_domain_parallel_manager() is first is manager_module._MANAGER
    second = credit_mpi.initialize_domain_parallel(None, world.Get_size(), shard_dim=-1)
    assert first.freed and not second.freed and second.shard_dim == -1
    assert credit_mpi.get_domain_parallel_manager() is second
    credit_mpi.destroy_domain_parallel()
    assert second.freed and credit_mpi.get_domain_parallel_manager() is None
    credit_mpi.destroy_domain_parallel()  # idempotent


def test_logger_and_module_attributes():
    assert manager_module.logger.name == "credit_mpi.manager"
    assert hasattr(manager_module, "_MANAGER")


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 1, "domain_parallel_size": 0}, "domain_parallel_size must be >= 1, got 0"),
    ({"world_size": 1, "domain_parallel_size": 1.5}, "must be an integer, got 1.5"),
    ({"world_size": 0, "domain_parallel_size": 1}, "world_size must be >= 1, got 0"),
    ({"world_size": 1, "domain_parallel_size": 1, "shard_dim": "H"}, "shard_dim must be an integer"),
])
def test_argument_checks_on_comm_self(kwargs, match):
    with pytest.raises(ValueError, match=match):
        credit_mpi.DomainParallelManager(comm=MPI.COMM_SELF, **kwargs)


def test_rejects_a_non_communicator():
    with pytest.raises(TypeError, match="intracommunicator"):
        credit_mpi.DomainParallelManager(1, 1, comm="world")
