"""A converted model's step (issue 26): one agreement per layer call, and HaloExchange copies like the other layers."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import HaloExchange  # noqa: E402

from .halo_reference import band, prefix_managers  # noqa: E402


@pytest.mark.mpi(min_size=1)
def test_halo_exchange_module_deepcopies_and_names_state_dict_when_pickled(make_manager):
    """An EMA copy of a model with a HaloExchange shares its manager; pickling it says to save the state_dict()."""
    with prefix_managers(make_manager) as managers:
        for _, manager in managers:
            model = nn.Sequential(HaloExchange(1, manager=manager), nn.Conv2d(2, 2, (3, 1))).double()
            ema = copy.deepcopy(model)
            assert ema[0].manager is manager and ema[1].weight is not model[1].weight
            a, b = band(8, manager)
            x = torch.randn(1, 2, 8, 3, dtype=torch.float64).narrow(2, a, b - a).contiguous()
            torch.testing.assert_close(ema(x), model(x), rtol=0, atol=0)
            for save in (lambda m=model: torch.save(m, io.BytesIO()), lambda m=model: pickle.dumps(m)):
                with pytest.raises(TypeError, match=r"state_dict\(\)"):
                    save()
    pickle.loads(pickle.dumps(HaloExchange(1)))  # no manager (the global one at each call): pickles


def _agreements(run) -> int:
    """The agreements ``run()`` makes on this rank (each one is an ``Allgather``: the watchdog counts them)."""
    from credit_mpi import watchdog

    before = watchdog.STATE.seq
    run()
    return watchdog.STATE.seq - before


def _domains(make_manager):
    """``(d, manager, x)`` for every domain of 2.. ranks: ``x`` this rank's band of a (1, 2, 4d, 5) float64 field."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d > 1:
                a, b = band(4 * d, manager)
                yield d, manager, torch.randn(1, 2, 4 * d, 5, dtype=torch.float64).narrow(2, a, b - a).contiguous()


def _convs(k: int, manager):
    """``k`` converted 3x3 convolutions in a row (float64)."""
    from credit_mpi.nn import convert_to_domain_parallel

    return convert_to_domain_parallel(nn.Sequential(*[nn.Conv2d(2, 2, 3, padding=1) for _ in range(k)]).double(), manager)


@pytest.mark.mpi(min_size=2)
def test_a_converted_conv_agrees_once_per_call(make_manager):
    """The layer's agreement covers the halo's (issue 26, item 1): three convs cost two agreements more than one."""
    for _, manager, x in _domains(make_manager):
        x.requires_grad_()
        counts = []
        for k in (1, 3):
            model = _convs(k, manager)
            model(x).sum().backward()  # plans remembered
            counts.append(_agreements(lambda m=model, x=x: m(x).sum().backward()))
        assert counts[1] - counts[0] == 2, counts


def _agreements_per_layer(build, x, k: int) -> int:
    """The agreements one more layer of ``build()`` adds to a forward and backward (plans remembered)."""
    counts = []
    for layers in (1, 1 + k):
        model = build(layers)
        model(x).sum().backward()  # plans remembered
        counts.append(_agreements(lambda m=model, x=x: m(x).sum().backward()))
    return (counts[1] - counts[0]) // k


@pytest.mark.mpi(min_size=2)
def test_a_transposed_conv_agrees_once_per_call(make_manager):
    """The overlap-add's exchange takes the layer's agreement (forward and backward: none of its own)."""
    from credit_mpi.nn import convert_to_domain_parallel

    def build(layers, manager):
        convs = [nn.ConvTranspose2d(2, 2, 3, padding=1) for _ in range(layers)]  # an overlap of one row
        return convert_to_domain_parallel(nn.Sequential(*convs).double(), manager)

    for _, manager, x in _domains(make_manager):
        for grad in (True, False):  # the input's gradient, or the weight's only
            assert _agreements_per_layer(lambda n, m=manager: build(n, m), x.detach().requires_grad_(grad), 2) == 1


@pytest.mark.mpi(min_size=2)
def test_a_transposed_weight_frozen_on_one_rank_raises_on_every_rank(make_manager):
    """Whether the overlap-add's backward runs (the weight's requires_grad too) is part of the layer's agreement."""
    from credit_mpi.nn import convert_to_domain_parallel

    from .nn_reference import same_error_everywhere

    for d, manager, x in _domains(make_manager):
        model = convert_to_domain_parallel(nn.Sequential(nn.ConvTranspose2d(2, 2, 3, padding=1)).double(), manager)
        model[0].weight.requires_grad_(manager.domain_rank != d - 1)
        message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ValueError)
        assert "weight requires_grad" in message


@pytest.mark.mpi(min_size=2)
def test_on_a_domain_grid_a_layer_agrees_once_per_call(make_manager):
    """On a 1 x n grid (longitude blocks) a conv and a transposed conv make one agreement per call, as on bands."""
    from credit_mpi.nn import convert_to_domain_parallel

    world = MPI.COMM_WORLD
    n = world.Get_size()
    manager = make_manager(n, domain_grid=(1, n))
    x = torch.randn(1, 2, 5, 4 * n, dtype=torch.float64).narrow(3, 4 * manager.domain_rank, 4).contiguous().requires_grad_()
    for layer in (lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), lambda: nn.ConvTranspose2d(2, 2, 3, padding=1)):
        def build(layers, make=layer):
            return convert_to_domain_parallel(nn.Sequential(*[make() for _ in range(layers)]).double(), manager)

        assert _agreements_per_layer(build, x, 2) == 1


