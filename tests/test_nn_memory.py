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


def _convs() -> dict:
    """Band convolutions that fetch halo rows: plain, strided, dilated, an even kernel's asymmetric window, 1-D."""
    return {
        "3x3": (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, None, 6)),
        "stride 2": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False), (2, 3, None, 6)),
        "dilated 5x3": (lambda: nn.Conv2d(3, 2, (5, 3), padding=(4, 1), dilation=(2, 1)), (1, 3, None, 5)),
        "conv1d k4": (lambda: nn.Conv1d(3, 2, 4, padding=2), (2, 3, None)),
    }


@pytest.mark.mpi(min_size=1)
def test_band_convs_keep_the_band_and_the_halo_rows_not_a_padded_copy(make_manager):
    """After a ReLU (which keeps the conv's input), a band conv keeps no more than the unconverted conv on the band
    plus its halo rows; and its forward, input and parameter gradients are one process's (even and uneven bands)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for name, (build, shape) in _convs().items():
                for h in (8 * d, 8 * d + d - 1):  # even and uneven bands
                    full = tuple(h if s is None else s for s in shape)
                    axis = shape.index(None)
                    assert_same(run_both(lambda b=build: nn.Sequential(nn.ReLU(), b()), full, manager, seed=h,
                                         shard_dim=axis - len(full)))
                    a, b = band(h, manager)
                    x = torch.randn(full, dtype=torch.float64).narrow(axis, a, b - a).contiguous().requires_grad_()
                    torch.manual_seed(0)
                    ref = nn.Sequential(nn.ReLU(), build()).double()
                    layer = convert_to_domain_parallel(copy.deepcopy(ref), manager, shard_dim=axis - len(full))
                    ours, out = saved_activation_bytes(lambda m=layer, x=x: m(x), layer.parameters())
                    theirs, _ = saved_activation_bytes(lambda m=ref, x=x: m(x), ref.parameters())
                    k = ref[1].kernel_size[0] * ref[1].dilation[0]
                    halo = 2 * k * x.numel() // x.shape[axis] * 8  # at most k rows on each side
                    assert ours <= theirs + halo, (name, d, h, ours, theirs)
                    out.sum().backward()  # every rank: the halo's backward is collective


@pytest.mark.mpi(min_size=1)
def test_band_conv_double_backward_equals_one_process(make_manager):
    """A gradient penalty through a band conv: the second derivative (through the rebuilt halo rows) is one process's."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(d)
            conv = nn.Conv2d(2, 3, 3, padding=1).double()
            x = torch.randn(1, 2, 4 * d + d - 1, 5, dtype=torch.float64)  # uneven bands
            mine = credit_mpi.shard_tensor(x, -2, manager, uneven=True).clone().requires_grad_()
            model = convert_to_domain_parallel(copy.deepcopy(conv), manager)
            (g,) = torch.autograd.grad(model(mine).pow(2).sum(), mine, create_graph=True)
            (h,) = torch.autograd.grad(g.pow(2).sum(), mine)
            xr = x.clone().requires_grad_()
            (g_ref,) = torch.autograd.grad(conv(xr).pow(2).sum(), xr, create_graph=True)
            (h_ref,) = torch.autograd.grad(g_ref.pow(2).sum(), xr)
            for ours, ref in ((g, g_ref), (h, h_ref)):
                torch.testing.assert_close(ours, credit_mpi.shard_tensor(ref, -2, manager, uneven=True), rtol=1e-12, atol=1e-12)


def _pools() -> dict:
    """Pools and their input shapes (None: the sharded dim): max pools of 1-3 dims, and the global mean."""
    return {
        "maxpool2d k3s2p1": (lambda: nn.MaxPool2d(3, 2, 1), (2, 3, None, 6)),
        "maxpool2d ceil": (lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), (1, 2, None, 5)),
        "maxpool1d k3s1p1": (lambda: nn.MaxPool1d(3, 1, 1), (2, 3, None)),
        "maxpool3d k3s2p1": (lambda: nn.MaxPool3d(3, 2, 1), (1, 2, 3, None, 4)),
        "global mean": (lambda: nn.AdaptiveAvgPool2d(1), (2, 3, None, 6)),
    }


@pytest.mark.mpi(min_size=1)
def test_band_pools_keep_no_more_than_torch_on_the_band(make_manager):
    """A max pool keeps its indices only (not the fetched rows), the global mean nothing (as torch's ``x.mean``);
    their forward, input and parameter gradients are one process's (even and uneven bands)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for name, (build, shape) in _pools().items():
                for h in (4 * d, 4 * d + d - 1):  # even and uneven bands
                    full = tuple(h if s is None else s for s in shape)
                    axis = shape.index(None)
                    glob = name == "global mean"
                    assert_same(run_both(build, full, manager, seed=h, shard_dim=axis - len(full), replicated=glob))
                    a, b = band(h, manager)
                    x = torch.randn(full, dtype=torch.float64).narrow(axis, a, b - a).contiguous().requires_grad_()
                    layer = convert_to_domain_parallel(build(), manager, shard_dim=axis - len(full))
                    ours, out = saved_activation_bytes(lambda m=layer, x=x: m(x))
                    theirs, _ = saved_activation_bytes(lambda m=build(), x=x: m(x))  # noqa: B008 - one plain layer per case
                    assert ours <= theirs - (0 if glob or d == 1 else x.numel() * 8), (name, d, h, ours, theirs)  # not the input
                    out.sum().backward()  # every rank: the halo's / the mean's backward is collective
