"""Train a small UNet on bands of a synthetic ERA5-like field, domain x data parallel; check against one process.

    mpiexec -n 2 python examples/train_unet.py --steps 20
    mpiexec -n 4 python examples/train_unet.py --data-parallel 2   # 2 bands x 2 sample groups
    mpiexec -n 4 python examples/train_unet.py --data-parallel 2 --store /tmp/era5.zarr --make-store

The model has a strided conv down, a transposed conv up, GroupNorm and
circular longitude padding. Every rank trains its latitude band of its
samples. The loss is credit_mpi.nn.LatitudeWeightedMSELoss: a band's share
of the global latitude-weighted MSE (its weighted sum of squared errors over
the GLOBAL number of points), so that credit_mpi.reduce_gradients (sum over
the domain, mean over data-parallel ranks) gives the single-process
gradient; credit_mpi.nn.global_loss gives the value that is logged, and
``--clip`` clips the global gradient norm (credit_mpi.nn.clip_grad_norm_).

Data: by default every rank builds the whole field in memory and slices its
band. With ``--store PATH`` the samples come from a Zarr store (variables
``t`` and ``u``, dims (time, latitude, longitude); sample i is time i -> time
i + 1) through credit_mpi.io.BandDataset and a torch DataLoader with the
dataset's data-parallel sampler: every rank reads only its band of its
replica's samples. ``--make-store`` first writes the synthetic field there:
the ranks of data-parallel group 0 each write their band with
credit_mpi.io.write_bands. The single-process reference reads the same
store whole and trains on the same global batches (the union of every
replica's batch, in the sampler's order).

Rank 0 also trains the same model on the whole field in one process; every
rank exits 1 if the loss curves differ (float64: relative 1e-9; with --bf16:
3e-2).

Like a real job (docs/training.rst): ``--fsdp`` shards parameters and
optimizer state over the data-parallel group (FSDP2, the domain sum in its
all-reduce hook), ``--bf16`` runs the float32 model under bf16 autocast,
``--compile`` compiles the converted model, ``--checkpoint-every N`` saves
credit_mpi.nn checkpoints to ``--checkpoint`` and ``--resume`` continues
from one (the loss curve equals the uninterrupted run's, float for float);
``--crash-after K`` dies after step K to try it. Rank 0 prints one line per
step (global loss, step time, samples/s); ``--log`` writes the curve as
JSON, ``--plot`` draws it (matplotlib).

    mpiexec -n 4 python examples/train_unet.py --data-parallel 2 --fsdp --checkpoint-every 5 --plot loss.png
    mpiexec -n 2 python examples/train_unet.py --checkpoint-every 5 --crash-after 12   # dies after step 12
    mpiexec -n 2 python examples/train_unet.py --resume                               # steps 10 to 19
"""

from __future__ import annotations

import mpi4py

# DataLoader workers (--workers, started with spawn) import this file again as __mp_main__: no MPI there.
mpi4py.rc.initialize = __name__ != "__mp_main__"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
import credit_mpi.nn  # noqa: E402
from credit_mpi import allgather_or_raise, shard_tensor  # noqa: E402
from credit_mpi.nn import LatitudeWeightedMSELoss, clip_grad_norm_, global_loss  # noqa: E402

VARIABLES = ("t", "u")
CRASHED = 17  # the exit status of --crash-after


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


def era5_like(samples: int, lat: int, lon: int, seed: int) -> torch.Tensor:
    """A trajectory of ``samples + 1`` states, shape (time, 2, lat, lon): a temperature-like and a wind-like field.

    Each state is the previous one advected east by one grid point plus a
    small random forcing; sample ``i`` is (state ``i``, state ``i + 1``).
    Latitudes run from 90 to -90 degrees (ERA5's order).
    """
    g = torch.Generator().manual_seed(seed)
    phi = torch.deg2rad(torch.linspace(90, -90, lat, dtype=torch.float64)).view(lat, 1)
    lam = torch.linspace(0, 2 * math.pi, lon + 1, dtype=torch.float64)[:-1].view(1, lon)
    states = []
    for _ in range(samples + 1):
        k = torch.randint(1, 5, (2,), generator=g)
        a = torch.randn(4, generator=g, dtype=torch.float64)
        t = torch.cos(phi) * (1 + 0.3 * a[0] * torch.cos(k[0] * lam + a[1]))
        u = torch.sin(2 * phi) * (0.5 + 0.2 * a[2] * torch.sin(k[1] * lam + a[3]))
        forcing = torch.stack([t, u])
        states.append(forcing if not states else torch.roll(states[-1], 1, dims=-1) + 0.05 * forcing)
    return torch.stack(states)


