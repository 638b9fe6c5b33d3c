"""Per-call fast paths: remembered agreements and plans, the halo's one-round exchange, the output pool.

Every test runs the same call shape more than once (so the remembered plan
is used), then changes something on ONE rank: the change must still be the
same exception on every rank (never a hang or garbage), and the call after it
must still be exact against one process.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import DomainParallelError, gather_tensor, halo_exchange, validation
from credit_mpi.transport import arrays
from tests.halo_reference import band, pad_numpy, prefix_managers


def _halo_case(rng, d, manager, total, width=1, boundary="zero", dtype=np.float64):
    g = rng.standard_normal((2, 3, total, 5)).astype(dtype)
    start, stop = band(total, manager)
    local = np.ascontiguousarray(g[:, :, start:stop])
    expected = pad_numpy(g, width, 2, boundary)[:, :, start : stop + 2 * width]
    return local, expected


@pytest.mark.mpi(min_size=1)
def test_repeated_halo_is_exact_and_a_change_on_one_rank_raises_everywhere(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            rng = np.random.default_rng(d)
            rank = manager.domain_rank
            for total in (4 * d, 4 * d + d - 1):  # even and uneven bands
                for boundary in ("zero", "periodic", "reflect"):
                    local, expected = _halo_case(rng, d, manager, total, 1, boundary)
                    for _ in range(3):  # the second and third calls use the remembered plan
                        np.testing.assert_array_equal(halo_exchange(local, 1, -2, manager, boundary=boundary), expected)
            if d == 1:
                continue
            local, expected = _halo_case(rng, d, manager, 4 * d)
            halo_exchange(local, 1, -2, manager)
            # another channel count on the last rank only: the same ValueError on every rank
            wrong = local if rank != d - 1 else np.zeros((2, 4, 4, 5))
            with pytest.raises(ValueError, match="do not fit together"):
                halo_exchange(wrong, 1, -2, manager)
            # another dtype on rank 0 only
            wrong = local if rank else local.astype(np.float32)
            with pytest.raises(TypeError, match="differ in array kind, dtype"):
                halo_exchange(wrong, 1, -2, manager)
            # another width on rank 0 only: the calls differ
            with pytest.raises((ValueError, DomainParallelError)):
                halo_exchange(local, 1 if rank else 2, -2, manager)
            # a rank in another operation
            with pytest.raises(DomainParallelError, match="different calls"):
                if rank:
                    halo_exchange(local, 1, -2, manager)
                else:
                    gather_tensor(local, -2, manager)
            # and the remembered plan still gives the exact result afterwards
            np.testing.assert_array_equal(halo_exchange(local, 1, -2, manager), expected)


@pytest.mark.mpi(min_size=2)
def test_band_rows_change_on_one_rank_is_a_new_agreement(make_manager):
    manager = make_manager()
    d, rank = manager.domain_parallel_size, manager.domain_rank
    rng = np.random.default_rng(7)
    for total in (4 * d, 4 * d + 1, 4 * d, 5 * d - 1):  # the rows of some ranks change between calls
        local, expected = _halo_case(rng, d, manager, total, 2)
        for _ in range(2):
            np.testing.assert_array_equal(halo_exchange(local, 2, -2, manager), expected)
    # a band that becomes too narrow on one rank only: the same ValueError everywhere
    local = np.zeros((2, 3, 1 if rank == d - 1 else 4, 5))
    with pytest.raises(ValueError, match="holds 1 row"):
        halo_exchange(local, 2, -2, manager)


@pytest.mark.mpi(min_size=1)
def test_repeated_halo_autograd_forward_and_backward(make_manager):
    torch = pytest.importorskip("torch")
    from tests.halo_reference import pad_torch

    manager = make_manager()
    d = manager.domain_parallel_size
    module = credit_mpi.HaloExchange(1, manager=manager)
    from credit_mpi.partition import band_range

    for total in (3 * d, 3 * d + d - 1):
        g = torch.from_numpy(np.random.default_rng(total).standard_normal((2, 3, total, 4)))
        # every rank's loss weighs its padded band (halo rows included); the reference sums all ranks' losses
        ranges = [band_range(total, d, r, uneven=True) for r in range(d)]
        weights = [torch.from_numpy(np.random.default_rng(100 + r).standard_normal((2, 3, b - a + 2, 4))) for r, (a, b) in enumerate(ranges)]
        full = g.clone().requires_grad_(True)
        padded = pad_torch(full, 1, "zero")
        sum((padded[:, :, a : b + 2] * w).sum() for (a, b), w in zip(ranges, weights, strict=True)).backward()
        start, stop = ranges[manager.domain_rank]
        for _ in range(3):
            x = g[:, :, start:stop].clone().requires_grad_(True)
            y = module(x)
            torch.testing.assert_close(y.detach(), pad_torch(g, 1, "zero")[:, :, start : stop + 2], rtol=0, atol=0)
            (y * weights[manager.domain_rank]).sum().backward()
            torch.testing.assert_close(x.grad, full.grad[:, :, start:stop], rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_repeated_gather_returns_fresh_memory_never_a_live_array(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d == 1:
                continue  # one rank: the gather returns its input (nothing is allocated)
            for total in (3 * d, 3 * d + d - 1):
                g = np.random.default_rng(total).standard_normal((2, 3, total, 5))
                start, stop = band(total, manager)
                local = np.ascontiguousarray(g[:, :, start:stop])
                kept = []
                for i in range(6):
                    y = gather_tensor(local, -2, manager)
                    np.testing.assert_array_equal(y, g)
                    for old in kept:  # what the caller still holds is never handed out again
                        assert not np.shares_memory(y, old)
                        np.testing.assert_array_equal(old, g)
                    if i % 2:
                        kept.append(y)
                    else:
                        y[...] = -1  # the caller owns the result it drops; the next call must not see it
                    del y
                    gc.collect(1)  # this call's young cycles (a full collection of the suite's heap costs ~1 s a call on 4 ranks)


@pytest.mark.mpi(min_size=2)
def test_gather_output_memory_is_reused_once_dropped(make_manager):
    manager = make_manager()
    d = manager.domain_parallel_size
    local = np.ones((4, 8, 3, 16), dtype=np.float32)
    y = gather_tensor(local, -2, manager)
    del y
    before = arrays._POOL.reused
    for _ in range(4):
        y = gather_tensor(local, -2, manager)  # the previous y is alive during this call
        assert y.shape == (4, 8, 3 * d, 16) and (y == 1).all()
    assert arrays._POOL.reused - before >= 3
    view = y[:, :1]  # a view keeps the memory in use
    del y
    z = gather_tensor(local, -2, manager)
    w = gather_tensor(local, -2, manager)
    assert not np.shares_memory(view, z) and not np.shares_memory(view, w) and not np.shares_memory(z, w)
    np.testing.assert_array_equal(view, 1)


@pytest.mark.mpi(min_size=2)
def test_gather_torch_pool_and_change_on_one_rank(make_manager):
    torch = pytest.importorskip("torch")
    manager = make_manager()
    d, rank = manager.domain_parallel_size, manager.domain_rank
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.arange(2 * 3 * 5 * d * 4, dtype=torch.float64).reshape(2, 3, 5 * d, 4).to(dtype)
        local = g[:, :, 5 * rank : 5 * rank + 5].clone()
        kept = [gather_tensor(local, -2, manager) for _ in range(3)]
        for i, y in enumerate(kept):
            assert y.dtype == dtype
            torch.testing.assert_close(y, g, rtol=0, atol=0)
            for other in kept[:i]:
                assert y.data_ptr() != other.data_ptr()
    wrong = local if rank else local[:, :2].clone()
    with pytest.raises(ValueError, match="do not fit together"):
        gather_tensor(wrong, -2, manager)
    wrong = local if rank else local.to(torch.float32)
    with pytest.raises(TypeError):
        gather_tensor(wrong, -2, manager)
    torch.testing.assert_close(gather_tensor(local, -2, manager), g, rtol=0, atol=0)


@pytest.mark.mpi(min_size=1)
def test_packed_and_sliced_gathers_are_exact(make_manager, monkeypatch):
    from credit_mpi.transport import limits

    manager = make_manager()
    d = manager.domain_parallel_size
    cases = [(0, 1 << 40, 1 << 23), (0, 1 << 40, 64), (0, 1, 1 << 23), (8, 1 << 40, 1 << 23), (8, 1, 1 << 23)]
    for p2p_ranks, slice_bytes, pack_bytes in cases:  # collective strategies, then point to point
        monkeypatch.setattr(limits, "P2P_RANKS", p2p_ranks)
        monkeypatch.setattr(limits, "SLICE_BYTES", slice_bytes)
        monkeypatch.setattr(limits, "PACK_BYTES", pack_bytes)
        for total in (2 * d, 2 * d + d - 1):
            g = np.random.default_rng(total).standard_normal((3, 4, total, 6)).astype(np.float32)
            start, stop = band(total, manager)
            for _ in range(2):
                np.testing.assert_array_equal(gather_tensor(np.ascontiguousarray(g[:, :, start:stop]), -2, manager), g)


@pytest.mark.mpi(min_size=2)
def test_gather_out_plan_is_remembered_but_never_its_output(make_manager):
    """``out=`` plans are remembered per output description: each call writes the out it was given.

    An output that fails the checks on one rank after the plan was
    remembered (read-only, non-contiguous, another shape) is still the same
    ValueError on every rank; the cache keeps no caller's output alive.
    """
    import weakref

    manager = make_manager()
    d, rank = manager.domain_parallel_size, manager.domain_rank
    g = np.random.default_rng(3).standard_normal((2, 3, 4 * d, 5))
    local = np.ascontiguousarray(g[:, :, 4 * rank : 4 * rank + 4])
    outs = [np.zeros_like(g) for _ in range(3)]
    for i in range(6):
        out = outs[i % 3]
        out[...] = 0
        assert gather_tensor(local, -2, manager, out=out) is out
        np.testing.assert_array_equal(out, g)
    probe = np.zeros_like(g)
    gather_tensor(local, -2, manager, out=probe)
    gone = weakref.ref(probe)
    del probe
    gc.collect()
    assert gone() is None  # the remembered plan does not hold the output
    read_only = np.zeros_like(g)
    read_only.flags.writeable = False
    for wrong in (read_only, np.zeros((5, 4 * d, 3, 2)).transpose(3, 2, 1, 0)[:2], np.zeros((2, 3, 4 * d + 1, 5))):
        with pytest.raises(ValueError, match="out"):
            gather_tensor(local, -2, manager, out=wrong if rank == d - 1 else outs[0])
    outs[1][...] = 0
    assert gather_tensor(local, -2, manager, out=outs[1]) is outs[1]
    np.testing.assert_array_equal(outs[1], g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["halo", "gather"])
def test_a_repeated_call_skips_the_planning_but_a_change_is_still_seen(make_manager, monkeypatch, op):
    """A repeat of a remembered call is one Allgather and the kernel; any change on one rank plans again everywhere.

    Also: a freed manager after a remembered call is the freed-manager error,
    not a call on its freed communicator.
    """
    from credit_mpi import engine

    planned = []  # the engine's slow path of this op: agree (settle the table received) and plan
    original, name = engine.agree_cached, "halo_exchange" if op == "halo" else "gather_tensor"
    monkeypatch.setattr(engine, "agree_cached", lambda comm, operation, *a, **k: (operation == name and planned.append(1))
                        or original(comm, operation, *a, **k))
    manager = make_manager()
    d, rank = manager.domain_parallel_size, manager.domain_rank
    g = np.random.default_rng(5).standard_normal((2, 3, 4 * d, 5))
    local = np.ascontiguousarray(g[:, :, 4 * rank : 4 * rank + 4])

    def call(x):
        return halo_exchange(x, 1, -2, manager) if op == "halo" else gather_tensor(x, -2, manager)

    expected = pad_numpy(g, 1, 2, "zero")[:, :, 4 * rank : 4 * rank + 6] if op == "halo" else g
    for _ in range(4):
        np.testing.assert_array_equal(call(local), expected)
    assert len(planned) == 1  # planned once, then remembered
    wrong = local if rank != d - 1 else local[:, :2].copy()  # another shape on the last rank only
    with pytest.raises(ValueError, match="do not fit together"):
        call(wrong)
    assert len(planned) == 2  # every rank planned again (the others saw the change in the table)
    np.testing.assert_array_equal(call(local), expected)
    manager.free()
    with pytest.raises(DomainParallelError, match="freed"):
        call(local)


@pytest.mark.mpi(min_size=2)
def test_agree_cached_unit(world):
    comm = world.Dup()
    try:
        rank = comm.Get_rank()
        calls = []

        def local(shape):
            def run():
                calls.append(shape)
                return validation.Local(shape, ("x",), shape[1:], shape[0])

            return run

        def finish(plan, counts):
            return (plan, tuple(counts))

        for _ in range(3):
            assert validation.agree_cached(comm, "collective", ("k", 1), local((2, 3)), finish) == ((2, 3), (2,) * comm.Get_size())
        assert len(calls) == 1  # local checks once, then remembered
        # one rank's key changes (a different shape): every rank raises alike
        shape = (2, 4) if rank == 0 else (2, 3)
        with pytest.raises(DomainParallelError, match="different calls"):
            validation.agree_cached(comm, "collective", ("k", shape[1]), local(shape), finish)
        # a failing local check on one rank only
        def bad():
            raise ValueError("bad on this rank")

        with pytest.raises(ValueError, match=r"bad on this rank \[on rank\(s\) 0 of"):
            validation.agree_cached(comm, "collective", ("other", rank), bad if rank == 0 else local((2, 3)), finish)
        # a rank that agreed before but whose count changes: a new agreement, not an error
        count_shape = (3, 3) if rank == comm.Get_size() - 1 else (2, 3)
        got = validation.agree_cached(comm, "collective", ("k", count_shape), local(count_shape), finish)
        assert got[1] == (2,) * (comm.Get_size() - 1) + (3,)
        comm.Barrier()
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_layer_agreement_is_remembered_and_still_collective(make_manager):
    torch = pytest.importorskip("torch")
    from credit_mpi.nn import _comm

    manager = make_manager()
    comm, rank, d = manager.domain_group, manager.domain_rank, manager.domain_parallel_size
    x = torch.zeros(2, 3, 4 + (rank == 0), 5)
    for _ in range(3):
        bands = _comm.agree(x, lambda t: t.ndim - 2, comm, "layer0")
        assert bands.sizes == [5] + [4] * (d - 1) and bands.axis == 2
    wrong = x if rank else torch.zeros(2, 4, 5, 5)
    with pytest.raises(ValueError, match="layer0: the bands do not fit together"):
        _comm.agree(wrong, lambda t: t.ndim - 2, comm, "layer0")

    def axis_of(t):
        if rank == d - 1:
            raise ValueError("layer0 needs a 4-D input")
        return t.ndim - 2

    with pytest.raises(ValueError, match="needs a 4-D input"):
        _comm.agree(x, axis_of, comm, "layer0")
    MPI.COMM_WORLD.Barrier()
