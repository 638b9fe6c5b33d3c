"""Rules at the function level (credit_mpi.nn.judge): custom forwards judged by what they do to the sharded dim.

Every case: ``describe()``'s verdict (from its meta-device dry run) is what the run does: exact
against one process (float64: forward, input gradient, parameter gradients) when the plan says
it runs exactly, the same ConversionError on every rank when it refuses. Never silently wrong.
Domain sizes 1..W, array_split bands of an even and an uneven height.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import ConversionError, convert_to_domain_parallel, describe  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import assert_same, run_both  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = torch.nn.functional


class Attention(nn.Module):
    """The issue's ten lines: 1x1 convs to q, k, v; tokens flattened from (lat, lon); softmax(q^T k); v a^T."""

    def __init__(self, c=4):
        super().__init__()
        self.q, self.k, self.v = (nn.Conv2d(c, c, 1) for _ in range(3))

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.q(x).flatten(2), self.k(x).flatten(2), self.v(x).flatten(2)
        a = torch.softmax(q.transpose(1, 2) @ k / c**0.5, dim=-1)
        return (v @ a.transpose(1, 2)).reshape(b, c, h, w) + x


class Gram(nn.Module):
    """A sum over the tokens of every band with a tensor that is not every band's tokens: refused."""

    def forward(self, x):
        t = x.flatten(2)
        return (t @ t.transpose(1, 2)).sum() * x


class Skip(nn.Module):
    """A UNet level whose decoder resizes to the skip's shape in its own forward (smp's decoder)."""

    def __init__(self, mode="nearest"):
        super().__init__()
        self.enc, self.down, self.mid = nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(3, 3, 3, padding=1)
        self.dec, self.mode = nn.Conv2d(6, 2, 3, padding=1), mode

    def forward(self, x):
        skip = self.enc(x)
        up = F.interpolate(self.mid(self.down(skip)), size=skip.shape[-2:], mode=self.mode)
        return self.dec(torch.cat([skip, up], dim=1))


class CoordAttention(nn.Module):
    """CoordinateAttention: a latitude mean (replicated) concatenated to the band's rows, one conv over both."""

    def __init__(self, c=2):
        super().__init__()
        self.conv0, self.pool_w, self.conv = nn.Conv2d(c, c, 3, padding=1), nn.AdaptiveAvgPool2d((1, None)), nn.Conv2d(c, c, 1)

    def forward(self, x):
        x = self.conv0(x)
        h = x.shape[2]
        x_h = x.mean(-1, keepdim=True)
        x_w = self.pool_w(x).permute(0, 1, 3, 2)
        y = self.conv(torch.cat([x_h, x_w], dim=2))
        a_h, a_w = torch.split(y, [h, y.shape[2] - h], dim=2)
        return x * a_h.sigmoid() * a_w.permute(0, 1, 3, 2).sigmoid()


class ChannelNorm(nn.Module):
    """CREDIT's channel LayerNorm (over dim 1): row-local."""

    def __init__(self, c, eps=1e-5):
        super().__init__()
        self.g, self.b, self.eps = nn.Parameter(torch.ones(1, c, 1, 1)), nn.Parameter(torch.zeros(1, c, 1, 1)), eps

    def forward(self, x):
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) / (var + self.eps).sqrt() * self.g + self.b


class GELU(nn.GELU):
    """timm's GELU: a subclass of a pointwise module."""


