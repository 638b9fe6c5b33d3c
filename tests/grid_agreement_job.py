"""The agreement rule on the 2-D domain grid, as a standalone MPI program (random one-rank perturbations).

Launched by tests/test_agreement_property.py under mpiexec (not collected by pytest):

    mpiexec -n N python tests/grid_agreement_job.py --seed S --trials K

As tests/agreement_job.py, on every grid the world size allows (and on no
``domain_grid``, an ``(n, 1)`` grid without a Cartesian communicator): each
trial picks, from a random stream that is the same on every rank, a grid, a
2-D call (halo_exchange with (lat, lon) widths and boundaries,
gather_tensor, scatter_tensor, shard_tensor and shard_batch with
``check="collective"``), and one perturbation applied on ONE random rank:
the 1-D/2-D decision (a single dim, a single width, a single boundary), the
widths, the boundaries, the dims' order, the block's rows, the array's
dtype, kind, ndim, other dims, the check mode, uneven, the root. The rule:
every rank raises the same exception type (one of credit_mpi's documented
errors), or every rank succeeds with the single-process result; after each
trial a valid gather works on every rank. Every manager has a watchdog
deadline (``--timeout``): a hang ends the job with the watchdog's report.
Prints one summary line and exits non-zero on a violation.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

import credit_mpi
from credit_mpi.layout import offsets
from credit_mpi.partition import band_sizes

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from agreement_job import as_kind, judge, outcome, perturb_array, report, to_numpy  # noqa: E402 (the 1-D job's helpers)
from halo_reference import pad_numpy  # noqa: E402 (the tests' single-process reference)

OPERATIONS = ["halo", "gather", "shard_tensor", "shard_batch", "scatter"]
LAT = ["zero", "periodic", "reflect", "earth"]
LON = ["periodic", "zero", "reflect"]
LON_MODES = {"zero": "constant", "periodic": "wrap", "reflect": "reflect"}
ARRAY = ["dtype", "other-dim-size", "ndim", "kind", "list"]
DECISION = ["single-dim", "dims-swapped"]  # the 1-D/2-D decision and the dims' order
PERTURBATIONS = {
    "halo": ["none", *DECISION, "single-width", "single-boundary", "width-lat", "width-lon", "boundary-lat",
             "boundary-lon", "check", "block-rows", *ARRAY],
    "gather": ["none", *DECISION, "check", "block-rows", "block-cols", *ARRAY],
    "shard_tensor": ["none", *DECISION, "check", "uneven", *ARRAY],
    "shard_batch": ["none", *DECISION, "check", "uneven", "transport", *ARRAY],
    "scatter": ["none", *DECISION, "root", "uneven", *ARRAY],
}


def grids(n: int) -> list:
    return [None] + [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def draw(rng: np.random.Generator, n: int, managers: list) -> SimpleNamespace:
    """One trial (the same on every rank)."""
    g = int(rng.integers(len(managers)))
    op = OPERATIONS[rng.integers(len(OPERATIONS))]
    t = SimpleNamespace(grid_index=g, op=op, perturbation=PERTURBATIONS[op][rng.integers(len(PERTURBATIONS[op]))])
    rows, cols = managers[g].domain_grid
    t.odd, t.n, t.root = int(rng.integers(n)), n, int(rng.integers(n))
    t.kind = "torch" if rng.integers(2) else "numpy"
    t.uneven = bool(rng.integers(2))
    t.shape = (rows * 3 + (int(rng.integers(1, rows)) if t.uneven and rows > 1 else 0), cols * 4 + 2 * t.uneven)
    t.width = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
    t.boundary = (LAT[rng.integers(len(LAT))], LON[rng.integers(len(LON))])
    t.g = rng.standard_normal((2, *t.shape))
    t.heights, t.widths = band_sizes(t.shape[0], rows, True), band_sizes(t.shape[1], cols, True)
    return t


def window(a: np.ndarray, heights: list, widths: list, rank: int, cols: int, hy: int = 0, hx: int = 0) -> np.ndarray:
    """Domain rank ``rank``'s block of ``a`` (plus ``hy`` rows and ``hx`` columns each side of a padded ``a``)."""
    i, j = divmod(rank, cols)
    y0, x0 = offsets(heights)[i], offsets(widths)[j]
    return a[..., y0 : y0 + heights[i] + 2 * hy, x0 : x0 + widths[j] + 2 * hx]


def perturbed(a: np.ndarray, p: str, kind: str):
    """The odd rank's array for the array perturbations (None for the others); "other-dim-size" cuts the channels."""
    return as_kind(a[:1], kind) if p == "other-dim-size" else perturb_array(a, p, kind)


def field(t: SimpleNamespace, cols: int) -> tuple[np.ndarray, list, list]:
    """The global field the ranks' blocks make up, with its blocks' heights and widths.

    A block with one row (column) less on the odd rank is a legal layout
    where its grid row (column) is alone (one column: any heights tile; one
    row: any widths): the field then has that row (column) less.
    """
    g, heights, widths = t.g, list(t.heights), list(t.widths)
    i, j = divmod(t.odd, cols)
    if t.perturbation == "block-rows":
        g = np.delete(g, offsets(heights)[i] + heights[i] - 1, axis=1)
        heights[i] -= 1
    if t.perturbation == "block-cols":
        g = np.delete(g, offsets(widths)[j] + widths[j] - 1, axis=2)
        widths[j] -= 1
    return g, heights, widths


