"""Reliability of the model side (issue 27): what one rank sees becomes the same exception on every rank.

Each MPI test runs inside :func:`tests.bounded.bounded`, so a regression that
leaves ranks waiting ends the job in seconds with the test named, instead of
hanging it. Domain sizes 2..W (sub-communicators over world ranks 0..d-1).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi import DomainParallelError  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel, describe, keep_local  # noqa: E402
from credit_mpi.nn.replicated import is_replicated  # noqa: E402

from .bounded import bounded  # noqa: E402
from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import assert_same, bands_of, run_both, same_error_everywhere  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


class SkipNet(nn.Module):
    """A small UNet: a strided conv, nearest upsampling, and a skip connection joined by torch.cat."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(2, 3, 3, padding=1)
        self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.out = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        a = torch.relu(self.inc(x))
        return self.out(torch.cat([a, self.up(self.down(a))], dim=1))


def domains(make_manager, smallest=2):
    """``(d, manager)`` for the domain sizes ``smallest``.. world size this rank is in."""
    with prefix_managers(make_manager) as pairs:
        yield from ((d, m) for d, m in pairs if d >= smallest)


def band_of(x: torch.Tensor, manager, axis: int = -2) -> torch.Tensor:
    start, stop = bands_of(x.shape[axis], manager)
    return x.narrow(axis, start, stop - start).clone()


class FailsOn(nn.Module):
    """Raises on one domain rank only (user code between converted layers)."""

    def __init__(self, rank: int, manager) -> None:
        super().__init__()
        self.rank, self.manager = rank, manager

    def forward(self, x):
        if self.manager.domain_rank == self.rank:
            raise RuntimeError(f"injected failure on domain rank {self.rank}")
        return x


# -- item 1: a rank-local exception inside a converted forward -----------------------------------


@pytest.mark.mpi(min_size=3)
def test_unet_skip_of_another_layout_joins_on_every_rank(make_manager):
    """8 latitudes on 3 ranks: the up path returns [4, 2, 2] rows for the skip's [3, 3, 2]; a plain torch.cat would
    fail on two ranks while the third went on to the next layer's agreement. The cat's rule agrees every part's rows
    on every rank first and re-bands the up path to the skip's layout: every rank joins, exactly."""
    for d, manager in domains(make_manager, 3):
        if d != 3:
            continue
        with bounded("unet skip"):
            assert verdict_is_the_run("unet skip", SkipNet, (1, 2, 8, 6), manager).exact


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["between", "after"])
def test_exception_on_one_rank_reaches_every_rank(where, make_manager):
    """User code that raises on one rank only, before a layer (the others are in its agreement) or after the last
    one (the others are in the agreement that ends every forward): the same exception on every rank; then the
    model runs again."""
    for d, manager in domains(make_manager):
        for rank in (0, d - 1):
            conv = nn.Conv2d(2, 2, 3, padding=1)
            layers = [FailsOn(rank, manager), conv] if where == "between" else [conv, FailsOn(rank, manager)]
            model = convert_to_domain_parallel(nn.Sequential(*layers).double(), manager, custom_converters={FailsOn: keep_local})
            x = band_of(torch.randn(1, 2, 2 * d + 1, 5, dtype=torch.float64), manager)
            with bounded(f"one-rank exception {where}"):
                message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), DomainParallelError)
                assert f"injected failure on domain rank {rank}" in message and f"rank(s) {rank} of" in message
                model[0 if where == "between" else 1].rank = -1
                assert model(x).shape == x.shape  # the next forward runs


@pytest.mark.mpi(min_size=2)
def test_agreed_error_is_raised_as_it_is(make_manager):
    """An error every rank raises alike (a bad input) comes out unchanged: type and message."""
    for d, manager in domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)).double(), manager)
        x = torch.zeros(1, 2, 3, 4, dtype=torch.float32 if manager.domain_rank == d - 1 else torch.float64)
        with bounded("agreed error"):
            message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ValueError)
        assert message.count("[on rank") <= 1 and "do not fit together" in message, message


# -- item 2: the layer's mode is part of its agreement -------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layer", ["batchnorm", "conv"])
def test_eval_on_one_rank_raises_on_every_rank(layer, make_manager):
    """model.eval() on one rank only: BatchNorm's training ranks would gather statistics the eval rank skips; every
    layer agrees on its mode, so every rank raises the same ValueError naming it."""
    for d, manager in domains(make_manager):
        inner = nn.BatchNorm2d(2) if layer == "batchnorm" else nn.Conv2d(2, 2, 3, padding=1)
        model = convert_to_domain_parallel(nn.Sequential(inner).double(), manager)
        model.train(manager.domain_rank != d - 1)
        x = band_of(torch.randn(2, 2, 2 * d, 3, dtype=torch.float64), manager)
        with bounded("eval on one rank"):
            message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ValueError)
        assert "training" in message, message
        model.eval()
        with bounded("eval on every rank"):
            assert model(x).shape == x.shape


