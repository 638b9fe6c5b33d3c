"""The zoo: models and blocks of other groups' PyPI packages, converted unchanged (issue 37's "zoo test").

Each case is a small float64 model or block from a weather or vision package nobody here wrote (timm,
segmentation-models-pytorch, torch-harmonics, neuraloperator, nvidia-physicsnemo, vit-pytorch; the ``zoo``
extra), converted with :func:`~credit_mpi.nn.convert_to_domain_parallel` and checked through
``verdict_is_the_run`` (tests/verdict_reference.py) on d bands in the d-rank job (1..4 ranks), even and
uneven bands: EXACT against one process (forward, input gradient, parameter gradients after
reduce_gradients), or REFUSED with the same ConversionError on every rank, describe() agreeing.

``EXPECTED`` (one line a case, at the top) is the verdict on more than one band today: ``EXACT``, or a
regex that the refusing plan row (``path kind: note``) must match (or a pair for even and uneven bands, or a dict of
those by the number of bands); the test fails when the run gives the
other verdict, so flipping a case is editing its line. On one band every case must be exact.

Two limits of the packages themselves, not of the bands: torch-harmonics' spectral convolutions compute in float32
whatever their input (``x.float()``), so their cases are exact to float32 round-off (``float32_inside``); and
physicsnemo's AFNO (``AFNO2DLayer``: ``x.float()`` against float64 weights) and neuraloperator's FNO
(``SpectralConv``: a complex64 output buffer) do not run in float64 even in one process, so they are not cases.
A model that checks its input's height itself (smp's ``check_input_shape``, timm's and einops' window asserts)
sees the field's (sizes read from a band are the field's), so its check passes on uneven bands too, and the
rules decide.

Only the wrappers below are written here: a channels-last block (timm's Swin, physicsnemo's AFNO block) or a
token block (Pangu's) gets its input from a (B, C, H, W) field and gives one back, as the model around it
would; a classifier is taken without its pooled head (its features are the band's output).

What the packages import and these cases never use: torchvision (timm, vit-pytorch, physicsnemo; its PyPI
wheels do not load beside the CPU torch) and s3fs (physicsnemo's file system helpers) are stand-ins that
refuse to be used (tests/credit_stand_ins.py), when the real ones do not import.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from .credit_stand_ins import _StandInFinder  # noqa: E402
from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import refused_at_conversion, verdict_is_the_run  # noqa: E402

EXACT = "exact"


def _stand_ins():
    """torchvision and s3fs, imported by the packages for names these cases never use, when they do not import."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a wheel built for another torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _StandInFinder())
    if importlib.util.find_spec("s3fs") is None and "s3fs" not in sys.modules:
        stand_in = types.ModuleType("s3fs")  # physicsnemo.core.filesystem: remote checkpoints, not used here

        def S3FileSystem(*args, **kwargs):  # noqa: N802 - the name physicsnemo calls
            raise RuntimeError("s3fs stand-in: remote file systems are not part of these tests")

        stand_in.S3FileSystem = S3FileSystem
        sys.modules["s3fs"] = stand_in


_stand_ins()

# name -> the verdict on more than one band today (EXACT, or a regex of the refusing row "path kind: note"); an entry
# (even, uneven) when the two layouts differ. The lead flips these as the field-size, field-value, spectral,
# outside and longitude work lands (see each case's `area`).
_WINDOWS = r"\(PartitionAttentionCl\) view\(\): refused: it splits the sharded dim into windows"
EXPECTED: dict[str, Any] = {
    "timm_convnext": EXACT,
    "timm_squeeze_excite": EXACT,
    "timm_cbam": EXACT,
    "timm_coord_attn": EXACT,
    "timm_swin": EXACT,
    "timm_swin_v2": EXACT,
    "timm_patch_embed": EXACT,
    "timm_maxvit": {2: EXACT, 3: _WINDOWS, 4: _WINDOWS},
    "smp_unet_scse": EXACT,
    "smp_fpn": (EXACT, r"decoder\.p4 add\(\): it combines bands of \d+ rows in different layouts"),
    "smp_deeplabv3plus": r"aspp.*Conv2d: a halo of 3 row\(s\) comes from the neighbouring band only",
    "th_sfno_block": EXACT,
    "th_sfno": EXACT,
    "th_fno_block": EXACT,
    "th_disco": r"DiscreteContinuousConvS2\) _disco_s2_contraction_optimized\.default\(\): refused: no rule",
    "neuralop_domain_padding": EXACT,
    "neuralop_grid_embedding": EXACT,
    "neuralop_channel_mlp": r"fcs\.0 \(DomainParallelConv1d\) its forward: refused: its input holds the bands along dim 2 \(merged",
    "physicsnemo_spectral_conv": EXACT,
    "physicsnemo_fno": EXACT,
    "physicsnemo_pangu_block": EXACT,
    "vit_simple": (EXACT, r"Rearrange\) reshape\(\): refused: it splits the sharded dim into windows"),
    "vit_maxvit": {2: (EXACT, r"Rearrange\) reshape\(\): refused"), 3: r"Rearrange\) reshape\(\): refused",
                   4: r"Rearrange\) reshape\(\): refused"},
}


