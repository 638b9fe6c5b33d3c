"""A converted model's step: the example UNet on 1, 2, 4 ranks in one run.

    mpiexec -n 4 python benchmarks/bench_model.py [--lat 360 --lon 720] [--iters 5] [--plot model.png]

Reported per domain size (world ranks 0..d-1; the others sleep): the saved
activation memory per rank (what autograd keeps for backward, counted with
saved_tensors_hooks) against the bound 1.1 x (one process / d) + the halo
rows, the slowest rank's median step time (forward, backward,
reduce_gradients) and its ratio to one rank's, and the communication share
(1 - the unconverted model's step on the band alone / the converted step),
the step with the convolutions' halos overlapped (credit_mpi.nn.conv.OVERLAP)
against that local step, and both steps against the converted step with every halo
replaced by a local pad of the same shape (credit_mpi.nn.conv.local_halos).
The measurements live in credit_mpi/cli/bench_model.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from mpi4py import MPI

from credit_mpi.cli.bench_model import measure, table


def unet():
    """examples/train_unet.py's model."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train_unet.py"
    spec = importlib.util.spec_from_file_location("train_unet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UNet


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lat", type=int, default=360)
    parser.add_argument("--lon", type=int, default=720)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", help="draw saved memory and step time per rank count (matplotlib)")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    sizes = [d for d in (1, 2, 4) if d <= world.Get_size()]
    rows = measure(unet(), (1, 2, args.lat, args.lon), sizes, args.iters)
    if world.Get_rank() == 0:
        print(f"example UNet, input (1, 2, {args.lat}, {args.lon}) float32, {args.iters} steps")
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if args.plot:
            plot(rows, args.plot)
    return 0


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(9, 3.5))
    mem.plot(ranks, [r["saved_mib"] for r in rows], "o-", label="saved per rank")
    mem.plot(ranks, [r["bound_mib"] for r in rows], "k--", label="1.1 x one/n + halo")
    mem.set(xlabel="ranks", ylabel="MiB", xticks=ranks, title="saved activations")
    mem.legend()
    step.bar([str(r) for r in ranks], [r["step_s"] for r in rows], label="step")
    step.bar([str(r) for r in ranks], [r["overlap_s"] for r in rows], label="step, overlap", alpha=0.7)
    step.bar([str(r) for r in ranks], [r["pad_s"] for r in rows], label="halos a local pad", alpha=0.6)
    step.bar([str(r) for r in ranks], [r["local_s"] for r in rows], label="compute alone", alpha=0.6)
    step.set(xlabel="ranks", ylabel="s", title="step time")
    step.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
