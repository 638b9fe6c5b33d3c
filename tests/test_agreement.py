"""Reliability: what one rank does differently is everyone's error.

One test per finding of the issue. Each perturbs one argument or array
property on ONE rank (the last, so that 3 and 4 ranks see it in the middle
of the group's order too) and requires the same exception type on every
rank, or the correct result on every rank, against a single-process
reference built from the same seed on every rank. Before the agreement
(``credit_mpi.validation.agree``) these hung or were silently wrong.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import (
    DomainParallelError,
    gather_tensor,
    halo_exchange,
    reduce_gradients,
    scatter_tensor,
    shard_batch,
    shard_tensor,
)
from credit_mpi.manager import ResourceLeakWarning
from credit_mpi.partition import band_sizes

from .conftest import SEED, domain_sizes, reset_torch_distributed
from .halo_reference import band, pad_numpy, pad_torch, prefix_managers

torch = pytest.importorskip("torch")

BOUNDARIES = ["zero", "periodic", "reflect", "earth"]


def outcome(fn):
    """``("ok", result)`` or ``("error", exception type name)`` of ``fn()`` on this rank."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the test compares the types across ranks
        return "error", type(exc).__name__


def raises_everywhere(comm: MPI.Comm, fn, expected: type) -> None:
    """``fn()`` raises ``expected`` on every rank of ``comm`` (compared across ranks, so no rank can differ silently)."""
    kind, value = outcome(fn)
    seen = comm.allgather((kind, value if kind == "error" else None))
    assert seen == [("error", expected.__name__)] * comm.Get_size(), seen


def odd_one(manager) -> bool:
    """The one rank that does something different: the last of the domain group."""
    return manager.domain_rank == manager.domain_parallel_size - 1


def a_valid_gather_works(manager, rng) -> None:
    """After an agreed error the group is in step: the next valid call gives the right result."""
    g = rng.standard_normal((2, 3 * manager.domain_parallel_size + 1, 3))
    start, stop = band(g.shape[1], manager)
    np.testing.assert_array_equal(gather_tensor(g[:, start:stop], 1, manager), g)


# -- hangs: one rank takes another code path --------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("operation", ["gather", "halo", "shard_batch"])
def test_invalid_transport_on_one_rank(make_manager, rng, operation):
    manager = make_manager()
    x = rng.standard_normal((2, 3 * manager.domain_parallel_size, 4))
    transport = "MPI" if odd_one(manager) else "mpi"
    local = x[:, :3]
    calls = {
        "gather": lambda: gather_tensor(local, 1, manager, transport=transport),
        "halo": lambda: halo_exchange(local, 1, 1, manager, transport=transport),
        "shard_batch": lambda: shard_batch({"x": x[None]}, manager=manager, check="collective", transport=transport),
    }
    raises_everywhere(manager.domain_group, calls[operation], ValueError)
    a_valid_gather_works(manager, rng)


