"""credit_mpi.nn.save_checkpoint / load_checkpoint: one atomic file, the plain model's keys, exact resume.

MPI tests (1-4 ranks; 2 bands x 2 data-parallel groups on 4): training k
steps, saving, loading into a fresh model, optimizer and scheduler (other
initial weights, scrambled RNGs) and training on equals the uninterrupted
run bit for bit (``torch.equal``), with per-rank noise drawn from the torch,
numpy and Python RNGs so that their restored states matter. A write that
fails half way on the writing rank is an exception on every rank and leaves
the previous checkpoint whole; a file with another world size, a missing
file, or ranks that disagree on the step raise on every rank. A process
killed in the middle of a save (serial) leaves the previous checkpoint; the
next save removes the killed one's temporary file.
"""

from __future__ import annotations

import glob
import io
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import DomainParallelError

from .conftest import child_env

torch = pytest.importorskip("torch")
from credit_mpi.nn import checkpoint as ckpt_module  # noqa: E402
from credit_mpi.nn import load_checkpoint, save_checkpoint  # noqa: E402

H, W = 11, 8  # uneven bands on 2, 3 and 4 ranks



def layout(world: int) -> int:
    """The domain size: every rank on bands, but 2 bands x 2 data-parallel groups on 4 ranks."""
    return 2 if world == 4 else world


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.GroupNorm(2, 4),
        torch.nn.SiLU(),
        torch.nn.Conv2d(4, 2, 3, padding=1),
    ).double()


class Job:
    """A converted model, AdamW, a step scheduler and this rank's band of its replica's sample."""

    def __init__(self, manager, seed: int = 0):
        self.manager = manager
        self.model = credit_mpi.convert_to_domain_parallel(net(seed), manager)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        g = np.random.default_rng(7)
        x = torch.from_numpy(g.standard_normal((manager.data_parallel_size, 2, H, W)))
        i = manager.dp_rank
        self.x = credit_mpi.shard_tensor(x[i : i + 1], -2, manager, uneven=True)
        self.y = torch.roll(self.x, 1, dims=-1)

    def steps(self, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            # per-rank noise from all three RNGs: a resume that lost any of them would differ
            noise = torch.randn(self.x.shape, dtype=torch.float64) * 1e-2
            noise = noise + float(np.random.standard_normal()) * 1e-3 + random.random() * 1e-3
            self.opt.zero_grad()
            loss = ((self.model(self.x + noise) - self.y) ** 2).sum() / (H * W * 2)
            loss.backward()
            credit_mpi.reduce_gradients(self.model.parameters(), self.manager)
            self.opt.step()
            self.sched.step()
            losses.append(float(loss.detach()))
        return losses


def seed_everything(rank: int) -> None:
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
def test_resume_equals_the_uninterrupted_run(make_manager, shared_dir):
    world = MPI.COMM_WORLD
    manager = make_manager(layout(world.Get_size()))
    path = os.path.join(shared_dir, "ckpt.pt")

    seed_everything(world.Get_rank())
    straight = Job(manager)
    expected = straight.steps(5)

    seed_everything(world.Get_rank())
    first = Job(manager)
    before = first.steps(3)
    sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=1, rank=0)
    sampler.set_epoch(2)
    save_checkpoint(
        path, first.model, manager, optimizer=first.opt, scheduler=first.sched, sampler=sampler, step=3, extra={"note": "k=3"}
    )
    assert glob.glob(os.path.join(shared_dir, ".*tmp*")) == []  # no temporary file left behind

    seed_everything(1000 + world.Get_rank())  # scrambled RNGs and other initial weights: the checkpoint restores them
    resumed = Job(manager, seed=5)
    fresh_sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=1, rank=0)
    info = load_checkpoint(path, resumed.model, manager, optimizer=resumed.opt, scheduler=resumed.sched, sampler=fresh_sampler)
    assert info["step"] == 3 and info["extra"] == {"note": "k=3"} and info["epoch"] == 2
    assert fresh_sampler.epoch == 2 and list(fresh_sampler) == list(sampler)
    after = resumed.steps(2)

    assert before + after == expected
    for p, q in zip(params(resumed.model), params(straight.model), strict=True):
        assert torch.equal(p, q)
    assert resumed.sched.state_dict() == straight.sched.state_dict()


