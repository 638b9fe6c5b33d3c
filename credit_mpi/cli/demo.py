"""End-to-end demo: an ERA5-sized global field, sharded, processed, gathered back, checked.

Run as ``credit-mpi demo`` (or ``python -m credit_mpi demo``) under MPI, e.g.
``mpiexec -n 4 credit-mpi demo``. Every rank builds the same synthetic field
on ERA5's 0.25-degree grid (721 x 1440, several channels; same seed within a
domain group), and then, with progress printed as it goes:

1. **shard**: each rank keeps its latitude band (``shard_tensor(...,
   uneven=True)``: 721 rows do not split evenly over 2, 4 or 8 ranks);
2. **halo + convolution**: each
   band gets one row of halo from its neighbours (zero at the poles) and goes
   through a 3 x 3 depthwise convolution, periodic in longitude; the gathered
   result is compared with the same convolution of the whole field in one
   process (float tolerance: arithmetic is involved);
3. **gather**: the bands are gathered back (``gather_tensor``) and compared
   bit for bit with the original field (pure data movement).

A summary gives the bytes each step moves between the ranks of one domain
group (what they receive in all: the gather's is ``D - 1`` times the field,
since each of the ``D`` ranks receives the bands it lacks) and its time per
step (median over ``--steps`` repetitions, slowest rank). Output comes from
rank 0 only. The exit status is 0 when every check passed on every rank.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..halo import halo_exchange
from ..manager import DomainParallelManager
from ..partition import band_sizes
from ..sharding import gather_tensor, shard_tensor
from .common import _mismatch_hint

__all__ = ["ERA5_LAT", "ERA5_LON", "add_arguments", "conv3x3", "run", "synthetic_field"]

ERA5_LAT, ERA5_LON = 721, 1440  # the 0.25-degree grid


def synthetic_field(batch: int, channels: int, lat: int, lon: int, seed: int = 0) -> np.ndarray:
    """A smooth-plus-noise (B, C, lat, lon) float32 field, the same on every rank for one seed."""
    rng = np.random.default_rng(seed)
    phi = np.linspace(-np.pi / 2, np.pi / 2, lat)[:, None]
    lam = np.linspace(0, 2 * np.pi, lon, endpoint=False)[None, :]
    base = np.cos(phi) * np.sin(3 * lam) + 0.5 * np.sin(2 * phi)
    noise = rng.standard_normal((batch, channels, lat, lon), dtype=np.float32)
    return (base[None, None] + 0.1 * noise).astype(np.float32)


def conv3x3(padded: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Depthwise 3 x 3 convolution of a (B, C, H + 2, W) array padded by one row above and below.

    Longitude is periodic (wraps around); the result has H rows. ``weights``
    is (C, 3, 3). The same arithmetic in the same order on a band as on the
    whole field, so results agree to float rounding.
    """
    h, w = padded.shape[-2] - 2, padded.shape[-1]
    wrapped = np.concatenate([padded[..., -1:], padded, padded[..., :1]], axis=-1)  # periodic longitude
    out = np.zeros(padded.shape[:-2] + (h, w), dtype=padded.dtype)
    for i in range(3):
        for j in range(3):
            out += weights[:, i, j][None, :, None, None] * wrapped[..., i : i + h, j : j + w]
    return out


