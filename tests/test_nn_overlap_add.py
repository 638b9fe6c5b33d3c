"""The transposed convolutions' overlap-add, an op of the engine (the halo exchange's adjoint): twice differentiable.

A converted ``ConvTranspose2d`` on bands adds the outer rows of each band's
output to its neighbours' (credit_mpi.nn._comm.overlap_add, on 1-D bands and
on a 2-D grid); its backward is the halo exchange, and the engine records
that too, so a second backward (a gradient penalty, a Hessian-vector
product) runs and equals the single-process one, band for band.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402

from .ops.conformance import grid_for  # noqa: E402


def _second_order(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = d sum(model(x) ** 2) / dx`` (with its graph) and ``d sum(g) / dx``."""
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    return g.detach(), h


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("form", ["bands", "blocks"])
def test_double_backward_of_the_overlap_add_equals_one_process(make_manager, form):
    n = MPI.COMM_WORLD.Get_size()
    manager = make_manager(n, domain_grid=grid_for(n)) if form == "blocks" else make_manager(n)
    torch.manual_seed(3)
    tconv = nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1).double()
    rows, cols = manager.domain_grid if form == "blocks" else (n, 1)
    x = torch.randn(1, 2, 3 * rows + 1, 4 * cols + 1, dtype=torch.float64)  # uneven bands / blocks
    dims = (-2, -1) if form == "blocks" else -2
    band = credit_mpi.shard_tensor(x, dims, manager, uneven=True)
    g, h = _second_order(convert_to_domain_parallel(tconv, manager), band)
    g_ref, h_ref = _second_order(tconv, x)
    torch.testing.assert_close(g, credit_mpi.shard_tensor(g_ref, dims, manager, uneven=True), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, credit_mpi.shard_tensor(h_ref, dims, manager, uneven=True), rtol=1e-12, atol=1e-12)
