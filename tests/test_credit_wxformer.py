"""CREDIT's WXFormer family on bands (issue 24, item 3): its CrossEmbed branches, a stored interpolation size, the joins.

* A ``ZeroPad2d`` of the sharded dim followed by an unpadded (strided) convolution, WXFormer's
  CrossEmbed branch: the tracker folds the padding into the convolution, whose output bands are
  then anchored on the unpadded field, so branches padded by ``kernel - stride`` rows join.
* ``F.interpolate(x, size=(H, W))`` with ``H`` stored for the whole field (CREDIT's ``interp=True``):
  the global output size, computed in global coordinates; the output banded as the model's input
  (``credit_mpi.layout.split``), so it joins the input's rows.
* A join of bands whose layouts differ (CrossFormer's skip connections on uneven bands): the
  join re-bands the decoder's part to the skip's layout, exact, and describe() plans the move.

Each exact against one process (forward, input gradient, parameter gradients; float64), even and
uneven bands, with describe()'s verdict equal to the run (tests/verdict_reference.py); d bands in
the d-rank job (each domain size once over the 1..4-rank jobs).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from credit_mpi.layout import split  # noqa: E402
from credit_mpi.nn import describe  # noqa: E402

from .halo_reference import first_ranks, prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


def _this_job(managers):
    """The managers of d = the world size only: each domain size once over the 1..4-rank jobs (CI's time)."""
    return [(d, m) for d, m in managers if d == MPI.COMM_WORLD.Get_size()]


class Branches(nn.Module):
    """Two branches, each ``ZeroPad2d`` of ``kernel - stride`` rows (asymmetric when odd) + an unpadded conv, joined."""

    def __init__(self, kernels=(2, 4), stride=2):
        super().__init__()
        self.convs = nn.ModuleList()
        for k in kernels:
            total = k - stride
            pad = (total // 2, total - total // 2)
            self.convs.append(nn.Sequential(nn.ZeroPad2d((*pad, *pad)), nn.Conv2d(2, 3, k, stride=stride)))

    def forward(self, x):
        return torch.cat([conv(x) for conv in self.convs], dim=1)


class StoredSize(nn.Module):
    """A conv, then ``F.interpolate`` to a size stored in ``__init__`` (CREDIT's ``size=(image_height, image_width)``)."""

    def __init__(self, size, mode, align_corners=None, stride=1):
        super().__init__()
        self.size, self.mode, self.align = size, mode, align_corners
        self.conv = nn.Conv2d(2, 3, 3, stride=stride, padding=1)

    def forward(self, x):
        return F.interpolate(self.conv(x), size=self.size, mode=self.mode, align_corners=self.align)


class BackToTheInput(StoredSize):
    """Down by a strided conv, back to the field's stored height, plus the input: the output's bands are the input's."""

    def forward(self, x):
        return super().forward(x) + x.sum(1, keepdim=True)


@pytest.mark.parametrize(("kernels", "stride"), [((2, 4), 2), ((2, 3), 1), ((3, 4), 1), ((4, 8), 4)])
def test_padded_branches_give_one_band_layout(kernels, stride):
    """describe(): every branch's conv has the same output bands (uneven bands of 3 and 4 ranks), and it runs exactly."""
    for d, height in ((3, 3 * 4 * stride + 1), (4, 4 * 4 * stride + 3)):
        plan = describe(Branches(kernels, stride).double(), (1, 2, height, 8), d)
        convs = [r for r in plan.rows if r.kind == "Conv2d"]
        assert plan.exact and len(convs) == 2 and convs[0].bands_out == convs[1].bands_out, str(plan)
        assert all(r.rows_in == height for r in convs), str(plan)  # the padding folded: the conv reads the field


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("kernels", "stride"), [((2, 4), 2), ((2, 3), 1)])
def test_padded_branches_are_exact(kernels, stride, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (4 * d, 4 * d + 3):  # even and uneven bands
                plan = verdict_is_the_run("branches", lambda k=kernels, s=stride: Branches(k, s), (1, 2, height, 8), manager)
                assert plan.exact, str(plan)


_MODES = [("nearest", None), ("bilinear", False), ("bilinear", True), ("bicubic", False)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(("mode", "align"), _MODES)
def test_interpolate_to_a_stored_size_is_exact(mode, align, make_manager):
    """Up by 7/5 and down by 3/5 along the bands (no whole factor), the longitude too; the output banded as split(S)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            height = 5 * d + 2
            for size in ((7 * d + 1, 9), (3 * d + 1, 5)):
                plan = verdict_is_the_run(f"stored {size}", lambda s=size: StoredSize(s, mode, align), (1, 2, height, 6), manager)
                assert plan.exact, str(plan)
                rows = [list(r.bands_out) for r in plan.rows if r.kind == "Interpolate"]
                assert rows == ([split(size[0], d, uneven=True)] if d > 1 else []), str(plan)


@pytest.mark.mpi(min_size=1)
def test_stored_size_output_joins_the_input(make_manager):
    """A strided conv to ceil(H / 2) rows, back to the stored H, plus the input: its bands are the input's (uneven too)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (4 * d, 4 * d + 3):
                build = lambda h=height: BackToTheInput((h, 6), "bilinear", False, stride=2)  # noqa: E731
                assert verdict_is_the_run("back to the input", build, (1, 2, height, 6), manager).exact


class Skip(nn.Module):
    """A UNet's skip connection: stride 2 down, a transposed conv back up, joined with the input's conv."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Conv2d(2, 2, 3, padding=1)
        self.down = nn.Conv2d(2, 2, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2, 2, 2, stride=2)

    def forward(self, x):
        x = self.inner(x)
        return torch.cat([self.up(self.down(x)), x], dim=1)


@pytest.mark.mpi(min_size=3)
def test_a_join_of_different_layouts_is_re_banded(make_manager):
    """Uneven bands 3, 3, 2 (offsets 0, 3, 6): the transposed conv gives 4, 2, 2 rows and the skip 3, 3, 2.

    The join agrees every part's rows and re-bands the transposed conv's output to the skip's layout (the part the
    forward made first): exact, and describe() plans the move (tests/test_uneven_joins.py has more).
    """
    with first_ranks(make_manager, 3) as manager:
        if manager is None:
            return
        plan = verdict_is_the_run("skip", Skip, (1, 2, 8, 4), manager)
        assert plan.exact, str(plan)
        join = next(r for r in plan.rows if r.kind == "cat()")
        assert (join.bands_in, join.bands_out) == ((4, 2, 2), (3, 3, 2)), str(plan)


@pytest.mark.mpi(min_size=3)
@pytest.mark.world_sizes(3)
def test_whole_crossformer_on_uneven_bands_is_exact(make_manager):
    """CREDIT's CrossFormer (its default interp=True) on 128 rows, 3 bands of 43, 43, 42.

    The strided convs own rows ``[ceil(a / 2), ...)`` of each stage, the transposed convs ``[2 a, ...)``: at the
    16-row stage the bands are 6, 5, 5 and 6, 6, 4. Each up_block's join re-bands the decoder's part to the skip's
    layout: exact against one process, describe()'s verdict the run's.
    """
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .credit_stand_ins import credit_models
    from .test_credit_models import EveryParameter

    crossformer = credit_models()[0]

    def build():
        return EveryParameter(crossformer.CrossFormer(
            image_height=128, image_width=32, frames=1, channels=1, surface_channels=1, input_only_channels=0,
            levels=2, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=(2, 1, 1, 1),
            local_window_size=2, cross_embed_kernel_sizes=((2, 4),) * 4, cross_embed_strides=(2, 2, 2, 2),
            use_spectral_norm=False))

    with first_ranks(make_manager, 3) as manager:
        if manager is None:
            return
        plan = verdict_is_the_run("crossformer uneven", build, (1, 3, 1, 128, 32), manager)
        assert plan.exact, str(plan)
        assert any(r.kind == "cat()" and r.bands_in != r.bands_out for r in plan.rows), str(plan)


def _nextgen_parts():
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .credit_stand_ins import credit_models

    credit_models()  # the post block's stand-in first
    from credit.models.wxformer import wxformer_next

    return wxformer_next


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("part", ["column_attention", "feedforward", "level_embedding"])
def test_nextgen_parts_run_locally_and_exactly(part, make_manager):
    """The nextgen WXFormer's column attention (nn.MultiheadAttention over the levels, the bands in the batch), its
    channels-last FeedForward (an nn.Dropout(0) on a permuted band) and level embedding: exact, even and uneven."""
    nx = _nextgen_parts()
    build = {"column_attention": lambda: nx.ColumnAttention(2, 2, num_heads=2),
             "feedforward": lambda: nx.FeedForward(4, mult=2),
             "level_embedding": lambda: nx.LevelEmbedding(2, 2)}[part]
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (2 * d, 2 * d + 1):
                assert verdict_is_the_run(part, build, (1, 4, height, 3), manager).exact


class Spectral(nn.Module):
    """A conv, then nextgen WXFormer's SpectralGNNBottleneck (its token pooling by a parameter over the field's tokens)."""

    def __init__(self, height, width, nodes=3):
        super().__init__()
        nx = _nextgen_parts()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bottleneck = nx.SpectralGNNBottleneck(4, height, width, num_spectral_nodes=nodes)

    def forward(self, x):
        return self.bottleneck(self.conv(x))


class SpectralMatmul(nn.Module):
    """The same pooling written with ``@`` (``x_flat @ agg_w.T`` and ``s @ scatter_w.T``), a replicated MLP between."""

    def __init__(self, height, width, nodes=3):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.agg = nn.Parameter(torch.randn(nodes, height * width))
        self.scatter = nn.Parameter(torch.randn(height * width, nodes))
        self.mlp = nn.Linear(nodes, nodes)

    def forward(self, x):
        x = self.conv(x)
        B, C, H, W = x.shape
        s = torch.tanh(self.mlp(x.reshape(B, C, -1) @ self.agg.T))
        return x + (s @ self.scatter.T).reshape(B, C, H, W)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["einsum", "matmul"])
def test_spectral_bottleneck_is_exact(kind, make_manager):
    """A contraction of the band's tokens with a parameter over the field's tokens (cut to the band, summed over the
    domain: replicated) and its inverse (the parameter's rows cut to the band): exact, even and uneven bands."""
    cls = {"einsum": Spectral, "matmul": SpectralMatmul}[kind]
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            for height in (2 * d, 2 * d + 1):
                assert verdict_is_the_run(kind, lambda h=height: cls(h, 3), (2, 2, height, 3), manager).exact


class DenseHead(nn.Module):
    """A weight over every channel's tokens (``x.flatten(1) @ w``: the channels merged before the rows): no rule."""

    def __init__(self, height, width):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.w = nn.Parameter(torch.randn(2 * height * width, 3))

    def forward(self, x):
        return self.conv(x).flatten(1) @ self.w


@pytest.mark.mpi(min_size=1)
def test_a_sum_over_merged_channels_and_rows_is_refused_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in _this_job(managers):
            if d == 1:
                continue  # one band: the original forward (its output holds no band to compare)
            plan = verdict_is_the_run("dense_head", lambda d=d: DenseHead(2 * d + 1, 3), (1, 2, 2 * d + 1, 3), manager)
            assert not plan.exact and plan.rows[-1].kind == "matmul()" and "merged windows" in plan.rows[-1].note, str(plan)
