"""The one-rank perturbation property of the model side and band IO, as a standalone MPI program.

Launched by tests/test_nn_properties.py under mpiexec (not collected by pytest):

    mpiexec -n N python tests/nn_property_job.py --seed S --trials K --dir D

Each trial draws (from a stream that is the same on every rank) a converted
model or an IO call and one perturbation applied on ONE random rank (or
none: the control trials): the model's mode (eval), the autograd state, the
input dtype, another width, another band split (legal: the result must be
exact), a custom converter on that rank only, an exception in user code
between layers, another setting of a layer; for IO, another store, another variable set, a read that
fails, a write that fails. The rule: every rank raised the same exception
type, or every rank succeeded with the single-process result; afterwards a
valid converted forward works on every rank (the group is in step), and
after a failed write the store is refused as incomplete on every rank. A
hang is caught by the launcher's timeout. Prints one summary line and exits
non-zero on a violation.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import credit_mpi
from credit_mpi.nn import convert_to_domain_parallel, keep_local
from credit_mpi.partition import band_sizes

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from agreement_job import outcome, report  # noqa: E402 (the agreement property's: one rank's outcome, AGREEMENT_JOB_TRACE=1 prints it)

warnings.filterwarnings("ignore")


class FailsOn(nn.Module):
    """User code between layers that raises on one rank (``rank`` -1: never)."""

    def __init__(self):
        super().__init__()
        self.rank = -1

    def forward(self, x):
        if credit_mpi.get_domain_parallel_manager().domain_rank == self.rank:
            raise RuntimeError("injected failure in user code")
        return x


def skipnet():
    class SkipNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.inc, self.down = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, stride=2, padding=1)
            self.up, self.out = nn.Upsample(scale_factor=2), nn.Conv2d(6, 2, 1)

        def forward(self, x):
            a = torch.relu(self.inc(x))
            return self.out(torch.cat([a, self.up(self.down(a))], dim=1))

    return SkipNet()


MODELS = {
    "conv": lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), FailsOn(), nn.Conv2d(2, 2, 3, padding=1)),
    "reflect": lambda: nn.Sequential(FailsOn(), nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")),
    "groupnorm": lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), FailsOn(), nn.GroupNorm(1, 2)),
    "batchnorm": lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), FailsOn(), nn.BatchNorm2d(2)),
    "pool_up": lambda: nn.Sequential(nn.MaxPool2d(2), FailsOn(), nn.Upsample(scale_factor=2, mode="bilinear")),
    "convT": lambda: nn.Sequential(FailsOn(), nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1)),
    "mean_conv": lambda: nn.Sequential(nn.AdaptiveAvgPool2d((1, None)), FailsOn(), nn.Conv2d(2, 2, 3, padding=1)),
    "skip": lambda: nn.Sequential(FailsOn(), skipnet()),
}
LAYERS = (nn.Conv2d, nn.ConvTranspose2d, nn.GroupNorm, nn.BatchNorm2d, nn.MaxPool2d, nn.Upsample, nn.AdaptiveAvgPool2d)
NN_PERTURBATIONS = ["none", "eval", "no-grad", "dtype", "width", "band-rows", "custom", "raise", "setting"]
IO_PERTURBATIONS = ["none", "store", "variables", "read-fail", "write-fail"]
LEGAL = {"none", "band-rows"}  # success is legal (and must be exact); the others must raise alike


def draw(rng: np.random.Generator, n: int) -> SimpleNamespace:
    t = SimpleNamespace(n=n, odd=int(rng.integers(n)))
    t.area = "io" if rng.random() < 0.25 else "nn"
    if t.area == "nn":
        t.model = sorted(MODELS)[rng.integers(len(MODELS))]
        t.perturbation = NN_PERTURBATIONS[rng.integers(len(NN_PERTURBATIONS))]
        extra = 2 * int(rng.integers(0, 2))  # drawn always: the stream stays the same on every rank
        t.rows = 4 * n + (0 if t.model == "skip" else extra)  # even rows (pooling); the skip joins on even bands only
        t.sizes = band_sizes(t.rows, n, True)
        if t.perturbation == "band-rows" and n > 1:
            other = (t.odd + 1) % n
            if t.sizes[t.odd] > 3:
                t.sizes[t.odd] -= 2
                t.sizes[other] += 2
        t.x = rng.standard_normal((2, 2, t.rows, 6))
        t.seed = int(rng.integers(1 << 30))
    else:
        t.perturbation = IO_PERTURBATIONS[rng.integers(len(IO_PERTURBATIONS))]
        t.rows = 3 * n + int(rng.integers(0, n))
        t.data = rng.standard_normal((2, t.rows, 4))
    return t


def run_nn(t, manager, rank):
    p = t.perturbation if rank == t.odd else "none"
    torch.manual_seed(t.seed)
    ref = MODELS[t.model]().double()
    custom = {FailsOn: keep_local}
    if p == "custom":  # this rank only: its layers would make no collective
        custom.update(dict.fromkeys(LAYERS, keep_local))
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager, custom_converters=custom)
    if p == "eval":
        model.eval()
    if p == "raise":
        next(m for m in model.modules() if isinstance(m, FailsOn)).rank = rank
    if p == "setting":  # this rank's first layer changed after conversion
        change(next(m for m in model.modules() if isinstance(m, LAYERS)))
    start = sum(t.sizes[:rank])
    x = torch.from_numpy(t.x[:, :, start : start + t.sizes[rank]].copy())
    if p == "dtype":
        x = x.float()
    if p == "width":
        x = x[..., :-1]
    x.requires_grad_(p != "no-grad")
    out = model(x)
    out.sum().backward()
    whole = ref(torch.from_numpy(t.x))
    if out.shape[-2] == 1 and whole.shape[-2] == 1:  # replicated
        return torch.allclose(out, whole, rtol=1e-10, atol=1e-12)
    parts = manager.domain_group.allgather(out.detach().numpy())
    return np.allclose(np.concatenate(parts, -2), whole.detach().numpy(), rtol=1e-10, atol=1e-12)


def change(layer: nn.Module) -> None:
    """Another setting of ``layer`` (a pooling's output size, a window's padding)."""
    if isinstance(layer, nn.AdaptiveAvgPool2d):
        layer.output_size = (2, None)
    elif isinstance(layer.padding, tuple):
        layer.padding = tuple(p + 1 for p in layer.padding)
    else:
        layer.padding = layer.padding + 1


def _raise(block):
    raise OSError("injected: unreadable chunk")


def run_io(t, manager, rank, folder, trial):
    import dask.array as da
    import xarray as xr

    from credit_mpi import io as cio

    p = t.perturbation if rank == t.odd else "none"
    sizes = band_sizes(t.rows, t.n, True)
    start = sum(sizes[:rank])
    band = t.data[:, start : start + sizes[rank]]
    variables = {"t": (("time", "latitude", "longitude"), band), "s": (("time", "latitude", "longitude"), band * 2)}
    if p == "variables":
        del variables["s"]
    ds = xr.Dataset(variables, coords={"latitude": np.arange(start, start + sizes[rank], dtype=float)})
    if p == "read-fail":
        lazy = da.from_array(band, chunks=-1).map_blocks(_raise, dtype=band.dtype)
        ds["t"] = (("time", "latitude", "longitude"), lazy)
    path = os.path.join(folder, f"trial{trial}{'-other' if p == 'store' else ''}.zarr")
    original = xr.Dataset.to_zarr
    if p == "write-fail":
        def fail(self, *args, region=None, **kwargs):
            if region is not None:
                raise OSError("injected: disk full")
            return original(self, *args, region=region, **kwargs)

        xr.Dataset.to_zarr = fail
    try:
        cio.write_bands(ds, path, manager)
    except Exception:
        t.failed_write = path
        raise
    finally:
        xr.Dataset.to_zarr = original
    back = cio.open_band(path, manager)
    return np.array_equal(back["t"].values, band) and np.array_equal(back["s"].values, band * 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    manager = credit_mpi.initialize_domain_parallel(n, n)
    rng = np.random.default_rng(args.seed)
    counts: Counter = Counter()
    violations = []
    probe_model = convert_to_domain_parallel(nn.Conv2d(2, 2, 3, padding=1).double(), manager)
    probe = torch.zeros(1, 2, 2, 3, dtype=torch.float64)
    for trial in range(args.trials):
        t = draw(rng, n)
        fn = (lambda t=t: run_nn(t, manager, rank)) if t.area == "nn" else (lambda t=t, k=trial: run_io(t, manager, rank, args.dir, k))
        if os.environ.get("AGREEMENT_JOB_TRACE"):
            print(f"rank {rank} trial {trial}: {t.area} {getattr(t, 'model', '')} / {t.perturbation} on {t.odd}", flush=True)
        kind, value = outcome(fn)
        every = world.allgather((kind, value))
        label = f"trial {trial}: {t.area} {getattr(t, 'model', '')} / {t.perturbation} on rank {t.odd}"
        if all(k == "ok" for k, _ in every):
            name = "ok"
            if not all(v for _, v in every):
                violations.append(f"{label}: succeeded with a wrong result: {every}")
            elif t.perturbation not in LEGAL and n > 1 and t.perturbation != "band-rows":
                violations.append(f"{label}: a perturbation that must raise succeeded")
        elif len(set(every)) == 1:
            name = every[0][1]
            if name not in ("ValueError", "TypeError", "DomainParallelError", "ConversionError"):
                violations.append(f"{label}: every rank raised {name}, not one of credit_mpi's documented errors")
        else:
            name = "mixed"
            violations.append(f"{label}: ranks differ: {every}")
        if t.perturbation == "none" and name != "ok":
            violations.append(f"{label}: the control failed: {every}")
        if t.area == "io" and t.perturbation == "write-fail" and name != "ok":  # the store must say it is incomplete
            from credit_mpi import io as cio

            path = getattr(t, "failed_write", None)
            refused = outcome(lambda path=path: cio.open_band(path, manager))
            if world.allgather(refused[0]) != ["error"] * n:
                violations.append(f"{label}: the store of the failed write opened on some rank")
        counts[f"{t.area}-{t.perturbation == 'none' and 'control' or 'perturbed'}-{name == 'ok' and 'ok' or 'error'}"] += 1
        counts[f"{t.area}:{t.perturbation}:{name}"] += 1
        again = outcome(lambda: tuple(probe_model(probe).shape) == (1, 2, 2, 3))
        if world.allgather(again) != [("ok", True)] * n:
            violations.append(f"{label}: the next valid forward failed: {world.allgather(again)}")
            break
    credit_mpi.destroy_domain_parallel()
    report("nn_property_job", MPI.COMM_WORLD.Get_size(), args.seed, args.trials, counts, violations)


if __name__ == "__main__":
    main()