def run(t: SimpleNamespace, m, rank: int):
    """This rank's call."""
    p = t.perturbation if rank == t.odd else "none"
    cols = m.domain_grid[1]
    dim = {"single-dim": -2, "dims-swapped": (-1, -2)}.get(p, (-2, -1))
    check = p != "check"
    if t.op in ("halo", "gather"):
        block = window(t.g, t.heights, t.widths, rank, cols)
        if p == "block-rows":
            block = block[:, :-1]
        if p == "block-cols":
            block = block[:, :, :-1]
        x = perturbed(block, p, t.kind)
        x = as_kind(block, t.kind) if x is None else x
        if t.op == "gather":
            return credit_mpi.gather_tensor(x, dim, m, check=check)
        hy, hx = t.width
        width = {"single-width": hy, "single-dim": hy, "width-lat": (hy + 1, hx), "width-lon": (hy, hx + 1)}.get(p, (hy, hx))
        lat, lon = t.boundary
        boundary = {"single-boundary": lat, "single-dim": lat, "boundary-lat": (LAT[(LAT.index(lat) + 1) % 4], lon),
                    "boundary-lon": (lat, LON[(LON.index(lon) + 1) % 3])}.get(p, (lat, lon))
        return credit_mpi.halo_exchange(x, width, dim, m, boundary=boundary, check=check)
    uneven = t.uneven != (p == "uneven")
    if t.op == "scatter":
        root = (t.root + 1) % t.n if p == "root" else t.root
        x = None
        if m.domain_rank == root:
            x = perturbed(t.g, p, t.kind)
            x = as_kind(t.g, t.kind) if x is None else x
        return credit_mpi.scatter_tensor(x, dim, m, root=root, uneven=uneven)
    g = t.g if t.op == "shard_tensor" else t.g[None]
    x = perturbed(g, p, t.kind)
    x = as_kind(g, t.kind) if x is None else x
    mode = "local" if p == "check" else "collective"
    if t.op == "shard_tensor":
        return credit_mpi.shard_tensor(x, dim, m, uneven=uneven, check=mode)
    transport = "MPI" if p == "transport" else "mpi"
    return credit_mpi.shard_batch({"x": x, "meta": 7}, dim, dim, m, uneven=uneven, check=mode, transport=transport)["x"]


def correct(t: SimpleNamespace, result, m, rank: int) -> bool:
    """Whether a successful call gave the single-process result on this rank."""
    rows, cols = m.domain_grid
    got = to_numpy(result)
    g, heights, widths = field(t, cols)
    if t.op == "gather":
        return np.array_equal(got, g)
    if t.op == "halo":
        (hy, hx), (lat, lon) = t.width, t.boundary
        padded = np.pad(pad_numpy(g, hy, 1, lat), [(0, 0), (0, 0), (hx, hx)], mode=LON_MODES[lon])
        return np.array_equal(got, window(padded, heights, widths, rank, cols, hy, hx))
    if t.op == "scatter":  # the root's array decides (the others pass None)
        a = perturbed(t.g, t.perturbation if t.root == t.odd else "none", "numpy")
        a = t.g if a is None else to_numpy(a)
        heights, widths = band_sizes(a.shape[-2], rows, t.uneven), band_sizes(a.shape[-1], cols, t.uneven)
        expected = window(a, heights, widths, rank, cols)
        return got.dtype == expected.dtype and np.array_equal(got, expected)
    expected = window(t.g, heights, widths, rank, cols)
    return np.array_equal(got, expected if t.op != "shard_batch" else expected[None])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=60.0, help="the watchdog's deadline (a hang aborts the job)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    managers = [credit_mpi.DomainParallelManager(None, n, domain_grid=grid, timeout=args.timeout) for grid in grids(n)]
    rng = np.random.default_rng(args.seed)
    counts: Counter = Counter()
    violations = []
    for trial in range(args.trials):
        t = draw(rng, n, managers)
        m = managers[t.grid_index]
        probe = window(t.g, t.heights, t.widths, rank, m.domain_grid[1])

        def sequence(t=t, m=m, probe=probe):
            ok = correct(t, run(t, m, rank), m, rank)
            credit_mpi.gather_tensor(probe, (-2, -1), m)  # a rank that skipped a collective meets the others here
            return ok

        every = world.allgather(outcome(sequence))
        label = f"trial {trial}: {t.op} / {t.perturbation} on rank {t.odd}, grid {m.domain_grid} (kind {t.kind}, uneven {t.uneven})"
        judge(label, t.perturbation, every, counts, violations)
        again = outcome(lambda m=m, probe=probe, t=t: np.array_equal(credit_mpi.gather_tensor(probe, (-2, -1), m), t.g))
        if world.allgather(again) != [("ok", True)] * n:
            violations.append(f"{label}: the next valid gather failed: {world.allgather(again)}")
            break
    for m in managers:
        m.free()
    report("grid_agreement_job", n, args.seed, args.trials, counts, violations)

if __name__ == "__main__":
    main()
