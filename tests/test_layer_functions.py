"""Convolution, pooling and interpolation called as functions in a custom forward: the layers' own band code.

``F.conv*``, ``F.conv_transpose*``, ``F.max_pool*``, ``F.avg_pool*``, ``F.adaptive_avg_pool*`` and
``F.interpolate`` applied to a band run the converted layers' halo / overlap-add code
(credit_mpi.nn.judge.conv_pool): exact against one process (float64: forward, input gradient,
parameter gradients) on 1..W ranks, even and uneven bands, and describe()'s verdict is the run's.
What the layers cannot do exactly is refused by name on every rank.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import describe  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = torch.nn.functional


class Conv(nn.Module):
    """``F.conv2d`` with its own weight and bias, any padding, stride and dilation."""

    def __init__(self, c=2, k=3, **settings):
        super().__init__()
        groups = settings.get("groups", 1)
        self.weight = nn.Parameter(torch.randn(3 * groups, c // groups, k, k))
        self.bias = nn.Parameter(torch.randn(3 * groups))
        self.settings = settings

    def forward(self, x):
        return torch.tanh(F.conv2d(x, self.weight, self.bias, **self.settings))


class ConvTranspose(nn.Module):
    """``F.conv_transpose2d`` (stride 2): the overlap-add of the layer."""

    def __init__(self, c=2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, 3, 3, 3))

    def forward(self, x):
        return F.conv_transpose2d(x, self.weight, None, stride=2, padding=1, output_padding=1)


class Functional(nn.Module):
    """One function of ``x`` (a pooling, an interpolation) between two ``F.conv2d`` of padding 1."""

    def __init__(self, fn, c=2):
        super().__init__()
        self.fn = fn
        self.a, self.b = nn.Parameter(torch.randn(c, c, 3, 3)), nn.Parameter(torch.randn(c, c, 3, 3))

    def forward(self, x):
        return F.conv2d(self.fn(F.conv2d(x, self.a, padding=1)), self.b, padding=1)


CASES = {
    # name: (build, row unit of the heights)
    "conv2d_padding_1": (lambda: Conv(padding=1), 1),
    "conv2d_padding_2_1": (lambda: Conv(padding=(2, 1)), 1),
    "conv2d_same_dilation_2": (lambda: Conv(padding="same", dilation=2), 1),
    "conv2d_same_even_kernel": (lambda: Conv(k=4, padding="same"), 1),
    "conv2d_valid": (lambda: Conv(padding="valid"), 2),
    "conv2d_stride_2": (lambda: Conv(padding=1, stride=2), 2),
    "conv2d_stride_2_dilation_2": (lambda: Conv(padding=2, stride=2, dilation=2), 2),
    "conv2d_groups": (lambda: Conv(c=4, padding=1, groups=2), 1),
    "pad_then_conv2d": (lambda: Functional(lambda t: F.pad(t, (1, 1, 1, 1))), 1),
    "conv_transpose2d": (ConvTranspose, 1),
    "max_pool2d": (lambda: Functional(lambda t: F.max_pool2d(t, 2)), 2),
    "max_pool2d_3_1_1": (lambda: Functional(lambda t: F.max_pool2d(t, 3, 1, 1)), 1),
    "avg_pool2d": (lambda: Functional(lambda t: F.avg_pool2d(t, 3, 1, 1, count_include_pad=False)), 1),
    "adaptive_avg_pool2d": (lambda: Functional(lambda t: F.adaptive_avg_pool2d(t, (8, 3))), 2),
    "interpolate_scale_2": (lambda: Functional(lambda t: F.interpolate(t, scale_factor=2)), 1),
    "interpolate_bilinear": (lambda: Functional(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")), 1),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size  # each rank count is one domain size (CI runs 1..4)
@pytest.mark.parametrize("name", sorted(CASES))
def test_functions_run_the_layers_exactly(name, make_manager):
    build, unit = CASES[name]
    c = 4 if "groups" in name else 2
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in (4 * unit * d, 4 * unit * d + unit * (d > 1)):  # even bands, then uneven ones
                plan = verdict_is_the_run(name, build, (2, c, h, 5), manager)
                assert plan.exact, f"{name} {h} rows on {d}:\n{plan}"


REFUSED = {
    "lp_pool2d": (lambda: Functional(lambda t: F.lp_pool2d(t, 2, 2)), "lp_pool2d()"),
    "adaptive_max_pool2d": (lambda: Functional(lambda t: F.adaptive_max_pool2d(t, (2, 3))), "adaptive_max_pool2d()"),
    "max_pool2d_indices": (lambda: Functional(lambda t: F.max_pool2d(t, 2, return_indices=True)[0]), "max_pool2d"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_layers_cannot_do_is_refused_on_every_rank(name, make_manager):
    build, op = REFUSED[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            plan = verdict_is_the_run(name, build, (2, 2, 4 * d, 5), manager)
            if d > 1:
                assert not plan.exact and op in str(plan), str(plan)


def test_describe_shows_the_layers_rows():
    """The dry run reports each function's layer as a row of its own: its halo, its output bands."""
    plan = describe(Functional(lambda t: F.max_pool2d(t, 2)).double(), (1, 2, 16, 5), 4)
    kinds = [row.kind for row in plan.rows]
    assert plan.exact and "MaxPool2d" in kinds and kinds.count("Conv2d") == 2, str(plan)
    pool = plan.rows[kinds.index("MaxPool2d")]
    assert pool.rows_out == 8 and pool.path.endswith("max_pool2d"), str(plan)