@pytest.fixture
def torch_bridge_gloo():
    """torch.distributed over gloo for the test's managers, torn down afterwards (as tests/test_torch_bridge.py)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():  # pragma: no cover
        pytest.skip("torch.distributed is not available")
    from datetime import timedelta

    yield lambda manager: credit_mpi.init_torch_distributed(manager, "gloo", timeout=timedelta(seconds=60))
    reset_torch_distributed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("operation", ["gather", "halo", "shard_batch"])
def test_two_valid_transports(make_manager, rng, torch_bridge_gloo, operation):
    manager = torch_bridge_gloo(make_manager())
    x = torch.from_numpy(rng.standard_normal((2, 3 * manager.domain_parallel_size, 4)))
    transport = "torch" if odd_one(manager) else "mpi"
    local = x[:, :3]
    calls = {
        "gather": lambda: gather_tensor(local, 1, manager, transport=transport),
        "halo": lambda: halo_exchange(local, 1, 1, manager, transport=transport),
        "shard_batch": lambda: shard_batch({"x": x[None]}, manager=manager, check="collective", transport=transport),
    }
    raises_everywhere(manager.domain_group, calls[operation], DomainParallelError)
    a_valid_gather_works(manager, rng)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("operation", ["gather", "halo", "reduce_gradients"])
def test_check_differs_across_ranks(make_manager, rng, operation):
    manager = make_manager()
    check = not odd_one(manager)
    local = rng.standard_normal((2, 3, 4))
    model = torch.nn.Linear(3, 2).double()
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    calls = {
        "gather": lambda: gather_tensor(local, 1, manager, check=check),
        "halo": lambda: halo_exchange(local, 1, 1, manager, check=check),
        "reduce_gradients": lambda: reduce_gradients(model.parameters(), manager, check=check),
    }
    raises_everywhere(manager.comm, calls[operation], DomainParallelError)
    a_valid_gather_works(manager, rng)


@pytest.mark.mpi(min_size=2)
def test_shard_check_collective_on_one_rank_then_gather(make_manager, rng):
    """The collective shard pairs with the others' gather: both raise, alike; nothing pairs with the next call."""
    manager = make_manager()
    x = rng.standard_normal((2, 3 * manager.domain_parallel_size, 4))
    check = "collective" if odd_one(manager) else "local"
    got = []
    for step in (lambda: shard_tensor(x, 1, manager, check=check), lambda: gather_tensor(x[:, :3], 1, manager)):
        kind, value = outcome(step)
        if kind == "error":
            got.append(value)
            break
    seen = manager.domain_group.allgather(got)
    assert seen == [["DomainParallelError"]] * manager.domain_parallel_size, seen
    a_valid_gather_works(manager, rng)
    part = shard_tensor(x, 1, manager, check="collective")  # and the collective check is in step too
    np.testing.assert_array_equal(gather_tensor(part, 1, manager), x)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("no_grad", [False, True])
def test_forward_gather_requires_grad_on_one_rank(make_manager, rng, no_grad):
    manager = make_manager()
    g = torch.from_numpy(rng.standard_normal((2, 3 * manager.domain_parallel_size + 1, 4)))
    start, stop = band(g.shape[1], manager)
    local = g[:, start:stop].clone().requires_grad_(odd_one(manager))
    with torch.set_grad_enabled(not no_grad):
        full = gather_tensor(local, 1, manager)
    torch.testing.assert_close(full.detach(), g, rtol=0, atol=0)
    a_valid_gather_works(manager, rng)


@pytest.mark.mpi(min_size=2)
def test_halo_requires_grad_on_one_rank(make_manager, rng):
    manager = make_manager()
    local = torch.from_numpy(rng.standard_normal((2, 3, 4))).requires_grad_(odd_one(manager))
    raises_everywhere(manager.domain_group, lambda: halo_exchange(local, 1, 1, manager), DomainParallelError)
    a_valid_gather_works(manager, rng)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", ["read-only", "none"])
def test_out_differs_on_one_rank(make_manager, rng, bad):
    manager = make_manager()
    n = manager.domain_parallel_size
    local = rng.standard_normal((2, 3, 4))
    out = np.empty((2, 3 * n, 4))
    if odd_one(manager):
        if bad == "read-only":
            out.flags.writeable = False
        else:
            out = None
    raises_everywhere(manager.domain_group, lambda: gather_tensor(local, 1, manager, out=out), ValueError)
    a_valid_gather_works(manager, rng)


# -- silently wrong -----------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("uneven", [False, True])
def test_scatter_of_a_record_dtype(make_manager, rng, uneven):
    manager = make_manager()
    n = manager.domain_parallel_size
    record = np.dtype([("t", "<f8"), ("q", "<i4"), ("flag", "?")])
    for trial in range(2):  # two in a row: nothing of the first may be received by the second
        total = 3 * n + (trial + 1 if uneven else 0)
        g = np.zeros((2, total, 5), dtype=record)
        g["t"] = rng.standard_normal(g.shape)
        g["q"] = rng.integers(-1000, 1000, g.shape)
        g["flag"] = rng.integers(0, 2, g.shape).astype(bool)
        part = scatter_tensor(g if manager.domain_rank == 0 else None, 1, manager, uneven=uneven)
        start, stop = band(total, manager) if uneven else (manager.domain_rank * 3, manager.domain_rank * 3 + 3)
        assert part.dtype == record
        np.testing.assert_array_equal(part, g[:, start:stop])


