"""Indexing the sharded dim with the field's rows, and extremes over it (credit_mpi.nn.judge.indexing, reductions).

A model written for the whole field indexes its rows: ``index_select(2, idx)``, ``x[:, :, idx]``, ``x[:, :, mask]``,
``torch.gather`` / ``take_along_dim`` with an index that takes the same rows everywhere, and takes ``amax`` / ``amin``
over them (CBAM's channel attention). A sorted index (a crop, a stride, a mask) keeps each band's share of the
selected rows; an index out of order or repeated is a row move (the row map ``take_rows``); an extreme is the
domain's, its gradient shared among the tied elements as torch shares it, ties across bands too. Each is exact
against one process (forward, input gradient, parameter gradients after reduce_gradients, float64) on 1..W ranks,
even and uneven bands, and describe() says so (verdict_is_the_run); an index that takes other rows at other
positions is refused by describe() and by the run alike.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

W = 5  # the longitude (not sharded)


class Crop(nn.Module):
    """A conv, the field's inner rows by index_select (a crop), a conv, every other row by x[:, :, idx] (a stride)."""

    def __init__(self, height):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.register_buffer("inner", torch.arange(1, height - 1))
        self.register_buffer("every_other", torch.arange(0, height - 2, 2))

    def forward(self, x):
        y = self.b(self.a(x).index_select(2, self.inner))
        return y[:, :, self.every_other] * 2.0


class MaskRows(nn.Module):
    """Rows chosen by a boolean mask of the field's rows (x[:, :, mask]), then a conv over them."""

    def __init__(self, height):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.register_buffer("keep", torch.arange(height) % 3 != 1)

    def forward(self, x):
        return self.b(self.a(x)[:, :, self.keep])


class Permute(nn.Module):
    """The field's rows permuted (index_select of a fixed permutation) between two convs, then reversed by an index."""

    def __init__(self, height):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.register_buffer("perm", torch.randperm(height, generator=torch.Generator().manual_seed(height)))
        self.register_buffer("back", torch.arange(height - 1, -1, -1))

    def forward(self, x):
        y = self.b(torch.index_select(self.a(x), 2, self.perm))
        return y[:, :, self.back] + y


class Repeat(nn.Module):
    """Rows taken twice (the field, then the field again: a repeated index out of order; each row twice in a row: a
    sorted one), a conv over them."""

    def __init__(self, height):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.register_buffer("twice", torch.cat([torch.arange(height), torch.arange(height)]))
        self.register_buffer("doubled", torch.arange(height).repeat_interleave(2))

    def forward(self, x):
        y = self.a(x)
        return self.b(y[:, :, self.twice]) + self.b(y[:, :, self.doubled])


class Gather(nn.Module):
    """torch.gather and torch.take_along_dim along the rows with an index that takes the same rows everywhere."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.register_buffer("perm", torch.randperm(height, generator=torch.Generator().manual_seed(7)))

    def forward(self, x):
        y = self.a(x)
        b, c, _, w = y.shape
        idx = self.perm.view(1, 1, -1, 1).expand(b, c, -1, w)
        return torch.gather(y, 2, idx) + torch.take_along_dim(y, idx.flip(2), dim=2)


class Extremes(nn.Module):
    """CBAM's channel attention (amax over the rows and columns), amin over the rows of a ReLU (ties across bands), the
    whole field's amax, an amax over channels and rows."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.a(x)
        gate = torch.sigmoid(self.fc(y.amax((2, 3), keepdim=True)) + self.fc(y.mean((2, 3), keepdim=True)))
        low = torch.relu(y).amin(dim=2, keepdim=True)  # zeros in every band: the gradient shared as torch shares it
        tied = torch.relu(y - 10.0).amax(2, keepdim=True)  # every element tied (0): the gradient spread over the field
        cols = y.amax(dim=(1, 2))  # (batch, columns)
        return y * gate + low + tied + cols[:, None, None, :] + torch.amin(y)


EXACT = {"crop": Crop, "mask_rows": MaskRows, "permute": Permute, "repeat": Repeat, "gather": Gather,
         "extremes": Extremes}


def _heights(d):
    return (4 * d,) if d == 1 else (4 * d, 4 * d + 3)  # even bands, then uneven ones


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(EXACT))
def test_rows_taken_by_field_indices_are_exact(name, make_manager):
    """Exact on every domain size, even and uneven bands, describe() agreeing."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                plan = verdict_is_the_run(name, lambda h=h: EXACT[name](h), (2, 2, h, W), manager)
                assert plan.exact, str(plan)


class Scattered(nn.Module):
    """torch.gather along the rows with an index that takes other rows in other columns: no rule on bands."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.register_buffer("index", (torch.arange(height).view(-1, 1) + torch.arange(W)) % height)

    def forward(self, x):
        y = self.a(x)
        return torch.gather(y, 2, self.index.expand(y.shape[0], y.shape[1], -1, -1))


class OtherDim(nn.Module):
    """torch.gather along the columns with a field-sized index buffer (its rows are not the band's): refused."""

    def __init__(self, height):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.register_buffer("index", (torch.arange(height).view(-1, 1) + torch.arange(W)) % W)

    def forward(self, x):
        y = self.a(x)
        return torch.gather(y, 3, self.index.expand(y.shape[0], y.shape[1], -1, -1))


REFUSED = {"scattered": (Scattered, "other rows at other positions"), "other_dim": (OtherDim, "not a band like its input")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_rows_taken_differently_per_position_are_refused(name, make_manager):
    """Refused on every rank, describe() agreeing, even and uneven bands."""
    build, why = REFUSED[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d == 1:
                continue
            for h in _heights(d):
                plan = verdict_is_the_run(name, lambda h=h: build(h), (2, 2, h, W), manager)
                assert not plan.exact
                row = next(r for r in plan.rows if not r.exact)
                assert row.kind == "gather()" and why in row.note, row
