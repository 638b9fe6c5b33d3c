"""credit_mpi.nn.training against one process: weights, loss, gradients, metrics, clipping.

Every MPI test runs every layout the world allows: each domain size d that
divides the world size as d domain x (W/d) data-parallel ranks over
COMM_WORLD (4 ranks: 1x4, 2x2, 4x1), and the other domain sizes over the
first d ranks (3 on 4 ranks, 2 on 3 ranks). Fields have 12 latitudes (even
bands on 1-4 ranks) or 13 (uneven on 2-4 ranks). The single-process
reference is computed on every rank from the same seed; float64, 1e-12.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import reduce_gradients, shard_tensor

from .conftest import domain_sizes
from .halo_reference import prefix_managers

torch = pytest.importorskip("torch")
F = torch.nn.functional
cnn = pytest.importorskip("credit_mpi.nn")

TOL = {"rtol": 1e-12, "atol": 1e-12}
LON = 8


@contextlib.contextmanager
def layouts(make_manager):
    """Managers for every (domain x data-parallel) layout this rank takes part in (see the module docstring)."""
    world = MPI.COMM_WORLD.Get_size()
    full = [make_manager(d) for d in domain_sizes(world)]
    with prefix_managers(make_manager) as prefix:
        yield full + [m for d, m in prefix if world % d]


def global_weights(nlat: int) -> torch.Tensor:
    """The single-process weights, written out independently: cos(lat) / mean(cos(lat)), (nlat, 1)."""
    lat = torch.linspace(90.0, -90.0, nlat, dtype=torch.float64)
    cos = torch.cos(torch.deg2rad(lat))
    return (cos / cos.mean()).reshape(-1, 1)


def my_samples(x: torch.Tensor, manager) -> torch.Tensor:
    """This rank's samples of a global batch (dp * B samples) and its band of them."""
    b = x.shape[0] // manager.data_parallel_size
    mine = x[manager.dp_rank * b : (manager.dp_rank + 1) * b]
    return shard_tensor(mine, -2, manager, uneven=True)


def agreed(manager, value, comm=None):
    """Assert that ``value`` (a tensor or float) is bitwise the same on every rank of ``comm``."""
    comm = manager.comm if comm is None else comm
    values = comm.allgather(value.numpy().tobytes() if isinstance(value, torch.Tensor) else value)
    assert all(v == values[0] for v in values), f"ranks of {comm.Get_name()} disagree: {values}"


# -- latitude weights -------------------------------------------------------


def test_latitude_weights_single_process():
    w = cnn.latitude_weights(721)
    assert w.shape == (721, 1) and w.dtype == torch.float64
    torch.testing.assert_close(w, global_weights(721), **TOL)
    assert abs(float(w.mean()) - 1.0) < 1e-14
    lat = np.array([-60.0, -20.0, 10.0, 45.0, 80.0])  # any order, any spacing
    cos = np.cos(np.deg2rad(lat))
    torch.testing.assert_close(cnn.latitude_weights(lat, dim=-1), torch.from_numpy(cos / cos.mean()), **TOL)
    assert cnn.latitude_weights(torch.tensor(lat), dim=-3).shape == (5, 1, 1)
    assert cnn.latitude_weights(3, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((1,), {}, ValueError, ">= 2"),
        ((True,), {}, TypeError, "count"),
        (("north",), {}, TypeError, "real numbers"),
        (([[0.0, 1.0]],), {}, ValueError, "1-D"),
        (([0.0, 91.0],), {}, ValueError, "91.0 at index 1"),
        (([0.0, float("nan")],), {}, ValueError, "finite"),
        (([90.0, -90.0],), {}, ValueError, "pole"),
        ((12,), {"dim": 2}, ValueError, "negative"),
        ((12,), {"uneven": "yes"}, ValueError, "uneven"),
    ],
)
def test_latitude_weights_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cnn.latitude_weights(*args, **kwargs)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("nlat", [12, 13])
def test_latitude_weights_are_the_rows_of_the_global_weights(nlat, make_manager):
    with layouts(make_manager) as managers:
        for manager in managers:
            w = cnn.latitude_weights(nlat, manager, check=True)
            whole = cnn.latitude_weights(nlat)
            assert torch.equal(w, shard_tensor(whole, -2, manager, uneven=True))  # bit for bit
            torch.testing.assert_close(w, shard_tensor(global_weights(nlat), -2, manager, uneven=True), **TOL)
            w5 = cnn.latitude_weights(nlat, manager, dim=-3)  # (B, C, lat, lon, level)
            assert w5.shape == (w.shape[0], 1, 1)


