"""CrossFormer's long-distance attention across bands: the group layout (credit_mpi.ops.group_rows) at the module's boundary.

The attention groups the rows ``i * (H / window) + j`` (a stride across the whole latitude); the
window rule (credit_mpi.nn.judge.rows) moves the input bands to the group layout before its forward
and the output back after. Exact against one process (forward, input gradient, parameter gradients)
on even and uneven bands, uneven in groups too, wherever describe() says so (tests/verdict_reference.py).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
pytest.importorskip("einops")
pytest.importorskip("credit")

from torch import nn  # noqa: E402

from credit_mpi.nn import ConversionError, convert_to_domain_parallel, describe  # noqa: E402
from credit_mpi.ops.group_rows import from_groups, group_sizes, group_source, to_groups  # noqa: E402
from credit_mpi.ops.rows import plan_moves  # noqa: E402

from .credit_stand_ins import credit_models  # noqa: E402
from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import bands_of, same_error_everywhere  # noqa: E402
from .test_windows import check_move, raised_everywhere  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

crossformer, _ = credit_models()


def long_attention(window=2):
    """A conv, then CREDIT's long-distance attention (its rows grouped at a stride of H / window)."""
    return lambda: nn.Sequential(nn.Conv2d(2, 8, 3, padding=1),
                                 crossformer.Attention(8, attn_type="long", window_size=window, dim_head=4))


def whole_crossformer(height, width, global_window, interp=False):
    """CREDIT's whole CrossFormer, small (as tests/test_credit_models.py), every parameter in the graph.

    ``interp``: its last ``F.interpolate(size=(image_height, image_width))``, a size stored for the whole
    field (refused on bands; the identity here, the output has that size already).
    """
    from .test_credit_models import EveryParameter

    return lambda: EveryParameter(crossformer.CrossFormer(
        image_height=height, image_width=width, frames=1, channels=1, surface_channels=1, input_only_channels=0,
        levels=2, dim=(4, 8, 16, 32), depth=(1, 1, 1, 1), dim_head=4, global_window_size=global_window,
        local_window_size=2, cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)),
        cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=False, interp=interp))