@dataclass(frozen=True)
class Case:
    package: str  # the PyPI distribution
    module: str  # what importorskip needs
    build: object  # build(global input shape) -> nn.Module
    shape: object  # shape(d, uneven) -> the global input shape
    area: str  # whose work would make it exact (fieldsizes, fieldvalues, spectral, outside, gridlon, layers) or "-"
    float32_inside: bool = False  # the model computes its transforms in float32 whatever its input: exact to that
    same_op: bool = True  # False: the run refuses another op than describe() (verdict_is_the_run's same_op)
    # False: even bands only. smp's models check `x.shape[-2] % output_stride` on the band's height (their own
    # RuntimeError on every rank, not a ConversionError): uneven bands of a field that is whole strides are never whole
    # strides; with the field's sizes in x.shape (issue 37, fieldsizes) they would run: then set True
    uneven: bool = True


FLOAT32 = (1e-5, 1e-4)  # (atol, rtol) of a model whose spectral convolution casts to float32 (torch-harmonics)


def rows(unit, per_band=2):
    """A field of ``per_band`` units of ``unit`` rows a band (even), one unit more (uneven, d > 1)."""
    return lambda d, uneven: per_band * unit * d + (unit if uneven and d > 1 else 0)


def image(c, w, unit, per_band=2, b=1):
    r = rows(unit, per_band)
    return lambda d, uneven: (b, c, r(d, uneven), w)


class ChannelsLast(nn.Module):
    """``block`` takes (B, H, W, C): the permutes of the model around it."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Tokens(nn.Module):
    """``block`` takes (B, H * W, C) tokens, row-major (Pangu's and FengWu's 2-D blocks)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.block(x.flatten(2).transpose(1, 2))
        return y.transpose(1, 2).reshape(b, c, h, w)


class Features(nn.Module):
    """A classifier's layers up to its pooled head (their output a feature map of the field)."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


class SimpleViTFeatures(nn.Module):
    """vit-pytorch's SimpleViT without its mean-pooled head: patches, its sin-cos position embedding of the field's
    patch grid, the transformer, and the tokens back on the patch grid."""

    def __init__(self, vit, patch):
        super().__init__()
        self.vit, self.patch = vit, patch

    def forward(self, img):
        from einops import rearrange

        x = self.vit.to_patch_embedding(img)
        x = x + self.vit.pos_embedding.to(img.device, dtype=x.dtype)
        x = self.vit.transformer(x)
        return rearrange(x, "b (h w) d -> b d h w", w=img.shape[-1] // self.patch)


class EveryParameter(nn.Module):
    """``model`` with every parameter in the graph (a classifier's head, a decoder's unused stage: no gradient to compare
    otherwise)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x) + 0.0 * sum(p.sum() for p in self.model.parameters() if not p.is_complex())


class Padded(nn.Module):
    """neuraloperator's domain padding around a 1x1 conv, as its FNO uses it (pad by a fraction, unpad by slicing)."""

    def __init__(self, padding, channels):
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return self.padding.unpad(self.conv(self.padding.pad(x)))


# ---- the builders (each takes the global input shape) ----------------------------------------------------------