def _penalty_setup(rng, total, axis, width, boundary):
    """A global field, a per-lon weight (the 'model'), and coefficients on the padded field (float64)."""
    shape = [2, 3, 4, 6]
    shape[axis] = total
    x = torch.from_numpy(rng.standard_normal(shape))
    k = 1 if axis != 1 else 2  # the weight varies along a dim that is not sharded
    wshape = [1] * len(shape)
    wshape[k] = shape[k]
    a = torch.from_numpy(rng.standard_normal(wshape) + 1.5)
    padded = list(shape)
    padded[axis] = total + 2 * width
    coef = torch.from_numpy(rng.standard_normal(padded))
    return x, a, coef


def _pad_along(g, width, axis, boundary):
    """pad_torch along any axis (moved to -2 and back)."""
    return pad_torch(g.movedim(axis, -2), width, boundary).movedim(-2, axis)


def _band_loss(p, coef, start, rows, width, axis):
    """The loss one rank computes from its padded band (nonlinear, so the second derivative matters)."""
    return (p.pow(3) * coef.narrow(axis, start, rows + 2 * width)).sum()


def _cases():
    for axis in (2, 0, 1, 3):
        for boundary in BOUNDARIES:
            if boundary == "earth" and axis == 3:
                continue  # 'earth' needs the whole longitude (the last dim)
            yield axis, boundary


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis,boundary", list(_cases()))
def test_halo_gradient_and_gradient_penalty_equal_one_process(make_manager, axis, boundary):
    """Backward and double backward (a gradient penalty) through halo_exchange along any dim.

    ``axis`` 2 is dim -2 (latitude); 0, 1 and 3 (-1) cover the mutation that
    assumed the sharded dim is the second-to-last. Every prefix of the world
    (1..W ranks), even and uneven bands.
    """
    width = 2
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for total in (3 * d, 3 * d + 1):
                # a stream per case: ranks outside the smaller prefixes skip those cases
                x, a, coef = _penalty_setup(np.random.default_rng((SEED, d, total, axis)), total, axis, width, boundary)
                sizes = band_sizes(total, d, True)
                starts = [sum(sizes[:r]) for r in range(d)]
                # the single-process reference: every rank's loss on its rows of the padded global field
                xr = x.clone().requires_grad_()
                ar = a.clone().requires_grad_()
                pr = _pad_along(xr * ar, width, axis, boundary)
                loss = sum(_band_loss(pr.narrow(axis, s, n + 2 * width), coef, s, n, width, axis)
                           for s, n in zip(starts, sizes, strict=True))
                (gx_ref,) = torch.autograd.grad(loss, xr, create_graph=True)
                gx_ref.pow(2).sum().backward()
                # the domain-parallel run
                r = manager.domain_rank
                start, rows = starts[r], sizes[r]
                xl = x.narrow(axis, start, rows).clone().requires_grad_()
                al = a.clone().requires_grad_()
                p = halo_exchange(xl * al, width, axis, manager, boundary=boundary)
                torch.testing.assert_close(p.detach(), pr.detach().narrow(axis, start, rows + 2 * width), rtol=0, atol=1e-12)
                (gx,) = torch.autograd.grad(_band_loss(p, coef, start, rows, width, axis), xl, create_graph=True)
                torch.testing.assert_close(gx.detach(), gx_ref.detach().narrow(axis, start, rows), rtol=0, atol=1e-12)
                gx.pow(2).sum().backward()  # this rank's share of the penalty; a's gradient sums over the group
                ga = al.grad.numpy().copy()
                manager.domain_group.Allreduce(MPI.IN_PLACE, ga)
                np.testing.assert_allclose(ga, ar.grad.numpy(), rtol=1e-12, atol=1e-12)


