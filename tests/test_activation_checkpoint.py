"""torch.utils.checkpoint around converted blocks: exact against one process, reentrant and not.

A recomputed forward repeats every collective of the block (halo exchanges,
the agreements, the allgather of the norm statistics) during the backward
pass. Every rank runs the same graph, so torch's autograd engine recomputes
the blocks in the same order on every rank and the collectives pair up.
Checked on every domain size of the world (1-4 ranks, uneven bands of 13
latitudes) and on a 2 x 2 latitude x longitude grid (4 ranks): the output, the input gradient and the parameter gradients
after ``reduce_gradients`` equal one process running the same checkpointed
model (float64, 1e-12), and the BatchNorm running statistics too (a
recomputed forward updates them a second time, as torch's own BatchNorm
does under checkpointing: the one-process model with the same
checkpointing is the reference).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

from .conftest import domain_sizes

torch = pytest.importorskip("torch")
from torch.utils.checkpoint import checkpoint  # noqa: E402

nn = torch.nn
H, W = 13, 8
SAMPLES = 12  # split evenly over 1, 2, 3 or 4 data-parallel groups


class Checkpointed(nn.Module):
    """Three blocks, each run under ``torch.utils.checkpoint`` (or not: ``reentrant=None``)."""

    def __init__(self, reentrant: bool | None, batchnorm: bool = False):
        super().__init__()
        norm = nn.BatchNorm2d(4) if batchnorm else nn.GroupNorm(2, 4)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), norm, nn.SiLU()),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.LayerNorm([H, W]), nn.Tanh()),
            nn.Sequential(nn.Conv2d(4, 4, 3, stride=1, padding=2, dilation=2), nn.GELU(), nn.Conv2d(4, 2, 1)),
        ])
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def run(model, x, manager=None):
    """Output, input gradient and parameter gradients of the sum of squares of the output (a share of it on bands)."""
    x = x.clone().requires_grad_(True)  # reentrant checkpointing needs an input that requires grad
    out = model(x)
    (out**2).sum().backward()
    if manager is not None:
        credit_mpi.reduce_gradients(model.parameters(), manager)
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_checkpointed_blocks_equal_one_process(reentrant, batchnorm, make_manager):
    world = MPI.COMM_WORLD.Get_size()
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((SAMPLES, 2, H, W)))
    torch.manual_seed(0)
    ref = Checkpointed(reentrant, batchnorm).double()
    plain = copy.deepcopy(ref)
    plain.reentrant = None
    model = copy.deepcopy(ref)
    out_ref, gx_ref, g_ref = run(ref, x)
    if not batchnorm:  # checkpointing changes nothing on one process
        out_plain, _, g_plain = run(plain, x)
        assert torch.equal(out_plain, out_ref) and all(torch.equal(a, b) for a, b in zip(g_plain, g_ref, strict=True))
    layouts = [(d, None) for d in domain_sizes(world)] + ([(4, (2, 2))] if world == 4 else [])
    for d, grid in layouts:  # latitude bands, and a 2 x 2 latitude x longitude grid on 4 ranks
        manager = make_manager(d, domain_grid=grid)
        net = credit_mpi.convert_to_domain_parallel(copy.deepcopy(model), manager)
        dp, n = manager.data_parallel_size, SAMPLES // manager.data_parallel_size
        mine = slice(manager.dp_rank * n, (manager.dp_rank + 1) * n)
        dims = -2 if grid is None else (-2, -1)
        out, gx, grads = run(net, credit_mpi.shard_tensor(x[mine], dims, manager, uneven=True), manager)
        layout = f"{world // d} x {d}, grid {grid}, reentrant={reentrant}, batchnorm={batchnorm}"
        close(credit_mpi.gather_tensor(out, dims, manager), out_ref[mine], layout)
        close(gx, credit_mpi.shard_tensor(gx_ref[mine], dims, manager, uneven=True), layout)
        for g, r in zip(grads, g_ref, strict=True):
            close(g * dp, r, layout)  # the one-process loss sums all samples, reduce_gradients averages the groups
        if batchnorm:
            bn, bn_ref = net.blocks[0][1], ref.blocks[0][1]
            close(bn.running_mean, bn_ref.running_mean, layout)
            close(bn.running_var, bn_ref.running_var, layout)
            assert int(bn.num_batches_tracked) == int(bn_ref.num_batches_tracked)
        manager.free()


def close(a, b, layout: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{layout}: {m}")
