"""Randomised round trips and halo exchanges against single-process references (hypothesis).

Every rank draws the same cases: ``derandomize=True`` (the seed comes from
the test itself, not from the clock or a database), so the ranks enter the
same collectives with the same arguments. A case is judged collectively
(``allreduce`` of "this rank matched"), so every rank fails the same example
together, and shrinking is off, so the ranks never wander apart.

Data are random bit patterns (NaNs, infinities, negative zeros included)
and the comparison is on bytes: the collectives must move data bit for bit.
"""

from __future__ import annotations

import atexit
import collections
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import credit_mpi
from credit_mpi import DomainParallelManager

from .halo_reference import pad_numpy


def domain_sizes(world_size: int) -> list[int]:
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "float16",
    "int32",
    "float32",
    "uint64",
    "float64",
    "complex64",
    "complex128",
]

COLLECTIVE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: ranks stay in step
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


def examples(n: int) -> int:
    """``n`` scaled by $CREDIT_MPI_PROPERTY_SCALE (default 1; CI's other MPIs run fewer)."""
    return max(1, round(n * float(os.environ.get("CREDIT_MPI_PROPERTY_SCALE", "1"))))


# How many cases each test drew (reported to stderr at exit by rank 0, on request).
DRAWN: collections.Counter = collections.Counter()


@atexit.register
def _report() -> None:
    if os.environ.get("CREDIT_MPI_REPORT") and DRAWN and MPI.COMM_WORLD.Get_rank() == 0:
        total = sum(DRAWN.values())
        print(
            f"\n[test_properties] {MPI.COMM_WORLD.Get_size()} rank(s): {total} cases {dict(DRAWN)}",
            flush=True,
        )


_MANAGERS: dict[int, DomainParallelManager] = {}


@pytest.fixture(scope="module", autouse=True)
def _free_managers():
    yield
    for manager in _MANAGERS.values():
        manager.free()
    _MANAGERS.clear()


def manager_for(d: int) -> DomainParallelManager:
    """One manager per domain size for the whole module (creating is collective)."""
    if d not in _MANAGERS:
        _MANAGERS[d] = DomainParallelManager(None, d)
    return _MANAGERS[d]


