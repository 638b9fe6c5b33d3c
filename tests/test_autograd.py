"""Autograd through shard_tensor, gather_tensor and halo_exchange, against single-process torch."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, halo_exchange, shard_tensor

from .halo_reference import band, pad_torch, prefix_managers

torch = pytest.importorskip("torch")

BOUNDARIES = ["zero", "periodic", "reflect", "earth"]


@pytest.mark.mpi(min_size=1)
def test_gather_backward_is_this_ranks_slice(rng, make_manager):
    manager = make_manager()
    total = 3 * manager.domain_parallel_size + 1
    g = torch.from_numpy(rng.standard_normal((2, total, 4)))
    weight = torch.from_numpy(rng.standard_normal((2, total, 4)))
    start, stop = band(total, manager)
    local = g[:, start:stop].clone().requires_grad_()
    full = gather_tensor(local, 1, manager)
    assert full.requires_grad
    torch.testing.assert_close(full.detach(), g, rtol=0, atol=0)
    (full * weight).sum().backward()  # the same loss on every rank: a replicated gradient
    torch.testing.assert_close(local.grad, weight[:, start:stop], rtol=0, atol=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how", ["shard_tensor", "shard_batch"])
def test_shard_backward_is_the_slices(rng, make_manager, how):
    """A shard is a slice (as in the reference): this rank's rows get their gradient, the others zero.

    The same for shard_tensor and shard_batch; summed over the domain group
    (what reduce_gradients does for parameters) it is the whole gradient.
    """
    manager = make_manager()
    total = 3 * manager.domain_parallel_size + 1
    weight = torch.from_numpy(rng.standard_normal((2, 1, total, 4)))
    x = torch.from_numpy(rng.standard_normal((2, 1, total, 4))).requires_grad_()
    start, stop = band(total, manager)
    if how == "shard_tensor":
        local = shard_tensor(x, -2, manager, uneven=True)
    else:
        local = credit_mpi.shard_batch({"x": x}, manager=manager, uneven=True)["x"]
    torch.testing.assert_close(local.detach(), x.detach()[..., start:stop, :], rtol=0, atol=0)
    (local * weight[..., start:stop, :]).sum().backward()  # each rank's loss covers its band
    expected = torch.zeros_like(weight)
    expected[..., start:stop, :] = weight[..., start:stop, :]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    summed = x.grad.numpy().copy()
    manager.domain_group.Allreduce(MPI.IN_PLACE, summed)
    np.testing.assert_array_equal(summed, weight.numpy())


@pytest.mark.mpi(min_size=1)
def test_no_grad_mode_stays_plain(rng, make_manager):
    manager = make_manager()
    x = torch.ones(2, 2 * manager.domain_parallel_size, 3, requires_grad=True)
    with torch.no_grad():
        assert shard_tensor(x, 1, manager).grad_fn is None
        assert halo_exchange(x, 1, 1).grad_fn is None


def _halo_case(manager, d, boundary, width, total, module=False):
    rng = np.random.default_rng(100 + d)
    g = torch.from_numpy(rng.standard_normal((2, 3, total, 6)))
    weights = torch.from_numpy(rng.standard_normal((d, 2, 3, total + 2 * width, 6)))
    start, stop = band(total, manager)
    # single process: each band's window of the padded global field, weighted, summed over bands
    ref_x = g.clone().requires_grad_()
    padded = pad_torch(ref_x, width, boundary)
    loss = 0
    for r in range(d):
        s, e = (band_of(total, d, r))
        loss = loss + (padded[..., s : e + 2 * width, :] * weights[r, ..., : e - s + 2 * width, :]).sum()
    loss.backward()
    local = g[..., start:stop, :].clone().requires_grad_()
    layer = credit_mpi.HaloExchange(width, -2, boundary, manager=manager) if module else None
    out = layer(local) if module else halo_exchange(local, width, -2, manager, boundary=boundary)
    torch.testing.assert_close(out.detach(), padded.detach()[..., start : stop + 2 * width, :], rtol=0, atol=0)
    (out * weights[manager.domain_rank, ..., : stop - start + 2 * width, :]).sum().backward()
    torch.testing.assert_close(local.grad, ref_x.grad[..., start:stop, :], rtol=1e-12, atol=1e-12)


def band_of(total, d, r):
    from credit_mpi.partition import band_range

    return band_range(total, d, r, uneven=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_halo_backward_sends_gradients_home(boundary, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for total in (4 * d, 4 * d + d - 1):
                for width in (0, 1, 2, 3):
                    if width + (boundary == "reflect") > total // d:
                        continue
                    _halo_case(manager, d, boundary, width, total)
            _halo_case(manager, d, boundary, 2, 4 * d + 1, module=True)


def test_halo_gradcheck_single_process():
    for boundary in BOUNDARIES:
        x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t, b=boundary: halo_exchange(t, 2, boundary=b), (x,))


def test_halo_module_is_lazy_and_validates():
    assert credit_mpi.HaloExchange.__module__ == "credit_mpi.nn.exchange"
    with pytest.raises(ValueError, match="unknown boundary"):
        credit_mpi.HaloExchange(1, boundary="mirror")
    with pytest.raises(ValueError, match="halo_width must be >= 0, got -2"):
        credit_mpi.HaloExchange(-2)
    with pytest.raises(AttributeError):
        credit_mpi.NoSuchThing  # noqa: B018


def _in_thread(fn):
    """Run ``fn`` on another thread (as torch's autograd runs CUDA backward passes); its exception or None."""
    import threading

    caught = []

    def run():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return caught[0] if caught else None


def test_backward_off_the_main_thread_needs_thread_serialized(monkeypatch):
    from credit_mpi.autograd import check_backward_thread

    error = _in_thread(check_backward_thread)  # at the level this process really has
    if MPI.Query_thread() >= MPI.THREAD_SERIALIZED:
        assert error is None
    else:
        assert isinstance(error, credit_mpi.DomainParallelError)
    import credit_mpi.autograd as autograd

    monkeypatch.setattr(autograd, "_thread_level", lambda: MPI.THREAD_FUNNELED)  # the level (asked once) as if FUNNELED
    check_backward_thread()  # MPI's main thread: fine at any level
    error = _in_thread(check_backward_thread)
    assert isinstance(error, credit_mpi.DomainParallelError)
    assert "THREAD_FUNNELED" in str(error) and "THREAD_SERIALIZED" in str(error)


@pytest.mark.mpi(min_size=2)
def test_backward_passes_that_call_mpi_check_the_thread_level(rng, make_manager, monkeypatch):
    import credit_mpi.autograd as autograd

    calls = []
    monkeypatch.setattr(autograd, "check_backward_thread", lambda: calls.append(1))
    manager = make_manager()
    x = torch.from_numpy(rng.standard_normal((2, 3 * manager.domain_parallel_size, 4))).requires_grad_()
    shard_tensor(x, 1, manager).sum().backward()  # a slice: no MPI in the backward pass
    gather_tensor(x.detach()[:, :3].clone().requires_grad_(), 1, manager).sum().backward()  # a slice again
    assert calls == []
    band_ = x.detach()[:, :3].clone().requires_grad_()
    halo_exchange(band_, 1, 1, manager).sum().backward()  # backward: MPI Sendrecv
    assert len(calls) == 1
