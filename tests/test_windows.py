"""Shifted and re-banded windows: the cyclic shift across bands (``torch.roll``), re-banding to whole windows, Swin-style attention.

Every collective is exact against one process (forward and gradient, float64) on even and uneven
bands; every model case is exact wherever ``describe()`` says so and refused on every rank where it
does not (tests/verdict_reference.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from credit_mpi.nn import describe  # noqa: E402
from credit_mpi.ops.reband import reband, whole_windows  # noqa: E402
from credit_mpi.ops.rows import plan_moves, roll_along  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


def raised_everywhere(world, fn):
    """Call ``fn`` on every rank; every rank raised, an exception of the same type (returns its message)."""
    try:
        fn()
        got = None
    except Exception as exc:  # noqa: BLE001 - compared below
        got = exc
    names = world.allgather(None if got is None else type(got).__name__)
    assert None not in names and len(set(names)) == 1, names
    return str(got)


def layouts(n):
    """Band sizes on ``n`` ranks: even, uneven, one empty band (n > 1)."""
    out = [[3] * n, [3 + (r % 2) for r in range(n)]]
    if n > 1:
        out.append([0] + [4] * (n - 1))
    return out


def field(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, sum(sizes), 3, dtype=torch.float64, generator=g)


def mine(whole, sizes, rank):
    start = sum(sizes[:rank])
    return whole[:, start : start + sizes[rank]]


def check_move(world, sizes_in, sizes_out, fn, ref):
    """``fn(band)`` on every rank equals this rank's band (layout ``sizes_out``) of ``ref(field)``; so does the gradient."""
    rank = world.Get_rank()
    whole = field(sizes_in).requires_grad_()
    weight = field(sizes_out, seed=1)
    x = mine(whole.detach(), sizes_in, rank).clone().requires_grad_()
    y = fn(x)
    expected = ref(whole)
    assert torch.equal(y, mine(expected.detach(), sizes_out, rank))
    (y * mine(weight, sizes_out, rank)).sum().backward()
    (expected * weight).sum().backward()
    assert torch.equal(x.grad, mine(whole.grad, sizes_in, rank))


@pytest.mark.mpi
def test_roll_along_is_torch_roll_of_the_field(world):
    n = world.Get_size()
    for sizes in layouts(n):
        total = sum(sizes)
        for shift in (1, -1, 4, -5, total + 2, 0):  # beyond one band: rows from several ranks
            check_move(world, sizes, sizes, lambda x, s=shift: roll_along(x, s, 1, world),
                       lambda f, s=shift: torch.roll(f, s, 1))


@pytest.mark.mpi
def test_reband_moves_rows_to_the_target_layout_and_back(world):
    n = world.Get_size()
    for sizes in layouts(n):
        target = whole_windows(sizes, 2)
        assert sum(target) == sum(sizes) and all(sum(target[: r + 1]) % 2 == 0 for r in range(n - 1))
        check_move(world, sizes, target, lambda x: reband(x, 1, world, window=2), lambda f: f * 1)
        back = list(reversed(sizes)) if n > 1 else sizes
        check_move(world, sizes, back, lambda x, b=back: reband(x, 1, world, sizes=b), lambda f: f * 1)


def test_whole_windows_rounds_every_band_end():
    assert whole_windows([3, 3, 2], 2) == (4, 2, 2)
    assert whole_windows([3, 3, 3], 4) == (4, 4, 1)
    assert whole_windows([1, 1, 7], 4) == (0, 4, 5)  # ends 1, 2, 9: 1 rounds down, 2 (a tie) up
    assert whole_windows([1, 0, 8], 4) == (0, 0, 9)  # a band left with no rows
    assert whole_windows([4, 4], 4) == (4, 4)
    with pytest.raises(ValueError, match="at least one row"):
        whole_windows([2, 2], 0)


@pytest.mark.mpi
def test_bad_moves_raise_on_every_rank(world):
    rank, n = world.Get_rank(), world.Get_size()
    x = field([3] * n)[:, :3]
    assert "not a layout" in raised_everywhere(world, lambda: reband(x, 1, world, sizes=[3] * n + [1]))
    shift = "1" if rank == n - 1 else 1  # one rank's bad argument: every rank raises
    assert "shift must be an int" in raised_everywhere(world, lambda: roll_along(x, shift, 1, world))
    if n > 1:  # ranks that disagree on the shift
        assert "roll_along" in raised_everywhere(world, lambda: roll_along(x, rank, 1, world))
    assert roll_along(x, 1, 1, world).shape == x.shape  # still in step


# -- models: torch.roll across bands, Swin-style shifted windows --------------------------------------


class Rolled(nn.Module):
    """A conv, ``torch.roll`` (of the sharded dim and/or others), a conv."""

    def __init__(self, shifts, dims):
        super().__init__()
        self.a, self.b, self.shifts, self.dims = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1), shifts, dims

    def forward(self, x):
        y = self.a(x)
        y = torch.roll(y, self.shifts) if self.dims is None else torch.roll(y, self.shifts, self.dims)
        return self.b(y) + x