@pytest.mark.mpi(min_size=2)
def test_a_layer_changed_on_one_rank_raises_on_every_rank(make_manager):
    """A setting that decides the layer's collectives (a global mean on one rank, a resampling on the others) is part
    of its agreement: the same ValueError on every rank, naming the settings."""
    for d, manager in domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.AdaptiveAvgPool2d((2, None))).double(), manager)
        if manager.domain_rank == d - 1:
            model[0].output_size = (1, None)
        x = band_of(torch.randn(1, 2, 2 * d, 3, dtype=torch.float64), manager)
        with bounded("a layer changed on one rank"):
            message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ValueError)
        assert "output_size=(1, None)" in message and "output_size=(2, None)" in message, message


@pytest.mark.mpi(min_size=2)
def test_grad_mode_on_one_rank_raises_on_every_rank(make_manager):
    """torch.no_grad() on one rank only: the backward's collectives would run on some ranks only."""
    for d, manager in domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.GroupNorm(1, 2)).double(), manager)
        x = band_of(torch.randn(1, 2, 2 * d, 3, dtype=torch.float64), manager).requires_grad_()

        def call(m=model, x=x, rank=manager.domain_rank):
            with torch.set_grad_enabled(rank != 0):
                return m(x)

        with bounded("grad mode on one rank"):
            message = same_error_everywhere(manager.domain_group, call, ValueError)
        assert "requires_grad=False" in message and "requires_grad=True" in message, message


# -- item 4: a replicated global mean, then a padded conv ----------------------------------------


def mean_then_conv():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.AdaptiveAvgPool2d((1, None)), nn.ReLU(),
                         nn.Conv2d(3, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Upsample(scale_factor=(1, 2)))


@pytest.mark.mpi(min_size=2)
def test_global_mean_then_padded_conv_is_exact(make_manager):
    """AdaptiveAvgPool2d((1, None)) replicates its row on every rank; the next (padded 3x3) conv, norm and upsample
    compute on it locally: forward and backward equal one process, and describe() says how."""
    for d, manager in domains(make_manager):
        with bounded("global mean then conv"):
            r = run_both(mean_then_conv, (2, 2, 2 * d + 1, 6), manager, replicated=True)
        assert_same(r)
        plan = describe(mean_then_conv(), (2, 2, 2 * d + 1, 6), domain_size=d)
        assert plan.exact, plan
        assert [row.note for row in plan.rows[2:]] == ["replicated input: computed locally"] * 3, plan


def test_replicated_stays_replicated_only_without_bands():
    """What a replicated tensor and parameters make stays replicated; anything with a band in it is a band."""
    from credit_mpi.nn.replicated import replicated

    band = torch.randn(1, 2, 3, 4)
    r = replicated(band.mean(2, keepdim=True))
    assert is_replicated(torch.relu(r)) and is_replicated(r * 2) and is_replicated(nn.Conv2d(2, 2, 1)(r))
    assert not is_replicated(band - r) and not is_replicated(torch.cat([r, band], 2))


# -- item 9: deepcopy (an EMA copy) and pickling -------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_deepcopy_of_a_converted_model_shares_the_manager(make_manager):
    """An EMA copy: the same forward as the original; updating it leaves the original alone."""
    for d, manager in domains(make_manager):
        torch.manual_seed(1)
        model = convert_to_domain_parallel(SkipNet().double(), manager)
        ema = copy.deepcopy(model)
        assert ema.inc.dp_manager is manager and ema.inc.weight is not model.inc.weight
        x = band_of(torch.randn(1, 2, 4 * d, 6, dtype=torch.float64), manager)
        with bounded("deepcopy"):
            torch.testing.assert_close(ema(x), model(x), rtol=0, atol=0)
            before = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p in ema.parameters():
                    p.mul_(0.5)
            for p, q in zip(model.parameters(), before, strict=True):
                assert torch.equal(p, q)
            assert not torch.equal(ema(x), model(x))


@pytest.mark.mpi(min_size=2)
def test_pickling_a_converted_model_names_state_dict(make_manager):
    for _, manager in domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)), manager)
        for save in (lambda m=model: torch.save(m, io.BytesIO()), lambda m=model: pickle.dumps(m)):
            with pytest.raises(TypeError, match=r"state_dict\(\)"):
                save()
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)  # the way out works


