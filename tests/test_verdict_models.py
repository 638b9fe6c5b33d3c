"""describe()'s verdict is the run's where it used to fail or disagree (issue 24: "describe() equal to what running does").

Each case goes through tests/verdict_reference.py (exact against one process where the plan says so,
the same ConversionError on every rank where it does not), on 1..W ranks, even and uneven bands:

* a forward that makes a tensor on the host (no ``device=``): the dry run on the meta device used to
  fail on it; it joins the meta tensors there as it joins the bands in the run;
* a trusted module (``custom_converters``, its forward not judged) that calls a
  :class:`~credit_mpi.nn.HaloExchange` itself: the dry run used to call MPI-less halo code on meta
  tensors and fail; the exchange pads the field there and is a row of the plan, with its traffic;
* a windowed module as the converted model's root: re-banded to whole windows as inside a model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import HaloExchange, describe  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .test_windows import SwinStyle, band_cases  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


class HostTensors(nn.Module):
    """A conv, then a longitude weight and a constant made on the host (``torch.linspace`` / ``torch.ones``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.linspace(0.5, 1.5, y.shape[-1], dtype=y.dtype) + torch.ones(1, 2, 1, 1, dtype=y.dtype)


class OwnHalo(nn.Module):
    """A halo exchange and a conv without padding along the rows: the block's own halo (CREDIT's layers do so)."""

    def __init__(self, width=1):
        super().__init__()
        self.halo = HaloExchange(width, manager=ONE_BAND)  # one process: the field padded
        self.conv = nn.Conv2d(2, 2, 2 * width + 1, padding=(0, width))

    def forward(self, x):
        return self.conv(self.halo(x))


def own_halo(width=1):
    return lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), OwnHalo(width))


ONE_BAND = SimpleNamespace(domain_parallel_size=1)


def with_the_manager(module, manager, shard_dim):
    """The user's converter: the block kept as it is (trusted), its exchange over the conversion's manager."""
    module.halo = HaloExchange(module.halo.halo_width, manager=manager or ONE_BAND)
    return module


TRUSTED = {OwnHalo: with_the_manager}


@pytest.mark.mpi(min_size=1)
def test_a_tensor_made_on_the_host_is_judged_not_a_failure(make_manager):
    for _, manager, h in band_cases(make_manager, 1):
        assert verdict_is_the_run("host_tensors", HostTensors, (1, 2, h, 4), manager).exact


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("width", [1, 2])
def test_a_trusted_module_with_its_own_halo_exchange(width, make_manager):
    """Exact where every band holds the halo; a band thinner than the halo is refused (by describe, as by the run)."""
    for d, manager, h in band_cases(make_manager, 1):
        plan = verdict_is_the_run("own_halo", own_halo(width), (1, 2, h, 4), manager, custom=TRUSTED)
        assert plan.exact, str(plan)
        (row,) = [r for r in plan.rows if r.kind == "HaloExchange"]
        assert row.path == "1.halo" and row.halo_before == width and row.traffic is not None


def test_describe_refuses_a_halo_wider_than_a_band():
    plan = describe(own_halo(2)().double(), (1, 2, 3, 4), 3, custom_converters=TRUSTED)
    assert not plan.exact and plan.rows[-1].kind == "HaloExchange" and "halo" in plan.rows[-1].note, str(plan)


class RootWindows(SwinStyle):
    """Shifted windows as the converted model's root (no module around it): its input re-banded to whole windows."""

    def __init__(self):
        super().__init__(2, 2, 1)


@pytest.mark.mpi(min_size=1)
def test_a_windowed_module_as_the_root_is_rebanded(make_manager):
    for _, manager, h in band_cases(make_manager, 2):
        assert verdict_is_the_run("root_windows", RootWindows, (1, 2, h, 4), manager).exact


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shift", [1, 0])
def test_fewer_windows_than_ranks_is_the_same_refusal_everywhere(shift, make_manager):
    """Windows of 3 rows, a field of fewer windows than ranks (6 or 9 rows on 4 ranks): re-banded to whole windows a
    band holds none. The run used to fail on those ranks inside the forward (a division by zero of the empty band,
    shared as a DomainParallelError) where describe() predicted a ConversionError: both refuse at the re-band now."""
    from .test_windows import swin

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in range(3 * ((d + 2) // 3), 3 * d, 3):  # every band a row or more, fewer windows than ranks
                plan = verdict_is_the_run("few_windows", swin(3, shift=shift), (1, 2, h, 6), manager)
                assert not plan.exact and plan.rows[-1].kind == "reband()" and "no window" in plan.rows[-1].note, str(plan)
