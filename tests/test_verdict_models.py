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


def test_describe_refuses_a_halo_wider_than_a_band():
    plan = describe(own_halo(2)().double(), (1, 2, 3, 4), 3, custom_converters=TRUSTED)
    assert not plan.exact and plan.rows[-1].kind == "HaloExchange" and "halo" in plan.rows[-1].note, str(plan)


class RootWindows(SwinStyle):
    """Shifted windows as the converted model's root (no module around it): its input re-banded to whole windows."""

    def __init__(self):
        super().__init__(2, 2, 1)


CASES = {
    # name: (build, row unit of the heights, custom_converters)
    "host_tensors": (HostTensors, 1, None),
    "own_halo": (own_halo(1), 1, TRUSTED),  # the exchange a row of the plan (tests/test_describe_traffic.py counts it)
    "own_halo_2": (own_halo(2), 1, TRUSTED),
    "root_windows": (RootWindows, 2, None),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(CASES))
def test_verdict_is_what_the_run_does(name, make_manager):
    """Exact on even bands and on uneven ones (not whole windows: re-banded), on 1..W ranks."""
    build, unit, custom = CASES[name]
    for _, manager, h in band_cases(make_manager, unit):
        plan = verdict_is_the_run(name, build, (1, 2, h, 4), manager, custom=custom)
        assert plan.exact and all(r.traffic is not None for r in plan.rows), str(plan)


@pytest.mark.mpi(min_size=2)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("shift", [1, 0])
def test_fewer_windows_than_ranks_is_the_same_refusal_everywhere(shift, make_manager):
    """Windows of 3 rows, a field of fewer windows than ranks (6 or 9 rows on 4 ranks): re-banded to whole windows a
    band holds none. It runs one phantom window whose output it drops (exact), unless the module's forward
    communicates (shift=1: its rolls across bands would take the phantom's zeros): that is refused, in describe() and
    in the run alike, at the re-band. A field of fewer rows than ranks is refused by the first conv."""
    from .test_windows import swin

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in range(3, 3 * d, 3):
                plan = verdict_is_the_run("few_windows", swin(3, shift=shift), (1, 2, h, 6), manager)
                if h < d:  # an empty band at the input: the conv refuses
                    assert not plan.exact, str(plan)
                elif shift:
                    assert not plan.exact and plan.rows[-1].kind == "reband()" and "communicates" in plan.rows[-1].note, str(plan)
                else:
                    assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
@pytest.mark.one_domain_size
def test_credit_short_attention_with_fewer_windows_than_ranks_is_exact(make_manager):
    """CREDIT's own short-distance Attention (einops windows, ``h=height // wsz``) where its default configuration
    meets it on 4 and 8 bands: fewer windows than ranks (2 windows of 2 rows on 4 ranks, 2 of 3, uneven bands), the
    bands without a window running a phantom one; exact against one process (forward, input and parameter grads)."""
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .credit_stand_ins import credit_models

    crossformer, _ = credit_models()

    def build(window):
        return lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), crossformer.Attention(4, "short", window, dim_head=2))

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for window, h in ((2, 4), (3, 6), (2, 6), (3, 9)):
                if h >= d:
                    plan = verdict_is_the_run("credit_short", build(window), (1, 2, h, 2 * window), manager)
                    assert plan.exact, str(plan)


