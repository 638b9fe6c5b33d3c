"""NCAR CREDIT's own models (PyPI ``miles-credit`` 2026.2.0, the ``credit`` test extra) converted with no change.

Small float64 versions; each is exact against one process on 1..W ranks (forward, input gradient,
parameter gradients after reduce_gradients) wherever ``describe()`` says it runs exactly, and raises
the same ConversionError on every rank (naming the module and the op the author changes) where it
says it does not: never silently wrong.

``credit.postblock.gen1`` (imported by the model modules for the optional post block, which these
configurations do not build) needs torchvision and torch_harmonics, whose wheels do not load beside
the CPU torch this project pins: a stand-in that refuses to build a PostBlock takes its place. FuXi
and the smp UNet need ``timm`` and ``segmentation_models_pytorch`` (installed ``--no-deps``), which
import torchvision at import time for names these models never use (transforms, torchvision's own
encoders): a stand-in package whose every class refuses to be built takes its place when the real
one does not import. The UNet uses a timm encoder (``timm-regnetx_002``, no weights).

The heavy cases (whole models) run on 1, 2 and 4 ranks only, each domain size once over those jobs:
d bands in the d-rank job, 3 bands in the 4-rank one (the light cases: d bands in the d-rank job,
``@pytest.mark.one_domain_size``).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
pytest.importorskip("einops")
pytest.importorskip("credit")

from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402

from .credit_stand_ins import credit_models, timm_models  # noqa: E402
from .halo_reference import first_ranks, prefix_managers  # noqa: E402
from .verdict_reference import refused_at_conversion, verdict_is_the_run  # noqa: E402

crossformer, wxformer = credit_models()
TIMM = timm_models()


class EveryParameter(torch.nn.Module):
    """``model`` with every parameter in the graph (CrossFormer holds some its forward does not use: no grad to compare)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) + 0.0 * sum(p.sum() for p in self.model.parameters())


def _crossformer(global_window=(2, 1, 1, 1), interp=False):
    """32 rows a band (its deepest local attention needs a window of 2 rows on every band); ``interp``: its last
    ``F.interpolate(size=(image_height, image_width))``, a size stored for the whole field."""
    return EveryParameter(crossformer.CrossFormer(
        image_height=32 * _D, image_width=32, interp=interp, frames=1, channels=1, surface_channels=1, input_only_channels=0, levels=2,
        dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=global_window, local_window_size=2,
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False,
    ))


