"""Data parallel x domain parallel with torch's DDP: one SGD step equals single-process training.

The documented recipe (docs/torch_bridge.rst): DDP over
``manager.torch_data_parallel_group`` averages the band gradients over the
samples during ``backward()``; ``reduce_gradients(..., over="domain")`` then
sums the bands' shares over the domain group. Checked here against one
process training on all samples at once, for every layout of the world
(``dp x domain`` = 2 x 1 and 1 x 2 on 2 ranks, 2 x 2, 4 x 1 and 1 x 4 on 4
ranks, ...), with uneven bands (13 latitudes), together with the two other
ways: ``reduce_gradients`` alone, and DDP over the whole world with the loss
scaled by the domain size. DDP alone (the recipe the docs showed before) is
shown to be wrong whenever the domain size is above 1.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import reduce_gradients, shard_tensor

from .conftest import domain_sizes, reset_torch_distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402 (after the skips)

nn = torch.nn
F = torch.nn.functional
H, W = 13, 8  # 13 latitudes: uneven bands on 2, 3 and 4 ranks
LR = 0.1
TIMEOUT = timedelta(seconds=120)
RECIPES = ["ddp_dp_group+domain_sum", "reduce_gradients", "ddp_world_scaled_loss"]


@pytest.fixture(autouse=True)
def clean_torch():
    """No test may leave a torch default group behind."""
    yield
    reset_torch_distributed()


class Net(nn.Module):
    """conv3x3 -> tanh -> conv3x3; latitude across the pole ("earth"), longitude circular."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, dtype=torch.float64)
        self.conv2 = nn.Conv2d(3, 2, 3, dtype=torch.float64)
        self.manager = None  # None: the whole field is here

    def pad(self, x):
        if self.manager is None:
            from .halo_reference import pad_torch

            x = pad_torch(x, 1, "earth")
        else:
            x = credit_mpi.halo_exchange(x, 1, -2, self.manager, boundary="earth")
        return F.pad(x, (1, 1, 0, 0), mode="circular")

    def forward(self, x):
        return self.conv2(self.pad(torch.tanh(self.conv1(self.pad(x)))))


def _data(dp: int):
    rng = np.random.default_rng(5)
    samples = torch.from_numpy(rng.standard_normal((dp, 2, H, W)))
    targets = torch.from_numpy(rng.standard_normal((dp, 2, H, W)))
    return samples, targets


def _reference_step(model, samples, targets):
    """One SGD step of the mean-squared error over all samples, in one process."""
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss = ((net(samples) - targets) ** 2).mean()
    loss.backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _band_loss(out, target, manager):
    """This band's share of its sample's loss: the band's squared errors over the sample's point count."""
    rows = out.shape[-2]
    start = manager.domain_group.exscan(rows) or 0
    return ((out - target[..., start : start + rows, :]) ** 2).sum() / target.numel()


def _distributed_step(model, manager, samples, targets, recipe):
    """One SGD step on this rank's band of sample ``dp_rank``; returns the parameters after it."""
    net = copy.deepcopy(model)
    net.manager = manager
    i = manager.dp_rank
    x, target = samples[i : i + 1], targets[i : i + 1]
    if recipe == "ddp_dp_group+domain_sum" or recipe == "ddp_alone":
        wrapped = DDP(net, process_group=manager.torch_data_parallel_group)
    elif recipe == "ddp_world_scaled_loss":
        wrapped = DDP(net)  # the default group: the whole world
    else:
        wrapped = net
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss = _band_loss(wrapped(shard_tensor(x, -2, manager, uneven=True)), target, manager)
    if recipe == "ddp_world_scaled_loss":
        # DDP divides by the world size dp * domain; the bands must be summed, not averaged
        (loss * manager.domain_parallel_size).backward()
    else:
        loss.backward()
    if recipe == "ddp_dp_group+domain_sum":
        reduce_gradients(net.parameters(), manager, over="domain")
    elif recipe == "reduce_gradients":
        reduce_gradients(net.parameters(), manager)
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _check_domain_group_identical(params, manager):
    """Every rank of the domain group holds bit-identical parameters."""
    flat = torch.cat([p.reshape(-1) for p in params]).numpy()
    everyone = manager.domain_group.allgather(flat)
    for r, other in enumerate(everyone):
        assert np.array_equal(other, flat), f"domain rank {r} differs from domain rank {manager.domain_rank}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_step_equals_single_process(recipe, make_manager):
    world = MPI.COMM_WORLD.Get_size()
    for d in domain_sizes(world):
        manager = make_manager(d)
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
        torch.manual_seed(3)
        model = Net()
        samples, targets = _data(manager.data_parallel_size)
        expected = _reference_step(model, samples, targets)
        params = _distributed_step(model, manager, samples, targets, recipe)
        _check_domain_group_identical(params, manager)
        layout = f"{recipe}, layout {world // d} x {d}"
        for p, ref in zip(params, expected, strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-12, msg=lambda m, layout=layout: f"{layout}: {m}")
        manager.free()
        assert not dist.is_initialized()