class Functional1d3d(nn.Module):
    """One function between two ``F.conv{1,3}d`` of padding 1 (``nd`` spatial dims)."""

    def __init__(self, fn, nd: int, c=2):
        super().__init__()
        self.fn, self.conv = fn, getattr(F, f"conv{nd}d")
        k = (3,) * nd
        self.a, self.b = nn.Parameter(torch.randn(c, c, *k)), nn.Parameter(torch.randn(c, c, *k))

    def forward(self, x):
        return self.conv(self.fn(self.conv(x, self.a, padding=1)), self.b, padding=1)


class ConvTransposeNd(nn.Module):
    def __init__(self, nd: int, c=2):
        super().__init__()
        self.nd, self.weight = nd, nn.Parameter(torch.randn(c, 3, *(3,) * nd))

    def forward(self, x):
        return getattr(F, f"conv_transpose{self.nd}d")(x, self.weight, None, stride=2, padding=1, output_padding=1)


# 1-D (B, C, L: the band along L, shard_dim -1) and 3-D (B, C, D, H, W: along H) functions; name: (build, nd, unit)
CASES_ND = {
    "conv1d": (lambda: Functional1d3d(lambda t: t, 1), 1, 1),
    "conv3d": (lambda: Functional1d3d(lambda t: t, 3), 3, 1),
    "conv_transpose1d": (lambda: ConvTransposeNd(1), 1, 1),
    "conv_transpose3d": (lambda: ConvTransposeNd(3), 3, 1),
    "max_pool1d": (lambda: Functional1d3d(lambda t: F.max_pool1d(t, 2), 1), 1, 2),
    "avg_pool1d": (lambda: Functional1d3d(lambda t: F.avg_pool1d(t, 3, 1, 1), 1), 1, 1),
    "max_pool3d": (lambda: Functional1d3d(lambda t: F.max_pool3d(t, 2), 3), 3, 2),
    "avg_pool3d": (lambda: Functional1d3d(lambda t: F.avg_pool3d(t, 2), 3), 3, 2),
    "adaptive_avg_pool1d": (lambda: Functional1d3d(lambda t: F.adaptive_avg_pool1d(t, 4), 1), 1, 2),
    "adaptive_avg_pool3d": (lambda: Functional1d3d(lambda t: F.adaptive_avg_pool3d(t, (2, 4, 2)), 3), 3, 2),
    "interpolate_linear": (lambda: Functional1d3d(lambda t: F.interpolate(t, scale_factor=2, mode="linear"), 1), 1, 1),
    "interpolate_trilinear": (lambda: Functional1d3d(lambda t: F.interpolate(t, scale_factor=2, mode="trilinear"), 3), 3, 1),
    "interpolate_nearest_3d": (lambda: Functional1d3d(lambda t: F.interpolate(t, scale_factor=(1, 2, 1)), 3), 3, 1),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(CASES_ND))
def test_1d_and_3d_functions_run_the_layers_exactly(name, make_manager):
    build, nd, unit = CASES_ND[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            heights = (4 * unit * d, 4 * unit * d + unit * (d > 1))  # even bands, then uneven ones
            if name == "adaptive_avg_pool1d" or name == "adaptive_avg_pool3d":
                heights = (8 * d,) if d > 1 else (8,)  # whole output rows per band: the layer's own condition
            for h in heights:
                shape, dim = ((2, 2, h), -1) if nd == 1 else ((1, 2, 3, h, 4), -2)
                plan = verdict_is_the_run(name, build, shape, manager, shard_dim=dim)
                assert plan.exact, f"{name} {h} rows on {d}:\n{plan}"


class Dropouts(nn.Module):
    """Dropouts (modules and functions) that are the identity: ``p=0`` in training, any ``p`` in eval."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.mods = nn.ModuleList([nn.Dropout(p), nn.Dropout1d(p), nn.Dropout2d(p), nn.Dropout3d(p), nn.AlphaDropout(p),
                                   nn.FeatureAlphaDropout(p)])

    def forward(self, x):
        y = self.conv(x)
        if len(self.mods):
            for m in (self.mods[0], self.mods[2], self.mods[4], self.mods[5]):
                y = m(y)
            y = self.mods[2](y.transpose(-1, -2)).transpose(-1, -2)  # a permuted band: the identity on any placement
            y = self.mods[1](y.flatten(2)).reshape(y.shape) + self.mods[3](y.unsqueeze(2)).squeeze(2)
        training = self.training
        y = F.dropout(y, self.p, training) + F.dropout2d(y, self.p, training) + F.alpha_dropout(y, self.p, training)
        y = F.dropout3d(y.unsqueeze(2), self.p, training).squeeze(2) + F.dropout1d(y.flatten(2), self.p, training).reshape(y.shape)
        return self.conv(F.feature_alpha_dropout(y, self.p, training))


class DropoutEval(Dropouts):
    def __init__(self):
        super().__init__(0.3)
        self.eval()


class DropoutTraining(Dropouts):
    def __init__(self):
        super().__init__(0.3)
        self.mods = nn.ModuleList()  # only the functions: F.dropout(p=0.3) in training is refused


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("build", [lambda: Dropouts(0.0), DropoutEval], ids=["p0_training", "eval"])
def test_dropout_that_is_the_identity_runs_exactly(build, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in (4 * d, 4 * d + (d > 1)):
                plan = verdict_is_the_run("dropout", build, (2, 2, h, 5), manager)
                assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_dropout_in_training_is_refused_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d == 1:
                continue  # one band is the field: the same draw as one process with the same seed
            plan = verdict_is_the_run("dropout", DropoutTraining, (2, 2, 4 * d, 5), manager)
            assert not plan.exact and "dropout()" in str(plan), str(plan)
