"""A property test of the agreement rule, as a standalone MPI program.

Launched by tests/test_agreement_property.py under mpiexec (not collected by pytest):

    mpiexec -n N python tests/agreement_job.py --seed S --trials K

Each trial picks, from a random stream that is the same on every rank, a
public collective (gather_tensor, halo_exchange, shard_tensor and
shard_batch with ``check="collective"``, scatter_tensor, reduce_gradients),
its arguments, and one perturbation applied on ONE random rank (or none: the
control trials). Every rank then runs the operation followed by a probe
gather (so that a rank that skipped a collective pairs with the others'
operation instead of with the next trial) and records ``("ok", correct?)``
or ``("error", exception type)`` for the first failure. The rule: every rank
raised the same exception type, or every rank succeeded with the result of
the single-process reference. After each trial a valid gather must work on
every rank (the group is in step again). A hang is caught by the launcher's
timeout. Prints one summary line and exits non-zero on a violation.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from mpi4py import MPI

import credit_mpi
from credit_mpi.partition import band_sizes

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from halo_reference import pad_numpy  # noqa: E402 (the tests' single-process reference)

OPERATIONS = ["gather", "halo", "shard_tensor", "shard_batch", "scatter", "reduce_gradients"]
BOUNDARIES = ["zero", "periodic", "reflect", "earth"]
# Perturbations per operation (applied on one rank). "none" is the control.
COMMON = ["transport-invalid", "transport-other", "check", "dtype", "other-dim-size", "ndim", "dim", "kind", "list"]
PERTURBATIONS = {
    "gather": ["none", *COMMON, "requires-grad", "out-read-only", "out-none", "out-given", "out-wrong-shape",
               "out-non-contiguous", "band-rows"],
    "halo": ["none", *COMMON, "width", "boundary", "requires-grad", "band-rows"],
    "shard_tensor": ["none", "check", "dtype", "other-dim-size", "ndim", "dim", "kind", "list", "uneven", "requires-grad"],
    "shard_batch": ["none", "transport-invalid", "transport-other", "check", "dtype", "other-dim-size", "ndim", "dim",
                    "kind", "list", "uneven", "requires-grad", "extra-key"],
    "scatter": ["none", "root", "uneven", "dim", "dtype", "other-dim-size", "ndim", "kind", "list"],
    "reduce_gradients": ["none", "check", "missing-grad", "extra-grad", "grad-dtype", "grad-size"],
}
# Perturbations after which success is legal (the result must then be right); the others may also succeed only
# with the right result, but are expected to raise.
LEGAL = {"none", "requires-grad", "band-rows"}


def draw(rng: np.random.Generator, n: int) -> SimpleNamespace:
    """One trial's operation, arguments and perturbation (the same on every rank)."""
    op = OPERATIONS[rng.integers(len(OPERATIONS))]
    perturbation = PERTURBATIONS[op][rng.integers(len(PERTURBATIONS[op]))]
    t = SimpleNamespace(op=op, perturbation=perturbation, odd=int(rng.integers(n)), n=n)
    t.kind = "torch" if rng.integers(2) else "numpy"
    if perturbation == "requires-grad":
        t.kind = "torch"
    t.uneven = bool(rng.integers(2))
    t.total = 3 * n + (int(rng.integers(1, n)) if t.uneven and n > 1 else 0)
    t.width = int(rng.integers(1, 3))
    t.boundary = BOUNDARIES[rng.integers(len(BOUNDARIES))]
    t.root = int(rng.integers(n))
    with_out = bool(rng.integers(2))  # drawn always, so the stream stays the same on every rank
    t.out = perturbation in ("out-read-only", "out-none", "out-wrong-shape", "out-non-contiguous") or (
        with_out and perturbation != "out-given")
    t.sizes = band_sizes(t.total, n, True)
    if perturbation == "band-rows" and n > 1:  # a legal other split: the odd rank gives a row to a neighbour
        other = (t.odd + 1) % n
        if t.sizes[t.odd] > 2:
            t.sizes[t.odd] -= 1
            t.sizes[other] += 1
    t.g = rng.standard_normal((2, t.total, 6))
    t.grads = [rng.integers(-8, 9, s).astype(np.float64) for s in [(n, 3, 2)] + [(n, 4), (n, 2)]]
    return t


def as_kind(a: np.ndarray, kind: str):
    return torch.from_numpy(np.ascontiguousarray(a)) if kind == "torch" else np.ascontiguousarray(a)


