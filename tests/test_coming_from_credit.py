"""What CREDIT users call that credit_mpi provides under CREDIT's names (docs/coming_from_credit.rst)."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import credit_mpi

torch = pytest.importorskip("torch")

from credit_mpi import nn as cnn  # noqa: E402


@pytest.mark.parametrize(("before", "after", "dim"), [(1, 1, -2), (2, 0, -2), (0, 3, 2), (0, 0, -1), (4, 4, 0)])
def test_trim_is_narrow_as_in_credit(before, after, dim):
    x = torch.arange(2 * 3 * 9 * 8.0).reshape(2, 3, 9, 8) if dim != 0 else torch.arange(9 * 2.0).reshape(9, 2)
    axis = dim % x.ndim
    expected = x.narrow(axis, before, x.shape[axis] - before - after)
    got = cnn.HaloExchange.trim(x, before, after, dim)
    assert torch.equal(got, expected) and got.data_ptr() == expected.data_ptr()  # a view
    assert (cnn.HaloExchange.trim(x.numpy(), before, after, dim) == expected.numpy()).all()


@pytest.mark.parametrize(("before", "after"), [(-1, 0), (5, 5), (1.5, 0)])
def test_trim_refuses_what_it_cannot_cut(before, after):
    with pytest.raises(ValueError, match="halo_before|halo_after"):
        cnn.HaloExchange.trim(torch.zeros(1, 9), before, after, -1)


def _model():
    return torch.nn.Sequential(torch.nn.Conv2d(2, 2, 5, padding=2), torch.nn.ReLU(), torch.nn.Conv2d(2, 2, 3, padding=1))


@pytest.mark.parametrize(("height", "domain_size"), [(32, 4), (721, 4), (9, 8), (5, 4)])
def test_validate_sharding_constraints_is_describes_verdict(height, domain_size):
    shape = (1, 2, height, 16)
    problems = cnn.validate_sharding_constraints(_model(), input_shape=shape, domain_size=domain_size)
    plan = cnn.describe(_model(), shape, domain_size)
    assert (problems == []) == plan.exact
    assert len(problems) == sum(not r.exact for r in plan.rows)


def test_validate_sharding_constraints_checks_windows_as_credit():
    shape = (1, 2, 32, 16)  # bands of 8 rows on 4 ranks: 8, then 4 at the second level
    assert cnn.validate_sharding_constraints(_model(), 8, [4, 4], input_shape=shape, domain_size=4) == []
    (problem,) = cnn.validate_sharding_constraints(_model(), 8, [4, 8], input_shape=shape, domain_size=4)
    assert problem.startswith("Level 1: local H=4 not divisible by window_size=8")
    with pytest.raises(ValueError, match="local_h=7 is not a band height.*\\[8\\]"):
        cnn.validate_sharding_constraints(_model(), 7, None, input_shape=shape, domain_size=4)


def test_validate_sharding_constraints_reports_a_module_without_a_rule():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return x.rot90(1, (-2, -1))

    problems = cnn.validate_sharding_constraints(torch.nn.Sequential(Odd()), input_shape=(1, 1, 8, 8), domain_size=2)
    # judged by what its forward does (credit_mpi.nn.judge): the op and the module's path named
    assert len(problems) == 1 and "0 (Odd)" in problems[0] and "rot90()" in problems[0], problems


def test_halo_with_no_manager_pads_as_the_documented_difference():
    """credit_mpi pads on one rank (CREDIT's HaloExchange returns x): a padding-0 conv keeps the height."""
    credit_mpi.destroy_domain_parallel()
    x = torch.ones(1, 1, 6, 4)
    padded = cnn.HaloExchange(2)(x)
    assert padded.shape[-2] == 10 and padded[..., :2, :].abs().sum() == 0


def test_one_process_asking_for_a_domain_names_the_launcher():
    with pytest.raises(ValueError, match=r"single MPI rank: started without a launcher\? Start it with `.*mpiexec -n 2"):
        credit_mpi.DomainParallelManager(None, 2, comm=MPI.COMM_SELF)
