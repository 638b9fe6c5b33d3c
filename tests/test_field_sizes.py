"""Field sizes inside a converted forward (issue 37, item 1): what a forward reads along the sharded dim is the field's.

``x.shape``, ``x.size()``, ``x.numel()``, ``len(x)`` and every number computed from them are the
whole field's on every band (credit_mpi.nn.judge.field_sizes): a hand-written mean divides by the
field's count, a branch goes as in one process, a stored image size compares equal, a reshape
into a stored patch grid and a pad to a window multiple with its crop map the field's sizes and
rows to each band. Every case: describe()'s verdict is the run's and it is exact against one
process (float64: forward, input gradient, parameter gradients), domain sizes 1..W, an even and
an uneven height. On the main branch before this change each of them was silently wrong
(the means, branches and scales: describe() said exact) or refused (the stored sizes, the crop).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

from credit_mpi.nn import describe  # noqa: E402

from .halo_reference import first_ranks, prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = torch.nn.functional


class SpatialMeanByHand(nn.Module):
    """``x.sum((2, 3), keepdim=True) / (H * W)``: the field's mean (the sum is the domain's, so is the count)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        x = self.conv(x)
        _, _, h, w = x.shape
        return x - x.sum((2, 3), keepdim=True) / (h * w)


class NumelMean(nn.Module):
    """``x.sum() / x.numel()``: the field's mean of every element."""

    def forward(self, x):
        return x * (x.sum() / x.numel())


class RowMean(nn.Module):
    """``x.sum(-2, keepdim=True) / x.shape[-2]``: the latitude mean, divided by the field's rows."""

    def forward(self, x):
        return x - x.sum(-2, keepdim=True) / x.shape[-2]


class LenMean(nn.Module):
    """``len(t)`` of a tensor whose first dim holds the rows (channels-last, rows first)."""

    def forward(self, x):
        t = x.permute(2, 0, 1, 3)
        return x * (t.sum() / (len(t) * t.shape[1] * t.shape[2] * t.shape[3]))


class Branches(nn.Module):
    """Python branches on the height: ``if H > 6``, ``if H % 2``, ``max(0, 12 - H)``: as in one process."""

    def forward(self, x):
        h = x.shape[-2]
        x = x * 2.0 if h > 6 else x * 3.0
        x = x + 1.0 if h % 2 else x - 1.0
        return x * (1.0 + max(0, 12 - h))


class TokenScale(nn.Module):
    """Scales from the field's token count: ``x * (h * w) ** -0.5`` and ``t.sum(-1) / (h * w)``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.proj(x).flatten(2)
        pooled = t.sum(-1) / (h * w)
        return x * (h * w) ** -0.5 + pooled[:, :, None, None]


class StoredSize(nn.Module):
    """A size stored in ``__init__`` for the whole field, asserted and compared (timm's PatchEmbed, CREDIT's Swin)."""

    def __init__(self, height, width):
        super().__init__()
        self.img_size = (height, width)
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        assert h == self.img_size[0] and w == self.img_size[1], (h, w, self.img_size)
        if x.shape[-2] != self.img_size[0]:
            raise ValueError("the band is not the field")
        scale = 2.0 if x.size(2) == self.img_size[0] else 5.0
        return self.conv(x) * scale


class PatchGrid(nn.Module):
    """A reshape into the patch grid stored for the whole field (FuXi, CubeEmbedding: ``patches_resolution``)."""

    def __init__(self, height, width, patch=2, c=2, dim=4, windowed=False):
        super().__init__()
        if windowed:  # uneven bands: the module's input re-banded to whole patches (credit_mpi.nn.judge.rows)
            self.window_size = patch
        self.grid = (height // patch, width // patch)
        self.patch, self.c = patch, c
        self.embed = nn.Linear(c * patch * patch, dim)
        self.out = nn.Linear(dim, c * patch * patch)

    def forward(self, x):
        b = x.shape[0]
        gh, gw, p, c = *self.grid, self.patch, self.c
        t = x.view(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        t = self.out(torch.relu(self.embed(t)))
        return t.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, gh * p, gw * p)


class PadWindows(nn.Module):
    """Pad to a window multiple, attend within windows, crop by the field's height (timm's Swin V2, 3-D Swin):
    ``F.pad`` pads the last band; ``x[:, :, :H]`` keeps each band's share. ``window_size``: its input is re-banded
    to whole windows (credit_mpi.nn.judge.rows); ``narrow``: the crop by ``narrow`` instead of a slice."""

    def __init__(self, window=4, narrow=False, c=2):
        super().__init__()
        self.window_size, self.narrow = window, narrow
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.proj = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        ws = self.window_size
        pad = (ws - h % ws) % ws
        q, k, v = F.pad(self.qkv(x), (0, 0, 0, pad)).chunk(3, dim=1)
        hp = h + pad
        q, k, v = (t.view(b, c, hp // ws, ws, w).permute(0, 2, 1, 3, 4).reshape(b, hp // ws, c, ws * w) for t in (q, k, v))
        a = torch.softmax(q.transpose(-1, -2) @ k / c ** 0.5, dim=-1)
        y = (v @ a.transpose(-1, -2)).reshape(b, hp // ws, c, ws, w).permute(0, 2, 1, 3, 4).reshape(b, c, hp, w)
        y = y.narrow(2, 0, h) if self.narrow else y[:, :, :h]
        return self.proj(y) + x


class QkvTokens(nn.Module):
    """``qkv.flatten(2).transpose(1, 2).reshape(b, -1, 3, heads, hd)``: every size -1 or a constant, then back to
    the field's (H, W) read from x.shape."""

    def __init__(self, c=4, heads=2):
        super().__init__()
        self.heads, self.hd = heads, c // heads
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.qkv(x).flatten(2).transpose(1, 2).reshape(b, -1, 3, self.heads, self.hd)
        q, k, v = t.unbind(2)
        y = torch.sigmoid((q * k).sum(-1, keepdim=True)) * v
        return y.reshape(b, h, w, c).permute(0, 3, 1, 2) + x