def timm_convnext(shape):
    from timm.models.convnext import ConvNeXtBlock

    return ConvNeXtBlock(shape[1], kernel_size=3, mlp_ratio=2, ls_init_value=0.5)


def timm_squeeze_excite(shape):
    from timm.layers import SqueezeExcite

    return SqueezeExcite(shape[1], rd_channels=2)


def timm_cbam(shape):
    from timm.layers.cbam import CbamModule

    return CbamModule(shape[1], rd_channels=2, spatial_kernel_size=3)


def timm_coord_attn(shape):
    from timm.layers.coord_attn import CoordAttn

    return CoordAttn(shape[1], rd_channels=4)


def timm_swin(shape):
    from timm.models.swin_transformer import SwinTransformerBlock

    return ChannelsLast(SwinTransformerBlock(shape[1], input_resolution=shape[-2:], num_heads=2, window_size=2, shift_size=1,
                                             mlp_ratio=2))


def timm_swin_v2(shape):
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    return ChannelsLast(SwinTransformerV2Block(shape[1], input_resolution=shape[-2:], num_heads=2, window_size=4, shift_size=2,
                                               mlp_ratio=2))


def timm_patch_embed(shape):
    from timm.layers import PatchEmbed

    return PatchEmbed(img_size=shape[-2:], patch_size=2, in_chans=shape[1], embed_dim=4, flatten=False)


def timm_maxvit(shape):
    from timm.models.maxxvit import MaxxVitBlock, MaxxVitConvCfg, MaxxVitTransformerCfg

    return MaxxVitBlock(shape[1], shape[1], conv_cfg=MaxxVitConvCfg(expand_ratio=2.0, attn_layer="se"),
                        transformer_cfg=MaxxVitTransformerCfg(dim_head=4, window_size=(2, 2), grid_size=(2, 2),
                                                              expand_ratio=2.0))


def smp_unet_scse(shape):
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name="timm-regnetx_002", encoder_weights=None, encoder_depth=3, decoder_channels=(32, 16, 16),
                    decoder_attention_type="scse", in_channels=shape[1], classes=2)


def smp_fpn(shape):
    import segmentation_models_pytorch as smp

    return smp.FPN(encoder_name="timm-regnetx_002", encoder_weights=None, encoder_depth=3, decoder_pyramid_channels=32,
                   decoder_segmentation_channels=32, decoder_dropout=0.0, in_channels=shape[1], classes=2,
                   upsampling=4)


def smp_deeplabv3plus(shape):
    import segmentation_models_pytorch as smp

    return smp.DeepLabV3Plus(encoder_name="timm-regnetx_002", encoder_weights=None, encoder_depth=4, encoder_output_stride=8,
                             decoder_channels=8, decoder_atrous_rates=(1, 2, 3), decoder_aspp_dropout=0.0, in_channels=shape[1],
                             classes=2)


def th_sfno_block(shape):
    from torch_harmonics import InverseRealSHT, RealSHT
    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperatorBlock

    h, w = shape[-2:]
    fwd, inv = RealSHT(h, w, grid="equiangular"), InverseRealSHT(h, w, grid="equiangular")
    return SphericalFourierNeuralOperatorBlock(fwd, inv, shape[1], shape[1], mlp_ratio=2.0)


def th_sfno(shape):
    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperator

    return SphericalFourierNeuralOperator(img_size=tuple(shape[-2:]), scale_factor=1, in_chans=shape[1], out_chans=shape[1],
                                          embed_dim=4, num_layers=1)


def th_disco(shape):
    from torch_harmonics import DiscreteContinuousConvS2

    h, w = shape[-2:]
    return DiscreteContinuousConvS2(shape[1], 2, in_shape=(h, w), out_shape=(h, w), kernel_shape=3, grid_in="equiangular",
                                    grid_out="equiangular", theta_cutoff=3.0 * torch.pi / h)




def neuralop_channel_mlp(shape):
    from neuralop.layers.channel_mlp import ChannelMLP

    return ChannelMLP(shape[1], out_channels=shape[1], hidden_channels=4, n_layers=2)