@pytest.mark.mpi(min_size=1)
def test_latitude_weights_refusals_raise_on_every_rank(make_manager):
    with layouts(make_manager) as managers:
        for manager in managers:
            d = manager.domain_parallel_size
            if d > 1:  # 13 rows on 2-4 ranks: uneven, refused with uneven=False
                with pytest.raises(ValueError, match="uneven=True"):
                    cnn.latitude_weights(13, manager, uneven=False, check=True)
            lat = np.linspace(80.0, -80.0, 13)
            if manager.rank == manager.comm.Get_size() - 1:
                lat = lat[::-1].copy()  # the last rank passes the latitudes in the other order
            if manager.comm.Get_size() > 1:
                with pytest.raises(ValueError, match="different latitudes"):
                    cnn.latitude_weights(lat, manager, check=True)
            bad = 13 if manager.rank else [0.0, 100.0]  # rank 0 alone passes a latitude out of range
            if manager.comm.Get_size() > 1:
                with pytest.raises(ValueError, match="100.0"):
                    cnn.latitude_weights(bad, manager, check=True)


# -- loss and a training step -------------------------------------------------


def test_weighted_mse_single_process_and_bad_input():
    rng = np.random.default_rng(3)
    p = torch.from_numpy(rng.standard_normal((2, 3, 13, LON)))
    t = torch.from_numpy(rng.standard_normal((2, 3, 13, LON)))
    w = global_weights(13)
    ref = (w * (p - t) ** 2).mean()
    torch.testing.assert_close(cnn.LatitudeWeightedMSELoss(13)(p, t), ref, **TOL)
    torch.testing.assert_close(cnn.latitude_weighted_mse(p, t, w.reshape(-1), 13), ref, **TOL)
    with pytest.raises(ValueError, match="differ in shape"):
        cnn.latitude_weighted_mse(p, t[:1], w, 13)
    with pytest.raises(ValueError, match=r"must have shape \(13,\) or \(13, 1\)"):
        cnn.latitude_weighted_mse(p, t, global_weights(12), 13)
    with pytest.raises(ValueError, match="total_rows must be >= 13"):
        cnn.latitude_weighted_mse(p, t, w, 12)
    with pytest.raises(TypeError, match="pred must be a torch tensor"):
        cnn.latitude_weighted_mse(p.numpy(), t, w, 13)
    assert cnn.global_loss(ref) == float(ref)
    with pytest.raises(ValueError, match="scalar"):
        cnn.global_loss(p)


class Net(torch.nn.Module):
    """A 3x3 conv (zero latitude halo, circular longitude) times a parameter broadcast against the band."""

    def __init__(self, channels: int, nlat: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, dtype=torch.float64)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, channels * LON, dtype=torch.float64).reshape(1, channels, 1, LON))
        self.manager = None

    def forward(self, x):
        x = credit_mpi.halo_exchange(x, 1, -2, self.manager)  # no manager: zero rows, as the global edge
        x = F.pad(x, (1, 1, 0, 0), mode="circular")
        return torch.tanh(self.conv(x)) * self.scale