CASES = {
    # name: (build, input shape for d bands (d -> shape))
    "upblock": (lambda: crossformer.UpBlock(4, 4, 2), lambda d: (1, 4, 4 * d, 4)),
    "upblock_upsample": (lambda: crossformer.UpBlock(4, 4, 2, upsample_v_conv=True), lambda d: (1, 4, 4 * d + 1, 4)),
    "upblock_scse": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="scse_standard", reduction=2), lambda d: (1, 4, 4 * d, 4)),
    # coordinate attention: the band's rows pooled over the longitude joined with the longitude's columns pooled over
    # the field (replicated) along the sharded dim, a 1x1 conv, BatchNorm counting the replicated rows once, split
    # back (credit_mpi.nn.judge.field_values): exact, even and uneven bands
    "upblock_coordinate": (lambda: crossformer.UpBlock(4, 8, 2, attention_type="coordinate", reduction=2), lambda d: (1, 4, 4 * d, 4)),
    "upblock_coordinate_uneven": (lambda: crossformer.UpBlock(4, 8, 2, attention_type="coordinate", reduction=2),
                                  lambda d: (1, 4, 4 * d + 1, 6)),
    "upblock_eca": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="eca"), lambda d: (1, 4, 4 * d, 4)),
    "upblock_spatial": (lambda: crossformer.UpBlock(4, 4, 2, attention_type="spatial", spatial_kernel=3), lambda d: (1, 4, 4 * d, 4)),
    "cross_embed": (lambda: crossformer.CrossEmbedLayer(2, 8, (2, 4), stride=2), lambda d: (1, 2, 4 * d, 8)),
    # WXFormer's: each branch a ZeroPad2d (the field's edges) and an unpadded conv; stride 1 pads unevenly
    "wxformer_cross_embed": (lambda: wxformer.CrossEmbedLayer(2, 8, (2, 4), stride=2), lambda d: (1, 2, 4 * d + 2, 8)),
    "wxformer_cross_embed_s1": (lambda: wxformer.CrossEmbedLayer(2, 4, (2, 3), stride=1), lambda d: (1, 2, 3 * d + 1, 6)),
    "channel_layernorm": (lambda: crossformer.LayerNorm(4), lambda d: (1, 4, 3 * d + 1, 4)),
    "feedforward": (lambda: crossformer.FeedForward(4, 2), lambda d: (1, 4, 3 * d + 1, 4)),
    # as the converted model's root: the group layout, as inside a model: exact
    "attention_global": (lambda: crossformer.Attention(8, attn_type="long", window_size=2, dim_head=4), lambda d: (1, 8, 4 * d, 4)),
    "attention_local": (lambda: crossformer.Attention(8, attn_type="short", window_size=2, dim_head=4), lambda d: (1, 8, 4 * d, 4)),
    # a band of exactly one window (the window count read from x.shape: H // window): exact
    "attention_local_one_window": (lambda: crossformer.Attention(8, attn_type="short", window_size=2, dim_head=4),
                                   lambda d: (1, 8, 2 * d, 4)),
    # the whole model with CREDIT's default interp=True: its long-distance attention through the group layout
    # (without the interpolation: tests/test_long_attention.py), its last F.interpolate(size=(image_height,
    # image_width)), a size stored for the whole field, in global coordinates (the output banded as the input): exact
    "crossformer_interp": (lambda: _crossformer(interp=True), lambda d: (1, 3, 1, 32 * d, 32)),
    # reshapes to its stored global patches_resolution: the field's sizes, mapped to each band (whole patches): exact
    "cube_embedding": (lambda: crossformer.CubeEmbedding((1, 4 * _D, 8), (1, 2, 2), 3, 8), lambda d: (1, 3, 1, 4 * d, 8)),
    "debugger": (lambda: _debugger(), lambda d: (1, 3, 1, 3 * d + 1, 8)),
    "upblock_ps": (lambda: wxformer.UpBlockPS(4, 4, 2), lambda d: (1, 4, 4 * d + 1, 4)),
    "wxformer": (lambda: _wxformer(), lambda d: (1, 3, 1, 32 * d, 32)),
    "nextgen_wxformer": (lambda: _nextgen(), lambda d: (1, 3, 1, 32 * d, 32)),
    # 128 rows on 3 bands: the joins re-band the pixel-shuffled bands to the encoder's; the stored-size interpolation
    # at the end bands the output as the input (its residual add): exact
    "nextgen_wxformer_uneven": (lambda: _nextgen(32), lambda d: (1, 3, 1, 32 * d + 32, 32)),
    "fuxi": (lambda: _fuxi(), lambda d: (1, 3, 2, 8 * d, 16)),
    "unet": (lambda: _unet(8 * _D), lambda d: (1, 3, 1, 8 * d, 16)),  # even bands of whole 8-row blocks: exact
    # uneven bands: F.interpolate(size=skip.shape[-2:]) by the field's factor, re-banded to the skip's layout: exact
    "unet_uneven": (lambda: _unet(8 * _D + 8), lambda d: (1, 3, 1, 8 * d + 8, 16)),
}
# the run may refuse a later op than describe() (see verdict_is_the_run)
LATER_OP = {"wxformer"}
# exact on every domain size (the others: exact where describe() says so)
EXACT = {"upblock_coordinate", "upblock_coordinate_uneven", "attention_global", "cube_embedding", "fuxi", "crossformer_interp", "nextgen_wxformer", "wxformer", "wxformer_cross_embed", "wxformer_cross_embed_s1",
         "unet", "unet_uneven", "nextgen_wxformer_uneven"}
# refused on more than one band, at this op
REFUSED_AT: dict[str, str] = {}
# whole models: on 1, 2 and 4 ranks only, each domain size once (see the module docstring)
HEAVY = {"crossformer_interp", "wxformer", "nextgen_wxformer", "nextgen_wxformer_uneven", "fuxi", "unet", "unet_uneven"}
NEEDS_TIMM = {"fuxi", "unet", "unet_uneven"}
_D = 1  # the domain size of the case being built (models that store the field's size take it from here)


def _debugger():
    from credit.models.debugger_model import DebuggerModel

    return DebuggerModel(image_height=3 * _D + 1, image_width=8, frames=1, channels=1, surface_channels=1,
                         input_only_channels=0, levels=2)


def _wxformer():
    return EveryParameter(wxformer.CrossFormer(
        image_height=32 * _D, image_width=32, interp=False, frames=1, channels=1, surface_channels=1, input_only_channels=0, levels=2,
        dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=(2, 1, 1, 1), local_window_size=2,
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False,
    ))


def _nextgen(extra=0):
    from credit.models.wxformer import wxformer_next

    return EveryParameter(wxformer_next.NextGenWXFormer(
        image_height=32 * _D + extra, image_width=32, frames=1, channels=1, surface_channels=1, input_only_channels=0, levels=2,
        dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=(2, 1, 1, 1), local_window_size=2,
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)), cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False, col_attn_heads=1, num_spectral_nodes=4,
    ))