class Windows(nn.Module):
    """Window attention over 2x2 windows moved into the batch (CrossFormer's short distance): local when bands are whole windows."""

    def __init__(self, c=4, s=2):
        super().__init__()
        self.qkv, self.s = nn.Conv2d(c, 3 * c, 1), s

    def forward(self, x):
        b, c, h, w = x.shape
        s = self.s
        q, k, v = self.qkv(x).chunk(3, dim=1)

        def win(t):  # b c (h s1) (w s2) -> (b h w) (s1 s2) c
            t = t.reshape(b, c, h // s, s, w // s, s).permute(0, 2, 4, 3, 5, 1)
            return t.reshape(b * (h // s) * (w // s), s * s, c)

        a = torch.softmax(win(q) @ win(k).transpose(-1, -2), dim=-1)
        o = (a @ win(v)).reshape(b, h // s, w // s, s, s, c).permute(0, 5, 1, 3, 2, 4)
        return o.reshape(b, c, h, w) + x


class GlobalAttention(nn.Module):
    """Full attention over the tokens flattened from (lat, lon) with F.scaled_dot_product_attention: K/V gathered."""

    def __init__(self, c=4, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1), heads

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=1)

        def tokens(t):  # (b, heads, h w, c / heads)
            return t.reshape(b, self.heads, c // self.heads, h * w).transpose(-1, -2)

        o = F.scaled_dot_product_attention(tokens(q), tokens(k), tokens(v))
        return self.out(o.transpose(-1, -2).reshape(b, c, h, w)) + x


class RelativeTable(nn.Module):
    """A reshape/permute of a tensor without bands (a relative-position table) inside the forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(2, 9, dtype=torch.float64))

    def forward(self, x):
        table = self.bias.reshape(2, 3, 3).permute(1, 2, 0).flatten(0, 1).mean(0)  # no bands: passes
        return self.conv(x) * table.reshape(1, 2, 1, 1)


CASES = {
    # name: (build, channels, width, row unit of the heights)
    "attention": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Attention(4)), 2, 3, 1),
    "skip_nearest": (Skip, 2, 4, 2),
    "skip_bilinear": (lambda: Skip("bilinear"), 2, 4, 2),
    "coord_attention": (CoordAttention, 2, 4, 1),
    "channel_norm": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), ChannelNorm(3), nn.Softmax(dim=1)), 2, 4, 1),
    "pixel_shuffle": (lambda: nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.PixelShuffle(2), GELU(), nn.Conv2d(2, 2, 3, padding=1)), 2, 3, 1),
    "pixel_unshuffle": (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.PixelUnshuffle(2), nn.Conv2d(8, 2, 3, padding=1)), 2, 4, 2),
    "windows": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Windows(4)), 2, 4, 2),
    "relative_table": (RelativeTable, 2, 4, 1),
    "zero_pad": (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ZeroPad2d((1, 0, 2, 1)), nn.Conv2d(2, 2, 3)), 2, 4, 1),
    "global_attention": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), GlobalAttention(4)), 2, 3, 1),
}
# what the run must do (True: exact wherever the plan says so; the verdict equals the run in every case)
NEVER_EXACT: set = set()
ALWAYS_EXACT = {"coord_attention"}  # replicated rows joined to a band and split back (credit_mpi.nn.judge.field_values)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CASES))
def test_verdict_is_what_the_run_does(name, make_manager):
    build, c, width, unit = CASES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            _verdict_case(name, build, c, width, unit, d, manager)


def _verdict_case(name, build, c, width, unit, d, manager):
    for h in (4 * unit * d, 4 * unit * d + unit * (d > 1)):  # even bands, then uneven ones
        plan = verdict_is_the_run(name, build, (2, c, h, width), manager)
        if d > 1 and name in NEVER_EXACT:
            assert not plan.exact, str(plan)
        if name in ALWAYS_EXACT:
            assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
def test_refusals_name_the_module_and_the_op(make_manager):
    manager = make_manager()
    if True:
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Gram()).double(), manager)
        x = torch.randn(1, 2, 3, 3, dtype=torch.float64) + manager.domain_rank  # bands: each rank's own rows
        with pytest.raises(ConversionError, match=r"1 \(Gram\) calls matmul\(\).*contracts the sharded dim"):
            model(x)
        plan = describe(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Gram()).double(), (1, 2, 8, 3), 2)
        assert not plan.exact and plan.rows[-1].kind == "matmul()" and "does NOT run exactly" in str(plan)
        coord = describe(CoordAttention().double(), (1, 2, 8, 4), 2)
        # replicated rows joined to a band and split back (credit_mpi.nn.judge.field_values): the split's sum is a row of its own
        assert coord.exact and any(r.kind == "domain_sum() of split()" for r in coord.rows), str(coord)


def test_the_model_on_one_process_is_not_judged():
    """No manager (or a domain of one): the original forward, whatever it does."""
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Attention(4)).double(), None)
    x = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    assert model(x).shape == (1, 4, 4, 3)
    assert describe(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Attention(4)).double(), (1, 2, 4, 3), 1).exact


@pytest.mark.mpi(min_size=2)
def test_einops_on_uneven_bands_raises_on_every_rank(make_manager):
    """einops raising on some ranks only (a band that is not whole windows) is every rank's exception."""
    einops = pytest.importorskip("einops")

    class Rearranged(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            y = einops.rearrange(self.conv(x), "b c (h s) w -> (b h) c s w", s=2)
            return einops.rearrange(y.softmax(dim=2), "(b h) c s w -> b c (h s) w", b=x.shape[0])

    manager = make_manager()
    if True:
        d = manager.domain_parallel_size
        sizes = [3] + [2] * (d - 1)  # rank 0's band is not whole windows
        model = convert_to_domain_parallel(Rearranged().double(), manager)
        x = torch.randn(1, 2, sizes[manager.domain_rank], 4, dtype=torch.float64)
        try:
            model(x)
            name = None
        except Exception as exc:  # noqa: BLE001 - compared below
            name = type(exc).__name__
        names = manager.domain_group.allgather(name)
        assert None not in names and len(set(names)) == 1, names
        # whole windows on every band: exact
        assert_same(run_both(Rearranged, (1, 2, 4 * d, 4), manager))


@pytest.mark.mpi(min_size=2)
def test_global_attention_moves_what_the_theory_says(make_manager, monkeypatch):
    """K and V gathered: per rank 2 (N - N_rank) d elements received, 2 N d (P - 1) / P on even bands."""
    from credit_mpi.nn.judge import attention
    from credit_mpi.ops.allgather_along import received_elements

    monkeypatch.setattr(attention, "SDPA_PATH", "gather")  # tests/test_attention.py: every layout
    manager = make_manager()
    d = manager.domain_parallel_size
    b, c, h, w = 1, 4, 4 * d, 3
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), GlobalAttention(c)).double(), manager)
    x = torch.randn(b, 2, h // d, w, dtype=torch.float64) + manager.domain_rank  # bands: each rank's own rows
    received_elements(reset=True)
    model(x)
    n, n_rank = h * w, (h // d) * w
    assert received_elements() == 2 * (n - n_rank) * b * c  # heads x (c / heads) = c features per token
    assert received_elements() == 2 * n * b * c * (d - 1) // d
