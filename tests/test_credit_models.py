"""NCAR CREDIT's own models (PyPI ``miles-credit`` 2026.2.0, the ``credit`` test extra) converted with no change.

Small float64 versions; each is exact against one process on 1..W ranks (forward, input gradient,
parameter gradients after reduce_gradients) wherever ``describe()`` says it runs exactly, and raises
the same ConversionError on every rank (naming the module and the op the author changes) where it
says it does not: never silently wrong.

``credit.postblock.gen1`` (imported by the model modules for the optional post block, which these
configurations do not build) needs torchvision and torch_harmonics, whose wheels do not load beside
the CPU torch this project pins: a stand-in that refuses to build a PostBlock takes its place.
"""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("einops")
pytest.importorskip("credit")

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


def _credit_models():
    try:
        import credit.postblock.gen1  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("credit.postblock.gen1")

        class PostBlock:  # the configurations below never build one
            def __init__(self, *args, **kwargs):
                raise RuntimeError("credit.postblock.gen1 stand-in: the post block is not part of these tests")

        stand_in.PostBlock = PostBlock
        sys.modules["credit.postblock.gen1"] = stand_in
    from credit.models import crossformer
    from credit.models.wxformer import crossformer as wxformer

    return crossformer, wxformer


crossformer, wxformer = _credit_models()

class EveryParameter(torch.nn.Module):
    """``model`` with every parameter in the graph (CrossFormer holds some its forward does not use: no grad to compare)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) + 0.0 * sum(p.sum() for p in self.model.parameters())


def _crossformer(global_window=(2, 1, 1, 1)):
    return EveryParameter(crossformer.CrossFormer(
        image_height=32, image_width=32, frames=1, channels=1, surface_channels=1, input_only_channels=0, levels=2,
        dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=global_window, local_window_size=2,
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False,
    ))


CASES = {
    # name: (build, input shape for d bands (d -> shape))
    "upblock": (lambda: crossformer.UpBlock(4, 4, 2), lambda d: (1, 4, 4 * d, 4)),
    "upblock_upsample": (lambda: crossformer.UpBlock(4, 4, 2, upsample_v_conv=True), lambda d: (1, 4, 4 * d + 1, 4)),
    "upblock_scse": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="scse_standard", reduction=2), lambda d: (1, 4, 4 * d, 4)),
    "upblock_coordinate": (lambda: crossformer.UpBlock(4, 8, 2, attention_type="coordinate", reduction=2), lambda d: (1, 4, 4 * d, 4)),
    "upblock_eca": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="eca"), lambda d: (1, 4, 4 * d, 4)),
    "upblock_spatial": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="spatial", spatial_kernel=3), lambda d: (1, 4, 4 * d, 4)),
    "cross_embed": (lambda: crossformer.CrossEmbedLayer(2, 8, (2, 4), stride=2), lambda d: (1, 2, 4 * d, 8)),
    # WXFormer's: each branch a ZeroPad2d (the field's edges) and an unpadded conv; stride 1 pads unevenly
    "wxformer_cross_embed": (lambda: wxformer.CrossEmbedLayer(2, 8, (2, 4), stride=2), lambda d: (1, 2, 4 * d + 2, 8)),
    "wxformer_cross_embed_s1": (lambda: wxformer.CrossEmbedLayer(2, 4, (2, 3), stride=1), lambda d: (1, 2, 3 * d + 1, 6)),
    "channel_layernorm": (lambda: crossformer.LayerNorm(4), lambda d: (1, 4, 3 * d + 1, 4)),
    "feedforward": (lambda: crossformer.FeedForward(4, 2), lambda d: (1, 4, 3 * d + 1, 4)),
    "attention_global": (lambda: crossformer.Attention(8, attn_type="long", window_size=2, dim_head=4), lambda d: (1, 8, 4 * d, 4)),
    "attention_local": (lambda: crossformer.Attention(8, attn_type="short", window_size=2, dim_head=4), lambda d: (1, 8, 4 * d, 4)),
    # the whole model: refused at its long-distance attention (rows grouped at a stride across the globe)
    "crossformer": (_crossformer, lambda d: (1, 3, 1, 32, 32)),
}
# the run may refuse a later op than describe() (see verdict_is_the_run)
LATER_OP = {"attention_global", "crossformer"}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CASES))
def test_credit_model_exact_or_refused_on_every_rank(name, make_manager):
    build, shape_of = CASES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            torch.manual_seed(0)
            verdict_is_the_run(name, build, shape_of(d), manager, seed=5, same_op=name not in LATER_OP)