def region_mask(labels, n):
    """Swin's mask from region labels of every window's tokens ``(windows, n)``: -100 between regions, 0 within."""
    diff = labels.reshape(-1, n).unsqueeze(1) - labels.reshape(-1, n).unsqueeze(2)
    return diff.masked_fill(diff != 0, -100.0)


class WindowAttention(nn.Module):
    """Attention within each window, the windows in the batch dim (Swin's WindowAttention: it has a window_size too)."""

    def __init__(self, c, window):
        super().__init__()
        self.qkv, self.window_size = nn.Linear(c, 3 * c), (window, window)

    def forward(self, t):  # (windows, s s, c)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        return (q @ k.transpose(-1, -2) / t.shape[-1] ** 0.5).softmax(dim=-1) @ v


class SwinStyle(nn.Module):
    """Shifted-window attention as Swin writes it: roll by -shift, window partition, attention, reverse, roll back.

    ``mask``: None; ``"buffer"``: Swin's own, built in __init__ from the global image size (one mask per
    window of the whole field, broadcast against the band's windows: the band's windows of it); ``"input"``: built in
    the forward from region labels that are a band like the input (channel 0's sign): exact.
    """

    def __init__(self, c=4, window=2, shift=1, mask=None, image=None, attention=False):
        super().__init__()
        self.window_size, self.shift, self.mask = window, shift, mask
        self.proj = nn.Linear(c, c)
        self.attention = WindowAttention(c, window) if attention else None
        self.qkv = None if attention else nn.Linear(c, 3 * c)
        if mask == "buffer":
            h, w = image
            labels = torch.zeros(1, h, w, 1)
            for i, rows in enumerate((slice(0, -window), slice(-window, -shift), slice(-shift, None))):
                labels[:, rows] = i
            self.register_buffer("attn_mask", region_mask(self.partition(labels), window * window))

    def partition(self, t):  # b h w c -> (b h/s w/s) (s s) c
        b, h, w, c = t.shape
        s = self.window_size
        return t.reshape(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)

    def reverse(self, t, b, h, w):
        s = self.window_size
        return t.reshape(b, h // s, w // s, s, s, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)

    def forward(self, x):
        b, c, h, w = x.shape
        n = self.window_size**2
        t = torch.roll(x.permute(0, 2, 3, 1), (-self.shift, -self.shift), dims=(1, 2))
        if self.attention is not None:
            o = self.reverse(self.attention(self.partition(t)), b, h, w)
            return self.proj(torch.roll(o, (self.shift, self.shift), dims=(1, 2))).permute(0, 3, 1, 2) + x
        q, k, v = self.qkv(self.partition(t)).chunk(3, dim=-1)
        a = q @ k.transpose(-1, -2) / c**0.5
        if self.mask == "buffer":
            a = (a.view(b, -1, n, n) + self.attn_mask).view(-1, n, n)
        elif self.mask == "input":
            a = a + region_mask(self.partition((t[..., :1] > 0).to(t.dtype)), n)
        o = self.reverse(a.softmax(dim=-1) @ v, b, h, w)
        o = torch.roll(o, (self.shift, self.shift), dims=(1, 2))
        return self.proj(o).permute(0, 3, 1, 2) + x


def swin(window=2, **kw):
    return lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), SwinStyle(4, window, **kw))


CASES = {
    # name: (build, channels, width, row unit of the heights)
    "roll_one_row": (lambda: Rolled(1, 2), 2, 3, 1),
    "roll_beyond_a_band": (lambda: Rolled(-7, -2), 2, 3, 1),
    "roll_two_dims": (lambda: Rolled((5, 1), (2, 3)), 2, 3, 1),
    "roll_longitude": (lambda: Rolled(2, 3), 2, 3, 1),
    "roll_flattened": (lambda: Rolled(3, None), 2, 3, 1),
    "windows": (swin(2, shift=0), 2, 4, 2),
    "shifted_windows": (swin(2), 2, 4, 2),
    "shifted_windows_3": (swin(3), 2, 6, 3),
    "shifted_windows_input_mask": (swin(2, mask="input"), 2, 4, 2),
    "shifted_window_attention_module": (swin(2, attention=True), 2, 4, 2),  # windows in the batch: not re-banded again
}
NEVER_EXACT = {"roll_flattened"}


