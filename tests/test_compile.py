"""torch.compile of a converted model: the example's UNet (convolutions, GroupNorm, a transposed conv).

The collectives of the converted layers (the band agreements, halo
exchanges, the norm statistics' allgather, the transposed conv's
overlap-add) run eagerly under ``torch.compile`` (``torch.compiler.disable``
in credit_mpi.nn._comm: graph breaks), the torch ops between them compile.
Two training steps of the compiled model (``backend="aot_eager"``) give the
eager run's losses and parameters bit for bit. Compiling is slow on a small
CPU machine, so this runs on 2 ranks only (one compile of one model);
``inductor`` (it needs a C++ compiler) was checked by hand: equal to
round-off (its fused kernels reorder float64 sums).
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

from .conftest import ROOT

torch = pytest.importorskip("torch")


def unet():
    spec = importlib.util.spec_from_file_location("train_unet", ROOT / "examples" / "train_unet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.UNet().double()


def train(model, x, y, steps: int, manager) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).sum() / 1000
        loss.backward()
        credit_mpi.reduce_gradients(model.parameters(), manager)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.mpi(min_size=2)
def test_compiled_unet_equals_eager(make_manager):
    if MPI.COMM_WORLD.Get_size() != 2:
        pytest.skip("one compile on 2 ranks is enough (slow on small machines)")
    torch._dynamo.reset()
    manager = make_manager()
    ref = unet()
    eager = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager)
    model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager)
    g = np.random.default_rng(0)
    x = credit_mpi.shard_tensor(torch.from_numpy(g.standard_normal((2, 2, 16, 16))), -2, manager)
    y = torch.roll(x, 1, dims=-1)
    compiled = torch.compile(model, backend="aot_eager")
    assert train(compiled, x, y, 2, manager) == train(eager, x, y, 2, manager)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q)
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # something was compiled, not all skipped