def _reference_steps(net, x, y, nlat, steps, max_norm, norm_type):
    """Single process: per step the loss, the gradients, the clipped norm and the parameters after SGD."""
    net = copy.deepcopy(net)
    loss_fn = cnn.LatitudeWeightedMSELoss(nlat)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    record = []
    for _ in range(steps):
        loss = loss_fn(net(x), y)
        loss.backward()
        grads = [p.grad.clone() for p in net.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm, norm_type=norm_type)
        opt.step()
        opt.zero_grad()
        record.append((float(loss.detach()), grads, norm, [p.detach().clone() for p in net.parameters()]))
    return record


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("nlat", [12, 13])
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_training_steps_match_single_process(nlat, norm_type, make_manager):
    """3 SGD steps: band-share loss -> reduce_gradients -> clip_grad_norm_ -> step, equal to one process."""
    torch.manual_seed(5)
    model = Net(2, nlat)
    rng = np.random.default_rng(9)
    with layouts(make_manager) as managers:
        for manager in managers:
            dp = manager.data_parallel_size
            x = torch.from_numpy(rng.standard_normal((2 * dp, 2, nlat, LON)))
            y = torch.from_numpy(rng.standard_normal((2 * dp, 2, nlat, LON)))
            # max_norm below the gradient norm, so every step clips
            ref = _reference_steps(model, x, y, nlat, 3, 0.05, norm_type)
            net = copy.deepcopy(model)
            net.manager = manager
            loss_fn = cnn.LatitudeWeightedMSELoss(nlat, manager)
            opt = torch.optim.SGD(net.parameters(), lr=0.3)
            xb, yb = my_samples(x, manager), my_samples(y, manager)
            for step, (ref_loss, ref_grads, ref_norm, ref_params) in enumerate(ref):
                share = loss_fn(net(xb), yb)
                share.backward()
                value = cnn.global_loss(share, manager)
                assert abs(value - ref_loss) <= 1e-12 * max(1.0, abs(ref_loss)), (step, value, ref_loss)
                agreed(manager, value)
                reduce_gradients(net.parameters(), manager)
                for p, g in zip(net.parameters(), ref_grads, strict=True):
                    torch.testing.assert_close(p.grad, g, **TOL)
                norm = cnn.clip_grad_norm_(net.parameters(), 0.05, manager, norm_type=norm_type)
                assert float(ref_norm) > 0.05
                torch.testing.assert_close(norm, ref_norm, **TOL)
                agreed(manager, norm)
                opt.step()
                opt.zero_grad()
                for p, q in zip(net.parameters(), ref_params, strict=True):
                    torch.testing.assert_close(p.detach(), q, **TOL)
                    agreed(manager, p.detach())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_partial_gradients_before_reduce(norm_type, make_manager):
    """gradients='partial': clip before reduce_gradients; after it the gradients are torch's clipped ones."""
    nlat = 13
    torch.manual_seed(6)
    model = Net(2, nlat)
    rng = np.random.default_rng(10)
    with layouts(make_manager) as managers:
        for manager in managers:
            dp = manager.data_parallel_size
            x = torch.from_numpy(rng.standard_normal((dp, 2, nlat, LON)))
            y = torch.from_numpy(rng.standard_normal((dp, 2, nlat, LON)))
            ref = copy.deepcopy(model)
            cnn.LatitudeWeightedMSELoss(nlat)(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
            net = copy.deepcopy(model)
            net.manager = manager
            cnn.LatitudeWeightedMSELoss(nlat, manager)(net(my_samples(x, manager)), my_samples(y, manager)).backward()
            norm = cnn.clip_grad_norm_(net.parameters(), 0.01, manager, norm_type=norm_type, gradients="partial")
            torch.testing.assert_close(norm, ref_norm, **TOL)
            agreed(manager, norm)
            reduce_gradients(net.parameters(), manager)
            for p, q in zip(net.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_clip_without_manager_is_torchs():
    torch.manual_seed(2)
    a = Net(2, 12)
    b = copy.deepcopy(a)
    x = torch.randn(2, 2, 12, LON, dtype=torch.float64)
    for net in (a, b):
        net(x).square().sum().backward()
    for norm_type in (2.0, "inf", 3):
        got = cnn.clip_grad_norm_(a.parameters(), 0.5, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5, norm_type=norm_type)
        assert torch.equal(got, want)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    p = torch.nn.Parameter(torch.ones(3))
    assert float(cnn.clip_grad_norm_([p], 1.0)) == 0.0  # no gradients: norm 0, as torch
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        cnn.clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
    for kwargs, match in (
        ({"max_norm": -1.0}, "max_norm"),
        ({"max_norm": float("nan")}, "max_norm"),
        ({"max_norm": 1.0, "norm_type": "fro"}, "norm_type"),
        ({"max_norm": 1.0, "gradients": "summed"}, "gradients"),
    ):
        with pytest.raises(ValueError, match=match):
            cnn.clip_grad_norm_(p, **kwargs)


@pytest.mark.mpi(min_size=2)
def test_clip_refusals_raise_on_every_rank(make_manager):
    manager = make_manager()  # all ranks in one domain group
    world = manager.comm.Get_size()
    net = Net(2, 12)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    # one rank has no gradient for the bias
    saved = net.conv.bias.grad
    if manager.rank == world - 1:
        net.conv.bias.grad = None
    with pytest.raises(ValueError, match="different parameters"):
        cnn.clip_grad_norm_(net.parameters(), 1.0, manager)
    net.conv.bias.grad = saved
    # one rank passes a bad max_norm: its ValueError on every rank
    with pytest.raises(ValueError, match="max_norm"):
        cnn.clip_grad_norm_(net.parameters(), -1.0 if manager.rank == 0 else 1.0, manager)
    # ranks pass different (valid) arguments
    with pytest.raises(ValueError, match="same arguments"):
        cnn.clip_grad_norm_(net.parameters(), 1.0 + manager.rank, manager)
    # partial gradients (reduce_gradients not called) with gradients="reduced"
    for p in net.parameters():
        p.grad = torch.full_like(p, 1.0 + manager.rank)
    with pytest.raises(credit_mpi.DomainParallelError, match="reduce_gradients first"):
        cnn.clip_grad_norm_(net.parameters(), 1.0, manager)
    assert all(bool((p.grad == 1.0 + manager.rank).all()) for p in net.parameters())  # untouched
    # a non-finite global norm with error_if_nonfinite: on every rank (inf on one rank only, then reduced)
    if manager.rank == 0:
        net.scale.grad[0, 0, 0, 0] = float("inf")
    reduce_gradients(net.parameters(), manager)
    with pytest.raises(RuntimeError, match="non-finite"):
        cnn.clip_grad_norm_(net.parameters(), 1.0, manager, error_if_nonfinite=True)


@pytest.mark.mpi(min_size=2)
def test_global_loss_refusal_raises_on_every_rank(make_manager):
    manager = make_manager()
    loss = torch.ones(2) if manager.rank == 1 else torch.tensor(1.0)
    with pytest.raises(ValueError, match="1 rank"):
        cnn.global_loss(loss, manager)
    assert cnn.global_loss(torch.tensor(float(manager.rank)), manager) == sum(range(manager.comm.Get_size()))
    with pytest.raises(ValueError, match="data_parallel=True, the others False"):
        cnn.global_loss(torch.tensor(1.0), manager, data_parallel=manager.rank == 0)


@pytest.mark.mpi(min_size=1)
def test_global_loss_per_sample_and_batch(make_manager):
    """data_parallel=False: this domain group's sum (its sample); True: the mean over the domain groups."""
    with layouts(make_manager) as managers:
        for manager in managers:
            share = torch.tensor(float(manager.rank + 1))
            groups = manager.domain_groups()
            mine = sum(r + 1 for r in groups[manager.domain_group_index])
            assert cnn.global_loss(share, manager, data_parallel=False) == mine
            assert cnn.global_loss(share, manager) == sum(sum(r + 1 for r in g) for g in groups) / len(groups)


# -- metrics -------------------------------------------------------------------


def _reference_metrics(p, t, clim, w, reduce_dims, centered):
    """Single-process metrics from the whole fields (float64), written out directly."""
    wf = w.expand(p.shape)
    out = {"mse": (wf * (p - t) ** 2).sum(reduce_dims) / wf.sum(reduce_dims)}
    out["rmse"] = out["mse"].sqrt()
    if clim is not None:
        ap, at = p - clim, t - clim
        if centered:
            ap = ap - (wf * ap).sum(reduce_dims, keepdim=True) / wf.sum(reduce_dims, keepdim=True)
            at = at - (wf * at).sum(reduce_dims, keepdim=True) / wf.sum(reduce_dims, keepdim=True)
        out["acc"] = (wf * ap * at).sum(reduce_dims) / ((wf * ap * ap).sum(reduce_dims) * (wf * at * at).sum(reduce_dims)).sqrt()
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("nlat", [12, 13])
@pytest.mark.parametrize(("per_sample", "data_parallel"), [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("centered", [False, True])
def test_metrics_match_single_process(nlat, per_sample, data_parallel, centered, make_manager):
    rng = np.random.default_rng(12)
    with layouts(make_manager) as managers:
        for manager in managers:
            dp = manager.data_parallel_size
            shape = (2 * dp, 3, nlat, LON)
            t = torch.from_numpy(rng.standard_normal(shape))
            p = t + 0.7 * torch.from_numpy(rng.standard_normal(shape))
            clim = torch.from_numpy(rng.standard_normal((3, nlat, LON)))
            w = global_weights(nlat)
            got = cnn.latitude_weighted_metrics(
                my_samples(p, manager), my_samples(t, manager), cnn.latitude_weights(nlat, manager), manager,
                climatology=shard_tensor(clim, -2, manager, uneven=True),
                per_sample=per_sample, data_parallel=data_parallel, centered_acc=centered,
            )
            b = 2 * manager.dp_rank
            whole = (p, t) if data_parallel else (p[b : b + 2], t[b : b + 2])
            want = _reference_metrics(*whole, clim, w, (2, 3) if per_sample else (0, 2, 3), centered)
            assert set(got) == {"mse", "rmse", "acc"}
            for key in want:
                assert got[key].shape == want[key].shape and got[key].dtype == torch.float64
                torch.testing.assert_close(got[key], want[key], **TOL, msg=key)
                agreed(manager, got[key], manager.comm if data_parallel else manager.domain_group)


def test_metrics_of_float32_fields_accumulate_in_float64():
    rng = np.random.default_rng(15)
    t = torch.from_numpy(rng.standard_normal((2, 3, 181, 360)))
    p = t + 0.1 * torch.from_numpy(rng.standard_normal(t.shape))
    clim = torch.from_numpy(rng.standard_normal((3, 181, 360)))
    want = _reference_metrics(p, t, clim, global_weights(181), (0, 2, 3), False)
    got = cnn.latitude_weighted_metrics(p.float(), t.float(), cnn.latitude_weights(181), climatology=clim.float())
    for key in want:
        assert got[key].dtype == torch.float64
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0, msg=key)  # float32 inputs, not sums


def _weighted_corr(a, b, w):
    """Independent check of the centered ACC: numpy's weighted covariance."""
    c = np.cov(a.ravel(), b.ravel(), aweights=w.ravel(), bias=True)
    return c[0, 1] / np.sqrt(c[0, 0] * c[1, 1])


@pytest.mark.mpi(min_size=1)
def test_metrics_layouts_and_numpy_check(make_manager):
    """(B, C, T, lat, lon) fields, channel first, channel_dim=None; centered ACC against numpy's weighted cov."""
    rng = np.random.default_rng(13)
    nlat = 13
    with layouts(make_manager) as managers:
        for manager in managers:
            p = torch.from_numpy(rng.standard_normal((2, 3, 4, nlat, LON)))
            t = torch.from_numpy(rng.standard_normal((2, 3, 4, nlat, LON)))
            clim = torch.from_numpy(rng.standard_normal((nlat, LON)))
            w = cnn.latitude_weights(nlat, manager)
            band = (shard_tensor(p, -2, manager, uneven=True), shard_tensor(t, -2, manager, uneven=True))
            got = cnn.latitude_weighted_metrics(*band, w, manager, climatology=shard_tensor(clim, -2, manager, uneven=True), centered_acc=True)
            wf = global_weights(nlat).expand(p.shape).numpy()
            for c in range(3):
                ap, at = (p - clim)[:, c].numpy(), (t - clim)[:, c].numpy()
                assert abs(float(got["acc"][c]) - _weighted_corr(ap, at, wf[:, c])) < 1e-12
                rmse = np.sqrt(np.average((p - t)[:, c].numpy() ** 2, weights=wf[:, c]))
                assert abs(float(got["rmse"][c]) - rmse) < 1e-12
            # channel first, per sample (the batch is dim 1): shape (B, C)
            swapped = [x.transpose(0, 1).contiguous() for x in band]
            per = cnn.latitude_weighted_metrics(*swapped, w, manager, channel_dim=0, batch_dim=1, per_sample=True)
            want = _reference_metrics(p, t, None, global_weights(nlat), (2, 3, 4), False)
            torch.testing.assert_close(per["rmse"], want["rmse"], **TOL)
            # one value over everything
            one = cnn.latitude_weighted_metrics(*band, w, manager, channel_dim=None)
            assert one["rmse"].shape == ()
            torch.testing.assert_close(one["mse"], (global_weights(nlat) * (p - t) ** 2).mean(), **TOL)


@pytest.mark.mpi(min_size=1)
def test_metrics_refusals_raise_on_every_rank(make_manager):
    rng = np.random.default_rng(14)
    nlat = 13
    with layouts(make_manager) as managers:
        for manager in managers:
            p = shard_tensor(torch.from_numpy(rng.standard_normal((2, 3, nlat, LON))), -2, manager, uneven=True)
            w = cnn.latitude_weights(nlat, manager)
            comm = manager.domain_group
            last = comm.Get_rank() == comm.Get_size() - 1
            with pytest.raises(ValueError, match="per_sample=True"):
                cnn.latitude_weighted_metrics(p, p, w, manager, per_sample=True, data_parallel=True)
            # a climatology of the wrong shape on the last rank of the domain group only
            clim = torch.zeros(5) if last else torch.zeros(p.shape[1:])
            with pytest.raises(ValueError, match="does not broadcast"):
                cnn.latitude_weighted_metrics(p, p, w, manager, climatology=clim)
            # weights of another band layout on the last rank only
            bad_w = w[:-1] if last else w
            with pytest.raises(ValueError, match="do not fit this band"):
                cnn.latitude_weighted_metrics(p, p, bad_w, manager)
            if comm.Get_size() > 1:  # ranks disagree on the channels: one ValueError everywhere
                with pytest.raises(ValueError, match="disagree"):
                    cnn.latitude_weighted_metrics(p, p, w, manager, channel_dim=None if last else 1)
            if manager.comm.Get_size() > 1:  # one rank asks for data_parallel: the others must not wait elsewhere
                with pytest.raises(ValueError, match="disagree"):
                    cnn.latitude_weighted_metrics(p, p, w, manager, data_parallel=manager.rank == 0)
            with pytest.raises(ValueError, match="different dimensions"):
                cnn.latitude_weighted_metrics(p, p, w, manager, channel_dim=2)
            with pytest.raises(TypeError, match="climatology must be a torch tensor"):
                cnn.latitude_weighted_metrics(p, p, w, manager, climatology=np.zeros(3))
