"""Train a small UNet on bands of a synthetic ERA5-like field, domain x data parallel; check against one process.

    mpiexec -n 2 python examples/train_unet.py --steps 20
    mpiexec -n 4 python examples/train_unet.py --data-parallel 2   # 2 bands x 2 sample groups

The model has a strided conv down, a transposed conv up, GroupNorm and
circular longitude padding. Every rank trains its latitude band of its
samples; the loss of a band is its sum of squared errors divided by the
GLOBAL number of points of its data-parallel group's samples, so that
credit_mpi.reduce_gradients (sum over the domain, mean over data-parallel
ranks) gives the single-process gradient. Rank 0 also trains the same model
on the whole field in one process; every rank exits 1 if the loss curves
differ (float64: relative 1e-9).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import torch
from mpi4py import MPI
from torch import nn

import credit_mpi
import credit_mpi.nn
from credit_mpi.partition import band_range


class UNet(nn.Module):
    def __init__(self, channels: int = 2, width: int = 8):
        super().__init__()
        lon = nn.CircularPad2d((1, 1, 0, 0))  # the longitude wraps; latitude is padded by the convs (zeros)
        self.enc = nn.Sequential(lon, nn.Conv2d(channels, width, 3, padding=(1, 0)), nn.GroupNorm(2, width), nn.SiLU())
        self.down = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * width), nn.SiLU()
        )
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.CircularPad2d((1, 1, 0, 0)), nn.Conv2d(2 * width, channels, 3, padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc(x)
        return x + self.dec(torch.cat([a, self.up(self.down(a))], dim=1))


def era5_like(samples: int, lat: int, lon: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target): a temperature-like and a wind-like field; the target is advected by one grid point."""
    g = torch.Generator().manual_seed(seed)
    phi = torch.linspace(-math.pi / 2, math.pi / 2, lat, dtype=torch.float64).view(lat, 1)
    lam = torch.linspace(0, 2 * math.pi, lon + 1, dtype=torch.float64)[:-1].view(1, lon)
    fields = []
    for _ in range(samples + 1):
        k = torch.randint(1, 5, (2,), generator=g)
        a = torch.randn(4, generator=g, dtype=torch.float64)
        t = torch.cos(phi) * (1 + 0.3 * a[0] * torch.cos(k[0] * lam + a[1]))
        u = torch.sin(2 * phi) * (0.5 + 0.2 * a[2] * torch.sin(k[1] * lam + a[3]))
        fields.append(torch.stack([t, u]))
    x = torch.stack(fields[:samples])
    return x, torch.roll(x, 1, dims=-1) + 0.05 * torch.stack(fields[1:])


def train(model, x, y, steps, lr, manager=None, rows=None):
    """The loss curve; on bands, ``rows`` = (start, stop) of this rank's latitudes and the loss is the band's share."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    curve = []
    points = y.numel()  # of this data-parallel group's samples: the global count
    if rows is not None:
        x, y = x[..., rows[0] : rows[1], :], y[..., rows[0] : rows[1], :]
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).sum() / points
        loss.backward()
        value = float(loss.detach())
        if manager is not None:
            credit_mpi.reduce_gradients(model.parameters(), manager)
            value = manager.comm.allreduce(value) / manager.data_parallel_size
        curve.append(value)
        opt.step()
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--lat", type=int, default=32)
    parser.add_argument("--lon", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2, help="samples per data-parallel rank")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    domain = world.Get_size() // args.data_parallel
    manager = credit_mpi.DomainParallelManager(None, domain)
    dp, i = manager.data_parallel_size, manager.dp_rank
    torch.manual_seed(0)
    ref = UNet().double()
    model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager)
    x, y = era5_like(args.samples * dp, args.lat, args.lon, seed=1)
    mine = slice(i * args.samples, (i + 1) * args.samples)
    plan = credit_mpi.nn.describe(model, (args.samples, 2, args.lat, args.lon), manager=manager)  # no MPI
    if world.Get_rank() == 0:
        print(plan, flush=True)
    rows = band_range(args.lat, domain, manager.domain_rank, uneven=True)
    curve = train(model, x[mine], y[mine], args.steps, 0.05, manager, rows)
    reference = train(ref, x, y, args.steps, 0.05) if world.Get_rank() == 0 else None
    reference = world.bcast(reference, root=0)
    ok = all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-14) for a, b in zip(curve, reference, strict=True))
    if world.Get_rank() == 0:
        for step, (a, b) in enumerate(zip(curve, reference, strict=True)):
            print(f"step {step:3d}  loss on {domain} band(s) x {dp} group(s) {a:.12e}   one process {b:.12e}")
        print("loss curves equal" if ok else "LOSS CURVES DIFFER", flush=True)
    manager.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