def check_layout(plan, lat: int, domain: int) -> None:
    """ValueError unless describe()'s plan says the UNet runs exactly on this layout, naming the first refused row.

    Uneven bands are fine: where the stride-2 conv and the transposed conv do
    not give back the input's bands (band offsets not multiples of 2), the
    skip connection's ``torch.cat`` re-bands ``up``'s output to ``enc``'s.
    What is refused is a band too thin for a layer (fewer rows than its
    stride or its halo). Decided from the plan, which every rank computes
    alike without MPI: the same verdict everywhere, before the first step.
    """
    refused = [row for row in plan.rows if not row.exact]
    if refused:
        row = refused[0]
        raise ValueError(f"--lat {lat} on {domain} band(s): layer {row.path} ({row.kind}) does not run exactly "
                         f"on bands {list(row.bands_in)}: {row.note}; {fitting(lat, domain)}")


def fitting(lat: int, domain: int) -> str:
    """What latitude counts the UNet runs on with ``domain`` bands: even (the skip joins 2 x (lat / 2) rows), 2 per band."""
    fits = max(2 * domain, lat + lat % 2)
    return f"the UNet needs an even latitude count of at least {2 * domain} (2 rows per band), e.g. --lat {fits}"


def latitudes(lat: int) -> np.ndarray:
    """The synthetic field's latitudes in degrees, 90 to -90."""
    return np.linspace(90.0, -90.0, lat)


class Job:
    """The training-loop options the distributed run and the one-process reference share."""

    def __init__(self, args, manager=None):
        self.args, self.manager = args, manager
        self.rank0 = manager is None or manager.comm.Get_rank() == 0

    def autocast(self, x: torch.Tensor):
        """bf16 autocast with ``--bf16`` (the norm statistics stay float32), else nothing."""
        return torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.args.bf16)


def train(model, batches, steps, lr, loss_fn, manager=None, clip=None, *, job=None, start=0, ckpt=None) -> list[float]:
    """The loss curve of steps ``start`` to ``steps`` of SGD on ``(x, y)`` batches.

    On bands (``manager`` given), ``loss_fn`` returns the band's share of the
    global loss; the gradients are reduced (by FSDP2 and its domain-sum hook
    with ``--fsdp``, else by credit_mpi.reduce_gradients), the logged value is
    the global loss and clipping uses the global norm. ``ckpt``: a
    :class:`Checkpointing` that restores the state at ``start`` and saves
    every ``--checkpoint-every`` steps. With ``job`` and a manager, rank 0
    prints one line per step (loss, step time, samples/s).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if ckpt is not None:
        start = ckpt.resume(model, opt)
    fsdp = job is not None and job.args.fsdp and manager is not None
    curve = []
    for step, (x, y) in enumerate(itertools.islice(batches, start, steps), start):
        began = time.perf_counter()
        opt.zero_grad()
        with job.autocast(x) if job is not None else contextlib.nullcontext():
            out = model(x)
        loss = loss_fn(out.to(y.dtype), y)
        loss.backward()
        if manager is not None:
            if not fsdp:
                credit_mpi.reduce_gradients(model.parameters(), manager)
            value = global_loss(loss, manager)
            if clip is not None:  # FSDP2's DTensor gradients: torch's clip takes the norm over the mesh
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if fsdp else clip_grad_norm_(model.parameters(), clip, manager)
        else:
            value = float(loss.detach())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        curve.append(value)
        opt.step()
        if manager is not None and job is not None:
            job_progress(job, step, value, time.perf_counter() - began, x.shape[0] * manager.data_parallel_size)
        if ckpt is not None:
            ckpt.after(step + 1, model, opt)
    return curve


def job_progress(job: Job, step: int, loss: float, seconds: float, samples: int) -> None:
    """Rank 0's line for one step: the global loss, the step's wall time and the global samples per second."""
    if job.rank0:
        print(f"step {step:4d}  loss {loss:.6e}  {seconds * 1e3:8.1f} ms  {samples / seconds:8.1f} samples/s", flush=True)


class Checkpointing:
    """``--checkpoint PATH``: resume from it (``--resume``), save every ``--checkpoint-every`` steps, ``--crash-after``."""

    def __init__(self, args, manager):
        self.args, self.manager = args, manager

    def resume(self, model, opt) -> int:
        """The step to start from: the checkpoint's with ``--resume`` (when the file exists), else 0."""
        if not (self.args.resume and os.path.exists(self.args.checkpoint)):  # the same file system on every rank
            return 0
        info = credit_mpi.nn.load_checkpoint(self.args.checkpoint, model, self.manager, optimizer=opt)
        if self.manager.comm.Get_rank() == 0:
            print(f"resumed from {self.args.checkpoint} at step {info['step']}", flush=True)
        return info["step"]

    def after(self, step: int, model, opt) -> None:
        """After ``step`` steps: save when due; with ``--crash-after`` die like a killed job (no cleanup)."""
        every = self.args.checkpoint_every
        if every and step % every == 0:
            credit_mpi.nn.save_checkpoint(self.args.checkpoint, model, self.manager, optimizer=opt, step=step)
        if self.args.crash_after is not None and step == self.args.crash_after:
            sys.stdout.flush()
            os._exit(CRASHED)