def th_fno_block(shape):
    """torch-harmonics' SFNO block with its plain FFT transforms: an FNO block."""
    from torch_harmonics.examples.models._layers import InverseRealFFT2, RealFFT2
    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperatorBlock

    h, w = shape[-2:]
    return SphericalFourierNeuralOperatorBlock(RealFFT2(h, w), InverseRealFFT2(h, w), shape[1], shape[1], mlp_ratio=2.0)


def neuralop_domain_padding(shape):
    from neuralop.layers.padding import DomainPadding

    return Padded(DomainPadding(0.25), shape[1])


def neuralop_grid_embedding(shape):
    from neuralop.layers.embeddings import GridEmbedding2D

    return nn.Sequential(GridEmbedding2D(shape[1]), nn.Conv2d(shape[1] + 2, shape[1], 1))


def physicsnemo_spectral_conv(shape):
    from physicsnemo.nn.module.spectral_layers import SpectralConv2d

    return SpectralConv2d(shape[1], shape[1], 2, 2)


def physicsnemo_fno(shape):
    from physicsnemo.models.fno import FNO

    return FNO(shape[1], shape[1], decoder_layer_size=8, dimension=2, latent_channels=4, num_fno_layers=1, num_fno_modes=2,
               padding=2)


def physicsnemo_pangu_block(shape):
    from physicsnemo.nn.module.transformer_layers import Transformer2DBlock

    return Tokens(Transformer2DBlock(shape[1], input_resolution=tuple(shape[-2:]), num_heads=2, window_size=(2, 2),
                                     shift_size=(1, 1), mlp_ratio=2.0))


def vit_simple(shape):
    from vit_pytorch import SimpleViT

    vit = SimpleViT(image_size=tuple(shape[-2:]), patch_size=2, num_classes=2, dim=8, depth=1, heads=2, mlp_dim=8,
                    channels=shape[1], dim_head=4)
    return SimpleViTFeatures(vit, 2)


def vit_maxvit(shape):
    from vit_pytorch.max_vit import MaxViT

    vit = MaxViT(num_classes=2, dim=8, depth=(1,), dim_head=4, window_size=2, channels=shape[1], dim_conv_stem=8, dropout=0.0)
    return Features(vit.conv_stem, *vit.layers)


CASES: dict[str, Case] = {
    "timm_convnext": Case("timm", "timm", timm_convnext, image(4, 8, 1), "-"),
    "timm_squeeze_excite": Case("timm", "timm", timm_squeeze_excite, image(4, 8, 1), "-"),
    "timm_cbam": Case("timm", "timm", timm_cbam, image(4, 8, 1), "-"),
    "timm_coord_attn": Case("timm", "timm", timm_coord_attn, image(8, 8, 1), "fieldvalues"),
    "timm_swin": Case("timm", "timm", timm_swin, image(4, 8, 2), "fieldsizes"),
    "timm_swin_v2": Case("timm", "timm", timm_swin_v2, image(4, 8, 4, per_band=1), "fieldsizes"),
    "timm_patch_embed": Case("timm", "timm", timm_patch_embed, image(2, 8, 2), "fieldsizes"),
    "timm_maxvit": Case("timm", "timm", timm_maxvit, image(4, 8, 4, per_band=1), "fieldsizes"),
    "smp_unet_scse": Case("segmentation-models-pytorch", "segmentation_models_pytorch", smp_unet_scse, image(2, 16, 8, 1), "-"),
    "smp_fpn": Case("segmentation-models-pytorch", "segmentation_models_pytorch", smp_fpn, image(2, 16, 8, 1), "-"),
    "smp_deeplabv3plus": Case("segmentation-models-pytorch", "segmentation_models_pytorch", smp_deeplabv3plus,
                              image(2, 16, 16, 1, b=2), "-", uneven=False),  # two samples: BatchNorm after the pooled branch; uneven: the
                              # verdict varies with the band sizes (a 2-row band of a 3-row dilated conv's halo)
    "th_sfno_block": Case("torch-harmonics", "torch_harmonics", th_sfno_block, image(4, 16, 1, 4), "spectral", True),
    "th_sfno": Case("torch-harmonics", "torch_harmonics", th_sfno, image(2, 16, 1, 4), "spectral", True),
    "th_disco": Case("torch-harmonics", "torch_harmonics", th_disco, image(2, 16, 1, 4), "spectral"),
    "th_fno_block": Case("torch-harmonics", "torch_harmonics", th_fno_block, image(4, 16, 1, 4), "spectral", True),
    "neuralop_domain_padding": Case("neuraloperator", "neuralop", neuralop_domain_padding, image(2, 8, 2), "fieldsizes",
                                    same_op=False),
    "neuralop_grid_embedding": Case("neuraloperator", "neuralop", neuralop_grid_embedding, image(2, 8, 1), "fieldvalues"),
    "neuralop_channel_mlp": Case("neuraloperator", "neuralop", neuralop_channel_mlp, image(4, 8, 1), "-"),
    "physicsnemo_spectral_conv": Case("nvidia-physicsnemo", "physicsnemo", physicsnemo_spectral_conv, image(2, 16, 1, 4),
                                      "spectral"),
    "physicsnemo_fno": Case("nvidia-physicsnemo", "physicsnemo", physicsnemo_fno, image(2, 16, 1, 4), "spectral"),
    "physicsnemo_pangu_block": Case("nvidia-physicsnemo", "physicsnemo", physicsnemo_pangu_block, image(4, 8, 2), "fieldsizes"),
    "vit_simple": Case("vit-pytorch", "vit_pytorch", vit_simple, image(2, 8, 2), "fieldvalues"),
    "vit_maxvit": Case("vit-pytorch", "vit_pytorch", vit_maxvit, image(2, 16, 8, per_band=1), "-"),
}


