"""Joins of bands whose layouts differ (issue 24's last item): re-banded at the join, exact on any bands.

A UNet's skip connection on uneven bands: a strided conv's output bands own rows
``[ceil(a / 2), ceil(b / 2))``, the transposed conv (or nearest upsampling) of those gives bands
``[2 a', 2 b')``, which differ from the skip's. The ``torch.cat`` agrees every part's rows (one
fixed-size agreement) and re-bands each part whose layout differs to the layout of the part the
forward made first (the skip's, the encoder's), then joins: exact against one process (forward,
input gradient, parameter gradients; float64) on even and uneven bands, with describe()'s
verdict and traffic equal to the run (tests/verdict_reference.py, a counting communicator).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from credit_mpi.nn import ConversionError, describe  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import run_both  # noqa: E402
from .verdict_reference import _outcome, verdict_is_the_run  # noqa: E402


class Skip(nn.Module):
    """One skip connection: stride 2 down, a transposed conv back up, joined with the input's conv (up first)."""

    def __init__(self, up_first=True):
        super().__init__()
        self.up_first = up_first
        self.inner = nn.Conv2d(2, 2, 3, padding=1)
        self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)
        self.out = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        x = self.inner(x)
        up = self.up(self.down(x))
        return self.out(torch.cat([up, x] if self.up_first else [x, up], dim=1))


class UNet(nn.Module):
    """Two levels: strided convs down; up by a transposed conv, then by nearest interpolation; cat with each skip."""

    def __init__(self, c=2):
        super().__init__()
        self.enc0 = nn.Conv2d(2, c, 3, padding=1)
        self.enc1 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.enc2 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(1, c)
        self.up2 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = nn.Conv2d(2 * c, c, 3, padding=1)
        self.dec0 = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(self, x):
        s0 = torch.relu(self.enc0(x))
        s1 = torch.relu(self.enc1(s0))
        b = self.norm(self.enc2(s1))
        y = self.dec1(torch.cat([torch.relu(self.up2(b)), s1], dim=1))
        y = F.interpolate(y, scale_factor=2, mode="nearest")
        return self.dec0(torch.cat([y, s0], dim=1))


def _this_job(managers):
    """Each domain size once over the 1..4-rank jobs (CI's time): d = the world size."""
    return [(d, m) for d, m in managers if d == MPI.COMM_WORLD.Get_size()]


@pytest.mark.mpi(min_size=1)
def test_skip_connection_joins_on_uneven_bands(make_manager):
    """Either part first, even and uneven bands: exact, describe() exact with a cat() row."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (4 * d, 4 * d + 2, 2 * d + 2):
                for up_first in (True, False):
                    plan = verdict_is_the_run("skip", lambda u=up_first: Skip(u), (1, 2, height, 4), manager)
                    assert plan.exact, str(plan)
                    assert sum(r.kind == "cat()" for r in plan.rows) == (d > 1), str(plan)


@pytest.mark.mpi(min_size=1)
def test_small_unet_on_uneven_bands(make_manager):
    """Two skip connections (transposed conv and interpolation up), a GroupNorm at the bottom: exact."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (8 * d, 8 * d + 4):
                plan = verdict_is_the_run("unet", UNet, (2, 2, height, 8), manager)
                assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
def test_describe_traffic_of_a_join_equals_what_the_run_sends(make_manager):
    """The join's agreement and its re-band (forward and backward): describe()'s numbers, a counting communicator's."""
    from credit_mpi.nn import convert_to_domain_parallel
    from credit_mpi.nn.traffic import Traffic

    from .halo_reference import band
    from .test_describe_traffic import _step as step
    from .test_describe_traffic import counting

    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for rows in (8 * d, 8 * d + 4):
                shape = (1, 2, rows, 8)
                plan = describe(UNet().double(), shape, d, requires_grad=True)
                assert plan.exact and plan.traffic is not None, str(plan)
                assert any(r.kind == "cat()" and r.bands_in != r.bands_out for r in plan.rows) == (rows % (4 * d) != 0)
                model = convert_to_domain_parallel(UNet().double(), manager)
                a, b = band(rows, manager)
                x = torch.randn(shape, dtype=torch.float64).narrow(2, a, b - a).contiguous().requires_grad_()
                paths = {r.path for r in plan.rows if r.kind != "cat()"}
                with counting(manager) as comm:
                    step(model, x, comm, paths)
                    comm.counts.clear()
                    step(model, x, comm, paths)
                total, counted = plan.traffic[manager.domain_rank], comm.counts
                forward = sum((counted.get(p, Traffic()) for p in paths | {"forward"}), Traffic())
                back = counted.get("backward", Traffic())
                assert (forward.forward_bytes, forward.forward_messages, forward.agreements) == (
                    total.forward_bytes, total.forward_messages, total.agreements), (d, rows, forward, total)
                assert (back.forward_bytes, back.forward_messages) == (total.backward_bytes, total.backward_messages)


class SizeOfTheSkip(nn.Module):
    """smp's UNet decoder in small: down by a strided conv, ``F.interpolate(size=skip.shape[-2:])``, cat, conv."""

    def __init__(self, mode="nearest"):
        super().__init__()
        self.mode = mode
        self.enc = nn.Conv2d(2, 2, 3, padding=1)
        self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.dec = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        skip = self.enc(x)
        y = F.interpolate(self.down(skip), size=skip.shape[-2:], mode=self.mode)
        return self.dec(torch.cat([y, skip], dim=1))


class Residual(nn.Module):
    """``x + up(down(x))``: two bands of one height in different layouts combined by an op that is not a join."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)

    def forward(self, x):
        return x + self.up(self.down(x))


@pytest.mark.mpi(min_size=1)
def test_interpolation_to_the_skips_size_and_the_output_layout(make_manager):
    """The size read from the skip: interpolated by the field's factor, re-banded to the skip's bands (nearest and
    bilinear); the models' outputs are banded as their inputs."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (4 * d, 4 * d + 2):
                for mode in ("nearest", "bilinear"):
                    plan = verdict_is_the_run("size of the skip", lambda m=mode: SizeOfTheSkip(m), (1, 2, height, 4),
                                              manager)
                    assert plan.exact and plan.rows[-1].bands_out == plan.rows[0].bands_in, str(plan)


@pytest.mark.mpi(min_size=3)
def test_bands_of_two_layouts_in_an_op_that_is_not_a_join(make_manager):
    """``x + up(down(x))`` on uneven bands: describe() says it does not run (the add), the run fails on every rank."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            plan = verdict_is_the_run("residual", Residual, (1, 2, 4 * d + 2, 4), manager)
            row = next(r for r in plan.rows if not r.exact)
            assert "add" in row.kind and "only a join" in row.note, str(plan)
            # the run: the add's ConversionError on every rank (never a band of one row broadcast to another's)
            _, error = _outcome(manager.domain_group, lambda d=d, m=manager: run_both(Residual, (1, 2, 4 * d + 2, 4), m))
            assert isinstance(error, ConversionError) and "add" in str(error) and "other rows" in str(error), error
