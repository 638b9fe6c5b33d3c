"""The one edge swap and the protocol's gather: ``transport="torch"`` on a 2-D domain grid, bit for bit MPI's.

Every grid that fits the world size (2x2 on 4 ranks, 2x3 and 3x2 on 6: the
grid runs of tools/run-tests), uneven blocks, the halo's boundaries (the
pole fold included) forward and backward, and the 2-D gather. gloo on CPU:
the code path of NCCL but the backend name.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, halo_exchange, shard_tensor

from .conftest import reset_torch_distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

TIMEOUT = timedelta(seconds=60)
BOUNDARIES = [("zero", "periodic"), ("earth", "periodic"), ("reflect", "reflect"), ("periodic", "zero")]


@pytest.fixture(autouse=True)
def clean_torch():
    yield
    reset_torch_distributed()


def _grids(n: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(1, n + 1) if n % r == 0]  # (n, 1): a rank is its own east and west


def _bits(x) -> bytes:
    return (x.detach().contiguous().view(torch.uint8).numpy() if torch.is_tensor(x) else x.view(np.uint8)).tobytes()


@pytest.mark.mpi(min_size=2)
def test_torch_transport_on_a_grid_is_bit_identical(make_manager):
    n = MPI.COMM_WORLD.Get_size()
    rng = np.random.default_rng(7)
    full = rng.standard_normal((2, 3, 2 * n + 1, 4 * n + 2))  # uneven in both dims
    for grid in _grids(n):
        manager = credit_mpi.init_torch_distributed(make_manager(n, domain_grid=grid), "gloo", timeout=TIMEOUT)
        for kind in ("numpy", "torch"):
            g = full if kind == "numpy" else torch.from_numpy(full)
            block = shard_tensor(g, (-2, -1), manager, uneven=True)
            via = {t: gather_tensor(block, (-2, -1), manager, transport=t) for t in ("mpi", "torch")}
            assert _bits(via["mpi"]) == _bits(g), (grid, kind, "mpi")
            assert _bits(via["torch"]) == _bits(g), (grid, kind, "torch")
            for boundary in BOUNDARIES:
                via = {t: halo_exchange(block, (1, 2), (-2, -1), manager, boundary=boundary, transport=t)
                       for t in ("mpi", "torch")}
                assert type(via["torch"]) is type(via["mpi"]), (grid, kind, boundary)
                assert _bits(via["torch"]) == _bits(via["mpi"]), (grid, kind, boundary)
        manager.free()
        reset_torch_distributed()


@pytest.mark.mpi(min_size=2)
def test_torch_transport_on_a_grid_backward(make_manager):
    """The adjoint (halo gradients go home, pole pieces back across the pole) over torch equals MPI's."""
    n = MPI.COMM_WORLD.Get_size()
    rng = np.random.default_rng(8)
    full = torch.from_numpy(rng.standard_normal((1, 2, 2 * n + 1, 4 * n)))
    for grid in _grids(n):
        manager = credit_mpi.init_torch_distributed(make_manager(n, domain_grid=grid), "gloo", timeout=TIMEOUT)
        block = shard_tensor(full, (-2, -1), manager, uneven=True)
        grads = {}
        for t in ("mpi", "torch"):
            x = block.clone().requires_grad_(True)
            y = halo_exchange(x, (1, 1), (-2, -1), manager, boundary=("earth", "periodic"), transport=t)
            (y * y).sum().backward()
            grads[t] = x.grad
            g = gather_tensor(x, (-2, -1), manager, transport=t)  # the differentiable gather, too
            g.sum().backward()
        assert _bits(grads["torch"]) == _bits(grads["mpi"]), grid
        manager.free()
        reset_torch_distributed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("shape", [(1, 5), (2, 3, 5, 4), (2, 5, 8192)])  # one slice, small slices, large slices
def test_the_protocol_gather_on_both_transports(make_manager, uneven, shape):
    """:func:`~credit_mpi.transport.moves.gather_blocks` over MpiMoves and TorchMoves: the gather's result, bit for bit."""
    from credit_mpi.layout import Layout
    from credit_mpi.transport import moves, torch_moves

    n = MPI.COMM_WORLD.Get_size()
    rows = shape[-2] * n + (n - 1 if uneven else 0)
    full = np.random.default_rng(3).standard_normal(shape[:-2] + (rows, shape[-1]))
    manager = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    band = shard_tensor(full, -2, manager, uneven=uneven)
    sizes = [len(part) for part in np.array_split(np.arange(rows), n)]
    for transfer in (moves.MpiMoves(manager.domain_group), torch_moves.TorchMoves(manager.torch_group("domain"))):
        out = np.empty_like(full)
        moves.gather_blocks(transfer, band, out, Layout.bands(sizes), (full.ndim - 2,))
        assert out.tobytes() == full.tobytes(), type(transfer).__name__