@pytest.mark.mpi(min_size=1)
def test_to_groups_places_every_group_window_major_and_back(world):
    """The move is the field's rows in group order (forward and gradient, bit for bit); there and back: the identity."""
    n = world.Get_size()
    for window, groups in ((2, 2 * n), (2, 2 * n + 1), (3, n + 2)):  # even, then uneven in groups
        height = window * groups
        for sizes in ([height // n + (r < height % n) for r in range(n)], [height] + [0] * (n - 1)):
            out_sizes = group_sizes(height, window, n)
            order = torch.as_tensor(group_source(height, window, n)(torch.arange(height).numpy()))
            check_move(world, sizes, out_sizes, lambda x, w=window: to_groups(x, 1, w, world),
                       lambda f, o=order: f[:, o])
            back = lambda x, w=window, s=sizes: from_groups(to_groups(x, 1, w, world), 1, w, s, world)  # noqa: E731
            check_move(world, sizes, sizes, back, lambda f: f * 1)


@pytest.mark.mpi(min_size=1)
def test_bad_group_moves_raise_on_every_rank(world):
    rank, n = world.Get_rank(), world.Get_size()
    x = torch.zeros(2, 3, 3, dtype=torch.float64)  # 3 n rows
    assert "not a multiple of the window" in raised_everywhere(world, lambda: to_groups(x, 1, 3 * n + 1, world))
    if n > 1:  # one group of 3 n rows: fewer than one a rank
        assert "fewer than 1 per rank" in raised_everywhere(world, lambda: to_groups(x, 1, 3 * n, world, least=1))
    assert "window must be >= 1" in raised_everywhere(world, lambda: to_groups(x, 1, 0, world))
    bad = "2" if rank == n - 1 else 2  # one rank's bad argument: every rank raises
    assert "window" in raised_everywhere(world, lambda: to_groups(x, 1, bad, world))
    assert "not the group layout" in raised_everywhere(world, lambda: from_groups(x, 1, 3, [3 * n + 1] + [0] * (n - 1), world))
    assert to_groups(x, 1, 3, world).shape == (2, 3, 3)  # still in step


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_long_attention_is_exact_on_even_and_uneven_bands(make_manager):
    """2 d groups (even bands of whole groups), 2 d + 1 (uneven in groups and in bands), d (one group a rank:
    a band of one row inside the forward, batch 1); fewer groups than ranks: refused by describe() and the run."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for groups, batch in ((2 * d, 2), (2 * d + 1, 1), (d, 1), (d - 1, 1)):
                if groups < 1:
                    continue
                plan = verdict_is_the_run("long_attention", long_attention(2), (batch, 2, 2 * groups, 4), manager)
                assert plan.exact == (groups >= d), str(plan)
                if groups < d:
                    assert "fewer than 1 per rank" in plan.rows[-1].note, str(plan)


class Residual(nn.Module):
    """A conv, then CREDIT's attention with its input added back (CrossFormer's Transformer: attn(x) + x)."""

    def __init__(self, attn_type):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.attn = crossformer.Attention(8, attn_type=attn_type, window_size=2, dim_head=4)

    def forward(self, x):
        x = self.conv(x)
        return self.attn(x) + x


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("attn_type", ["short", "long"])
def test_attention_plus_its_input_is_exact(attn_type, make_manager):
    """16 rows: on 3 ranks re-banded to whole windows [6, 4, 6] (describe() refused the add of the windows merged
    back to the input's bands: the run was exact); the long-distance one through the group layout."""
    with prefix_managers(make_manager) as managers:
        for _, manager in managers:
            plan = verdict_is_the_run(f"residual {attn_type}", lambda: Residual(attn_type), (1, 2, 16, 4), manager)
            assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
# "even_groups" (global window 2, 32 d rows) is tests/test_credit_models.py's crossformer_interp: the same model and
# input, interp=True only adding the final F.interpolate to the size it has (CI time: not run twice)
@pytest.mark.parametrize("case", ["window_3"])
def test_whole_crossformer_is_exact(case, make_manager):
    """The whole model on d = world size bands (and 1): its long-distance attention (global window 2 at the
    first stage: 32 d rows, even bands of whole groups; window 3: 96 x 96, 16 groups, uneven on 3 ranks)."""
    world = MPI.COMM_WORLD.Get_size()
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d not in (1, world) or (case == "window_3" and d > 3):
                continue  # each domain size once over the 1..4-rank jobs (96 rows: 3 windows at the deepest stage)
            height, width, window = (32 * d, 32, (2, 1, 1, 1)) if case == "even_groups" else (96, 96, (3, 1, 1, 1))
            plan = verdict_is_the_run(f"crossformer {case}", whole_crossformer(height, width, window),
                                      (1, 3, 1, height, width), manager, seed=5)
            assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=2)
def test_a_height_that_is_not_whole_groups_is_refused_on_every_rank(make_manager):
    """H = 4 d + 1 rows, windows of 2 (one process's einops raises too): describe() and every rank refuse it."""
    manager = make_manager(MPI.COMM_WORLD.Get_size())
    height = 4 * manager.domain_parallel_size + 1
    plan = describe(long_attention(2)().double(), (1, 2, height, 4), manager.domain_parallel_size)
    assert not plan.exact and "not a multiple of the window 2" in plan.rows[-1].note, str(plan)
    start, stop = bands_of(height, manager)
    model = convert_to_domain_parallel(long_attention(2)().double(), manager)
    x = torch.randn(1, 2, height, 4, dtype=torch.float64)[:, :, start:stop]
    message = same_error_everywhere(manager.domain_group, lambda: model(x), ConversionError)
    assert plan.rows[-1].path in message and "long-distance attention" in message, message
    assert f"{height} rows are not a multiple of the window 2" in message, message
    band = torch.randn(1, 2, 2, 4, dtype=torch.float64) + manager.domain_rank  # each rank its own band (not one field)
    assert model(band).shape == (1, 8, 2, 4)  # still in step


def test_the_group_move_sends_what_the_theory_says():
    """Per rank, the move sends the rows of its band outside its own groups (at most its band, H / P rows) and
    the move back sends the rows of its groups outside its band (at most w h_r rows): with the backward,
    four moves of at most N d / P elements a rank (the all-to-all's ~4 N d / P)."""
    for n, window, groups in ((2, 2, 8), (4, 2, 8), (3, 3, 16), (4, 3, 13)):
        height = window * groups
        sizes = tuple(height // n + (r < height % n) for r in range(n))
        per = [groups // n + (r < groups % n) for r in range(n)]
        for rank in range(n):
            start, first = sum(sizes[:rank]), sum(per[:rank])
            band = set(range(start, start + sizes[rank]))
            mine = {i1 * groups + j for i1 in range(window) for j in range(first, first + per[rank])}
            moves = plan_moves(sizes, group_sizes(height, window, n), group_source(height, window, n), rank)
            assert moves.sent_rows(rank) == len(band - mine) <= sizes[rank]
            assert moves.inverse().sent_rows(rank) == len(mine - band) <= window * per[rank]
    # P = 4, windows of 2, 8 groups, even bands of 4 rows: the outer ranks keep half their band, the inner none
    sent = [plan_moves((4,) * 4, group_sizes(16, 2, 4), group_source(16, 2, 4), r).sent_rows(r) for r in range(4)]
    assert sent == [2, 4, 4, 2]