def band_cases(make_manager, unit):
    """``(d, manager, h)`` on 1..W ranks: a height of even bands of whole windows (of ``unit`` rows), then one of
    uneven bands that are not whole windows (collective over COMM_WORLD, like prefix_managers)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            yield from ((d, manager, h) for h in (4 * unit * d, 4 * unit * d + unit * (d > 1)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("name", sorted(CASES))
def test_verdict_is_what_the_run_does(name, make_manager):
    """Even bands, then uneven ones that are not whole windows (re-banded to whole windows and back)."""
    build, c, width, unit = CASES[name]
    for d, manager, h in band_cases(make_manager, unit):
        plan = verdict_is_the_run(name, build, (2, c, h, width), manager)
        assert plan.exact != (d > 1 and name in NEVER_EXACT), str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_a_mask_of_the_global_size_gives_the_bands_windows(make_manager):
    """Swin's mask buffer (one per window of the whole field, built in __init__) against a band's windows: the band's
    windows of it (credit_mpi.nn.judge.field_values, a partner of the field's size cut to the band's), exact."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            h = 8 * d
            build = swin(2, mask="buffer", image=(h, 4))
            plan = verdict_is_the_run("swin_buffer_mask", build, (1, 2, h, 4), manager)
            assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
def test_a_band_left_with_one_window_is_exact(make_manager):
    """4 d - 2 rows: re-banded to whole windows of 2, the last band holds one window; the window count is read
    from the band (an Extent, credit_mpi.nn.judge), so one window is told apart from whole rows: exact."""
    manager = make_manager()
    h = 4 * manager.domain_parallel_size - 2
    plan = verdict_is_the_run("one_window", swin(2), (1, 2, h, 4), manager, same_op=False)
    assert plan.exact, str(plan)


class Flipped(nn.Module):
    """A conv, ``torch.flip`` of the sharded dim (and the longitude), a conv: the field upside down (a hemisphere swap)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return self.b(torch.flip(self.a(x), (2, 3))) + torch.flipud(x.transpose(0, 2)).transpose(0, 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_flip_along_the_sharded_dim_is_exact(make_manager):
    """torch.flip / flipud of the sharded dim: the row map flip_along (one Alltoallv, the move back in backward)."""
    for d, manager, h in band_cases(make_manager, 1):
        plan = verdict_is_the_run("flip", Flipped, (2, 2, h, 3), manager)
        moves = [row for row in plan.rows if row.kind == "flip_along()"]
        assert plan.exact and len(moves) == (2 if d > 1 else 0), str(plan)
        assert all("reversed" in row.note and row.bands_out == row.bands_in for row in moves), str(plan)


def test_describe_names_the_refused_roll():
    plan = describe(Rolled(3, None).double(), (1, 2, 8, 3), 2)
    assert not plan.exact and plan.rows[-1].kind == "roll()" and "flattened" in plan.rows[-1].note, str(plan)


class Neighbourhood(nn.Module):
    """Neighbourhood attention: every pixel attends to its k x k neighbours (``F.unfold``, or ``F.pad`` + ``Tensor.unfold``)."""

    def __init__(self, c=4, k=3, pad_unfold=False):
        super().__init__()
        self.qkv, self.k, self.pad_unfold = nn.Conv2d(c, 3 * c, 1), k, pad_unfold

    def neighbours(self, t):  # (b, c, h, w) -> (b, c, k k, h w)
        b, c, h, w = t.shape
        k = self.k
        if self.pad_unfold:
            t = nn.functional.pad(t, (k // 2,) * 4).unfold(2, k, 1).unfold(3, k, 1)  # b c h w k k
            return t.reshape(b, c, h * w, k * k).transpose(-1, -2)
        return nn.functional.unfold(t, k, padding=k // 2).reshape(b, c, k * k, h * w)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=1)
        a = (q.flatten(2).unsqueeze(2) * self.neighbours(k)).sum(1, keepdim=True).softmax(dim=2)
        return (a * self.neighbours(v)).sum(2).reshape(b, c, h, w) + x


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("pad_unfold", [False, True])
def test_neighbourhood_attention_takes_the_halo_or_is_refused(pad_unfold, make_manager):
    """F.unfold with "same" padding: the neighbours' rows from the halo, exact on even and uneven bands;
    F.pad + Tensor.unfold along the sharded dim: refused at the unfold, in describe() and on every rank."""
    build = lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Neighbourhood(4, 3, pad_unfold))  # noqa: E731
    for d, manager, h in band_cases(make_manager, 1):
        plan = verdict_is_the_run("neighbourhood", build, (1, 2, h, 4), manager)
        assert plan.exact == (d == 1 or not pad_unfold), str(plan)
        if not plan.exact:
            assert plan.rows[-1].kind == "unfold()", str(plan)


def test_the_moves_send_what_the_theory_says():
    """Per rank: a roll by s < a band sends s rows on (even bands); whole windows move only the straddled rows."""
    n, band = 4, 5
    sizes = (band,) * n
    for rank in range(n):
        roll = plan_moves(sizes, sizes, lambda j: (j - 2) % (n * band), rank)
        assert roll.sent_rows(rank) == 2 and len(roll.send[(rank + 1) % n]) == 2
        target = whole_windows(sizes, 2)  # ends 5, 10, 15, 20 -> 6, 10, 16, 20
        start, new_start = band * rank, sum(target[:rank])
        stays = max(0, min(start + band, new_start + target[rank]) - max(start, new_start))
        assert plan_moves(sizes, target, lambda j: j, rank).sent_rows(rank) == band - stays == rank % 2  # odd ranks send their first row back
