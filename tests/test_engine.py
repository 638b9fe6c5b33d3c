"""The engine (credit_mpi.engine): one op run through ``run``: agreement, autograd routing, kernel, adjoint.

``allgather_along`` is the engine's first op: exact against ``torch.cat`` of every rank's part
(even and uneven), its gradient (and double backward) exact, a rank whose call differs (a shape,
the autograd state) makes every rank raise, an unknown operation name is refused.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from credit_mpi.engine import Op, run  # noqa: E402
from credit_mpi.ops.allgather_along import allgather_along  # noqa: E402
from credit_mpi.validation import DomainParallelError, Local  # noqa: E402


def parts(n, uneven, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [3 + (r % 2 if uneven else 0) for r in range(n)]
    return [torch.randn(2, r, 5, dtype=torch.float64, generator=g) for r in rows]


@pytest.mark.mpi
@pytest.mark.parametrize("uneven", [False, True])
def test_allgather_along_is_cat_and_its_gradient_is_exact(world, uneven):
    rank, n = world.Get_rank(), world.Get_size()
    ps = parts(n, uneven)
    whole = torch.cat(ps, dim=1).requires_grad_()
    weight = torch.randn(whole.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = ps[rank].clone().requires_grad_()
    out = allgather_along(mine, 1, world)
    assert torch.equal(out, whole.detach())
    # Every rank computes the same loss of the gathered tensor (the loss of one process), so the
    # sum over ranks of the gradients of their parts is the gradient of the whole.
    (out * weight).sum().backward()
    (whole * weight).sum().backward()
    start = sum(p.shape[1] for p in ps[:rank])
    assert torch.allclose(mine.grad, n * whole.grad[:, start : start + ps[rank].shape[1]], rtol=0, atol=1e-12)


@pytest.mark.mpi
def test_double_backward_through_the_engine(world):
    n = world.Get_size()
    x = parts(n, True)[world.Get_rank()].clone().requires_grad_()
    y = allgather_along(x, 1, world)
    (g,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert torch.allclose(gg, n * 6 * x.detach(), rtol=0, atol=1e-12)  # d/dx sum_r 3 x^2 = n 6 x


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_records_autograd_alone_makes_every_rank_raise(world):
    x = parts(world.Get_size(), False)[world.Get_rank()].clone().requires_grad_(world.Get_rank() == 1)
    with pytest.raises(DomainParallelError, match="autograd"):
        allgather_along(x, 1, world)
    assert allgather_along(x.detach(), 1, world).shape[1] == 3 * world.Get_size()  # still in step


@pytest.mark.mpi(min_size=2)
def test_a_bad_dim_on_one_rank_is_every_rank_s_error(world):
    x = parts(world.Get_size(), False)[world.Get_rank()]
    with pytest.raises(ValueError, match="dim"):
        allgather_along(x, 7 if world.Get_rank() == 1 else 1, world)


def test_an_op_without_a_registered_name_is_refused(self_comm):
    class Nameless(Op):
        def local(self, x, args):
            return Local(None, ())

    with pytest.raises(ValueError, match="unknown operation"):
        run(Nameless(), torch.zeros(1), self_comm)
