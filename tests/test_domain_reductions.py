"""A sum or mean over the sharded dim (credit_mpi.nn.judge.reductions._domain_reduction): one sum over the domain, replicated.

A squeeze-excite written with ``x.mean((2, 3), keepdim=True)`` (timm's SqueezeExcite), a
coordinate attention whose latitude pool is ``x.mean(dim=2)`` (a replicated (B, C, 1, W)),
``x.sum(dim=-2)`` feeding a Linear, a normalisation by the field's mean ``x.mean()``, a
nan-aware mean: each exact against one process (forward, input gradient, parameter
gradients after ``reduce_gradients``) through :func:`verdict_is_the_run`, on 1-4 ranks,
even and uneven bands; ``x.amax(dim=-2)`` is the domain's max (tests/test_index_rows.py has its ties),
``x.logsumexp(dim=-2)`` stays refused on every rank. describe()'s row
of the domain sum carries its traffic: one Allreduce forward and one backward.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import describe  # noqa: E402
from credit_mpi.nn.traffic import Traffic  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


class SqueezeExcite(nn.Module):
    """timm's SqueezeExcite: the field's mean per channel (keepdim), two 1x1 convs on it, the band scaled by it."""

    def __init__(self, c=4):
        super().__init__()
        self.conv0, self.reduce, self.expand = nn.Conv2d(2, c, 3, padding=1), nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1)

    def forward(self, x):
        x = self.conv0(x)
        s = x.mean((2, 3), keepdim=True)
        return x * self.expand(self.reduce(s).relu()).sigmoid()


class CoordMeans(nn.Module):
    """Coordinate attention written with functions: x.mean(dim=3) (a band) and x.mean(dim=2) (over the sharded dim)."""

    def __init__(self, c=2):
        super().__init__()
        self.conv0, self.conv_h, self.conv_w = (nn.Conv2d(c, c, 1) for _ in range(3))

    def forward(self, x):
        x = self.conv0(x)
        x_h = x.mean(dim=3).unsqueeze(3)  # (B, C, H, 1): the band's rows
        x_w = x.mean(dim=2).unsqueeze(2)  # (B, C, 1, W): replicated
        return x * self.conv_h(x_h).sigmoid() * self.conv_w(x_w).sigmoid()


class RowSum(nn.Module):
    """``x.sum(dim=-2)`` (B, C, W) feeding a Linear over the longitude, added back to every row."""

    def __init__(self, w=4):
        super().__init__()
        self.conv0, self.fc = nn.Conv2d(2, 2, 3, padding=1), nn.Linear(w, w)

    def forward(self, x):
        x = self.conv0(x)
        return x + self.fc(torch.sum(x, dim=-2)).unsqueeze(-2)


class _Conv0(nn.Module):
    """A 3x3 conv (its output a band needing a halo), then the subclass's forward."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(2, 2, 3, padding=1)


class FieldNorm(_Conv0):
    """A normalisation by the field's mean over every dim (a 0-dim replicated tensor), and by a nan-aware mean."""

    def forward(self, x):
        x = self.conv0(x)
        centred = x - x.mean()
        return centred / (centred.square().nanmean(dim=(-2, -1), keepdim=True) + 1).sqrt() + x.nansum(-2, True)


class RowMax(_Conv0):
    """A max over the sharded dim: the domain's (the bands' maxima gathered)."""

    def forward(self, x):
        x = self.conv0(x)
        return x * x.amax(dim=-2, keepdim=True)


class RowLogSumExp(_Conv0):
    """A logsumexp over the sharded dim: no rule on bands (refused on every rank)."""

    def forward(self, x):
        x = self.conv0(x)
        return x * x.logsumexp(dim=-2, keepdim=True)


CASES = {"squeeze_excite": SqueezeExcite, "coord_means": CoordMeans, "row_sum": RowSum, "field_norm": FieldNorm,
         "row_max": RowMax, "row_logsumexp": RowLogSumExp}
REFUSED = {"row_logsumexp"}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CASES))
def test_domain_reductions_are_what_the_run_does(name, make_manager):
    build = CASES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in (4 * d, 4 * d + (d > 1)):  # even bands, then uneven ones
                plan = verdict_is_the_run(name, build, (2, 2, h, 4), manager)
                assert plan.exact == (d == 1 or name not in REFUSED), str(plan)
                if d > 1 and name in REFUSED:
                    assert "logsumexp" in str(plan), str(plan)


def test_describe_shows_the_domain_sum_and_its_traffic():
    """The mean over (2, 3): a row of its own; its partial (2, 4, 1, 1) float64 Allreduced forward and backward."""
    plan = describe(SqueezeExcite().double(), (2, 2, 7, 4), 3, requires_grad=True)
    assert plan.exact, str(plan)
    row = next(r for r in plan.rows if r.kind.startswith("domain_sum()"))
    assert row.kind == "domain_sum() of mean()" and row.bands_in == (3, 2, 2) and "Allreduce" in row.note
    nbytes = 2 * 4 * 8 * 2  # the partial's bytes to each of the 2 other ranks
    assert row.traffic == (Traffic(nbytes, 1, nbytes, 1, 1),) * 3
    refused = describe(RowLogSumExp().double(), (2, 2, 7, 4), 3)
    assert not refused.exact and "logsumexp" in refused.rows[-1].kind and "sum, mean" in refused.rows[-1].note


def test_describe_refuses_a_domain_sum_on_a_grid_as_the_run_does():
    """On a latitude x longitude grid the rule refuses (a sum over the rows alone is one column's): describe() too."""
    plan = describe(SqueezeExcite().double(), (2, 2, 8, 8), domain_grid=(2, 2))
    assert not plan.exact and "domain grid" in str(plan), str(plan)