@pytest.mark.mpi(min_size=2)
def test_grad_mode_or_requires_grad_on_one_rank_raises_on_every_rank(make_manager):
    """What the skipped halo agreement checked (autograd records the exchange, or not) the layer's still does."""
    from .nn_reference import same_error_everywhere

    for d, manager, x in _domains(make_manager):
        model = _convs(1, manager)
        last = manager.domain_rank == d - 1
        model(x.requires_grad_(True))  # remembered with grad
        odd = x.detach().requires_grad_(not last)
        message = same_error_everywhere(manager.domain_group, lambda m=model, t=odd: m(t), ValueError)
        assert "requires_grad" in message
        with torch.set_grad_enabled(not last):
            message = same_error_everywhere(manager.domain_group, lambda m=model, t=x: m(t), ValueError)
        assert "requires_grad" in message


# -- overlap (issue 26, item 1): the halo travels while the interior rows are convolved --------------


@pytest.fixture
def overlap(monkeypatch):
    """``credit_mpi.nn.conv.OVERLAP`` on (every rank), and a count of the overlapped calls."""
    from credit_mpi.nn import conv

    calls = []
    real = conv.overlapped_conv
    monkeypatch.setattr(conv, "OVERLAP", True)
    monkeypatch.setattr(conv, "overlapped_conv", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["k3p1", "k3s2p1", "k5d2p4", "same4", "circular", "k3s3p0", "k8s4p2", "groups", "replicate"])
def test_overlapped_convs_equal_one_process(name, overlap, make_manager):
    """Every band layout of tests/test_nn.py's conv test (the plain path where a band has no interior row, or replicate)."""
    from . import test_nn

    test_nn.test_conv_layers(name, make_manager)
    if MPI.COMM_WORLD.Get_size() > 1 and name in ("k3p1", "k3s2p1", "same4", "circular", "groups"):
        assert overlap  # bands of 8 rows: an interior for these kernels


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["unet", "fuxi", "crossembed_s2"])
def test_overlapped_models_equal_one_process(name, overlap, make_manager):
    from . import test_nn

    test_nn.test_models(name, make_manager)
    if name == "unet":
        test_nn.test_five_training_steps_equal_one_process(make_manager)


@pytest.mark.mpi(min_size=2)
def test_overlap_set_on_one_rank_only_raises_on_every_rank(make_manager, monkeypatch):
    from credit_mpi.nn import conv

    from .nn_reference import same_error_everywhere

    for d, manager, x in _domains(make_manager):
        model = _convs(1, manager)
        monkeypatch.setattr(conv, "OVERLAP", manager.domain_rank == d - 1)
        message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ValueError)
        assert "overlap" in message
        monkeypatch.setattr(conv, "OVERLAP", False)


class _Squeeze(nn.Module):
    """A 3x3 conv, two 1x1 convs, and a 1x1 conv on the global mean (a replicated input): squeeze-excite's shape."""

    def __init__(self, quiet: bool):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.quiet = nn.Sequential(nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1), nn.ReLU()) if quiet else nn.Identity()
        self.excite = nn.Conv2d(2, 2, 1) if quiet else nn.Identity()

    def forward(self, x):
        y = self.quiet(self.conv(x))
        return y * torch.sigmoid(self.excite(y.mean((2, 3), keepdim=True)))


@pytest.mark.mpi(min_size=2)
def test_layers_that_make_no_mpi_call_skip_their_agreement_in_a_repeated_step(make_manager):
    """1x1 convs and a conv on a replicated mean agree on the first step only: a repeated step makes as many agreements
    as the model without them (the 3x3 conv's and the mean's, the forward's first and last); the step stays exact."""
    from credit_mpi.nn import convert_to_domain_parallel

    from .nn_reference import assert_same, run_both

    for d, manager, x in _domains(make_manager):
        counts = []
        for quiet in (False, True):
            model = convert_to_domain_parallel(_Squeeze(quiet).double(), manager)
            # the band's own sum (a converted model's Band sums the field outside it: one agreement more)
            first = _agreements(lambda m=model, x=x: m(x).as_subclass(torch.Tensor).sum().backward())
            counts.append(_agreements(lambda m=model, x=x: m(x).as_subclass(torch.Tensor).sum().backward()))
            if quiet:
                assert first == counts[1] + 3, (first, counts)  # the two 1x1 convs and the conv on the replicated mean
        assert counts[0] == counts[1] == 4, counts  # forward start, the 3x3 conv, the mean, forward done
        assert_same(run_both(lambda: _Squeeze(True), (1, 2, 4 * d + d - 1, 5), manager, seed=d, steps=2))


class _Trim(nn.Module):
    """A 1x1 conv, then (on one rank, when ``odd`` is set) a column less, then another 1x1 conv."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.odd = nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1), False

    def forward(self, x):
        y = self.a(x)
        return self.b(y[..., :-1] if self.odd else y)


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_skipped_layer_sees_another_input_raises_on_every_rank(make_manager):
    """A shape that changes on one rank only inside the forward (its inputs unchanged): that rank agrees where the
    others skip, the agreements meet, and every rank raises (no wait)."""
    from credit_mpi.nn import convert_to_domain_parallel
    from credit_mpi.validation import DomainParallelError

    from .nn_reference import same_error_everywhere

    for d, manager, x in _domains(make_manager):
        model = convert_to_domain_parallel(_Trim().double(), manager)
        model(x), model(x)  # learned: both convs make no MPI call
        model.odd = manager.domain_rank == d - 1
        message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), DomainParallelError)
        # the rank that agreed names the steps, the others the calls that met theirs (forward done)
        assert "different steps of the model" in message or "made different calls" in message, message
        model.odd = False
        model(x)  # and the next forward runs again (what was remembered is consistent on every rank)