def _fuxi():
    return EveryParameter(TIMM[0].Fuxi(
        image_height=8 * _D, patch_height=2, image_width=16, patch_width=2, levels=2, frames=2, frame_patch_size=2,
        dim=8, num_groups=2, channels=1, surface_channels=1, num_heads=2, depth=1, window_size=2,
        use_spectral_norm=False, interp=False,
    ))


def _unet(height):
    return EveryParameter(TIMM[1].SegmentationModel(
        image_height=height, image_width=16, frames=1, channels=1, surface_channels=1, input_only_channels=0, levels=2,
        architecture={"name": "unet", "encoder_name": "timm-regnetx_002", "encoder_weights": None, "encoder_depth": 3,
                      "decoder_channels": (32, 16, 16)},
    ))


def _skip_unless_runs_here(name):
    if name in NEEDS_TIMM and TIMM is None:
        pytest.skip("needs timm and segmentation_models_pytorch (pip install --no-deps, see the Makefile)")
    if name in HEAVY and MPI.COMM_WORLD.Get_size() not in (1, 2, 4):
        pytest.skip("a whole model: runs on 1, 2 and 4 ranks (the 4-rank job covers 3 bands)")


def _verdict(name, build, shape, manager):
    """describe()'s verdict is the run's; a model refused at conversion (a module type) is refused on every rank."""
    if (message := refused_at_conversion(build, shape, manager)) is not None:
        assert "custom_converters" in message, message
        return None
    return verdict_is_the_run(name, build, shape, manager, seed=5, same_op=name not in LATER_OP)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in HEAVY else pytest.mark.one_domain_size) for n in sorted(CASES)])
def test_credit_model_exact_or_refused_on_every_rank(name, make_manager):
    global _D
    _skip_unless_runs_here(name)
    build, shape_of = CASES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if name in HEAVY and d != MPI.COMM_WORLD.Get_size() and (d, MPI.COMM_WORLD.Get_size()) != (3, 4):
                continue  # each domain size once over the 1, 2, 4-rank jobs (3 bands in the 4-rank one)
            torch.manual_seed(0)
            _D = d
            try:
                plan = _verdict(name, build, shape_of(d), manager)
                assert name not in EXACT or plan.exact, str(plan)
                if name in REFUSED_AT and d > 1:
                    assert not plan.exact and plan.rows[-1].kind == REFUSED_AT[name], str(plan)
            finally:
                _D = 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_stored_patch_grid_is_the_fields(uneven, make_manager):
    """CubeEmbedding reshapes to the patch grid it stored for the whole field: the sizes are the field's, so the
    reshape maps them to each band. Exact on even and uneven bands (its strided patch conv gives each band whole
    patches of the field's grid)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            height = 4 * d + (2 if uneven and d > 1 else 0)

            def build(height=height):
                return crossformer.CubeEmbedding((1, height, 8), (1, 2, 2), 3, 8)

            plan = verdict_is_the_run("cube_embedding", build, (1, 3, 1, height, 8), manager)
            assert plan.exact, str(plan)


class _Windows(torch.nn.Module):
    """Rows into windows of 2 by einops (its own check raises on a band of 3 rows, before any torch function)."""

    def forward(self, x):
        from einops import rearrange

        return rearrange(x, "b c (h w1) w -> b c h w1 w", w1=2).flatten(2, 3) * 2


@pytest.mark.mpi(min_size=3)
def test_rank_local_einops_error_is_every_ranks_exception(make_manager):
    """Uneven bands (3, 3, 2 rows) and windows of 2: einops sees the field's 8 rows (credit_mpi.nn.judge.field_sizes), and
    the reshape into windows of 2 that it computes is refused on every rank (bands of 3 rows are not whole windows)."""

    with first_ranks(make_manager, 3) as manager:
        if manager is None:
            return
        comm = manager.domain_group
        torch.manual_seed(0)
        model = convert_to_domain_parallel(_Windows(), manager)  # no window_size: not re-banded to whole windows
        rows = [3, 3, 2][manager.domain_rank]
        x = torch.randn(1, 8, rows, 4, dtype=torch.float64)
        try:
            model(x)
        except Exception as exc:  # noqa: BLE001 - compared on every rank below
            raised = exc
        else:
            raised = None
        mine = (type(raised).__name__, str(raised))
        every = comm.allgather(mine)
        assert raised is not None and len(set(every)) == 1, every
        assert mine[0] == "ConversionError" and "whole number of windows" in mine[1] and "[3, 3, 2]" in mine[1], mine
        # the model still runs afterwards (nobody was left inside a collective)
        ok = convert_to_domain_parallel(crossformer.Attention(8, attn_type="short", window_size=2, dim_head=4).double(), manager)
        assert ok(torch.randn(1, 8, 2, 4, dtype=torch.float64)).shape == (1, 8, 2, 4)
