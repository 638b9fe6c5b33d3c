"""The layers' statistics (credit_mpi.ops.statistics), bands and blocks: the conformance checks, inherited.

A rank's "part" is the first row (bands) or first element (blocks) of its piece of the field, a
fixed-size tensor on every rank; the result is every rank's part stacked in rank order. The adjoint
(the gradient summed over the ranks, this rank's row kept) is checked against the one-process sum.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi.ops.statistics import gather_agreed, gather_statistics

from .conformance import Conformance, other_dtype, other_kind, to_numpy, torch


def _starts(total: int, parts: int) -> list[int]:
    """The first global index of each uneven piece (numpy.array_split, as shard_tensor(uneven=True))."""
    return [int(piece[0]) for piece in np.array_split(np.arange(total), parts)]


def first_of(piece, form):
    """The first row of a band (bands) or first element of a block (blocks): a part of the same shape on every rank."""
    return piece[..., :1, :1] if form == "blocks" else piece[..., :1, :]


def pieces_of(field, manager, form) -> np.ndarray:
    """Every rank's :func:`first_of` its piece of the global ``field``, stacked in rank order (the one-process reference)."""
    field = to_numpy(field)
    rows, cols = manager.domain_grid if form == "blocks" else (manager.domain_parallel_size, 1)
    ys, xs = _starts(field.shape[-2], rows), _starts(field.shape[-1], cols)
    if form == "bands":
        return np.stack([field[..., y : y + 1, :] for y in ys])
    return np.stack([field[..., y : y + 1, x : x + 1] for y in ys for x in xs])


class TestStatistics(Conformance):
    forms = ("bands", "blocks")
    kinds = ("torch",)

    def part(self, field, manager, form):
        return first_of(super().part(field, manager, form), form).clone()

    def call(self, part, manager, form, **change):
        return gather_statistics(part, manager.domain_group)

    def expected(self, field, manager, form):
        return pieces_of(field, manager, form)

    perturbations = {
        "dtype": ({}, other_dtype),
        "kind": ({}, other_kind),
        "shape": ({}, lambda part: part[:, :-1].clone()),
    }


@pytest.mark.mpi
@pytest.mark.parametrize("agreed", [False, True])
def test_the_adjoint_sums_the_gradient_over_the_ranks(make_manager, agreed):
    n, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    comm = make_manager(n).domain_group
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3).add(10 * rank).requires_grad_()
    weights = torch.arange(1, n * 6 + 1, dtype=torch.float64).reshape(n, 2, 3)  # the same on every rank
    stacked = (gather_agreed if agreed else gather_statistics)(x, comm)
    assert stacked.requires_grad
    torch.testing.assert_close(stacked[rank], x.detach(), rtol=0, atol=0)
    (stacked * weights).sum().backward()  # every rank's loss holds every rank's x: n terms for this one
    torch.testing.assert_close(x.grad, n * weights[rank], rtol=0, atol=0)


@pytest.mark.mpi
def test_double_backward_through_the_adjoint(make_manager):
    n, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    comm = make_manager(n).domain_group
    x = torch.full((2,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = (gather_statistics(x, comm) ** 2).sum()  # every rank: sum over r of |x_r|^2
    (g,) = torch.autograd.grad(y, x, create_graph=True)  # n * 2 x
    torch.testing.assert_close(g, 2 * n * x.detach(), rtol=0, atol=0)
    g.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0 * n, dtype=torch.float64), rtol=0, atol=0)