@pytest.mark.mpi(min_size=1)
def test_the_file_has_the_plain_models_keys_and_credits_layout(make_manager, shared_dir):
    world = MPI.COMM_WORLD
    manager = make_manager(layout(world.Get_size()))
    path = os.path.join(shared_dir, "ckpt.pt")
    job = Job(manager)
    job.steps(1)
    save_checkpoint(path, job.model, manager, optimizer=job.opt, step=1)
    saved = torch.load(path, weights_only=True)
    plain = net(9)
    assert list(saved["model_state_dict"]) == list(plain.state_dict())
    plain.load_state_dict(saved["model_state_dict"])  # the unconverted model loads it
    for p, q in zip(plain.parameters(), job.model.parameters(), strict=True):
        assert torch.equal(p, q.detach())
    assert {"optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict", "epoch"} <= set(saved)
    world.Barrier()
    # a CREDIT-style file (model and optimizer only, an old torch format) loads into the converted model
    credit = os.path.join(shared_dir, "credit.pt")
    if world.Get_rank() == 0:
        state = {"epoch": 4, "model_state_dict": plain.state_dict(), "optimizer_state_dict": job.opt.state_dict()}
        torch.save(state, credit, _use_new_zipfile_serialization=False)  # torch's legacy format: not mappable
    world.Barrier()
    other = Job(manager, seed=3)
    info = load_checkpoint(credit, other.model, manager, optimizer=other.opt)
    assert info["step"] == 0 and info["epoch"] == 4
    for p, q in zip(other.model.parameters(), job.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.mpi(min_size=1)
def test_a_failure_mid_save_is_every_ranks_and_keeps_the_previous_file(make_manager, shared_dir, monkeypatch):
    world = MPI.COMM_WORLD
    manager = make_manager(layout(world.Get_size()))
    path = os.path.join(shared_dir, "ckpt.pt")
    job = Job(manager)
    save_checkpoint(path, job.model, manager, optimizer=job.opt, step=0)
    good = params(job.model)
    job.steps(1)

    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):  # half the bytes reach the file, then the disk is full
        real_save(obj, f, *args, **kwargs)
        if isinstance(f, io.BytesIO):  # torch pickles tensors for MPI through torch.save too: not the file
            return
        f.truncate(f.tell() // 2)
        raise OSError(28, "No space left on device")

    if world.Get_rank() == 0:
        monkeypatch.setattr(ckpt_module.torch, "save", dies_half_way)
    with pytest.raises(DomainParallelError, match="No space left on device"):
        save_checkpoint(path, job.model, manager, optimizer=job.opt, step=1)
    monkeypatch.undo()
    assert glob.glob(os.path.join(shared_dir, ".*tmp*")) == []
    fresh = Job(manager, seed=4)
    assert load_checkpoint(path, fresh.model, manager, optimizer=fresh.opt)["step"] == 0  # the previous one, whole
    for p, q in zip(params(fresh.model), good, strict=True):
        assert torch.equal(p, q)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_or_a_missing_file_raise_everywhere(make_manager, shared_dir):
    world = MPI.COMM_WORLD
    manager = make_manager(layout(world.Get_size()))
    job = Job(manager)
    path = os.path.join(shared_dir, "ckpt.pt")
    with pytest.raises(ValueError, match="the same path at the same step"):
        save_checkpoint(path, job.model, manager, step=world.Get_rank())
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(path, job.model, manager, step=-1 if world.Get_rank() == 1 else 0)
    with torch.no_grad():  # replicas that drifted apart: rank 0 alone would write its own
        next(job.model.parameters())[0].add_(1.0 if world.Get_rank() == world.Get_size() - 1 else 0.0)
    with pytest.raises(DomainParallelError, match=rf"rank\(s\) \[{world.Get_size() - 1}\] differ from rank 0"):
        save_checkpoint(path, job.model, manager, step=0)
    assert not os.path.exists(path)
    mine = os.path.join(shared_dir, "only-rank-0.pt")
    if world.Get_rank() == 0:
        solo = credit_mpi.DomainParallelManager(None, 1, comm=MPI.COMM_SELF)
        save_checkpoint(mine, net(0), solo, step=2)  # saved by a job of one rank
        solo.free()
    world.Barrier()
    with pytest.raises(ValueError, match="RNG states of 1 ranks, this job has"):
        load_checkpoint(mine, job.model, manager)
    assert load_checkpoint(mine, job.model, manager, rng=False)["step"] == 2
    with pytest.raises(DomainParallelError, match="missing.pt"):
        load_checkpoint(os.path.join(shared_dir, "missing.pt"), job.model, manager)


def test_wrappers_are_looked_through():
    """torch.compile's module prefixes its keys with ``_orig_mod.``: the checkpoint keeps the plain ones."""
    model = net(0)
    compiled = torch.compile(model)  # nothing is compiled before the first call
    assert list(compiled.state_dict())[0] == "_orig_mod.0.weight"
    assert ckpt_module.unwrap_model(compiled) is model


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    """A process that dies (os._exit) in the middle of writing: the file at ``path`` is the previous one, whole."""
    path = tmp_path / "ckpt.pt"
    code = (
        "import io, os, torch\n"
        "from credit_mpi.nn import checkpoint as c\n"
        "model = torch.nn.Linear(3, 2)\n"
        f"c.save_checkpoint({str(path)!r}, model, step=1)\n"
        "real = torch.save\n"
        "def dies(obj, f, *a, **k):\n"
        "    real(obj, f, *a, **k)\n"
        "    if not isinstance(f, io.BytesIO):\n"
        "        f.truncate(f.tell() // 2)\n"
        "        f.flush()\n"
        "        os._exit(9)\n"
        "c.torch.save = dies\n"
        f"c.save_checkpoint({str(path)!r}, model, step=2)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr  # killed in the middle of the second save
    leftovers = list(tmp_path.glob(".ckpt.pt.tmp-*"))
    assert len(leftovers) == 1  # the killed save's half-written temporary file
    model = torch.nn.Linear(3, 2)
    assert load_checkpoint(path, model)["step"] == 1
    save_checkpoint(path, model, step=3)  # the next save succeeds and removes the leftover
    assert list(tmp_path.glob(".ckpt.pt.tmp-*")) == []
    assert load_checkpoint(path, model)["step"] == 3