def _nn_cases():
    """Every layer and model case of tests/test_nn.py, with the shapes it runs on d = 1..4 bands (array_split only:
    describe() plans that layout; the explicit stride-aligned layouts of its UNet and FuXi are left to the run)."""
    from . import test_nn as t

    for d in range(1, 5):
        for name, build in t.CONVS.items():
            for h in t._heights(d, 8):
                yield f"conv {name}", build, (2, 4 if name == "groups" else 2, h, 6), d
        for name, build in t.NORMS.items():
            for h in t._heights(d, 3):
                norm = build or (lambda h=h: nn.LayerNorm((4, h, 5)))
                yield (f"norm {name}", lambda b=norm: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), b(), nn.Conv2d(4, 2, 3, padding=1)),
                       (2, 3, h, 5), d)
        for name, build in t.RESAMPLE.items():
            for h in t._heights(d, 6):
                if not (name == "adaptive_5x3" and h // d < 3):
                    yield f"resample {name}", build, (2, 2, h, 6), d
        for name, (build, base, width) in t.MODELS.items():
            h = base * d * (2 if name.startswith("crossembed") and d > 1 else 1)
            for rows in (h,) if name in ("fuxi", "unet") else (h, h + 1):
                yield f"model {name}", build, (2, 2, 4, rows, width) if name == "cube" else (2, 3 if name == "fuxi" else 2, rows, width), d


def test_describe_says_exact_on_every_case_the_nn_tests_run_exactly():
    """tests/test_nn.py runs these exactly against one process on 1..4 ranks (its run_both): describe() must agree."""
    wrong = [(name, shape, d, str(plan)) for name, build, shape, d in _nn_cases()
             if not (plan := describe(build().double(), shape, d)).exact]
    assert not wrong, "\n".join(map(str, wrong[:3]))



@pytest.mark.parametrize("family", ["crossformer", "wxformer"])
def test_credit_default_configuration_on_4_and_8_bands(family):
    """CREDIT's default CrossFormer / WXFormer (640 x 1280, interp=True; miles-credit's defaults), describe() only
    (the meta device: ~5-9 s a plan). Its short-distance attention of 20 rows (4 bands) or 40 rows (8 bands) in
    windows of 10 has fewer windows than bands: the bands without one run a phantom window (exact; the run:
    test_credit_short_attention_with_fewer_windows_than_ranks_is_exact). Exact on 4 bands and on 8, where the 20
    deepest rows are uneven bands (3 and 2 rows): the up_blocks' outputs (the CrossFormer's transposed conv, the
    WXFormer's pixel shuffle) have other bands than the skip connections they join, which the joins re-band."""
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .credit_stand_ins import credit_models

    module = dict(zip(("crossformer", "wxformer"), credit_models(), strict=True))[family]
    with torch.device("meta"):
        model = module.CrossFormer()
    channels = model.channels * model.levels + model.surface_channels + model.input_only_channels
    for d in (4, 8):
        plan = describe(model, (1, channels, model.frames, 640, 1280), d)
        assert plan.exact, str(plan)
        joins = [r for r in plan.rows if r.kind == "cat()"]
        assert joins and all(r.traffic is not None for r in joins), str(plan)
        rebanded = [r.path for r in joins if r.bands_in != r.bands_out]
        assert bool(rebanded) == (d == 8), str(plan)
        assert plan.rows[-1].bands_out == plan.rows[0].bands_in, str(plan)  # the output banded as the input


@pytest.mark.mpi(min_size=3)
@pytest.mark.one_domain_size
def test_describe_traffic_of_a_band_without_a_window(make_manager):
    """Windows of 3 over 6 rows on 3 and 4 ranks (a band re-banded to no window runs a phantom one): describe()'s
    traffic is what the run sends, forward (the re-band, the phantom moves nothing) and backward."""
    from credit_mpi.nn import convert_to_domain_parallel
    from credit_mpi.nn.traffic import Traffic

    from .test_describe_traffic import _step, band, counting
    from .test_windows import swin

    shape = (1, 2, 6, 6)
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d < 3:
                continue
            plan = describe(swin(3, shift=0)().double(), shape, d, requires_grad=True)
            assert plan.exact and plan.traffic is not None, str(plan)
            model = convert_to_domain_parallel(swin(3, shift=0)().double(), manager)
            a, b = band(shape[2], manager)
            x = torch.randn(shape, dtype=torch.float64).narrow(2, a, b - a).contiguous().requires_grad_(True)
            with counting(manager) as comm:
                _step(model, x, comm, set())
                comm.counts.clear()
                _step(model, x, comm, set())
            total, forward, back = plan.traffic[manager.domain_rank], comm.counts.get("forward", Traffic()), comm.counts.get("backward", Traffic())
            assert (forward.forward_bytes, forward.forward_messages, forward.agreements) == (
                total.forward_bytes, total.forward_messages, total.agreements), (d, forward, total)
            assert (back.forward_bytes, back.forward_messages) == (total.backward_bytes, total.backward_messages), (d, back, total)