@pytest.mark.mpi(min_size=2)
def test_ddp_alone_is_wrong_with_a_domain_group(make_manager):
    """What the docs used to show: DDP over the data-parallel group only. The bands' gradients differ."""
    world = MPI.COMM_WORLD.Get_size()
    for d in [k for k in domain_sizes(world) if k > 1]:
        manager = make_manager(d)
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
        torch.manual_seed(3)
        model = Net()
        samples, targets = _data(manager.data_parallel_size)
        expected = _reference_step(model, samples, targets)
        params = _distributed_step(model, manager, samples, targets, "ddp_alone")
        flat = torch.cat([p.reshape(-1) for p in params]).numpy()
        everyone = manager.domain_group.allgather(flat)
        assert any(not np.array_equal(everyone[0], other) for other in everyone[1:])
        ref = torch.cat([p.reshape(-1) for p in expected]).numpy()
        assert not np.allclose(flat, ref, rtol=1e-6, atol=1e-6)
        manager.free()


@pytest.mark.mpi(min_size=2)
def test_over_must_agree(make_manager):
    manager = make_manager()
    net = Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    over = "domain" if manager.rank == 1 else "all"
    with pytest.raises(ValueError, match="different over="):
        reduce_gradients(net.parameters(), manager, over=over)


@pytest.mark.mpi(min_size=2)
def test_bad_over_on_one_rank_raises_everywhere(make_manager):
    manager = make_manager()
    net = Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    over = "bands" if manager.rank == 0 else "all"
    with pytest.raises(ValueError, match="over must be one of"):
        reduce_gradients(net.parameters(), manager, over=over)


@pytest.mark.parametrize("over", ["domains", "", None, 1])
def test_bad_over_without_manager(over):
    net = Net()
    with pytest.raises(ValueError, match=r"over must be one of \['all', 'data_parallel', 'domain'\]"):
        reduce_gradients(net.parameters(), None, over=over)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("over", ["all", "domain", "data_parallel"])
def test_over_reduces_the_named_groups(over, make_manager):
    """Gradient = global rank + 1: each ``over`` gives the sum / mean it names, computed by hand."""
    world = MPI.COMM_WORLD
    for d in domain_sizes(world.Get_size()):
        manager = make_manager(d)
        weight = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        weight.grad = torch.full((3,), float(world.Get_rank() + 1), dtype=torch.float64)
        reduce_gradients([weight], manager, over=over)
        g, r = manager.dp_rank, manager.domain_rank  # global rank = g * d + r
        dp = manager.data_parallel_size
        if over == "all":
            expected = sum(gg * d + rr + 1 for gg in range(dp) for rr in range(d)) / dp
        elif over == "domain":
            expected = sum(g * d + rr + 1 for rr in range(d))
        else:
            expected = sum(gg * d + r + 1 for gg in range(dp)) / dp
        assert torch.equal(weight.grad, torch.full((3,), float(expected), dtype=torch.float64)), (over, d)
        manager.free()