# -- item 6: dropout on bands --------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_dropout_refused_in_training_identity_in_eval(make_manager):
    """Each band would draw its own mask (the same one on every rank with one seed): refused in training on every
    rank with the way out named; the identity in eval; keep_local accepts band-local masks."""
    for d, manager in domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.Dropout(0.5)).double(), manager)
        x = band_of(torch.randn(1, 2, 2 * d, 4, dtype=torch.float64), manager)
        assert not describe(model, (1, 2, 2 * d, 4), domain_size=d).exact
        with bounded("dropout in training"):
            message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), credit_mpi.nn.ConversionError)
            assert "keep_local" in message and "p=0.5" in message, message
            model.eval()
            assert describe(model, (1, 2, 2 * d, 4), domain_size=d).exact
            torch.testing.assert_close(model(x), model[0](x), rtol=0, atol=0)
            kept = convert_to_domain_parallel(nn.Sequential(nn.Dropout(0.5)), manager, custom_converters={nn.Dropout: keep_local})
            assert type(kept[0]) is nn.Dropout and kept(x.float()).shape == x.shape


# -- item 8: describe()'s verdict is the run's ---------------------------------------------------


class Doubler(nn.Module):
    def forward(self, x):
        return 2 * x


VERDICTS = {
    # name: (build, global (lat, lon) for d ranks, custom converters)
    "conv": (lambda: nn.Conv2d(2, 2, 3, padding=1), lambda d: (2 * d + 1, 5), None),
    "reflect_k5_two_rows": (lambda: nn.Conv2d(2, 2, 5, padding=2, padding_mode="reflect"), lambda d: (2 * d, 6), None),
    "reflect_k5_three_rows": (lambda: nn.Conv2d(2, 2, 5, padding=2, padding_mode="reflect"), lambda d: (3 * d, 6), None),
    "keep_local": (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Doubler()), lambda d: (2 * d, 4), {Doubler: keep_local}),
    "skip_of_another_layout": (SkipNet, lambda d: (8, 6) if d == 3 else (4 * d, 6), None),
    "mean_then_conv": (mean_then_conv, lambda d: (2 * d + 1, 6), None),
    "k7_on_thin_bands": (lambda: nn.Conv2d(2, 2, 7, padding=3), lambda d: (2 * d, 6), None),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_describe_verdict_is_the_runs(name, make_manager):
    """describe() (taking what convert takes) says "runs exactly" exactly when the run runs."""
    build, shape_of, custom = VERDICTS[name]
    for d, manager in domains(make_manager):
        torch.manual_seed(0)
        shape = (1, 2, *shape_of(d))
        model = convert_to_domain_parallel(build().double(), manager, custom_converters=custom)
        exact = describe(model, shape, domain_size=d, custom_converters=custom).exact
        assert describe(build(), shape, domain_size=d, custom_converters=custom).exact == exact
        x = band_of(torch.randn(shape, dtype=torch.float64), manager)
        with bounded(f"verdict {name}"):
            try:
                model(x)
                ran = True
            except (ValueError, DomainParallelError):
                ran = False
            assert manager.domain_group.allgather(ran) == [ran] * d
        assert ran == exact, (name, d, ran, exact)


@pytest.mark.mpi(min_size=2)
def test_describe_on_one_rank_makes_no_mpi_call(make_manager):
    """describe() of a converted model (its root's forward guard included) is a dry run: rank 0 alone may call it."""
    for d, manager in domains(make_manager):
        model = convert_to_domain_parallel(SkipNet().double(), manager)
        with bounded("describe on one rank"):
            if manager.domain_rank == 0:
                assert describe(model, (1, 2, 4 * d, 6), manager=manager).exact
            manager.domain_group.Barrier()


@pytest.mark.mpi(min_size=4)
def test_describe_verdict_layernorm_over_longitude_on_a_grid(make_manager):
    """A LayerNorm over the longitude on a 2x2 grid: the run refuses it, and so does describe()."""
    from .test_nn_grid import _block

    if MPI.COMM_WORLD.Get_size() != 4:
        pytest.skip("a 2x2 grid needs 4 ranks")
    manager = make_manager(4, domain_grid=(2, 2))
    for k, refused in ((1, True), (2, False)):
        ln = nn.LayerNorm((6,) if k == 1 else (4, 6))
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), ln).double(), manager)
        assert describe(model, (1, 2, 4, 6), manager=manager).exact is not refused
        x = _block(torch.randn(1, 2, 4, 6, dtype=torch.float64), manager).contiguous()
        with bounded("layernorm on a grid"):
            if refused:
                same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), credit_mpi.nn.ConversionError)
            else:
                model(x)