def _at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (a usage error naming the valid values otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (shared by ``credit-mpi demo``)."""
    parser.add_argument("-d", "--domain-size", type=_at_least(1, "the domain size"), default=None,
                        help="ranks per domain group (default: all ranks)")
    parser.add_argument("-c", "--channels", type=_at_least(1, "the channel count"), default=8,
                        help="channels of the synthetic field (default: 8)")
    parser.add_argument("--lat", type=_at_least(1, "the latitude count"), default=ERA5_LAT,
                        help=f"latitudes, at least the domain size (default: {ERA5_LAT}, ERA5 0.25 deg)")
    parser.add_argument("--lon", type=_at_least(1, "the longitude count"), default=ERA5_LON,
                        help=f"longitudes (default: {ERA5_LON})")
    parser.add_argument("--steps", type=_at_least(1, "the step count"), default=5,
                        help="repetitions of each step to time (default: 5)")


def check_sizes(lat: int, d: int) -> None:
    """Every band needs one row at least: the halo is one row from each neighbour (same verdict on every rank)."""
    if lat < d:
        raise ValueError(
            f"--lat {lat} gives some of the {d} ranks of a domain group no latitude row; "
            f"use --lat {d} or more (or a smaller -d/--domain-size)"
        )


def _timed(comm: MPI.Comm, fn: Callable, steps: int):
    """Run ``fn`` ``steps`` times after a barrier each; (last result, median seconds of the slowest rank)."""
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, comm.allreduce(statistics.median(times), op=MPI.MAX)


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def run(args: argparse.Namespace, comm: MPI.Comm | None = None, say: Callable[..., None] | None = None) -> int:
    """Run the demo on ``comm`` (default ``COMM_WORLD``); ``say`` prints (rank 0 only by default).

    Returns:
        0 when every check passed on every rank, 1 otherwise.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if say is None:
        say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    size = comm.Get_size()
    d = size if args.domain_size is None else args.domain_size
    check_sizes(args.lat, d)
    checks: dict[str, bool] = {}
    summary = []
    with DomainParallelManager(None, d, comm=comm) as manager:
        dom = manager.domain_group
        if size == 1:
            say("single rank: nothing is split or moved (start it with e.g. `mpiexec -n 4 credit-mpi demo`)")
            if _mismatch_hint(comm):
                say("warning: a single MPI rank" + _mismatch_hint(comm))
        say(f"{size} rank(s); domain groups (ranks sharing one sample): {manager.domain_groups()}", flush=True)
        field = synthetic_field(1, args.channels, args.lat, args.lon, seed=manager.dp_rank)
        sizes = band_sizes(args.lat, d, uneven=True)
        row_bytes = field.nbytes // args.lat
        say(
            f"field (B, C, lat, lon) = {field.shape} float32, {field.nbytes / 2**20:.1f} MiB; "
            f"latitude bands over {d} rank(s): {sizes}",
            flush=True,
        )

        say("[1/3] shard: each rank keeps its latitude band ...", end=" ", flush=True)
        band, t_shard = _timed(dom, lambda: shard_tensor(field, dim=-2, manager=manager, uneven=True), args.steps)
        checks["shard"] = dom.allreduce(band.shape[-2] == sizes[manager.domain_rank], op=MPI.LAND)
        say(f"{t_shard * 1e3:.2f} ms", flush=True)
        summary.append(("shard_tensor", 0, t_shard))

        say("[2/3] halo exchange (1 row, zero at the poles) + 3x3 convolution ...", end=" ", flush=True)
        weights = np.random.default_rng(1).standard_normal((args.channels, 3, 3)).astype(np.float32) / 9
        padded, t_halo = _timed(
            dom, lambda: halo_exchange(band, 1, dim=-2, manager=manager, boundary="zero"), args.steps
        )
        conv, t_conv = _timed(dom, lambda: conv3x3(padded, weights), args.steps)
        out = gather_tensor(conv, dim=-2, manager=manager)
        pad = np.zeros_like(field[..., :1, :])
        expected = conv3x3(np.concatenate([pad, field, pad], axis=-2), weights)
        err = float(np.max(np.abs(out - expected))) if out.shape == expected.shape else float("inf")
        err = dom.allreduce(err, op=MPI.MAX)
        checks["halo + convolution"] = err <= 1e-5
        say(f"halo {t_halo * 1e3:.2f} ms, conv {t_conv * 1e3:.2f} ms; max |error| vs one process {err:.1e}", flush=True)
        # every interior boundary moves one row each way
        summary.append(("halo_exchange", 2 * (d - 1) * row_bytes, t_halo))
        summary.append(("3x3 convolution (local)", 0, t_conv))

        say("[3/3] gather: bands back into the global field on every rank ...", end=" ", flush=True)
        gathered, t_gather = _timed(dom, lambda: gather_tensor(band, dim=-2, manager=manager), args.steps)
        same = gathered.dtype == field.dtype and gathered.shape == field.shape and np.array_equal(gathered, field)
        checks["gather (bit for bit)"] = dom.allreduce(same, op=MPI.LAND)
        say(f"{t_gather * 1e3:.2f} ms", flush=True)
        # every rank receives every band but its own
        summary.append(("gather_tensor", (d - 1) * field.nbytes, t_gather))

    ok = comm.allreduce(all(checks.values()), op=MPI.LAND)
    say(f"\nper domain group, per step (median of {args.steps}, slowest rank):")
    say(f"  {'step':<26}{'bytes moved':>14}{'time':>12}")
    for name, moved, t in summary:
        say(f"  {name:<26}{_human(moved):>14}{t * 1e3:>9.2f} ms")
    say("  (bytes moved: what the ranks of one domain group receive in all, per step. halo: one row each way "
        f"across each of the {d - 1} boundaries between bands; gather: each of the {d} ranks receives the {d - 1} "
        f"band(s) it does not hold, {d - 1} x the field)")
    for name, passed in checks.items():
        say(f"check {name}: {'ok' if passed else 'FAILED'}")
    say("all checks passed on every rank" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1

