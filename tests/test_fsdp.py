"""FSDP2 (``fully_shard``) over the data-parallel group x domain parallel: AdamW steps equal one process.

The recipe (docs/torch_bridge.rst): ``fully_shard`` each block and the root
of a converted model over ``manager.device_mesh["dp"]``; FSDP2's
reduce-scatter averages the band gradients over the samples, and an
all-reduce hook (``FSDPModule.set_all_reduce_hook``) sums the reduced shard
over ``manager.torch_domain_group`` (every rank of a domain group holds the
same shard). Checked on every layout of the world (``dp x domain`` = 1x1;
2x1, 1x2; 3x1, 1x3; 4x1, 2x2, 1x4) with uneven bands (13 latitudes) and
uneven shards (5 channels): three AdamW steps equal one process training on
all samples (float64, 1e-12), every rank of a domain group holds the same
shard, and a checkpoint (``save_checkpoint``, full tensors) of the sharded
model loads into the plain model and back into a sharded one.
The bytes that FSDP2 and the domain sum move per step are counted.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

from .conftest import domain_sizes, reset_torch_distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402 (after the skips)

from credit_mpi.nn import load_checkpoint, save_checkpoint  # noqa: E402

H, W = 13, 8
STEPS = 3
TIMEOUT = timedelta(seconds=120)


@pytest.fixture(autouse=True)
def clean_torch():
    """No test may leave a torch default group behind."""
    yield
    reset_torch_distributed()


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 5, 3, padding=1),
        torch.nn.GroupNorm(1, 5),
        torch.nn.SiLU(),
        torch.nn.Conv2d(5, 2, 3, padding=1),
    ).double()


def shard(model: torch.nn.Module, manager) -> torch.nn.Module:
    """The recipe: fully_shard the blocks and the root over the dp mesh dim, the domain sum in the all-reduce hook."""
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=manager.device_mesh["dp"])
    fully_shard(model, mesh=manager.device_mesh["dp"])

    def domain_sum(reduced: torch.Tensor) -> None:  # this rank's reduce-scattered shard, before the optimizer
        dist.all_reduce(reduced, group=manager.torch_domain_group)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(domain_sum)
    return model


def data(dp: int):
    g = np.random.default_rng(4)
    return torch.from_numpy(g.standard_normal((dp, 2, H, W))), torch.from_numpy(g.standard_normal((dp, 2, H, W)))


def reference(x, y) -> list[torch.Tensor]:
    """STEPS AdamW steps of the mean over the samples of each sample's mean-squared error, in one process."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def train(model, manager, x, y, steps: int = STEPS, opt=None):
    i = manager.dp_rank
    band = credit_mpi.shard_tensor(x[i : i + 1], -2, manager, uneven=True)
    target = credit_mpi.shard_tensor(y[i : i + 1], -2, manager, uneven=True)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        share = ((model(band) - target) ** 2).sum() / (H * W * 2)  # this band's share of its sample's loss
        share.backward()  # FSDP2: reduce-scatter (mean over the samples), then the hook (sum over the bands)
        opt.step()
    return opt


def check_shards(model, manager) -> None:
    """Every rank of a domain group holds the same shard of every parameter."""
    flat = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).numpy()
    for r, other in enumerate(manager.domain_group.allgather(flat)):
        assert np.array_equal(other, flat), f"domain rank {r} holds another shard than domain rank {manager.domain_rank}"


@pytest.mark.mpi(min_size=1)
def test_fsdp_steps_equal_one_process_on_every_layout(make_manager):
    world = MPI.COMM_WORLD.Get_size()
    for d in domain_sizes(world):
        manager = make_manager(d)
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
        x, y = data(manager.data_parallel_size)
        expected = reference(x, y)
        model = shard(credit_mpi.convert_to_domain_parallel(net(), manager), manager)
        train(model, manager, x, y)
        check_shards(model, manager)
        layout = f"layout {world // d} x {d}"
        for p, ref in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-12, atol=1e-12, msg=lambda m, layout=layout: f"{layout}: {m}")
        manager.free()
        assert not dist.is_initialized()



