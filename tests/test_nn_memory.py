"""What a converted model keeps for backward (issue 26, item 2): measured with saved_tensors_hooks, not timed.

The band norms (GroupNorm / InstanceNorm / LayerNorm) keep the input and the
per-group statistics only, as torch's own kernels do on one process; their
results stay exact (tests/test_nn.py's norm and model tests, and the odd
shapes here).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.cli.bench_model import saved_activation_bytes  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402

from .halo_reference import band, prefix_managers  # noqa: E402
from .nn_reference import assert_same, run_both  # noqa: E402


def _norms(h: int) -> dict:
    """A norm of each kind for a (2, 4, h, 5) field (LayerNorm normalises (C, H, W) and has no bias)."""
    return {
        "groupnorm": lambda: nn.GroupNorm(2, 4),
        "instancenorm": lambda: nn.InstanceNorm2d(4, affine=True),
        "layernorm": lambda: nn.LayerNorm((4, h, 5), bias=False),
        "batchnorm": lambda: nn.BatchNorm2d(4),
    }


def test_saved_activation_bytes_counts_each_storage_once():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    nbytes, out = saved_activation_bytes(lambda: (x @ w) * x, params=[w])
    assert nbytes == x.numel() * 8 + out.numel() * 8  # x (saved twice, counted once) and x @ w; w left out


@pytest.mark.mpi(min_size=1)
def test_band_norms_save_no_more_than_torch_on_one_process(make_manager):
    """Per rank: the converted norm on its band keeps at most what torch's norm keeps for the same band alone."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in (3 * d, 3 * d + d - 1):  # even and uneven bands
                a, b = band(h, manager)
                x = torch.randn(2, 4, h, 5, dtype=torch.float64).narrow(2, a, b - a).contiguous().requires_grad_()
                for name, build in _norms(h).items():
                    torch.manual_seed(0)
                    layer = convert_to_domain_parallel(build().double(), manager)
                    ours, out = saved_activation_bytes(lambda m=layer, x=x: m(x), layer.parameters())
                    alone = (_norms(b - a)[name] if name == "layernorm" else build)().double()
                    theirs, _ = saved_activation_bytes(lambda m=alone, x=x: m(x), alone.parameters())
                    assert 0 < ours <= theirs, (name, d, h, ours, theirs)
                    out.sum().backward()  # every rank: the backward's gather is collective


@pytest.mark.mpi(min_size=1)
def test_band_norms_exact_on_odd_shapes(make_manager):
    """1-D GroupNorm, LayerNorm without bias, an input that needs no grad (the parameters' only): one process's numbers."""
    def groupnorm1d():
        return nn.Sequential(nn.Conv1d(3, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.Conv1d(6, 2, 3, padding=1))

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in (4 * d, 4 * d + d - 1):  # even and uneven bands
                assert_same(run_both(groupnorm1d, (2, 3, h), manager, shard_dim=-1, seed=d * 10 + h))
                layernorm = lambda h=h: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.LayerNorm((4, h, 4), bias=False))  # noqa: E731
                assert_same(run_both(layernorm, (2, 3, h, 4), manager, seed=d * 10 + h))
                torch.manual_seed(1)
                ref = nn.GroupNorm(2, 4).double()
                layer = convert_to_domain_parallel(copy.deepcopy(ref), manager)
                xg = torch.randn(2, 4, h, 5, dtype=torch.float64)
                a, b = band(h, manager)
                (ref(xg) ** 2).sum().backward()
                (layer(xg.narrow(2, a, b - a)) ** 2).sum().backward()  # x needs no grad: no gather in backward
                credit_mpi.reduce_gradients(list(layer.parameters()), manager)
                for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.mpi(min_size=1)
def test_example_unet_saved_activations_within_the_bound(make_manager):
    """The example UNet per rank: <= 1.1 x (one process / n) + the halo rows (issue 26's bound), every domain size."""
    import importlib.util

    from credit_mpi.cli.bench_model import halo_row_bytes

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("train_unet", ROOT / "examples" / "train_unet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    ref = module.UNet()
    xg = torch.randn(1, 2, 48, 32)  # 48 rows: even, stride-aligned bands on 1..4 ranks
    one, _ = saved_activation_bytes(lambda: ref(xg.clone().requires_grad_()), ref.parameters())
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
            a, b = band(48, manager)
            x = xg.narrow(2, a, b - a).clone().requires_grad_()
            ours, out = saved_activation_bytes(lambda m=model, x=x: m(x), model.parameters())
            assert ours <= 1.1 * one / d + halo_row_bytes(ref, xg, d), (d, ours, one)
            out.sum().backward()
