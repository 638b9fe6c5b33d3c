"""Nothing is judged outside the rules: a converted model's input, its output, and what is done with the output.

The newcomer's three mistakes, each silently wrong before (these tests fail on the main of issue 37):

* the whole field fed to a converted model on every rank: now a ConversionError on every rank;
* ``F.mse_loss(out_band, y_band)`` outside the model: now the field's loss (2.09 against 1.05 before on
  2 ranks), with one process's gradients after ``reduce_gradients``;
* a band returned by a converted model fed to a model that was never converted: a ConversionError on every rank.

And: a model whose output merges the band's rows with another dim (``nn.Flatten()`` last) is refused
naming what to do, by describe() and by the run alike (``verdict_is_the_run``); the other ops on a band
outside the model are refused by name, identically on every rank (no hang); a converted model fed
another converted model's band is exact. 1-4 ranks, even and uneven bands.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.nn import Band, ConversionError, convert_to_domain_parallel, describe  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import same_error_everywhere  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = nn.functional


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1))


def _heights(d: int) -> tuple[int, ...]:
    return (4 * d, 4 * d + (d > 1))  # even bands, then uneven ones


def _field(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_whole_field_fed_to_a_converted_model_raises_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(0)
            model = convert_to_domain_parallel(_net().double(), manager)
            for h in _heights(d):
                x = _field((2, 2, h, 5), h)
                if d == 1:  # one band is the field
                    model(x)
                    continue
                message = same_error_everywhere(manager.domain_group, lambda x=x, m=model: m(x), ConversionError)
                assert "shard_tensor" in message and "whole field" in message, message
                band = credit_mpi.shard_tensor(x, -2, manager, uneven=True)
                model(band)  # the band runs (the check is made again for each new input)
                same_error_everywhere(manager.domain_group, lambda x=x, m=model: m(x), ConversionError)


LOSSES = {
    "F.mse_loss": lambda out, y: F.mse_loss(out, y),
    "F.l1_loss": lambda out, y: F.l1_loss(out, y),
    "nn.MSELoss(sum)": lambda out, y: nn.MSELoss(reduction="sum")(out, y),
    "F.smooth_l1_loss": lambda out, y: F.smooth_l1_loss(out, y),
    "mean of squares": lambda out, y: ((out - y) ** 2).mean(),
    "rmse": lambda out, y: ((out - y) ** 2).mean().sqrt(),
    "latitude mean then sum": lambda out, y: (out - y).abs().mean(-2).sum() + out.sum((-2, -1)).mean(),
    "nanmean": lambda out, y: torch.nanmean(out * y),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses_outside_the_model_are_the_fields(name, make_manager):
    loss_of = LOSSES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                x, y = _field((2, 2, h, 5), 1), _field((2, 2, h, 5), 2)
                torch.manual_seed(0)
                ref = _net().double()
                model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
                xr = x.clone().requires_grad_()
                loss_ref = loss_of(ref(xr), y)
                loss_ref.backward()
                xb = credit_mpi.shard_tensor(x, -2, manager, uneven=True).clone().requires_grad_()
                yb = credit_mpi.shard_tensor(y, -2, manager, uneven=True)
                out = model(xb)
                assert isinstance(out, Band) == (d > 1)
                loss = loss_of(out, yb)
                loss.backward()
                credit_mpi.reduce_gradients(model.parameters(), manager)
                values = manager.domain_group.allgather(float(loss))
                assert all(v == pytest.approx(float(loss_ref), rel=1e-12, abs=1e-12) for v in values), (name, values, float(loss_ref))
                torch.testing.assert_close(xb.grad, credit_mpi.shard_tensor(xr.grad, -2, manager, uneven=True),
                                           rtol=1e-10, atol=1e-12)
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
                gathered = credit_mpi.gather_tensor(out, -2, manager)
                assert type(gathered) is torch.Tensor
                torch.testing.assert_close(gathered, ref(x), rtol=1e-10, atol=1e-12)


REFUSED = {
    "a model never converted": lambda out, ref: ref(out),
    "max over every dim": lambda out, ref: out.max(),
    "std": lambda out, ref: out.std(),
    "softmax over the rows": lambda out, ref: out.softmax(-2),
    "cat along the rows": lambda out, ref: torch.cat([out, out], -2),
    "F.interpolate": lambda out, ref: F.interpolate(out, scale_factor=2),
    "matmul": lambda out, ref: out @ out.transpose(-1, -2),
    "the whole field as a partner": lambda out, ref: out - torch.zeros(2, 2, 64, 5, dtype=out.dtype),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_ops_on_a_band_outside_the_model_raise_on_every_rank(name, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(0)
            ref = _net().double()
            model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
            for h in _heights(d):
                out = model(credit_mpi.shard_tensor(_field((2, 2, h, 5), 3), -2, manager, uneven=True))
                if d == 1:
                    continue
                message = same_error_everywhere(manager.domain_group, lambda out=out, ref=ref: REFUSED[name](out, ref), ConversionError)
                assert "LatitudeWeightedMSELoss" in message and "reduce_gradients" in message, message


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_a_band_fed_to_another_converted_model_is_exact(make_manager):
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _net(), _net()

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                torch.manual_seed(0)
                ref = Chain().double()
                a = convert_to_domain_parallel(copy.deepcopy(ref.a), manager)
                b = convert_to_domain_parallel(copy.deepcopy(ref.b), manager)
                x = _field((2, 2, h, 5), 4)
                out = b(a(credit_mpi.shard_tensor(x, -2, manager, uneven=True)))
                torch.testing.assert_close(credit_mpi.gather_tensor(out, -2, manager), ref.b(ref.a(x)), rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_a_band_pickles_as_its_plain_values(make_manager, tmp_path):
    """A Band holds its manager (communicators): pickled (torch.save, mpi4py's lowercase calls) it is the plain tensor."""
    import pickle

    manager = make_manager()
    torch.manual_seed(0)
    model = convert_to_domain_parallel(_net().double(), manager)
    out = model(credit_mpi.shard_tensor(_field((1, 2, 4 * manager.domain_parallel_size, 5), 1), -2, manager))
    assert isinstance(out, Band) or manager.domain_parallel_size == 1  # one band: the field, a plain tensor
    back = pickle.loads(pickle.dumps(out.detach()))
    plain = out.as_plain() if isinstance(out, Band) else out
    assert type(back) is torch.Tensor and torch.equal(back, plain.detach())
    torch.save(out.detach(), tmp_path / f"out{manager.domain_rank}.pt")
    assert torch.equal(torch.load(tmp_path / f"out{manager.domain_rank}.pt"), back)
    gathered = manager.domain_group.allgather(out.detach().float())  # what tools/gpu_step.py does
    assert all(type(t) is torch.Tensor for t in gathered)


class Flattened(nn.Module):
    """``nn.Flatten()`` last: the band's rows merged with the channels and the longitude."""

    def __init__(self):
        super().__init__()
        self.conv, self.flat = nn.Conv2d(2, 2, 3, padding=1), nn.Flatten()

    def forward(self, x):
        return self.flat(self.conv(x))


class RowsWithLongitude(nn.Module):
    """A reshape last that merges the rows with the longitude (tokens): a band of tokens is gathered as one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x).flatten(2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_an_output_of_merged_rows_is_refused_naming_what_to_do(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                if d > 1:  # (on one rank the output is the field's, flat: run_both compares bands only)
                    plan = verdict_is_the_run("flatten last", Flattened, (2, 2, h, 5), manager)
                    assert not plan.exact and "its output" in str(plan) and "gather_tensor" in str(plan), str(plan)
                # tokens (rows x longitude, the channels apart): a band of the tokens, which a gather along dim 2 joins
                assert verdict_is_the_run("tokens last", RowsWithLongitude, (2, 2, h, 5), manager).exact


def test_describe_refuses_an_output_of_merged_rows():
    plan = describe(Flattened().double(), (2, 2, 8, 5), 2)
    assert not plan.exact and "its output" in str(plan), str(plan)
    assert describe(Flattened().double(), (2, 2, 8, 5), 1).exact


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_shard_tensor_band_fed_to_a_model_never_converted_raises_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                torch.manual_seed(0)
                plain = _net().double()
                band = credit_mpi.shard_tensor(_field((2, 2, h, 5), 5), -2, manager, uneven=True)
                if d == 1:  # one band is the field
                    plain(band)
                    continue
                message = same_error_everywhere(manager.domain_group, lambda b=band, m=plain: m(b), ConversionError)
                assert "never converted" in message and "convert_to_domain_parallel" in message, message
                nn.Identity()(band)  # a module without parameters (a transform) takes bands as they are
                model = convert_to_domain_parallel(copy.deepcopy(plain), manager)
                torch.testing.assert_close(credit_mpi.gather_tensor(model(band), -2, manager),
                                           plain(_field((2, 2, h, 5), 5)), rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.one_domain_size
def test_a_band_of_another_layout_raises_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(0)
            model = convert_to_domain_parallel(_net().double(), manager)
            x = _field((2, 2, 4 * d, 4 * d), 6)
            lon = credit_mpi.shard_tensor(x, -1, manager)  # bands along the longitude: another layout
            message = same_error_everywhere(manager.domain_group, lambda m=model, lon=lon: m(lon), ConversionError)
            assert "along dim 3" in message, message
            out = convert_to_domain_parallel(_net().double(), manager, -1)(lon)  # a model converted along dim -1
            same_error_everywhere(manager.domain_group, lambda m=model, out=out: m(out), ConversionError)


@pytest.mark.mpi(min_size=2)
@pytest.mark.one_domain_size
def test_what_leaves_the_rows_alone_runs_outside_the_model(make_manager):
    """A rollout's joins along other dims keep the band; a slice or a view is a plain tensor (as before)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(0)
            model = convert_to_domain_parallel(_net().double(), manager)
            x = credit_mpi.shard_tensor(_field((2, 2, 4 * d + 1, 5), 7), -2, manager, uneven=True)
            out = model(x)
            joined = torch.cat([x[:, 1:], out[:, :1].as_subclass(torch.Tensor)], 1)  # plain parts: a plain tensor
            assert type(joined) is torch.Tensor
            both = torch.cat([out, out], 1)
            assert isinstance(both, Band) and both.band_dim == 2
            assert isinstance(torch.stack([out, out], 1), Band) and torch.stack([out, out], 1).band_dim == 3
            assert isinstance(out.amax(1), Band) and out.softmax(-1).band_dim == 2
            assert type(out[:, 0]) is torch.Tensor
