"""Values of the whole field's size inside a converted forward (credit_mpi.nn.judge.field_values).

A model written for the whole field keeps tensors of the field's size along the sharded dim: a
positional embedding (a Parameter) added to a band, a latitude weight buffer, coordinates made
with ``torch.linspace`` / ``arange`` / ``meshgrid`` of the field's rows (added, or joined as
channels: CoordConv), a mask of the field's rows given to ``torch.where`` / ``masked_fill`` /
``x[mask] = v``, a positional embedding of the field's tokens added to a band's tokens. Each is
exact against one process (forward, input gradient, parameter gradients after reduce_gradients,
float64) on 1..W ranks, even and uneven bands, and describe() says so (verdict_is_the_run). A tensor
made in the forward from the band's own rows (``x.shape``) is refused by describe() and by the run
alike. Coordinate attention (replicated rows joined to a band): tests/test_credit_models.py's
``upblock_coordinate`` cases and :func:`test_replicated_rows_joined_to_a_band`.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

W = 5  # the longitude (not sharded)


class PositionalEmbedding(nn.Module):
    """A conv, a learned positional embedding of the field's (H, W) added, a conv."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, 3, height, W) * 0.5)
        self.b = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) + self.pos))


class LatitudeWeight(nn.Module):
    """A buffer of the field's latitudes' cosines (H rows, one column) multiplied in, and a per-row learned scale."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        lat = torch.linspace(-80.0, 80.0, height)
        self.register_buffer("coslat", torch.cos(torch.deg2rad(lat)).reshape(height, 1))
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(3, height, 1))

    def forward(self, x):
        return self.a(x) * self.coslat * self.scale


class Coordinates(nn.Module):
    """Coordinates of the field's size made in the forward: linspace / arange / meshgrid, added and joined as channels."""

    def __init__(self, height):
        super().__init__()
        self.height = height
        self.a = nn.Conv2d(2 + 2, 3, 3, padding=1)
        self.w = nn.Parameter(torch.randn(3, 1, 1))

    def forward(self, x):
        lat = torch.linspace(-1.0, 1.0, self.height, dtype=x.dtype)
        lon = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        gy, gx = torch.meshgrid(lat, lon, indexing="ij")
        coords = torch.stack([gy, gx]).unsqueeze(0).expand(x.shape[0], -1, -1, -1)
        y = self.a(torch.cat([x, coords], dim=1))  # CoordConv
        rows = torch.arange(self.height, dtype=x.dtype).reshape(-1, 1)
        return y + self.w * torch.sin(rows) + gy * gx


class Masks(nn.Module):
    """Masks of the field's rows (a land-sea-like buffer): torch.where, masked_fill, x[mask] = v, and x[x < 0] = 0."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        rows = torch.arange(height).reshape(height, 1) + torch.arange(W)
        self.register_buffer("land", rows % 3 == 0)
        self.register_buffer("north", (torch.arange(height) < height // 2).reshape(1, 1, height, 1))
        self.register_buffer("ice", (rows % 4 == 1).reshape(1, 1, height, W).expand(2, 3, height, W).clone())
        self.fill = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        y = self.a(x)
        y = torch.where(self.land, y * self.fill, y)
        y = y.masked_fill(self.north, -0.5)
        y = y.clone()
        y[self.ice] = 2.0  # a mask of the batch's whole shape
        z = y.clone()
        z[z < -1.0] = 0.0
        return z + y


class Tokens(nn.Module):
    """A ViT-style positional embedding of the field's H * W tokens added to a band's tokens."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, height * W, 4) * 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        b, c, h, w = y.shape
        t = self.lin(y.flatten(2).transpose(1, 2) + self.pos)
        return t.transpose(1, 2).reshape(b, c, h, w)


class FromTheBand(nn.Module):
    """Coordinates made from ``x.shape``: the field's rows (sizes read from a band are the field's), cut to the band's."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        rows = torch.arange(x.shape[-2], dtype=x.dtype).reshape(-1, 1)
        return self.a(x) * torch.cos(rows)


EXACT = {"positional_embedding": PositionalEmbedding, "latitude_weight": LatitudeWeight, "coordinates": Coordinates,
         "masks": Masks, "token_embedding": Tokens, "from_the_band": FromTheBand}


def _heights(d):
    return (3 * d,) if d == 1 else (3 * d, 3 * d + 2)  # even bands, then uneven ones


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(EXACT))
def test_field_sized_values_are_the_bands_rows(name, make_manager):
    """Exact on every domain size, even and uneven bands: the band's rows of the field-sized tensor."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                plan = verdict_is_the_run(name, lambda h=h: EXACT[name](h), (2, 2, h, W), manager)
                assert plan.exact, str(plan)


class CoordinateAttention(nn.Module):
    """Coordinate attention as CREDIT writes it: rows pooled over the longitude (a band) joined with the longitude's
    columns pooled over the field (replicated), a 1x1 conv, BatchNorm over both (the replicated rows counted once),
    split back."""

    def __init__(self, channels, first=False):
        super().__init__()
        self.first = first
        self.pool_h = nn.AdaptiveAvgPool2d((None, 1))
        self.pool_w = nn.AdaptiveAvgPool2d((1, None))
        self.conv1 = nn.Conv2d(channels, 4, 1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv_h = nn.Conv2d(4, channels, 1)
        self.conv_w = nn.Conv2d(4, channels, 1)
        self.pre = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        x = self.pre(x)
        n, c, h, w = x.size()
        x_h = self.pool_h(x)
        x_w = self.pool_w(x).permute(0, 1, 3, 2)
        if self.first:  # the replicated rows before the band's
            y = torch.nn.functional.silu(self.bn1(self.conv1(torch.cat([x_w, x_h], dim=2))))
            x_w, x_h = torch.split(y, [w, h], dim=2)
        else:
            y = torch.nn.functional.silu(self.bn1(self.conv1(torch.cat([x_h, x_w], dim=2))))
            x_h, x_w = torch.split(y, [h, w], dim=2)
        a_h = torch.sigmoid(self.conv_h(x_h))
        a_w = torch.sigmoid(self.conv_w(x_w.permute(0, 1, 3, 2)))
        return x * a_h * a_w


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("first", [False, True], ids=["after", "before"])
def test_replicated_rows_joined_to_a_band(first, make_manager):
    """The joined field's rows each on one rank (the last band owns the replicated rows, the first when they come
    first): BatchNorm's statistics count them once; the split sends them back to every rank. Exact, even and uneven."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                plan = verdict_is_the_run("coordinate_attention", lambda: CoordinateAttention(3, first), (2, 3, h, W),
                                          manager)
                assert plan.exact, str(plan)
                if d > 1:
                    assert any("split()" in r.kind for r in plan.rows), str(plan)

