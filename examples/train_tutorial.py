"""docs/tutorial.rst's end state: a conv net trained on latitude bands, domain x data parallel.

    mpiexec -n 2 python -m mpi4py examples/train_tutorial.py                        # 2 bands of one sample
    mpiexec -n 4 python -m mpi4py examples/train_tutorial.py --domain 2 --ddp       # 2 bands x 2 replicas, DDP
    mpiexec -n 2 python -m mpi4py examples/train_tutorial.py --checkpoint-every 5 --crash-after 7
    mpiexec -n 2 python -m mpi4py examples/train_tutorial.py --resume               # steps 5 to 19

Every rank builds the same global batch of each step (seeded by the step),
keeps its replica's samples and its latitude band of them, and trains the
converted model on the band: each band's loss is its share of the global
latitude-weighted MSE, and reduce_gradients (or DDP and the domain sum) makes
every rank's gradient the one-process gradient. The last prediction is
gathered and rank 0 writes it (--output). ``python -m mpi4py`` aborts every
rank when one raises; OMP_NUM_THREADS=1 keeps ranks from fighting over cores.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import credit_mpi as cm
from credit_mpi.nn import LatitudeWeightedMSELoss, global_loss, load_checkpoint, save_checkpoint


def make_model(channels: int = 2, width: int = 8) -> nn.Module:
    """Convolutions padded in latitude (a halo on bands) and in longitude (circular), and a GroupNorm (global statistics)."""
    return nn.Sequential(
        nn.CircularPad2d((1, 1, 0, 0)), nn.Conv2d(channels, width, 3, padding=(1, 0)), nn.GroupNorm(2, width), nn.SiLU(),
        nn.CircularPad2d((1, 1, 0, 0)), nn.Conv2d(width, channels, 3, padding=(1, 0)),
    )


def global_batch(step: int, samples: int, lat: int, lon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, the same on every rank: random fields and, as targets, the fields moved one point east."""
    x = torch.randn(samples, 2, lat, lon, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return x, torch.roll(x, 1, dims=-1)


def my_band(field: torch.Tensor, manager) -> torch.Tensor:
    """This data-parallel replica's samples, this domain rank's latitude rows."""
    per_replica = field.shape[0] // manager.data_parallel_size
    mine = field[manager.dp_rank * per_replica : (manager.dp_rank + 1) * per_replica]
    return cm.shard_tensor(mine, dim=-2, manager=manager, uneven=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--domain", type=int, default=None, help="ranks per domain group (default: all ranks, one sample at a time)")
    add("--steps", type=int, default=20, help="optimizer steps, counting those before a --resume")
    add("--batch", type=int, default=2, help="samples per step in all (a multiple of the data-parallel size)")
    add("--lat", type=int, default=37, help="latitudes (37: a 5-degree grid, uneven bands)")
    add("--lon", type=int, default=72, help="longitudes")
    add("--ddp", action="store_true", help="DDP over the data-parallel group (torch gloo/NCCL) and the domain sum")
    add("--checkpoint", default="tutorial_checkpoint.pt", help="checkpoint file")
    add("--checkpoint-every", type=int, default=0, help="save every this many steps (0: never)")
    add("--resume", action="store_true", help="continue from --checkpoint when it exists")
    add("--crash-after", type=int, default=None, help="exit (status 17) after this step, to try --resume")
    add("--output", default=None, help="rank 0 saves the last step's gathered prediction here (.npy)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, comm: MPI.Comm = MPI.COMM_WORLD) -> list[float]:
    """The global loss of every step run (from the resumed step on); the same list on every rank."""
    manager = cm.DomainParallelManager(None, args.domain or comm.Get_size(), comm=comm)
    if args.batch % manager.data_parallel_size:  # the same verdict on every rank: every rank frees, every rank raises
        manager.free()
        raise ValueError(f"--batch {args.batch} is not a multiple of the {manager.data_parallel_size} data-parallel replicas")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = cm.convert_to_domain_parallel(make_model().double(), manager)
    trained = model
    if args.ddp:
        cm.init_torch_distributed(manager)
        trained = nn.parallel.DistributedDataParallel(model, process_group=manager.torch_data_parallel_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = LatitudeWeightedMSELoss(args.lat, manager)  # this band's weights, the global row count
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        start = load_checkpoint(args.checkpoint, model, manager, optimizer=opt)["step"]
    losses = []
    for step in range(start, args.steps):
        x, y = (my_band(t, manager) for t in global_batch(step, args.batch, args.lat, args.lon))
        pred = trained(x)
        share = loss_fn(pred, y)  # this band's share of the global loss
        opt.zero_grad()
        share.backward()  # with DDP: the mean over the replicas
        cm.reduce_gradients(model.parameters(), manager, over="domain" if args.ddp else "all")
        opt.step()
        losses.append(global_loss(share, manager))  # the same float on every rank
        if comm.Get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, model, manager, optimizer=opt, step=step + 1)
        if step == args.crash_after:
            os._exit(17)  # a crash: no cleanup, no checkpoint
    if args.output and losses:
        whole = cm.gather_tensor(pred.detach(), dim=-2, manager=manager)  # every rank of the domain group
        if comm.Get_rank() == 0:
            np.save(args.output, whole.numpy())  # replica 0's samples, the whole globe
    manager.free()  # also the torch groups of --ddp
    return losses


def main(argv: list[str] | None = None) -> int:
    train(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
