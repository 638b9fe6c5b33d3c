"""The band convolution that copies no band (credit_mpi.nn.band_conv, issue 36): exact where it runs, and it runs.

The band's own call with the module's padding plus the halo rows' strips on the edge output rows must be one
process's convolution (forward, input and parameter gradients, second derivatives) on even and uneven bands, and
no aten op of its forward or backward may copy the band (only the edge rows travel).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.nn import conv as conv_module  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402
from credit_mpi.nn.band_conv import Strip, band_edges  # noqa: E402
from credit_mpi.nn.geometry import conv_layout  # noqa: E402

from .halo_reference import band, prefix_managers  # noqa: E402
from .nn_reference import assert_same, run_both  # noqa: E402


def _convs() -> dict:
    """Convolutions (and their input shapes, None the sharded dim) of every kind the band conv takes."""
    return {
        "2d k3": (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, None, 6)),
        "2d k5 no bias": (lambda: nn.Conv2d(3, 4, 5, padding=2, bias=False), (1, 3, None, 5)),
        "2d k7 stride 2": (lambda: nn.Conv2d(2, 3, 7, stride=2, padding=3), (1, 2, None, 5)),
        "2d k3 stride 2": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, None, 6)),
        "2d k3 dilation 2": (lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2), (2, 3, None, 6)),
        "2d groups": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=2), (1, 4, None, 5)),
        "2d circular": (lambda: nn.Conv2d(3, 4, (3, 1), padding=(1, 0), padding_mode="circular"), (2, 3, None, 6)),
        "1d k5 circular": (lambda: nn.Conv1d(3, 4, 5, padding=2, padding_mode="circular"), (2, 3, None)),
        "1d k3": (lambda: nn.Conv1d(3, 2, 3, padding=1), (2, 3, None)),
        "3d k3": (lambda: nn.Conv3d(2, 3, 3, padding=1), (1, 2, 3, None, 4)),
        "3d k3 stride 2": (lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1), (1, 2, 3, None, 4)),
    }


def _heights(d: int, stride: int, kernel: int) -> list[int]:
    """Even and uneven bands of a field where the band conv runs (stride-aligned starts, bands taller than the
    windows) and one where it may not (odd starts under stride 2)."""
    rows = 4 * kernel
    if stride == 1:
        return [rows * d, rows * d + d - 1]
    return [2 * rows * d, 2 * rows * d + 2 * d - 1]  # every band even but the last: aligned starts, uneven


@pytest.fixture
def counted(monkeypatch):
    """How many times the layers took the band conv (credit_mpi.nn.band_conv)."""
    calls = [0]
    original = conv_module.band_conv

    def spy(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(conv_module, "band_conv", spy)
    return calls


def _sizes(h: int, d: int, stride: int) -> list[int] | None:
    """Bands with stride-aligned starts: array_split for stride 1, even bands (the last one the rest) for 2."""
    if stride == 1:
        return None
    base = (h // d) // 2 * 2
    return [base] * (d - 1) + [h - base * (d - 1)]


@pytest.mark.mpi(min_size=1)
def test_band_conv_is_one_process_convolution(make_manager, counted):
    """Forward, input and parameter gradients of every kind on even and uneven bands: one process's (float64)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for name, (build, shape) in _convs().items():
                layer = build()
                sd = shape.index(None) - len(shape)
                stride, kernel = layer.stride[sd], layer.kernel_size[sd] * layer.dilation[sd]
                before = counted[0]
                for h in _heights(d, stride, kernel):
                    full = tuple(h if s is None else s for s in shape)
                    assert_same(run_both(build, full, manager, seed=h, shard_dim=sd, sizes=_sizes(h, d, stride)))
                if d > 1:  # (one rank: the layer's local forward)
                    assert counted[0] > before, f"{name}: the band conv did not run on {d} ranks"


def test_band_edges_decides_exact_and_simple_layouts_only():
    """The split runs where it is exact (aligned starts, the local call's rows the owned ones, strips apart) and
    not elsewhere; a zero-padded field edge has no strip, a circular one has."""
    def edges(sizes, kernel, stride=1, dilation=1, pad=None, periodic=False):
        pad = dilation * (kernel - 1) // 2 if pad is None else pad
        lay = conv_layout(list(sizes), kernel, stride, dilation, pad, pad)
        return band_edges(tuple(sizes), kernel, stride, dilation, pad, lay.width, periodic, lay.bands)

    three = edges((8, 7, 7), 3)
    assert [(e.top is not None, e.bottom is not None) for e in three] == [(False, True), (True, True), (True, False)]
    # one output row each side, read by the one tap that reaches the neighbour's row (received row 0 above, 3 below)
    assert three[1].top == Strip(0, 1, 0, 1, 0, True, 0, 1) and three[1].bottom == Strip(6, 1, 3, 1, 0, False, 2, 1)
    assert all(e.top and e.bottom for e in edges((8, 7, 7), 3, periodic=True))
    assert edges((8, 8), 3, stride=2)[1].top == Strip(0, 1, 0, 1, 0, True, 0, 1)
    assert edges((8, 8), 3, stride=2)[0].bottom is None  # the last window ends in the band
    # a 7-row kernel, stride 2: two output rows above, three taps, the second row's third tap on a zero (band) row
    assert edges((32, 32), 7, stride=2)[1].top == Strip(0, 2, 0, 3, 2, True, 0, 3)
    assert edges((32, 32), 7, stride=2)[0].bottom == Strip(15, 1, 9, 2, 0, False, 5, 2)
    assert edges((7, 9), 3, stride=2) is None  # an odd start under stride 2
    assert edges((4, 4), 7, stride=2) is None  # a 4-row band: one output row's window reaches both neighbours
    assert edges((8, 8), 4, pad=2) is None  # an even kernel: the local call has one row more than the band owns
    assert edges((8, 8), 1) is None  # no halo


