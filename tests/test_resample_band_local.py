"""Resampling whose rows on each band are torch's call on the band alone (nearest by a whole factor, averages over
windows inside the bands): torch's kernel on the band, bit for bit, no resampling matrix; the other maps still
through the matrix, exactly (float64, every domain size, even and uneven bands)."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from credit_mpi import shard_tensor  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import assert_same, run_both  # noqa: E402

F = torch.nn.functional


class _Count(TorchDispatchMode):
    """The aten ops a forward runs, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


class _Interp(nn.Module):
    """``F.interpolate`` in a custom forward (the function-level rule); ``skip``: the size read from a band's shape."""

    def __init__(self, skip: bool, **kw) -> None:
        super().__init__()
        self.skip, self.kw = skip, kw

    def forward(self, x):
        if self.skip:  # smp's UNet decoder: the skip connection's size, x2 of x's
            return F.interpolate(x, size=(2 * x.shape[-2], 3 * x.shape[-1]), **self.kw)
        return F.interpolate(x, **self.kw)


# name -> build(field rows): band-local on bands of an even number of rows
LOCAL = {
    "nearest2": lambda h: nn.Upsample(scale_factor=2, mode="nearest"),
    "nearest3x2": lambda h: nn.Upsample(scale_factor=(3, 2), mode="nearest"),
    "nearest_size": lambda h: nn.Upsample(size=(2 * h, 6), mode="nearest"),
    "nearest_exact2": lambda h: nn.Upsample(scale_factor=2, mode="nearest-exact"),
    "nearest_f": lambda h: _Interp(False, scale_factor=2.0, mode="nearest"),
    "nearest_skip": lambda h: _Interp(True, mode="nearest"),
    "area_half": lambda h: _Interp(False, scale_factor=0.5, mode="area"),
    "adaptive_half": lambda h: nn.AdaptiveAvgPool2d((h // 2, 3)),
}
MATRIX = {  # a halo row or windows across bands: the matrix path
    "nearest_1_5": lambda: nn.Upsample(scale_factor=1.5, mode="nearest"),
    "bilinear2": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
}


def _layouts(d: int) -> list[list[int]]:
    """Even bands and uneven ones, every band of an even number of rows (the windows of a halving stay in a band)."""
    return [[4] * d, [4 + 2 * (r % 2) for r in range(d)]]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(LOCAL))
def test_band_local_resampling_is_torchs_call_on_the_band(name, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for sizes in _layouts(d):
                counter, h = _Count(), sum(sizes)
                with counter:
                    r = run_both(lambda h=h: LOCAL[name](h), (2, 2, h, 4), manager, seed=d * 10 + h, sizes=sizes)
                assert_same(r)
                if name.startswith("nearest"):  # torch's kernel on the band: the same bits as on the whole field
                    assert torch.equal(r["out"], r["out_ref"])
                assert not counter.ops["bmm"], (name, sizes, dict(counter.ops))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_other_resampling_stays_on_the_matrix(name, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for sizes in ([5] * d, [3 + 2 * (r % 2) for r in range(d)]):  # odd bands: x1.5 is no map of a band alone
                counter = _Count()
                with counter:
                    r = run_both(MATRIX[name], (2, 2, sum(sizes), 4), manager, seed=d * 10 + sum(sizes), sizes=sizes)
                assert_same(r)
                if d > 1:
                    assert counter.ops["bmm"], (name, sizes, dict(counter.ops))


@pytest.mark.mpi(min_size=2)
def test_adaptive_pool_across_bands_stays_on_the_matrix(make_manager):
    """Bands of odd rows: the halving's windows cross them (the matrix path, a halo row), exact."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d < 2:
                continue
            sizes = [3 + 2 * (r % 2) for r in range(d)]
            sizes[-1] += sum(sizes) % 2  # an even field: the halving's windows are pairs of rows
            counter, h = _Count(), sum(sizes)
            with counter:
                r = run_both(lambda h=h: nn.AdaptiveAvgPool2d((h // 2, None)), (2, 2, h, 4), manager, seed=d, sizes=sizes)
            assert_same(r)
            assert counter.ops["bmm"], (sizes, dict(counter.ops))


@pytest.mark.mpi(min_size=1)
def test_the_plan_is_made_once_per_layout(make_manager):
    """The layout and the band-local check are pure functions of agreed values: a second call of the same shapes reads
    no matrix (no ``nonzero``, no ``.item()``), on either path."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            model = convert_to_domain_parallel(nn.Sequential(nn.Upsample(scale_factor=2), nn.Upsample(scale_factor=1.5),
                                                             nn.AdaptiveAvgPool2d((6 * d, None))).double(), manager)
            x = shard_tensor(torch.randn(1, 2, 8 * d, 3, dtype=torch.float64), -2, manager)
            model(x)
            counter = _Count()
            with counter:
                model(x)
            assert not counter.ops["nonzero"] and not counter.ops["_local_scalar_dense"], dict(counter.ops)
