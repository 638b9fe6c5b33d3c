"""The pencil transpose (credit_mpi.ops.transpose): the collectives' conformance checks, plus its own.

Inherited (:class:`~tests.ops.conformance.Conformance`): exact on even and uneven bands (the
longitude split unevenly too: 4 columns on 3 ranks), float32 and float64; a one-rank
perturbation is every rank's exception. Its own: the way back is the inverse, the adjoint
is the transpose back of the gradient, complex tensors move bit for bit, and what a counting
communicator sees it send is what :func:`~credit_mpi.ops.transpose.transpose_bytes` says.
"""

from __future__ import annotations

import numpy as np
import pytest

from credit_mpi.layout import split
from credit_mpi.ops.transpose import (
    column_sizes,
    pencil_transpose,
    pencil_transposed,
    received_elements,
    transpose_bytes,
)

from ..test_describe_traffic import counting
from .conformance import Conformance, agreed_failure, one_channel_less, other_dtype, torch


def _part(whole, dim, sizes, rank):
    start = sum(sizes[:rank])
    return whole.narrow(dim, start, sizes[rank])


class TestPencilTranspose(Conformance):
    kinds = ("torch",)

    def call(self, part, manager, form, **change):
        change = dict(change)
        return pencil_transpose(part, -2, change.pop("to_dim", -1), manager.domain_group, **change)

    def expected(self, field, manager, form):
        n, rank = manager.domain_parallel_size, manager.domain_rank
        return _part(torch.from_numpy(np.asarray(field)), -1, column_sizes(field.shape[-1], n), rank).numpy()

    perturbations = {"dtype": ({}, other_dtype), "a channel less": ({}, one_channel_less),
                     "sizes": ({"sizes": (99,)}, None), "to_dim": ({"to_dim": 1}, None), "path": ({"path": "x"}, None),
                     "a dim twice": ({"to_dim": -2}, None)}


def _field(rows, cols, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.complex(torch.randn(2, 3, rows, cols, dtype=torch.float64, generator=g),
                             torch.randn(2, 3, rows, cols, dtype=torch.float64, generator=g)).to(dtype)
    return torch.randn(2, 3, rows, cols, dtype=dtype, generator=g)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128])
def test_there_and_back_and_the_adjoint(make_manager, dtype):
    manager = make_manager()
    n, rank, comm = manager.domain_parallel_size, manager.domain_rank, manager.domain_group
    for rows, cols in ((2 * n, 2 * n), (2 * n + 1, n + 1), (n + 1, 1)):  # even; uneven both ways; fewer columns than ranks
        whole = _field(rows, cols, dtype).requires_grad_()
        weight = _field(rows, cols, dtype, seed=4)
        (whole * weight).real.sum().backward()
        counts = split(rows, n, uneven=True)
        band = _part(whole.detach(), 2, counts, rank).clone().requires_grad_()
        cols_part, agreed, sizes = pencil_transposed(band, 2, 3, comm)
        assert list(agreed) == counts and list(sizes) == column_sizes(cols, n)
        assert torch.equal(cols_part.detach(), _part(whole.detach(), 3, sizes, rank))
        back = pencil_transpose(cols_part, 3, 2, comm, sizes=agreed)
        assert torch.equal(back.detach(), band.detach())
        (back * _part(weight, 2, counts, rank)).real.sum().backward()  # the adjoint of there-and-back: the identity
        assert torch.equal(band.grad, _part(whole.grad, 2, counts, rank))


@pytest.mark.mpi(min_size=2)
def test_an_integer_tensor_is_every_ranks_error(make_manager):
    manager = make_manager()
    x = torch.zeros(1, 2, 2, 3, dtype=torch.int64)
    kind, message = agreed_failure(lambda: pencil_transpose(x, 2, 3, manager.domain_group), manager.domain_group)
    assert kind == "TypeError" and "complex128" in message


@pytest.mark.mpi(min_size=2)
def test_the_traffic_is_what_describe_counts(make_manager):
    manager = make_manager()
    n, rank = manager.domain_parallel_size, manager.domain_rank
    rows, cols = 3 * n + 1, 2 * n + 1
    counts = split(rows, n, uneven=True)
    x = torch.randn(2, 3, counts[rank], cols, dtype=torch.complex128).requires_grad_()
    pencil_transpose(x, 2, 3, manager.domain_group)  # the plan remembered: the counted call repeats it
    received_elements(reset=True)
    with counting(manager) as comm:
        comm.phase = "forward"
        y = pencil_transpose(x, 2, 3, comm)
        comm.phase = "backward"
        y.real.sum().backward()
        comm.phase = None
    got = comm.counts
    sizes = column_sizes(cols, n)
    fwd, back = transpose_bytes((2, 3, rows, cols), 16, 2, 3, counts, sizes)[rank]
    assert got["forward"].forward_bytes == fwd and got["forward"].agreements == 1, got
    assert got["backward"].forward_bytes == back, got
    # what the forward received: every other rank's rows of this rank's columns
    assert received_elements() * 16 == (rows - counts[rank]) * sizes[rank] * 2 * 3 * 16
    total = manager.domain_group.allreduce(received_elements(reset=True))
    assert total * 16 == sum(f for f, _ in transpose_bytes((2, 3, rows, cols), 16, 2, 3, counts, sizes))