@pytest.mark.mpi(min_size=2)
def test_fsdp_checkpoint_loads_both_ways_and_resumes(make_manager, shared_dir):
    """Save the sharded model + optimizer (full tensors), load into a plain model and into a fresh sharded one."""
    world = MPI.COMM_WORLD.Get_size()
    manager = make_manager(2 if world % 2 == 0 else 1)
    credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
    x, y = data(manager.data_parallel_size)
    path = os.path.join(shared_dir, "fsdp.pt")

    straight = shard(credit_mpi.convert_to_domain_parallel(net(), manager), manager)
    train(straight, manager, x, y, steps=STEPS)

    first = shard(credit_mpi.convert_to_domain_parallel(net(), manager), manager)
    opt = train(first, manager, x, y, steps=1)
    save_checkpoint(path, first, manager, optimizer=opt, step=1)

    saved = torch.load(path, weights_only=True)  # full tensors, the plain model's keys, int optimizer ids
    plain = net()
    plain.load_state_dict(saved["model_state_dict"])
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain_opt.load_state_dict(saved["optimizer_state_dict"])
    for i, (p, q) in enumerate(zip(plain.parameters(), first.parameters(), strict=True)):
        assert torch.equal(p.detach(), q.full_tensor().detach())
        exp_avg = opt.state[q]["exp_avg"].full_tensor()  # the optimizer ids follow the parameters' order
        assert torch.equal(plain_opt.state_dict()["state"][i]["exp_avg"], exp_avg)

    torch.manual_seed(9)
    resumed = shard(credit_mpi.convert_to_domain_parallel(net(), manager), manager)
    with torch.no_grad():
        for p in resumed.parameters():  # other weights: the checkpoint must overwrite them
            p.to_local().normal_()
    ropt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    assert load_checkpoint(path, resumed, manager, optimizer=ropt)["step"] == 1
    train(resumed, manager, x, y, steps=STEPS - 1, opt=ropt)
    check_shards(resumed, manager)
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


class Traffic:
    """Counts the payload bytes of FSDP2's collectives and the domain sum (patched torch.distributed functions)."""

    def __init__(self, monkeypatch):
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        real = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

        def all_gather_single(output, input, *args, **kwargs):  # received: every other rank's shard
            self.bytes["all_gather"] += (output.numel() - input.numel()) * output.element_size()
            return real["all_gather_single"](output, input, *args, **kwargs)

        def reduce_scatter_single(output, input, *args, **kwargs):  # sent: every other rank's part
            self.bytes["reduce_scatter"] += (input.numel() - output.numel()) * input.element_size()
            return real["reduce_scatter_single"](output, input, *args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):  # the buffer reduced (a ring sends 2 (k-1)/k of it)
            self.bytes["all_reduce"] += tensor.numel() * tensor.element_size()
            return real["all_reduce"](tensor, *args, **kwargs)

        for name, fn in (("all_gather_single", all_gather_single), ("reduce_scatter_single", reduce_scatter_single),
                         ("all_reduce", all_reduce)):
            monkeypatch.setattr(dist, name, fn)


@pytest.mark.mpi(min_size=4)
def test_fsdp_bytes_per_step(make_manager, monkeypatch, capsys):
    """On 2 bands x 2 samples: what one step moves per rank, against the parameter bytes P.

    FSDP2 gathers every parameter twice (forward, and again in backward:
    the blocks reshard after forward) and reduce-scatters the gradients: each
    about (dp - 1)/dp x P; the domain sum all-reduces this rank's shard, P/dp.
    """
    if MPI.COMM_WORLD.Get_size() != 4:
        pytest.skip("measured on 2 x 2")
    manager = make_manager(2)
    credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
    x, y = data(manager.data_parallel_size)
    model = shard(credit_mpi.convert_to_domain_parallel(net(), manager), manager)
    train(model, manager, x, y, steps=1)  # warm: lazy init out of the way
    params = sum(p.numel() * p.element_size() for p in net().parameters())
    traffic = Traffic(monkeypatch)
    train(model, manager, x, y, steps=1)
    monkeypatch.undo()
    got = traffic.bytes
    dp = manager.data_parallel_size
    assert params * (dp - 1) / dp <= got["reduce_scatter"] <= params  # padded shards: a little more than exact
    assert params / dp <= got["all_reduce"] <= params
    assert got["all_gather"] >= params * (dp - 1) / dp
    if MPI.COMM_WORLD.Get_rank() == 0:
        with capsys.disabled():
            print(f"\nFSDP2 x domain, 2 x 2, P = {params} B of parameters: per rank and step {got}")
