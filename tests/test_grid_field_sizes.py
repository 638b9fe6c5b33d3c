"""On a latitude x longitude grid the sizes a converted forward reads are the field's along both grid dims (issue 37).

Before, ``x.shape`` of a block gave the block's rows and columns: a mean written by hand divided the field's sum by
the block's count, a branch on ``H`` or ``W`` went the block's way, a scale from ``h * w`` was the block's, and a size
stored for the field failed its assert, while describe() (which sees the field) said exact. Each case here goes through
:func:`~tests.test_grid_longitude.grid_verdict_is_the_run` on every grid of the world size (2x2, 1x4 and 4x1 on 4 ranks;
1xN and Nx1 on 2 and 3), even and uneven blocks: exact against one process (forward, input and parameter gradients),
or the same ConversionError on every rank, describe() agreeing.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from credit_mpi.nn import describe  # noqa: E402
from credit_mpi.partition import band_sizes  # noqa: E402

from .test_grid_longitude import Then, grid_verdict_is_the_run  # noqa: E402
from .test_nn_grid import grid_managers  # noqa: E402

WS = 2  # a window of the longitude


def _mean_hw(x):
    _, _, h, w = x.shape
    return x - x.sum((2, 3), keepdim=True) / (h * w)


def _mean_lon(x):
    w = x.shape[-1]
    return x - x.sum(-1, keepdim=True) / w + x.sum(-1, keepdim=True) / x.size(3) ** 2


def _mean_numel(x):
    b, c, h, _ = x.shape
    return x * x.numel() ** -0.5 - x.sum(-1, keepdim=True) * (b * c * h) / x.numel() + len(x[0, 0]) / x.numel()


def _branch(x):
    _, _, h, w = x.shape
    y = x * 2 if h > 6 else x * 3  # a block of a grid has at most 5 rows and 5 columns here; every field more than 6
    y = y + 1 if w > 6 else y - 1
    return y * (0.5 if h % 2 else 1.5) + max(0, 12 - w)


def _scale(x):
    h, w = x.shape[-2:]
    return x * (h * w) ** -0.5 + x.sum(-1, keepdim=True) / (h * w)


def _windows(x):
    """A longitude split into windows of WS columns (every block a whole number of them), each window's own mean and
    the mean over the windows by hand (the field's window count)."""
    b, c, h, w = x.shape
    t = x.view(b, c, h, w // WS, WS)
    t = t - t.mean(-1, keepdim=True) + t.sum(3, keepdim=True) / t.shape[3]
    return t.reshape(b, c, h, w)


def _pad_crop(x):
    """Padded to a multiple of WS columns (the last block pads), windowed, cropped back to the field's columns."""
    b, c, h, w = x.shape
    pad = (WS - w % WS) % WS
    y = F.pad(x, (0, pad))
    _, _, hp, wp = y.shape
    t = y.view(b, c, hp, wp // WS, WS)
    t = t * t.sum(-1, keepdim=True)
    y = t.reshape(b, c, hp, wp)
    return y[..., :w] + y.narrow(-1, 0, w) * 0.5


class StoredSize(nn.Module):
    """A size stored for the whole field (``img_size``), asserted against the input's, and a mean by ``numel``."""

    def __init__(self, img_size) -> None:
        super().__init__()
        self.img_size = tuple(img_size)
        self.inc, self.out = nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), nn.Conv2d(2, 2, 1)

    def forward(self, x):
        x = self.inc(x)
        assert x.shape[-2:] == self.img_size, (tuple(x.shape), self.img_size)
        assert x.size(-1) == self.img_size[1] and len(x[0, 0]) == self.img_size[0]
        return self.out(x - x.sum(-1, keepdim=True) / self.img_size[1] + x.numel() / (self.img_size[0] * 100))


CASES = {
    "mean_lon": lambda shape: Then(_mean_lon),
    "mean_numel": lambda shape: Then(_mean_numel),
    "branch_hw": lambda shape: Then(_branch),
    "scale_hw": lambda shape: Then(_scale),
    "stored_img_size": lambda shape: StoredSize(shape[-2:]),
    "windows_lon": lambda shape: Then(_windows),
    "pad_crop_lon": lambda shape: Then(_pad_crop),
}


# a sum over the latitude has no rule on a grid of more than one column yet (a sum over a grid column): refused on
# every rank, describe() agreeing; on latitude bands (N x 1) exact
REFUSED_ON_GRID = {"mean_hw": lambda shape: Then(_mean_hw)}


def _shapes(grid):
    rows, cols = grid
    # fields of more than 6 rows and columns; blocks of at most 5 where the grid splits the dim in two or more
    return [(2, 2, 4 * rows + (rows > 1), 4 * cols), (2, 2, 4 * rows + 3, 4 * cols + 3)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(CASES))
def test_field_sizes_on_grid(name, make_manager):
    """Each case: describe()'s verdict is the run's; exact wherever every block holds whole windows."""
    for grid, manager in grid_managers(make_manager):
        for shape in _shapes(grid):
            if name == "windows_lon":  # the field a whole number of windows; its blocks too where the columns allow
                shape = (*shape[:3], shape[3] + shape[3] % WS)
            build = lambda shape=shape: CASES[name](shape)  # noqa: E731
            plan = grid_verdict_is_the_run(name, build, shape, manager)
            widths = band_sizes(shape[-1], grid[1], True)
            widths[-1] += (WS - shape[-1] % WS) % WS if name == "pad_crop_lon" else 0  # the last block pads
            whole = all(w % WS == 0 for w in widths)
            assert plan.exact == (whole or name not in ("windows_lon", "pad_crop_lon")), (name, grid, shape, str(plan))


@pytest.mark.mpi(min_size=2)
def test_mean_over_both_dims_on_grid(make_manager):
    """A mean by hand over (H, W): the field's count on latitude bands; refused on every rank on a grid (the sum over
    the latitude), describe() agreeing."""
    for grid, manager in grid_managers(make_manager):
        for shape in _shapes(grid):
            plan = grid_verdict_is_the_run("mean_hw", lambda shape=shape: REFUSED_ON_GRID["mean_hw"](shape), shape, manager)
            assert plan.exact == (grid[1] == 1), (grid, str(plan))


def test_describe_sees_field_sizes_on_grid():
    """The dry run alone (no MPI): each case exact on a 2x2 grid of a field of whole windows per block."""
    for name, make in CASES.items():
        shape = (1, 2, 10, 12)
        assert describe(make(shape).double(), shape, domain_grid=(2, 2)).exact, name


@pytest.mark.mpi(min_size=2)
def test_grid_size_reads_are_quiet_on_a_repeated_forward(make_manager, monkeypatch):
    """On a grid a size read agrees the block layout along its dim (over the whole domain); a forward with the last one's inputs skips every such agreement on every rank, as on bands."""
    import copy

    import credit_mpi.validation as validation
    from credit_mpi.layout import offsets
    from credit_mpi.nn import convert_to_domain_parallel

    seen = []
    agree_cached = validation.agree_cached

    def counted(comm, kind, key, *args, **kwargs):
        seen.append(key)
        return agree_cached(comm, kind, key, *args, **kwargs)

    for grid, manager in grid_managers(make_manager):
        if grid[1] == 1:
            continue
        torch.manual_seed(3)
        ref = Then(_branch).double()
        model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
        shape = _shapes(grid)[1]
        x = torch.randn(shape, dtype=torch.float64)
        out = ref(x)
        hs, ws = band_sizes(shape[-2], grid[0], True), band_sizes(shape[-1], grid[1], True)
        (row, col) = manager.domain_coords
        y0, x0 = offsets(hs)[row], offsets(ws)[col]
        window = (..., slice(y0, y0 + hs[row]), slice(x0, x0 + ws[col]))
        reads = []
        with monkeypatch.context() as m:
            m.setattr(validation, "agree_cached", counted)
            for _ in range(3):
                seen.clear()
                torch.testing.assert_close(model(x[window]), out[window], atol=1e-12, rtol=0)
                reads.append(sum("the field's size" in str(k) for k in seen))
        assert reads[0] == 2 and reads[1:] == [0, 0], (grid, reads)  # H, then W: one agreement each, then none