def _two_gathers_into_one_out(x1, x2, dim, manager, out):
    """Two differentiable gathers into ``out`` in one graph, the first one's result saved by autograd."""
    y1 = gather_tensor(x1, dim, manager, out=out)
    z1 = y1 * y1  # saves y1, which is out
    y2 = gather_tensor(x2, dim, manager, out=out)  # would overwrite what z1 saved
    (z1 + y2).sum().backward()


# What the library does: the first gather's out is in the graph (it requires grad), so the second
# gather into it is refused up front (ValueError), on every rank; torch's own in-place error at
# backward() would be the other acceptable answer. Never a silently wrong gradient.
IN_PLACE_REFUSALS = {"ValueError": "requires grad", "RuntimeError": "modified by an inplace operation"}


@pytest.mark.mpi(min_size=1)
def test_two_gathers_into_one_out_in_one_graph(make_manager, rng):
    manager = make_manager()
    n = manager.domain_parallel_size
    g1 = torch.from_numpy(rng.standard_normal((2, 3 * n, 4)))
    g2 = torch.from_numpy(rng.standard_normal((2, 3 * n, 4)))
    r = manager.domain_rank
    out = torch.empty(2, 3 * n, 4, dtype=torch.float64)
    x1 = g1[:, 3 * r : 3 * r + 3].clone().requires_grad_()
    x2 = g2[:, 3 * r : 3 * r + 3].clone().requires_grad_()
    try:
        _two_gathers_into_one_out(x1, x2, 1, manager, out)
        seen = ("ok", "")
    except (ValueError, RuntimeError) as exc:
        seen = (type(exc).__name__, str(exc))
    every = manager.domain_group.allgather(seen[0])
    assert every == [every[0]] * n and every[0] in IN_PLACE_REFUSALS, (every, seen)
    assert IN_PLACE_REFUSALS[seen[0]] in seen[1], seen
    # one gather into out: the right gradient (the replicated loss's, this rank's rows)
    w = torch.from_numpy(rng.standard_normal((2, 3 * n, 4)))
    x1.grad = None
    y = gather_tensor(x1, 1, manager, out=torch.empty(2, 3 * n, 4, dtype=torch.float64))
    torch.testing.assert_close(y.detach(), g1, rtol=0, atol=0)
    (y * y * w).sum().backward()
    torch.testing.assert_close(x1.grad, (2 * g1 * w)[:, 3 * r : 3 * r + 3], rtol=0, atol=1e-12)


def test_two_gathers_into_one_out_serial():
    """The same without a manager (the one-rank copy path)."""
    with pytest.raises((ValueError, RuntimeError), match="|".join(IN_PLACE_REFUSALS.values())):
        _two_gathers_into_one_out(torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True), 0, None, torch.zeros(3))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("axis", [0, 1])