def expected(name: str, d: int, uneven: bool) -> str:
    """``EXPECTED[name]``: one verdict, an ``(even, uneven)`` pair, or a dict of those by the number of bands."""
    if d == 1:
        return EXACT
    want = EXPECTED[name]
    want = want[d] if isinstance(want, dict) else want
    return want[uneven] if isinstance(want, tuple) else want


def _verdict(case: Case, name: str, shape: tuple, manager) -> str:
    """EXACT, or the refusal (the plan's refusing row, ``path kind: note``; a module refused at conversion: the
    ConversionError's message, the same on every rank), after checking that the run is describe()'s verdict."""
    build = lambda: EveryParameter(case.build(shape))  # noqa: E731
    if (message := refused_at_conversion(build, shape, manager)) is not None:
        return f"conversion: {message}"
    plan = verdict_is_the_run(name, build, shape, manager, seed=5, same_op=case.same_op, tolerance=FLOAT32 if case.float32_inside else (1e-12, 1e-10))
    if plan.exact:
        return EXACT
    row = next(r for r in plan.rows if not r.exact)
    return f"{row.path} {row.kind}: {row.note}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2, 3, 4)  # one band is one process (CI time: the imports alone are ~30 s a run)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_model_is_exact_or_refused_with_its_reason(name, make_manager):
    """d bands in the d-rank job, even and uneven: the verdict of EXPECTED, describe() agreeing with the run."""
    case = CASES[name]
    pytest.importorskip(case.module)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tensors the forwards make without a dtype (torch.zeros in a forward)
    try:
        with prefix_managers(make_manager) as managers:
            for d, manager in managers:
                for uneven in (False, True) if d > 1 and case.uneven else (False,):
                    shape = case.shape(d, uneven)
                    torch.manual_seed(0)
                    got = _verdict(case, name, shape, manager)
                    want = expected(name, d, uneven)
                    where = f"{name} ({case.package}) {shape} on {d} band(s)"
                    if want == EXACT:
                        assert got == EXACT, f"{where}: expected exact, refused: {got}"
                    else:
                        assert got != EXACT and re.search(want, got), f"{where}: expected refused /{want}/, got: {got}"
    finally:
        torch.set_default_dtype(dtype)


def test_every_case_has_its_expectation():
    assert sorted(EXPECTED) == sorted(CASES)
    for name in EXPECTED:
        for d in (2, 3, 4):
            for uneven in (False, True):
                w = expected(name, d, uneven)
                assert w == EXACT or re.compile(w), name
    assert len(CASES) >= 12 and len({c.package for c in CASES.values()}) >= 4
