"""The domain sum (credit_mpi.ops.allreduce's two steps): the conformance checks, inherited; its layout, its adjoint, its bits.

A rank's part is its band of the field; the call sums the band's rows and adds the sums over the
domain: the field's row sums on every rank (integer values: exact in any order). The plan's rows
are this band's rows of the field (what a weight over the field is cut to); the adjoint adds every
rank's gradient of the replicated result. The sum is one Allreduce: with any values it is the same
bits on every rank (what MPICH and Open MPI give; from device memory too: tests/test_transport_ops.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi.ops.allreduce import agree_domain_sum, allreduce_sum, domain_sum, received_elements

from .conformance import Conformance, agreed_failure, one_column_less, other_dtype, other_kind, to_numpy, torch


def _summed(part, manager, path="test"):
    rows = part.shape[-2]
    partial = part.sum(-2)
    plan = agree_domain_sum(tuple(partial.shape), part.dtype, rows, bool(getattr(partial, "requires_grad", False)),
                            manager.domain_group, path)
    return domain_sum(partial, plan), plan


class TestDomainSum(Conformance):
    kinds = ("torch",)

    def values(self, rng, shape):
        return rng.integers(-8, 8, shape).astype(np.float64)

    def call(self, part, manager, form, **change):
        return _summed(part, manager, **change)[0]

    def expected(self, field, manager, form):
        return to_numpy(field).sum(-2)

    perturbations = {"dtype": ({}, other_dtype), "kind": ({}, other_kind), "a column less": ({}, one_column_less),
                     "a channel less": ({}, lambda part: part[:, :-1].clone()), "path": ({"path": "other"}, None)}


@pytest.mark.mpi(min_size=1)
def test_plan_rows_are_the_bands_of_the_field(make_manager):
    manager = make_manager()
    n, rank = manager.domain_parallel_size, manager.domain_rank
    sizes = [2 + (r % 2) for r in range(n)]  # uneven: 2, 3, 2, 3 rows
    part = torch.ones(3, sizes[rank], 4, dtype=torch.float64)
    out, plan = _summed(part, manager)
    assert plan.rows() == (sum(sizes[:rank]), sum(sizes[: rank + 1])) and plan.total == sum(sizes)
    assert torch.equal(out, torch.full((3, 4), float(sum(sizes)), dtype=torch.float64))


@pytest.mark.mpi(min_size=1)
def test_adjoint_adds_every_ranks_gradient(make_manager):
    """Each rank weights the replicated sum by its own factor: the band's gradient is the sum of the factors."""
    manager = make_manager()
    n, rank = manager.domain_parallel_size, manager.domain_rank
    part = torch.ones(2, 3, 4, dtype=torch.float64, requires_grad=True)
    received_elements(reset=True)
    out, _ = _summed(part, manager)
    (out * (rank + 1)).sum().backward()
    assert torch.equal(part.grad, torch.full((2, 3, 4), n * (n + 1) / 2, dtype=torch.float64))
    assert received_elements() == (8 if n > 1 else 0)  # the forward's Allreduce of the (2, 4) sums


@pytest.mark.mpi(min_size=2)
def test_an_autograd_state_on_one_rank_is_every_ranks_error(make_manager):
    manager = make_manager()
    last = MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1
    part = torch.ones(2, 3, 4, dtype=torch.float64, requires_grad=last)
    kind, message = agreed_failure(lambda: _summed(part, manager), MPI.COMM_WORLD)
    assert kind == "ValueError" and "autograd" in message, message


def _parts(n: int) -> list:
    """Every rank's part (rank ``r``'s seeded by ``r``): float64 values whose sum depends on the order of the additions."""
    return [torch.randn(3, 2 + r % 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) * 10 ** r
            for r in range(n)]


def _bits(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.mpi(min_size=1)
def test_the_sum_is_the_same_bits_on_every_rank(make_manager):
    """MPI's order of the additions, not rank order: equal to it to round-off, and the same bits on every rank."""
    manager = make_manager()
    comm, rank = manager.domain_group, manager.domain_rank
    parts = _parts(comm.Get_size())
    want = parts[0].sum(-2)
    for p in parts[1:]:
        want = want + p.sum(-2)
    out = _summed(parts[rank], manager)[0]
    torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-13 * 10 ** comm.Get_size())
    assert len(set(comm.allgather(_bits(out)))) == 1
    flat = allreduce_sum(parts[rank].sum(-2).numpy(), comm)  # the numpy use: the same op, the same bits
    assert isinstance(flat, np.ndarray) and flat.tobytes() == _bits(out)


@pytest.mark.mpi(min_size=1)
def test_double_backward_through_the_adjoint(make_manager):
    """Every rank's loss is ``sum(S ** 2)``, ``S`` the sum of the ranks' ``x``: the gradient ``2 n S``, its own ``2 n ** 2``."""
    manager = make_manager()
    n, comm = manager.domain_parallel_size, manager.domain_group
    x = torch.full((2, 3), float(manager.domain_rank + 1), dtype=torch.float64, requires_grad=True)
    s = allreduce_sum(x, comm)
    (g,) = torch.autograd.grad((s ** 2).sum(), x, create_graph=True)
    torch.testing.assert_close(g, 2 * n * s.detach(), rtol=0, atol=0)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(h, torch.full((2, 3), 2.0 * n * n, dtype=torch.float64), rtol=0, atol=0)
