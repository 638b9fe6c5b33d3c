"""The proof that it trains: a conv net on a sharded global field matches the single-process model.

3x3 and 5x5 convolutions with periodic longitude padding and a halo along
latitude; the global field is sharded over every domain size from 1 to the
world size (sub-communicators of the first d ranks), with uneven bands. The
output, the input gradient and every parameter gradient must match the
single-process model in float64.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, reduce_gradients, shard_tensor

from .halo_reference import pad_torch, prefix_managers

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

H, W = 13, 8  # 13 latitudes: uneven on 2, 3 and 4 ranks (7/6, 5/4/4, 4/3/3/3)


class Net(nn.Module):
    """conv3x3 -> tanh -> conv5x5; latitude padding by ``lat_pad``, longitude circular."""

    def __init__(self, boundary: str) -> None:
        super().__init__()
        self.boundary = boundary
        self.conv1 = nn.Conv2d(2, 4, 3, dtype=torch.float64)
        self.conv2 = nn.Conv2d(4, 2, 5, dtype=torch.float64)
        self.manager = None  # None: the whole field is here (the single-process model)

    def lat_pad(self, x, width):
        if self.manager is None:
            return pad_torch(x, width, self.boundary)
        return credit_mpi.halo_exchange(x, width, -2, self.manager, boundary=self.boundary)

    def forward(self, x):
        x = F.pad(self.lat_pad(x, 1), (1, 1, 0, 0), mode="circular")
        x = torch.tanh(self.conv1(x))
        x = F.pad(self.lat_pad(x, 2), (2, 2, 0, 0), mode="circular")
        return self.conv2(x)


def _reference(net, samples, targets):
    """Output and gradients of the mean-squared-error over the samples, in one process."""
    net = copy.deepcopy(net)
    x = samples.clone().requires_grad_()
    out = net(x)
    loss = ((out - targets) ** 2).mean()
    loss.backward()
    return out.detach(), x.grad, [p.grad for p in net.parameters()]


def _distributed(net, manager, x, target, *, gathered_loss):
    """One sample's forward/backward on the domain group; the loss is this band's share."""
    x = x.clone().requires_grad_()
    local = shard_tensor(x, -2, manager, uneven=True)
    out = net(local)
    if gathered_loss:  # every rank computes the same loss from the gathered output
        full = gather_tensor(out, -2, manager)
        loss = ((full - target) ** 2).mean()  # its gradient is replicated: gather backward slices it
    else:  # each rank's band, normalised by the global count
        rows = out.shape[-2]
        start = manager.domain_group.exscan(rows) or 0
        loss = ((out - target[..., start : start + rows, :]) ** 2).sum() / target.numel()
    loss.backward()
    # shard_tensor is a slice: x.grad holds this band's rows (halo gradients
    # already sent home); summed over the domain group it is the whole gradient.
    xgrad = x.grad.numpy().copy()
    if manager.domain_parallel_size > 1:
        manager.domain_group.Allreduce(MPI.IN_PLACE, xgrad)
    return gather_tensor(out.detach(), -2, manager), torch.from_numpy(xgrad)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("boundary", ["zero", "periodic", "reflect", "earth"])
@pytest.mark.parametrize("gathered_loss", [False, True])
def test_conv_net_matches_single_process(boundary, gathered_loss, make_manager):
    torch.manual_seed(0)
    model = Net(boundary)
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((2, 2, H, W)))
    target = torch.from_numpy(rng.standard_normal((2, 2, H, W)))
    ref_out, ref_xgrad, ref_grads = _reference(model, x, target)
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            net = copy.deepcopy(model)
            net.manager = manager
            out, xgrad = _distributed(net, net.manager, x, target, gathered_loss=gathered_loss)
            reduce_gradients(net.parameters(), net.manager)
            torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(xgrad, ref_xgrad, rtol=1e-12, atol=1e-12)
            for (name, p), ref in zip(net.named_parameters(), ref_grads, strict=True):
                torch.testing.assert_close(p.grad, ref, rtol=1e-12, atol=1e-12, msg=f"{name} on {d} ranks")


@pytest.mark.mpi(min_size=2)
def test_domain_and_data_parallel_gradients(make_manager):
    """Domain x data parallel: sum over bands, mean over samples, equals the batch-mean gradient."""
    world = make_manager().comm.Get_size()
    for d in [k for k in range(1, world + 1) if world % k == 0 and world // k > 1]:
        manager = make_manager(d)
        dp = manager.data_parallel_size
        torch.manual_seed(1)
        model = Net("earth")
        rng = np.random.default_rng(11)
        samples = torch.from_numpy(rng.standard_normal((dp, 2, H, W)))
        targets = torch.from_numpy(rng.standard_normal((dp, 2, H, W)))
        _, _, ref_grads = _reference(model, samples, targets)  # mean over the dp samples
        net = copy.deepcopy(model)
        net.manager = manager
        i = manager.dp_rank
        _distributed(net, manager, samples[i : i + 1], targets[i : i + 1], gathered_loss=False)
        reduce_gradients(net.parameters(), manager)
        for p, ref in zip(net.parameters(), ref_grads, strict=True):
            torch.testing.assert_close(p.grad, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_reduce_gradients_disagreement_raises_everywhere(make_manager):
    manager = make_manager()
    net = Net("zero")
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    if manager.rank == 1:
        net.conv2.bias.grad = None
    with pytest.raises(ValueError, match="different parameters"):
        reduce_gradients(net.parameters(), manager)


def test_reduce_gradients_without_manager_is_a_no_op():
    net = Net("zero")
    for p in net.parameters():
        p.grad = torch.full_like(p, 2.0)
    reduce_gradients(net.parameters(), None)
    assert all(bool((p.grad == 2).all()) for p in net.parameters())