def test_in_place_gather(make_manager, rng, kind, axis):
    manager = make_manager()
    n = manager.domain_parallel_size
    shape = [2, 3, 4]
    shape[axis] = 3 * n + 1
    g = rng.standard_normal(shape)
    start, stop = band(shape[axis], manager)
    out = np.full(shape, np.nan) if kind == "numpy" else torch.full(shape, float("nan"), dtype=torch.float64)
    mine = np.take(g, range(start, stop), axis=axis)
    local = out[:, start:stop] if axis == 1 else out[start:stop]  # a view into out
    local[...] = mine if kind == "numpy" else torch.from_numpy(mine)
    result = gather_tensor(local, axis, manager, out=out)
    assert result is out
    np.testing.assert_array_equal(np.asarray(out), g)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("view", ["conj", "neg"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_halo_of_lazy_views(make_manager, rng, view, boundary):
    manager = make_manager()
    n = manager.domain_parallel_size
    total = 3 * n + 1
    if view == "conj":
        g = rng.standard_normal((2, total, 6)) + 1j * rng.standard_normal((2, total, 6))
        expected = np.conj(g)
    else:
        g = rng.standard_normal((2, total, 6))
        expected = -g
    start, stop = band(total, manager)
    t = torch.from_numpy(g[:, start:stop].copy())
    local = t.conj() if view == "conj" else torch._neg_view(t)
    assert local.is_conj() if view == "conj" else local.is_neg()
    padded = halo_exchange(local, 2, 1, manager, boundary=boundary)
    reference = pad_numpy(expected, 2, 1, boundary)[:, start : stop + 4]
    np.testing.assert_array_equal(padded.resolve_conj().resolve_neg().numpy(), reference)
    gathered = gather_tensor(local, 1, manager)
    np.testing.assert_array_equal(gathered.resolve_conj().resolve_neg().numpy(), expected)


# -- unclear or inconsistent ---------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("uneven", [False, True])
def test_shard_batch_and_shard_tensor_give_the_same_gradient(make_manager, rng, uneven):
    manager = make_manager()
    total = 3 * manager.domain_parallel_size + (1 if uneven else 0)
    x = torch.from_numpy(rng.standard_normal((2, 3, total, 4)))
    w = torch.from_numpy(rng.standard_normal((2, 3, total, 4)))
    start, stop = band(total, manager)
    grads = []
    for how in ("tensor", "batch", "tensor-collective", "batch-collective"):
        leaf = x.clone().requires_grad_()
        check = "collective" if how.endswith("collective") else "local"
        if how.startswith("tensor"):
            part = shard_tensor(leaf, -2, manager, uneven=uneven, check=check)
        else:
            part = shard_batch({"x": leaf, "meta": 1}, manager=manager, uneven=uneven, check=check)["x"]
        (part * w[..., start:stop, :]).pow(2).sum().backward()
        grads.append(leaf.grad)
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=0)
    expected = torch.zeros_like(x)
    expected[..., start:stop, :] = (2 * x * w * w)[..., start:stop, :]
    torch.testing.assert_close(grads[0], expected, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_garbage_collected_manager_warns():
    world = MPI.COMM_WORLD
    manager = credit_mpi.DomainParallelManager(None, world.Get_size())
    assert manager.domain_parallel_size == world.Get_size()
    with pytest.warns(ResourceLeakWarning, match=r"garbage-collected without free\(\)"):
        del manager
        gc.collect()
    world.Barrier()
    freed = credit_mpi.DomainParallelManager(None, world.Get_size())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceLeakWarning)
        freed.free()
        del freed
        gc.collect()


@pytest.mark.mpi(min_size=1)
def test_reduce_gradients_mixed_dtypes(make_manager, rng):
    """Every dtype group is reduced and written back (float64, float32 and bfloat16 in one model)."""
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]
    shapes = [(3, 2), (5,), (2, 2), (4,), (1, 3), (7,)]
    for d in domain_sizes(size):
        manager = make_manager(d)
        # every rank's gradients (small integers: bfloat16 holds them and their sums exactly)
        every = [[rng.integers(-8, 9, s).astype(np.float64) for s in shapes] for _ in range(size)]
        params = [torch.nn.Parameter(torch.zeros(s, dtype=t)) for s, t in zip(shapes, dtypes, strict=True)]
        for p, g in zip(params, every[rank], strict=True):
            p.grad = torch.from_numpy(g.copy()).to(p.dtype)  # a copy: the reduction writes in place
        reduce_gradients(params, manager)
        dp = size // d
        for i, p in enumerate(params):
            # sum over the domain group, then mean over the data-parallel group = total / dp
            expected = sum(every[r][i] for r in range(size)) / dp
            assert p.grad.dtype == dtypes[i]
            tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtypes[i]]
            np.testing.assert_allclose(p.grad.double().numpy(), expected, rtol=tol, atol=tol, err_msg=f"param {i} {dtypes[i]}")