def to_numpy(a) -> np.ndarray:
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def perturb_array(a: np.ndarray, p: str, kind: str):
    """The odd rank's array for the array-property perturbations (None when ``p`` is not one)."""
    if p == "dtype":
        return as_kind(a.astype(np.float32), kind)
    if p == "other-dim-size":
        return as_kind(a[..., :-1], kind)
    if p == "ndim":
        return as_kind(a[None], kind)
    if p == "kind":
        return as_kind(a, "numpy" if kind == "torch" else "torch")
    if p == "list":
        return a.tolist()
    return None


def run(t: SimpleNamespace, manager, rank: int):
    """This rank's call; returns its result (compared by :func:`correct`)."""
    p = t.perturbation if rank == t.odd else "none"
    transport = {"transport-invalid": "MPI", "transport-other": "torch"}.get(p, "mpi")
    dim = 0 if p == "dim" else 1
    if t.op in ("gather", "halo"):
        start = sum(t.sizes[:rank])
        band = t.g[:, start : start + t.sizes[rank]]
        x = perturb_array(band, p, t.kind)
        if x is None:
            x = as_kind(band, t.kind)
        if p == "requires-grad":
            x.requires_grad_()
        if t.op == "halo":
            width = t.width + 1 if p == "width" else t.width
            boundary = BOUNDARIES[(BOUNDARIES.index(t.boundary) + 1) % 4] if p == "boundary" else t.boundary
            return credit_mpi.halo_exchange(x, width, dim, manager, boundary=boundary, check=p != "check", transport=transport)
        out = None
        if t.out or p == "out-given":
            out = as_kind(np.empty(t.g.shape), t.kind)
            if p == "out-read-only" and t.kind == "numpy":
                out.flags.writeable = False
            elif p == "out-read-only":  # torch's unwritable out: one that requires grad
                out.requires_grad_()
            elif p == "out-none":
                out = None
            elif p == "out-wrong-shape":
                out = as_kind(np.empty((2, t.total + 1, 6)), t.kind)
            elif p == "out-non-contiguous":
                out = as_kind(np.empty((6, t.total, 2)), t.kind).transpose(0, 2) if t.kind == "torch" else np.empty((6, t.total, 2)).transpose(2, 1, 0)
        return credit_mpi.gather_tensor(x, dim, manager, check=p != "check", out=out, transport=transport)
    if t.op in ("shard_tensor", "shard_batch"):
        g = t.g if t.op == "shard_tensor" else t.g[None]
        x = perturb_array(g, p, t.kind)
        if x is None:
            x = as_kind(g, t.kind)
        if p == "requires-grad":
            x.requires_grad_()
        uneven = (not t.uneven) if p == "uneven" else t.uneven
        check = "local" if p == "check" else "collective"
        if t.op == "shard_tensor":
            return credit_mpi.shard_tensor(x, dim, manager, uneven=uneven, check=check)
        batch = {"x": x, "meta": 7}
        if p == "extra-key":
            batch["y"] = as_kind(g, t.kind)
        return credit_mpi.shard_batch(batch, spatial_dims_4d=-3 if p == "dim" else -2, manager=manager, uneven=uneven,
                                      check=check, transport=transport)["x"]
    if t.op == "scatter":
        root = (t.root + 1) % t.n if p == "root" else t.root
        x = None
        if manager.domain_rank == root:
            x = perturb_array(t.g, p, t.kind)
            if x is None:
                x = as_kind(t.g, t.kind)
        uneven = (not t.uneven) if p == "uneven" else t.uneven
        return credit_mpi.scatter_tensor(x, dim, manager, root=root, uneven=uneven)
    # reduce_gradients: three parameters of three dtypes, this rank's gradients
    dtypes = [torch.float64, torch.float32, torch.bfloat16]
    if p == "grad-dtype":
        dtypes[0] = torch.float32
    params = []
    for i, (grads, dtype) in enumerate(zip(t.grads, dtypes, strict=True)):
        g = grads[rank]
        if p == "grad-size" and i == 1:
            g = g[:-1]
        param = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype))
        param.grad = torch.from_numpy(g.copy()).to(dtype)
        params.append(param)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient on every rank ...
    if p == "extra-grad":
        params[-1].grad = torch.ones(3)  # ... but this one
    if p == "missing-grad":
        params[0].grad = None
    credit_mpi.reduce_gradients(params, manager, check=p != "check")
    return [q.grad for q in params]