def random_array(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def agree(check, what: str) -> None:
    """Judge ``check()`` on every rank; fail on every rank if any rank saw a mismatch.

    ``check`` runs inside a try, so an error in the local comparison on one
    rank is that rank's failure, not a rank that leaves the others waiting.
    """
    try:
        ok, why = bool(check()), "mismatch"
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        ok, why = False, f"{type(exc).__name__}: {exc}"
    verdicts = MPI.COMM_WORLD.allgather(None if ok else why)
    failed = {r: v for r, v in enumerate(verdicts) if v is not None}
    assert not failed, f"{what}: {failed}"


def same_case(*drawn) -> None:
    """Every rank must have drawn the same case (else they would not be in step)."""
    first = MPI.COMM_WORLD.bcast(drawn, root=0)
    agree(lambda: drawn == first, f"ranks drew different cases; rank 0 drew {first}")


@st.composite
def cases(draw, even_only: bool = False):
    """(seed, shape, dim, dtype, domain size, uneven, view) for this world size."""
    n = MPI.COMM_WORLD.Get_size()
    d = draw(st.sampled_from(domain_sizes(n)))
    ndim = draw(st.integers(1, 5))
    axis = draw(st.integers(0, ndim - 1))
    uneven = False if even_only else draw(st.booleans())
    rows = draw(st.integers(0, 3 * d + 2)) if uneven else d * draw(st.integers(0, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[axis] = rows
    dim = draw(st.sampled_from([axis, axis - ndim]))  # positive or negative spelling
    dtype = draw(st.sampled_from(DTYPES))
    view = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return seed, tuple(shape), dim, dtype, d, uneven, view


def make_input(seed, shape, dtype, view) -> np.ndarray:
    """The global array, possibly as a non-contiguous view with the same shape."""
    if view == "transposed":
        return random_array(seed, shape[::-1], dtype).T
    if view == "strided":
        base = random_array(seed, tuple(2 * s for s in shape), dtype)
        return base[tuple(slice(None, None, 2) for _ in shape)]
    return random_array(seed, shape, dtype)


@pytest.mark.mpi(min_size=1)
@settings(COLLECTIVE, max_examples=examples(150))
@given(case=cases())
def test_shard_then_gather_is_the_identity(case):
    seed, shape, dim, dtype, d, uneven, view = case
    DRAWN["shard+gather"] += 1
    same_case(case)
    manager = manager_for(d)
    x = make_input(seed, shape, dtype, view)
    axis = dim % len(shape)
    part = credit_mpi.shard_tensor(x, dim, manager, uneven=uneven)
    expect = np.array_split(x, d, axis=axis)[manager.domain_rank]
    agree(lambda: same_bits(part, expect), f"shard {case}")
    whole = credit_mpi.gather_tensor(part, dim, manager)
    agree(lambda: same_bits(whole, x), f"gather {case}")


@pytest.mark.mpi(min_size=1)
@settings(COLLECTIVE, max_examples=examples(80))
@given(case=cases(), root_pick=st.integers(0, 3))
def test_scatter_matches_array_split(case, root_pick):
    seed, shape, dim, dtype, d, uneven, view = case
    DRAWN["scatter"] += 1
    same_case(case, root_pick)
    manager = manager_for(d)
    root = root_pick % d
    x = make_input(seed, shape, dtype, view)
    held = x if manager.domain_rank == root else None
    part = credit_mpi.scatter_tensor(held, dim, manager, root=root, uneven=uneven)
    if d == 1:
        part = x  # the identity (the input comes back unchanged)
    expect = np.array_split(x, d, axis=dim % len(shape))[manager.domain_rank]
    agree(lambda: same_bits(part, expect), f"scatter {case} root {root}")
    whole = credit_mpi.gather_tensor(part, dim, manager)
    agree(lambda: same_bits(whole, x), f"scatter+gather {case}")


@pytest.mark.mpi(min_size=1)
@settings(COLLECTIVE, max_examples=examples(40))
@given(
    seed=st.integers(0, 2**32 - 1),
    d_pick=st.integers(0, 3),
    rows=st.integers(1, 4),
    dims=st.tuples(st.integers(-2, -1), st.integers(-2, -1)),
    dtype=st.sampled_from(DTYPES),
    uneven=st.booleans(),
)
def test_shard_batch_matches_array_split(seed, d_pick, rows, dims, dtype, uneven):
    DRAWN["shard_batch"] += 1
    same_case(seed, d_pick, rows, dims, dtype, uneven)
    sizes = domain_sizes(MPI.COMM_WORLD.Get_size())
    d = sizes[d_pick % len(sizes)]
    manager = manager_for(d)
    h = d * rows + (d_pick % d if uneven else 0)
    batch = {
        "x5": random_array(seed, (2, 3, 2, h, h), dtype),
        "x4": random_array(seed + 1, (2, 3, h, h), dtype),
        "static": random_array(seed + 2, (h, 4), dtype),  # 2-D: left alone
        "meta": {"step": seed},
    }
    out = credit_mpi.shard_batch(batch, dims[0], dims[1], manager, uneven=uneven)
    r = manager.domain_rank
    agree(
        lambda: (
            same_bits(out["x5"], np.array_split(batch["x5"], d, axis=dims[0] % 5)[r])
            and same_bits(
                out["x4"], np.array_split(batch["x4"], d, axis=dims[1] % 4)[r]
            )
            and out["static"] is batch["static"]
            and out["meta"] is batch["meta"]
        ),
        f"shard_batch seed {seed} d {d} rows {rows} dims {dims} {dtype}",
    )


TORCH_BITS = {
    "bfloat16": "uint16",
    "float16": "uint16",
    "float32": "uint32",
    "int64": "int64",
    "bool": "bool",
}


def torch_input(torch, seed, shape, torch_dtype, view):
    """Random bit patterns as a torch tensor of ``torch_dtype``, maybe a non-contiguous view."""
    build = {"transposed": shape[::-1], "strided": tuple(2 * s for s in shape)}.get(
        view, shape
    )
    t = torch.from_numpy(
        random_array(seed, build, TORCH_BITS[torch_dtype]).astype(
            TORCH_BITS[torch_dtype]
        )
    )
    if torch_dtype != "bool":
        t = (
            t.view(getattr(torch, torch_dtype))
            if TORCH_BITS[torch_dtype] != torch_dtype
            else t
        )
    if view == "transposed":
        return t.permute(*reversed(range(t.ndim)))
    if view == "strided":
        return t[tuple(slice(None, None, 2) for _ in shape)]
    return t


def torch_bits(torch, t) -> tuple:
    t = t.detach().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return tuple(t.shape), str(t.dtype), raw.numpy().tobytes()


@pytest.mark.mpi(min_size=1)
@settings(COLLECTIVE, max_examples=examples(40))
@given(case=cases(), torch_dtype=st.sampled_from(sorted(TORCH_BITS)))
def test_torch_round_trip(case, torch_dtype):
    torch = pytest.importorskip("torch")
    seed, shape, dim, _, d, uneven, view = case
    DRAWN["torch"] += 1
    same_case(case, torch_dtype)
    manager = manager_for(d)
    x = torch_input(torch, seed, shape, torch_dtype, view)
    part = credit_mpi.shard_tensor(x, dim, manager, uneven=uneven)
    expect = torch.tensor_split(x, d, dim=dim)[manager.domain_rank]
    agree(
        lambda: (
            isinstance(part, torch.Tensor)
            and torch_bits(torch, part) == torch_bits(torch, expect)
        ),
        f"torch shard {case} {torch_dtype}",
    )
    whole = credit_mpi.gather_tensor(part, dim, manager)
    agree(
        lambda: (
            isinstance(whole, torch.Tensor)
            and torch_bits(torch, whole) == torch_bits(torch, x)
        ),
        f"torch gather {case} {torch_dtype}",
    )


def halo_fits(sizes: list[int], width: int, boundary: str, shape: tuple, axis: int) -> bool:
    """The documented rules, restated: when must halo_exchange accept the case?"""
    if boundary == "earth" and (axis == len(shape) - 1 or shape[-1] % 2):
        return False
    if width == 0 or (len(sizes) == 1 and boundary == "zero"):
        return True
    n = len(sizes)
    return all(s >= (width + 1 if boundary == "reflect" and r in (0, n - 1) else width) for r, s in enumerate(sizes))


@pytest.mark.mpi(min_size=1)
@settings(COLLECTIVE, max_examples=examples(120))
@given(case=cases(), width=st.integers(0, 3), boundary=st.sampled_from(["zero", "periodic", "reflect", "earth"]))
def test_halo_matches_the_padded_global_field(case, width, boundary):
    """Each rank's padded band equals its window of the single-process padded field; misfits fail everywhere."""
    seed, shape, dim, dtype, d, uneven, view = case
    DRAWN["halo"] += 1
    same_case(case, width, boundary)
    manager = manager_for(d)
    x = make_input(seed, shape, dtype, view)
    axis = dim % len(shape)
    part = credit_mpi.shard_tensor(x, dim, manager, uneven=uneven)
    sizes = [len(p) for p in np.array_split(np.arange(shape[axis]), d)]
    if not halo_fits(sizes, width, boundary, shape, axis):
        DRAWN["halo misfit"] += 1
        if boundary == "earth" and axis == len(shape) - 1:
            why = "boundary='earth' needs the full longitude"
        elif boundary == "earth" and shape[-1] % 2:
            why = "the longitude count \\(last dimension\\) must be even"
        else:
            why = f"halo_width={width} with boundary='{boundary}' does not fit"
        with pytest.raises(ValueError, match=why):  # on every rank: a rank that did not raise fails here
            credit_mpi.halo_exchange(part, width, dim, manager, boundary=boundary)
        return
    padded = credit_mpi.halo_exchange(part, width, dim, manager, boundary=boundary)
    start = sum(sizes[: manager.domain_rank])
    window = np.take(pad_numpy(x, width, axis, boundary), range(start, start + sizes[manager.domain_rank] + 2 * width), axis=axis)
    agree(lambda: same_bits(padded, window), f"halo {case} width {width} {boundary}")
