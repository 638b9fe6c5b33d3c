"""NCAR CREDIT's Swin (``credit.models.swin``, miles-credit 2026.2.0) and window attention, converted with no change.

CREDIT's Swin block builds its shifted-window mask in ``__init__`` from the global feature size
(one mask per window of the whole field) and reverses its windows to the stored ``feat_size``: on
bands both are refused on every rank with a ConversionError that names the op and what the
author changes (a mask made from the band, a size from ``x.shape``). CREDIT's short-distance
(window) attention is exact on uneven bands too: its input is re-banded to whole windows.

``credit.models.swin`` imports four helpers from ``timm.layers``; timm's package imports
torchvision, whose wheels do not load beside this project's CPU torch: when timm does not import,
a stand-in module gives those four (the same on one process and on bands, so the comparison holds).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from .test_credit_models import crossformer  # noqa: E402  (its skips: einops, credit; the post-block stand-in)
from .test_windows import band_cases  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

nn = torch.nn


def _timm_layers():
    try:
        import timm.layers  # noqa: F401
    except ImportError:
        import sys
        import types

        class DropPath(nn.Identity):
            def __init__(self, drop_prob=0.0):
                super().__init__()

        class Mlp(nn.Module):
            def __init__(self, in_features, hidden_features=None, out_features=None, drop=0.0, **kwargs):
                super().__init__()
                self.fc1 = nn.Linear(in_features, hidden_features or in_features)
                self.act = nn.GELU()
                self.fc2 = nn.Linear(hidden_features or in_features, out_features or in_features)

            def forward(self, x):
                return self.fc2(self.act(self.fc1(x)))

        def _assert(condition, message):
            assert condition, message

        layers = types.ModuleType("timm.layers")
        layers.DropPath, layers.Mlp, layers._assert = DropPath, Mlp, _assert
        layers.to_2tuple = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)
        sys.modules["timm"], sys.modules["timm.layers"] = types.ModuleType("timm"), layers


_timm_layers()
from credit.models import swin  # noqa: E402


class Bhwc(nn.Module):
    """A conv, then CREDIT's Swin block on channels-last (as its model calls it: bchw_to_bhwc)."""

    def __init__(self, h, w, shift):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.block = swin.SwinTransformerV2CrBlock(dim=4, num_heads=2, feat_size=(h, w), window_size=(2, 2),
                                                   shift_size=(shift, shift), mlp_ratio=1.0)
        for m in self.block.modules():  # timm's Mlp keeps CREDIT's meta-MLP dropout (p=0.125, fixed in its code):
            if isinstance(m, nn.Dropout):  # a random draw is no one-process reference; with the stand-in it is absent
                m.p = 0.0

    def forward(self, x):
        return swin.bhwc_to_bchw(self.block(swin.bchw_to_bhwc(self.conv(x))))


def short_attention():
    """A conv, then CREDIT CrossFormer's short-distance attention (windows of 2 x 2 moved into the batch)."""
    return nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), crossformer.Attention(8, attn_type="short", window_size=2, dim_head=4))


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_credit_window_attention_is_exact_on_uneven_bands(make_manager):
    """Bands that are not whole windows (9, 9, 8 rows of windows of 2) are re-banded to whole windows and back."""
    for _, manager, h in band_cases(make_manager, 2):
        assert verdict_is_the_run("short_attention", short_attention, (1, 2, h, 4), manager).exact


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("shift", [1, 0])
def test_credit_swin_block_is_exact(shift, make_manager):
    """The windows reversed to the stored feat_size are the field's sizes (credit_mpi.nn.judge.field_sizes), its
    LayerNorms over channels-last tokens run on the band's rows, and the mask buffer of every window of the field
    (shift 1) is cut to the band's windows (credit_mpi.nn.judge.field_values): exact with and without a shift."""
    for _, manager, h in band_cases(make_manager, 2):
        plan = verdict_is_the_run("swin_block", lambda h=h: Bhwc(h, 4, shift), (1, 2, h, 4), manager, same_op=False)
        assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_credit_patch_embed_asserting_the_global_height_is_exact(make_manager):
    """PatchEmbed asserts ``H == self.img_size[0]`` (the field's height, stored in __init__): ``x.shape`` of a band is
    the field's (credit_mpi.nn.judge.field_sizes), so the assertion holds on every rank and the strided patch conv runs on
    bands: exact on even bands of whole patches; on uneven bands (odd offsets) the layer's own refusal, on every rank."""
    for d, manager, h in band_cases(make_manager, 2):
        build = lambda h=h: swin.PatchEmbed(img_size=(h, 4), patch_size=2, in_chans=2, embed_dim=4)  # noqa: E731
        plan = verdict_is_the_run("patch_embed", build, (1, 2, h, 4), manager)
        if h == 8 * d:
            assert plan.exact, str(plan)
        assert all("stored for the whole field" not in r.note for r in plan.rows), str(plan)


def test_comparisons_that_follow_the_band_are_not_refused():
    """Sizes compared with sizes read from the band, with 0, 1 and -1, or equal on every band: exact."""
    from credit_mpi.nn import describe

    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.window = nn.Conv2d(2, 2, 3, padding=1), 2

        def forward(self, x):
            b, c, h, w = x.shape
            assert h == x.shape[-2] and h % self.window == 0 and h != 1 and h != -1 and (h // h) == 1
            assert w == 4 and c == 2  # not the sharded dim: plain ints
            return self.conv(x)

    assert describe(Checks().double(), (1, 2, 16, 4), 2).exact
    assert describe(Checks().double(), (1, 2, 8, 4), 4).exact