@pytest.mark.mpi(min_size=2)
def test_band_conv_second_derivatives_are_one_process(make_manager, counted):
    """Gradient penalties (of the input gradient, and of the weight gradient through the input) on strided,
    circular and uneven bands: the band conv's recorded backward gives one process's second derivatives."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d < 2:
                continue
            for build, shape, sd in ((lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (1, 2, 8 * d, 5), -2),
                                     (lambda: nn.Conv1d(2, 3, 5, padding=2, padding_mode="circular"), (2, 2, 5 * d + 1), -1),
                                     (lambda: nn.Conv2d(2, 3, 3, padding=1), (1, 2, 4 * d + d - 1, 5), -2)):
                torch.manual_seed(d)
                conv = build().double()
                x = torch.randn(shape, dtype=torch.float64)
                mine = credit_mpi.shard_tensor(x, sd, manager, uneven=True).clone().requires_grad_()
                model = convert_to_domain_parallel(copy.deepcopy(conv), manager, shard_dim=sd)
                before = counted[0]
                g, gw = torch.autograd.grad(model(mine).pow(3).sum(), (mine, model.weight), create_graph=True)
                assert counted[0] > before
                hx, hw = torch.autograd.grad(g.pow(2).sum(), (mine, model.weight))
                # the weight's second derivative through the band's rows: each rank's part, summed
                hw = torch.from_numpy(manager.domain_group.allreduce(hw.detach().numpy()))
                xr = x.clone().requires_grad_()
                g_ref, _ = torch.autograd.grad(conv(xr).pow(3).sum(), (xr, conv.weight), create_graph=True)
                hx_ref, hw_ref = torch.autograd.grad(g_ref.pow(2).sum(), (xr, conv.weight))
                for ours, ref in ((g, g_ref), (hx, hx_ref)):
                    torch.testing.assert_close(ours, credit_mpi.shard_tensor(ref, sd, manager, uneven=True),
                                               rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(hw, hw_ref, rtol=1e-10, atol=1e-12)
                # the weight gradient's own derivative: only the weight requires grad in the second pass
                gw2 = torch.from_numpy(manager.domain_group.allreduce(gw.detach().numpy()))
                torch.testing.assert_close(gw2, torch.autograd.grad(conv(x).pow(3).sum(), conv.weight)[0],
                                           rtol=1e-10, atol=1e-12)


class _Ops(TorchDispatchMode):
    """Every aten op's outputs: (op name, numel of each tensor output)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        self.seen.append((func.__name__, [t.numel() for t in flat if isinstance(t, torch.Tensor)]))
        return out


@pytest.mark.mpi(min_size=2)
def test_band_conv_copies_no_band(make_manager):
    """Forward and backward of a band conv: no aten op but the convolution's own kernels makes a band-sized tensor
    (the floor's calls: its output, the input and weight gradients); the halo is the band's edge rows."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d < 2:
                continue
            for padding_mode in ("zeros", "circular"):
                torch.manual_seed(0)
                # (a circular longitude is padded by a copy, as torch's own circular Conv2d does: the band conv
                # takes a circular latitude with no other padding)
                kernel, padding = (3, 1) if padding_mode == "zeros" else ((3, 1), (1, 0))
                layer = convert_to_domain_parallel(
                    nn.Conv2d(4, 4, kernel, padding=padding, padding_mode=padding_mode).double(), manager)
                torch.manual_seed(1 + manager.domain_rank)  # each rank its band
                a, b = band(32 * d, manager)
                x = torch.randn(2, 4, b - a, 16, dtype=torch.float64, requires_grad=True)
                grad = torch.randn(2, 4, b - a, 16, dtype=torch.float64)
                layer(x).backward(grad)  # warm: agreed and planned
                x.grad = None  # (x.grad takes the input gradient as it is)
                with _Ops() as ops:
                    layer(x).backward(grad)
                kernels = {"convolution.default", "convolution_backward.default"}
                big = [(name, sizes) for name, sizes in ops.seen
                       if name not in kernels and any(n >= x.numel() // 4 for n in sizes)]
                # views only (the halo gradients travel as a byte view; what arrives is wrapped, not copied)
                assert all(name in ("detach.default", "view.dtype", "lift_fresh.default") for name, _ in big), big