def fsdp_shard(model: nn.Module, manager) -> nn.Module:
    """FSDP2 over the data-parallel mesh dim, the domain sum in its all-reduce hook (docs/torch_bridge.rst)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = manager.device_mesh["dp"]
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def domain_sum(reduced: torch.Tensor) -> None:  # the reduce-scattered (sample-averaged) shard: add the bands
        dist.all_reduce(reduced, group=manager.torch_domain_group)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(domain_sum)
    return model


def repeat(x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same (full) batch every step."""
    while True:
        yield x, y


def two_d(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """BandDataset's (B, C, 1, H, W) history/forecast of one time each as the model's (B, C, H, W)."""
    return batch["x"][:, :, 0], batch["y"][:, :, 0]


def band_batches(dataset, batch: int, seed: int, workers: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: its replica's samples (the dataset's data-parallel sampler), its band, epoch after epoch."""
    sampler = dataset.sampler(shuffle=True, seed=seed)  # collective over every rank: call it on all of them
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context="spawn" if workers else None,
        persistent_workers=workers > 0,
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for b in loader:
            yield two_d(b)
        epoch += 1


def global_batches(whole, replicas: int, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The single-process batches: step k's is every replica's k-th batch, replica 0 first, from the whole store."""
    samplers = [
        torch.utils.data.DistributedSampler(whole, num_replicas=replicas, rank=r, shuffle=True, seed=seed)
        for r in range(replicas)
    ]  # the same samplers as BandDataset.sampler(shuffle=True, seed=seed) on each data-parallel rank
    epoch = 0
    while True:
        order = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            order.append(list(sampler))
        for start in range(0, len(order[0]), batch):
            indices = [i for mine in order for i in mine[start : start + batch]]
            yield two_d(torch.utils.data.default_collate([whole[i] for i in indices]))
        epoch += 1


def make_store(path: str, trajectory: torch.Tensor, manager) -> None:
    """Write the trajectory as a Zarr store: each rank of data-parallel group 0 writes its band (write_bands).

    The other groups hold the same samples and write nothing (two groups
    writing one store would race). Collective over every rank: an error in
    the writing group is raised on every rank.
    """
    import xarray as xr

    from credit_mpi import io as cio

    steps, _, lat, lon = trajectory.shape
    data = shard_tensor(trajectory.numpy(), -2, manager, uneven=True)  # this rank's rows, as the model gets them
    band = xr.Dataset(
        {name: (("time", "latitude", "longitude"), data[:, c]) for c, name in enumerate(VARIABLES)},
        coords={"time": np.arange(steps), "latitude": shard_tensor(latitudes(lat), 0, manager, uneven=True),
                "longitude": np.arange(lon) * 360.0 / lon},
    )

    def write() -> None:
        if manager.dp_rank == 0:
            cio.write_bands(band, path, manager, chunks={"time": 1})  # one time per chunk: a sample reads its own

    allgather_or_raise(manager.comm, write)  # also the barrier: the store is complete when it returns


def store_data(args, manager, solo, replicas: int):
    """(band batches, reference batches or None, latitudes, longitudes, channels) read from ``args.store``."""
    from credit_mpi import io as cio

    box = []  # the dataset, built on every rank; a failure on one domain group is raised on every rank
    allgather_or_raise(manager.comm, lambda: box.append(cio.BandDataset(args.store, list(args.variables), manager)))
    dataset = box[0]
    whole = cio.BandDataset(args.store, list(args.variables), solo)  # one process: the whole store, lazily
    coords = cio.open_band(args.store, solo)
    lat, nlon = coords["latitude"].values, coords.sizes["longitude"]
    coords.close()
    batch = args.batch or args.samples
    bands = band_batches(dataset, batch, args.seed, args.workers)
    reference = global_batches(whole, replicas, batch, args.seed) if manager.comm.Get_rank() == 0 else None
    return bands, reference, lat, nlon, dataset.channels


def memory_data(args, manager, replicas: int):
    """(band batches, reference batches or None, latitudes, longitudes, channels) of the field built in memory."""
    trajectory = era5_like(args.samples * replicas, args.lat, args.lon, seed=1)
    x, y = trajectory[:-1], trajectory[1:]
    mine = slice(manager.dp_rank * args.samples, (manager.dp_rank + 1) * args.samples)
    bands = repeat(shard_tensor(x[mine], -2, manager, uneven=True), shard_tensor(y[mine], -2, manager, uneven=True))
    reference = repeat(x, y) if manager.comm.Get_rank() == 0 else None
    return bands, reference, latitudes(args.lat), args.lon, len(VARIABLES)


def parse(argv: list[str] | None, world: int) -> argparse.Namespace:
    """The command line, checked: the same verdict on every rank (they all parse the same arguments)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--steps", type=int, default=20, help="optimizer steps (in all, counting those before a --resume)")
    add("--data-parallel", type=int, default=1, help="data-parallel groups; the ranks are cut into this many domain groups")
    add("--lat", type=int, default=32, help="latitudes of the synthetic field")
    add("--lon", type=int, default=64, help="longitudes of the synthetic field")
    add("--samples", type=int, default=2, help="samples per data-parallel rank")
    add("--clip", type=float, default=None, help="clip the global gradient norm to this value")
    add("--store", default=None, help="read the samples from this Zarr store through BandDataset")
    add("--make-store", action="store_true", help="first write the synthetic field to --store")
    add("--variables", nargs="+", default=list(VARIABLES), help="the store's variables (channels)")
    add("--batch", type=int, default=None, help="samples per replica and step (default --samples)")
    add("--seed", type=int, default=0, help="seed of the data-parallel sampler's shuffle")
    add("--workers", type=int, default=0, help="DataLoader worker processes (spawn)")
    add("--fsdp", action="store_true", help="shard parameters and optimizer state over the data-parallel group (FSDP2)")
    add("--bf16", action="store_true", help="bf16 autocast (float32 model; compared with one process at bf16 tolerance)")
    add("--compile", action="store_true", help="torch.compile the converted model (graph breaks at the collectives)")
    add("--compile-backend", default="aot_eager", help="torch.compile backend (inductor needs a C++ compiler)")
    add("--checkpoint", default="unet_checkpoint.pt", help="checkpoint file (credit_mpi.nn.save_checkpoint)")
    add("--checkpoint-every", type=int, default=0, help="save a checkpoint every this many steps (0: never)")
    add("--resume", action="store_true", help="resume from --checkpoint when it exists")
    add("--crash-after", type=int, default=None, help=f"die (exit {CRASHED}, no cleanup) after this step, to test --resume")
    add("--log", default=None, help="rank 0 writes the loss curve here as JSON ({'steps': [...], 'loss': [...]})")
    add("--plot", default=None, help="rank 0 plots the loss curves to this image (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.make_store and args.store is None:
        parser.error("--make-store needs --store PATH")
    for name in ("steps", "samples", "batch", "workers", "data_parallel", "checkpoint_every"):
        value, least = getattr(args, name), 1 if name in ("samples", "batch", "data_parallel") else 0
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if world % args.data_parallel:
        fits = ", ".join(str(n) for n in range(args.data_parallel, 4 * args.data_parallel + 1, args.data_parallel))
        parser.error(
            f"--data-parallel {args.data_parallel} does not divide the {world} rank(s) into domain groups of equal size; "
            f"run on a multiple of {args.data_parallel} ranks (-n {fits}) or pick a divisor of {world}"
        )
    return args


def write_curves(args, curve: list[float], reference: list[float], start: int) -> None:
    """Rank 0: ``--log`` (JSON) and ``--plot`` (matplotlib, optional)."""
    steps = list(range(start, start + len(curve)))
    if args.log:
        with open(args.log, "w") as f:
            json.dump({"steps": steps, "loss": curve}, f)
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot: matplotlib is not installed; no plot", flush=True)
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.semilogy(range(len(reference)), reference, "k-", label="one process")
        ax.semilogy(steps, curve, "o", mfc="none", label="bands")
        ax.set_xlabel("step")
        ax.set_ylabel("latitude-weighted MSE")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"loss plot written to {args.plot}", flush=True)


def cast(batches, dtype: torch.dtype):
    """The batches in the model's dtype (float32 with --bf16: autocast casts float32, never float64)."""
    for x, y in batches:
        yield x.to(dtype), y.to(dtype)


def main(argv: list[str] | None = None) -> int:
    world = MPI.COMM_WORLD
    args = parse(argv, world.Get_size())
    domain = world.Get_size() // args.data_parallel
    manager = credit_mpi.DomainParallelManager(None, domain)
    solo = credit_mpi.DomainParallelManager(None, 1, comm=MPI.COMM_SELF)  # the one-process reference
    replicas = manager.data_parallel_size
    dtype = torch.float32 if args.bf16 else torch.float64
    try:
        if args.store is None:
            bands, reference, lat, nlon, channels = memory_data(args, manager, replicas)
        else:
            if args.make_store:
                make_store(args.store, era5_like(args.samples * replicas, args.lat, args.lon, seed=1), manager)
            bands, reference, lat, nlon, channels = store_data(args, manager, solo, replicas)
        torch.manual_seed(0)
        ref = UNet(channels).to(dtype)
        model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager)
        batch = args.batch or args.samples
        try:  # a dry run on the meta device, no MPI: the same outcome on every rank
            plan = credit_mpi.nn.describe(model, (batch, channels, len(lat), nlon), manager=manager)
        except RuntimeError as exc:  # e.g. an odd latitude count: the skip connection cannot join, on any layout
            raise ValueError(f"--lat {len(lat)}: the UNet does not run on this field ({exc}); {fitting(len(lat), domain)}") from exc
        if world.Get_rank() == 0:
            print(plan, flush=True)
        check_layout(plan, len(lat), domain)  # the same verdict on every rank (no MPI), before the first step
        if args.fsdp:
            credit_mpi.init_torch_distributed(manager)  # gloo on CPU, NCCL when every rank has its own GPU
            model = fsdp_shard(model, manager)
        trained = torch.compile(model, backend=args.compile_backend) if args.compile else model
        loss_fn = LatitudeWeightedMSELoss(lat, manager)  # this band's weights, the global row count
        ckpt = Checkpointing(args, manager)
        curve = train(trained, cast(bands, dtype), args.steps, 0.05, loss_fn, manager, args.clip, job=Job(args, manager), ckpt=ckpt)
    except (ValueError, TypeError, credit_mpi.DomainParallelError):
        # credit_mpi raises these on every rank alike (agreed before any MPI call), so every rank frees here;
        # anything else may be one rank's: that rank exits and the launcher ends the job (no collective free)
        solo.free()
        manager.free()
        raise
    start = args.steps - len(curve)
    if world.Get_rank() == 0:  # the single-process run: the same model, data and loss on the whole field, every step
        reference = train(ref, cast(reference, dtype), args.steps, 0.05, LatitudeWeightedMSELoss(lat, solo), clip=args.clip, job=Job(args))
    reference = world.bcast(reference, root=0)
    solo.free()
    manager.free()
    rel = 3e-2 if args.bf16 else 1e-9  # bf16 keeps 8 bits: the bands round differently from one process
    ok = all(math.isclose(a, b, rel_tol=rel, abs_tol=1e-14) for a, b in zip(curve, reference[start:], strict=True))
    if world.Get_rank() == 0:
        source = f"store {args.store}" if args.store else "memory"
        worst = max((abs(a - b) / abs(b) for a, b in zip(curve, reference[start:], strict=True) if b), default=0.0)
        print(f"steps {start}-{args.steps - 1} on {domain} band(s) x {replicas} group(s) against one process: "
              f"largest relative difference {worst:.2e} (tolerance {rel:g})")
        print(f"loss curves equal (data from {source})" if ok else "LOSS CURVES DIFFER", flush=True)
        write_curves(args, curve, reference, start)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
