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
