"""bf16 / fp16 autocast through every converted layer and collective, against one process under autocast.

``torch.autocast("cpu", dtype)`` around a converted model with every layer
kind that communicates (convolutions and their halos, a strided conv, a
transposed conv and its overlap-add, GroupNorm / BatchNorm / InstanceNorm /
LayerNorm statistics, pooling, upsampling): every layer's output has the
dtype of the same layer in one process (a norm's float32 weight does not
promote a bf16 output to float32), and the output and the parameter
gradients (after ``reduce_gradients``, which sums low-precision gradients in
float32) are as close to the float64 truth as the one-process autocast run
is: the bands add no error beyond the low-precision rounding itself (the
norm statistics stay in float32).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

torch = pytest.importorskip("torch")
nn = torch.nn
W = 8


def height(world: int) -> int:
    """Latitudes that every rank's band of the strided layers cuts at even offsets."""
    return 24 if world == 3 else 16


class Everything(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.ConvTranspose2d(8, 8, 2, stride=2), nn.InstanceNorm2d(8, affine=True),
            nn.Conv2d(8, 4, 3, padding=1), nn.MaxPool2d(2), nn.Upsample(scale_factor=2, mode="bilinear"),
            nn.LayerNorm([h, W]), nn.AvgPool2d(2), nn.Upsample(scale_factor=2), nn.Conv2d(4, 2, 3, padding=1),
        )

    def forward(self, x):
        return self.layers(x)


def dtypes(model, x) -> list[torch.dtype]:
    out = []
    for layer in model.layers:
        x = layer(x)
        out.append(x.dtype)
    return out


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_as_close_as_one_process(dtype, make_manager):
    world = MPI.COMM_WORLD.Get_size()
    manager = make_manager(world)
    h = height(world)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((2, 2, h, W))).float()
    torch.manual_seed(0)
    truth = Everything(h).double()
    one = copy.deepcopy(truth).float()
    net = credit_mpi.convert_to_domain_parallel(copy.deepcopy(truth).float(), manager)
    band = credit_mpi.shard_tensor(x, -2, manager)

    exact = truth(x.double())
    (exact**2).sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        assert dtypes(net, band) == dtypes(one, x)  # the same dtype after every layer
        out_one, out = one(x), net(band)
    (out_one.float() ** 2).sum().backward()
    (out.float() ** 2).sum().backward()
    credit_mpi.reduce_gradients(net.parameters(), manager)

    whole = credit_mpi.gather_tensor(out.float(), -2, manager).double()
    err_one = (out_one.double() - exact).abs().max().item()
    err = (whole - exact).abs().max().item()
    assert err <= 2 * err_one + 1e-6, f"{dtype}: bands {err:.3g} from float64, one process {err_one:.3g}"
    g_exact = grads(truth)
    g_err_one = (grads(one) - g_exact).abs().max().item()
    g_err = (grads(net) - g_exact).abs().max().item()
    assert g_err <= 2 * g_err_one + 1e-6, f"{dtype} gradients: bands {g_err:.3g} from float64, one process {g_err_one:.3g}"
    scale = g_exact.abs().max().item()
    assert g_err < 0.15 * scale  # low-precision rounding (bf16 keeps 8 bits), not a wrong gradient
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{dtype}: output error {err:.3g} (one process {err_one:.3g}), gradient error {g_err:.3g} "
              f"(one process {g_err_one:.3g}) of {scale:.3g}")