def correct(t: SimpleNamespace, result, manager, rank: int) -> bool:
    """Whether a successful call gave the single-process reference's result on this rank."""
    start, rows = sum(t.sizes[:rank]), t.sizes[rank]
    if t.op == "gather":
        return np.array_equal(to_numpy(result), t.g)
    if t.op == "halo":
        return np.array_equal(to_numpy(result), pad_numpy(t.g, t.width, 1, t.boundary)[:, start : start + rows + 2 * t.width])
    if t.op == "scatter":  # the root's arguments decide (the others' are ignored)
        rootp = t.perturbation if t.root == t.odd else "none"
        a = perturb_array(t.g, rootp, t.kind)
        a = t.g if a is None else to_numpy(a)
        axis = 0 if rootp == "dim" else 1
        sizes = band_sizes(a.shape[axis], t.n, t.uneven)
        expected = a[(slice(None),) * axis + (slice(sum(sizes[:rank]), sum(sizes[: rank + 1])),)]
        return to_numpy(result).dtype == expected.dtype and np.array_equal(to_numpy(result), expected)
    if t.op in ("shard_tensor", "shard_batch"):
        sizes = band_sizes(t.total, t.n, t.uneven)
        start = sum(sizes[:rank])
        expected = t.g[:, start : start + sizes[rank]]
        return np.array_equal(to_numpy(result), expected if t.op != "shard_batch" else expected[None])
    expected = [grads.sum(axis=0) for grads in t.grads]
    return all(np.array_equal(to_numpy(r.double()), e) for r, e in zip(result, expected, strict=False)) and result[-1] is None


def outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - compared across ranks
        if os.environ.get("AGREEMENT_JOB_TRACE"):
            traceback.print_exc()
        return "error", type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    manager = credit_mpi.DomainParallelManager(None, n)
    rng = np.random.default_rng(args.seed)
    counts: Counter = Counter()
    violations = []
    probe = np.arange(2 * 3 * n * 2, dtype=np.float64).reshape(2, 3 * n, 2)
    for trial in range(args.trials):
        t = draw(rng, n)

        def sequence(t=t):
            result = run(t, manager, rank)
            ok = correct(t, result, manager, rank) and not os.environ.get("AGREEMENT_JOB_BREAK")  # the job's own test
            # the probe: a rank that skipped a collective meets the others' operation here, not in the next trial
            credit_mpi.gather_tensor(probe[:, 3 * rank : 3 * rank + 3], 1, manager)
            return ok

        kind, value = outcome(sequence)
        every = world.allgather((kind, value))
        label = f"trial {trial}: {t.op} / {t.perturbation} on rank {t.odd} (kind {t.kind}, uneven {t.uneven})"
        if all(k == "ok" for k, _ in every):
            if not all(v for _, v in every):
                violations.append(f"{label}: succeeded with a wrong result on rank(s) {[r for r, (_, v) in enumerate(every) if not v]}")
            outcome_name = "ok"
        elif len(set(every)) == 1:
            outcome_name = every[0][1]
            if outcome_name not in ("ValueError", "TypeError", "DomainParallelError"):
                violations.append(f"{label}: every rank raised {outcome_name}, not one of credit_mpi's documented errors")
        else:
            violations.append(f"{label}: ranks differ: {every}")
            outcome_name = "mixed"
        if t.perturbation == "none" and outcome_name != "ok":
            violations.append(f"{label}: the control failed: {every}")
        counts[outcome_name] += 1
        counts[f"{t.perturbation == 'none' and 'control' or 'perturbed'}-{outcome_name == 'ok' and 'ok' or 'error'}"] += 1
        # in step again: a valid gather works on every rank
        again = outcome(lambda: np.array_equal(credit_mpi.gather_tensor(probe[:, 3 * rank : 3 * rank + 3], 1, manager), probe))
        if world.allgather(again) != [("ok", True)] * n:
            violations.append(f"{label}: the next valid gather failed: {world.allgather(again)}")
            break
    manager.free()
    report("agreement_job", args, counts, violations)


def report(job: str, args: argparse.Namespace, counts: Counter, violations: list[str]) -> None:
    """Rank 0 prints the summary line the tests parse (and every violation); exit non-zero on a violation."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        summary = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        print(f"{job}: {MPI.COMM_WORLD.Get_size()} ranks, seed {args.seed}, {args.trials} trials: {summary}; "
              f"violations={len(violations)}", flush=True)
        for v in violations:
            print(f"VIOLATION {v}", flush=True)
    sys.exit(1 if violations else 0)


if __name__ == "__main__":
    main()