def _height(d, uneven):
    return 3 * d + 1 if uneven else 4 * d


CASES = {
    # name: (build(height), input shape(height), height per domain size d and evenness)
    "spatial_mean_by_hand": (lambda h: SpatialMeanByHand(), lambda h: (2, 2, h, 5), _height),
    "numel_mean": (lambda h: NumelMean(), lambda h: (2, 2, h, 5), _height),
    "row_mean": (lambda h: RowMean(), lambda h: (2, 2, h, 5), _height),
    "len_mean": (lambda h: LenMean(), lambda h: (2, 2, h, 5), _height),
    "branches": (lambda h: Branches(), lambda h: (1, 2, h, 3), _height),
    "token_scale": (lambda h: TokenScale(), lambda h: (2, 2, h, 3), _height),
    "stored_size": (lambda h: StoredSize(h, 6), lambda h: (1, 2, h, 6), _height),
    # a stored patch grid of 2-row patches: even bands of whole patches; uneven bands (array_split: never all whole
    # patches) re-banded to whole patches by a window_size attribute
    "patch_grid": (lambda h: PatchGrid(h, 6, windowed=h % 4 != 0), lambda h: (1, 2, h, 6),
                   lambda d, uneven: 4 * d + (2 if uneven else 0)),
    "pad_windows": (lambda h: PadWindows(), lambda h: (1, 2, h, 3), lambda d, uneven: 4 * d + (2 if uneven else 0)),
    "pad_windows_narrow": (lambda h: PadWindows(narrow=True), lambda h: (1, 2, h, 3), lambda d, uneven: 4 * d - (1 if uneven else 0)),
    "qkv_tokens": (lambda h: QkvTokens(), lambda h: (1, 4, h, 3), _height),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_field_sizes_exact_on_every_band(name, uneven, make_manager):
    build, shape_of, height_of = CASES[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            h = height_of(d, uneven)
            plan = verdict_is_the_run(name, lambda h=h: build(h), shape_of(h), manager)
            assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=4)
def test_qkv_reshape_on_bands_2_2_2_1(make_manager):
    """The issue's 4-rank case: bands (2, 2, 2, 1) of 7 rows, a qkv reshape whose sizes are -1 or constants."""
    with first_ranks(make_manager, 4) as manager:
        if manager is None:
            return
        plan = verdict_is_the_run("qkv_tokens", lambda: QkvTokens(), (1, 4, 7, 3), manager)
        assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
def test_field_size_reads_are_quiet_on_a_repeated_forward(make_manager, monkeypatch):
    """A size read agrees the band layout (one fixed-size agreement); a forward with the last one's inputs skips it
    on every rank (the quiet agreements of a converted forward)."""
    import credit_mpi.validation as validation
    from credit_mpi.nn import convert_to_domain_parallel

    from .nn_reference import bands_of

    manager = make_manager(MPI.COMM_WORLD.Get_size())
    model = convert_to_domain_parallel(Branches().double(), manager)
    h = 4 * manager.domain_parallel_size + 1
    start, stop = bands_of(h, manager)
    x = torch.randn(1, 2, h, 3, dtype=torch.float64)
    ref = Branches().double()(x)
    seen = []
    agree_cached = validation.agree_cached

    def counted(comm, kind, key, *args, **kwargs):
        seen.append(key)
        return agree_cached(comm, kind, key, *args, **kwargs)

    monkeypatch.setattr(validation, "agree_cached", counted)
    reads = []
    for _ in range(3):
        seen.clear()
        torch.testing.assert_close(model(x[..., start:stop, :]), ref[..., start:stop, :])
        reads.append(sum("the field's size" in str(k) for k in seen))
    assert reads == [1, 0, 0], reads


def test_describe_sees_the_field_sizes():
    """The dry run reads the field's sizes too: a stored size compares equal, the plan is exact."""
    plan = describe(StoredSize(9, 6).double(), (1, 2, 9, 6), 2)
    assert plan.exact, str(plan)
    plan = describe(PatchGrid(8, 6).double(), (1, 2, 8, 6), 2)
    assert plan.exact, str(plan)
    plan = describe(PatchGrid(10, 6).double(), (1, 2, 10, 6), 2)  # bands of 5 rows: half a patch each
    assert not plan.exact and "whole number of windows" in plan.rows[-1].note, str(plan)
