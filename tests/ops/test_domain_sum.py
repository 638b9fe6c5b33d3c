"""domain_sum (credit_mpi.ops.domain_sum): the conformance checks, inherited; its layout and its adjoint.

A rank's part is its band of the field; the call sums the band's rows and adds the sums over the
domain (one Allreduce): the field's row sums on every rank (integer values: exact in any order).
The plan's rows are this band's rows of the field (what a weight over the field is cut to); the
adjoint adds every rank's gradient of the replicated result.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi.ops.domain_sum import agree_domain_sum, domain_sum, received_elements

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
