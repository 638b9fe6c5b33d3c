"""The model side on a 2-D latitude x longitude domain grid, against one process (float64).

Every MPI test runs the grids the world size allows (1xN, Nx1, 2x2, 2x3, 3x2) over COMM_WORLD, with
blocks even in both dims, uneven in both, and mixed, built from the same seed on every rank. A layer
is compared on forward output (every block gathered), input gradient and every parameter gradient
after ``reduce_gradients``. Refusals must raise the same exception on every rank.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.layout import offsets  # noqa: E402
from credit_mpi.nn import ConversionError, convert_to_domain_parallel  # noqa: E402
from credit_mpi.partition import band_sizes  # noqa: E402

from .nn_reference import same_error_everywhere  # noqa: E402

ATOL = 1e-12


def grids(n: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def grid_managers(make_manager) -> list[tuple[tuple[int, int], credit_mpi.DomainParallelManager]]:
    """One manager over COMM_WORLD for every grid of the world size (collective, same order on every rank)."""
    size = MPI.COMM_WORLD.Get_size()
    return [(g, make_manager(size, domain_grid=g)) for g in grids(size)]


def sizes_for(grid: tuple[int, int], base: int) -> list[tuple[int, int]]:
    """(lat, lon) global sizes: even in both dims, uneven in both (where the grid allows), and mixed."""
    rows, cols = grid
    return [
        (rows * base, cols * base),
        (rows * base + max(rows - 1, 1), cols * base + max(cols - 1, 1)),
        (rows * base + max(rows - 1, 1), cols * base),
    ]


def run_grid(build, shape, manager, *, seed=0, steps=0, lr=0.05):
    """Forward + backward of ``build()`` on one process and on the manager's blocks (array_split layout).

    The loss is sum(out * weight) with a fixed random weight (each block: its window). Returns the pieces
    to compare; with ``steps`` > 0 that many SGD steps are taken on both and the last step's pieces and the
    final parameters are returned.
    """
    comm = manager.domain_group
    rows, cols = manager.domain_grid
    row, col = manager.domain_coords
    torch.manual_seed(seed)
    ref = build().double()
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
    gen = torch.Generator().manual_seed(seed + 1)
    xg = torch.randn(shape, generator=gen, dtype=torch.float64)
    hs, ws = band_sizes(shape[-2], rows, True), band_sizes(shape[-1], cols, True)
    y0, x0 = offsets(hs)[row], offsets(ws)[col]
    result = {}
    if steps:
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max(steps, 1)):
        xr = xg.clone().requires_grad_()
        out_ref = ref(xr)
        wg = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(seed + 2 + step), dtype=torch.float64)
        (out_ref * wg).sum().backward()
        xl = xg[..., y0 : y0 + hs[row], x0 : x0 + ws[col]].clone().requires_grad_()
        out = model(xl)
        blocks = comm.allgather(out.detach().numpy())
        oh = [blocks[i * cols].shape[-2] for i in range(rows)]
        ow = [blocks[j].shape[-1] for j in range(cols)]
        for r, b in enumerate(blocks):  # the output blocks tile a global field
            assert b.shape[-2:] == (oh[r // cols], ow[r % cols]), [b.shape for b in blocks]
        gathered = np.concatenate([np.concatenate(blocks[i * cols : (i + 1) * cols], -1) for i in range(rows)], -2)
        oy, ox = offsets(oh)[row], offsets(ow)[col]
        (out * wg[..., oy : oy + oh[row], ox : ox + ow[col]]).sum().backward()
        credit_mpi.reduce_gradients(model.parameters(), manager)
        result.update(
            out=torch.from_numpy(gathered), out_ref=out_ref.detach(), gx=xl.grad,
            gx_ref=xr.grad[..., y0 : y0 + hs[row], x0 : x0 + ws[col]],
            grads=[p.grad.clone() for p in model.parameters()], grads_ref=[p.grad.clone() for p in ref.parameters()],
        )
        if steps:
            for o in (opt_ref, opt):
                o.step()
                o.zero_grad()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    result["params_ref"] = [p.detach().clone() for p in ref.parameters()]
    return result


def assert_same(r, what):
    torch.testing.assert_close(r["out"], r["out_ref"], atol=ATOL, rtol=0, msg=lambda m: f"{what} forward: {m}")
    torch.testing.assert_close(r["gx"], r["gx_ref"], atol=ATOL, rtol=0, msg=lambda m: f"{what} input grad: {m}")
    assert len(r["grads"]) == len(r["grads_ref"]) > 0 or not r["grads_ref"]
    for k, (g, h) in enumerate(zip(r["grads"], r["grads_ref"], strict=True)):
        torch.testing.assert_close(g, h, atol=ATOL, rtol=0, msg=lambda m, k=k: f"{what} param grad {k}: {m}")
    for g, h in zip(r["params"], r["params_ref"], strict=True):
        torch.testing.assert_close(g, h, atol=ATOL, rtol=0)


# -- convolutions --------------------------------------------------------------------------------

CONVS = {
    "k3p1": lambda: nn.Conv2d(2, 3, 3, padding=1),
    "k3s2p1": lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
    "k5d2p4": lambda: nn.Conv2d(2, 3, 5, dilation=2, padding=4),
    "same": lambda: nn.Conv2d(2, 3, 5, padding="same"),
    "same4": lambda: nn.Conv2d(2, 3, 4, padding="same"),
    "valid": lambda: nn.Conv2d(2, 3, 3, padding="valid"),
    "circular_lon": lambda: nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="circular"),
    "reflect": lambda: nn.Conv2d(2, 3, 3, padding=2, padding_mode="reflect"),
    "replicate": lambda: nn.Conv2d(2, 3, (5, 3), padding=(2, 1), padding_mode="replicate"),
    "groups_k4s2p1": lambda: nn.Conv2d(4, 6, 4, stride=2, padding=1, groups=2, bias=False),
    "k3s_2x1_p1": lambda: nn.Conv2d(2, 3, 3, stride=(2, 1), padding=1),
    "k4s4": lambda: nn.Conv2d(2, 3, 4, stride=4),
    "convT_k2s2": lambda: nn.ConvTranspose2d(2, 3, 2, stride=2),
    "convT_k4s2p1": lambda: nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1),
    "convT_k4s2p0": lambda: nn.ConvTranspose2d(2, 3, 4, stride=2),
    "convT_k3s2p1op1": lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
    "convT_k3d2s3_groups": lambda: nn.ConvTranspose2d(2, 4, 3, stride=3, dilation=2, groups=2),
    "convT_k3p1": lambda: nn.ConvTranspose2d(2, 3, (3, 5), padding=(1, 2)),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv2d_on_grid(name, make_manager):
    channels = 4 if name.startswith("groups") else 2
    base = 8 if name == "k4s4" else 5
    for grid, manager in grid_managers(make_manager):
        for shape in sizes_for(grid, base):
            r = run_grid(CONVS[name], (2, channels, *shape), manager, seed=shape[0] * 31 + shape[1])
            assert_same(r, f"{name} on {grid} {shape}")


CONVS3D = {
    "k3p1": lambda: nn.Conv3d(2, 3, 3, padding=1),
    "k3s2p1_circular": lambda: nn.Conv3d(2, 3, 3, stride=(1, 2, 2), padding=1, padding_mode="circular"),
    "cube_embed": lambda: nn.Conv3d(2, 3, (2, 4, 4), stride=(2, 4, 4)),
    "convT3d_k2s2": lambda: nn.ConvTranspose3d(2, 3, (1, 3, 4), stride=(1, 2, 2), padding=(0, 1, 1), output_padding=(0, 1, 0)),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CONVS3D))
def test_conv3d_on_grid(name, make_manager):
    """Conv3d over (time, lat, lon): the last two dims are the grid's."""
    base = 8 if name == "cube_embed" else 5
    for grid, manager in grid_managers(make_manager):
        for shape in sizes_for(grid, base):
            r = run_grid(CONVS3D[name], (1, 2, 4, *shape), manager, seed=shape[0] * 7 + shape[1])
            assert_same(r, f"conv3d {name} on {grid} {shape}")


# -- norms ---------------------------------------------------------------------------------------

NORMS = {
    "groupnorm": lambda shape: nn.GroupNorm(2, 4),
    "instancenorm": lambda shape: nn.InstanceNorm2d(4, affine=True),
    "layernorm": lambda shape: nn.LayerNorm((4, *shape)),
    "layernorm_hw": lambda shape: nn.LayerNorm(shape),
    "batchnorm": lambda shape: nn.BatchNorm2d(4),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_on_grid(name, make_manager):
    """conv -> norm -> conv: the statistics are those of the whole field (every block of the grid)."""
    for grid, manager in grid_managers(make_manager):
        for shape in sizes_for(grid, 3):
            def build(shape=shape):
                return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), NORMS[name](shape), nn.Conv2d(4, 2, 3, padding=1))

            r = run_grid(build, (2, 3, *shape), manager, seed=shape[0] + 5 * shape[1])
            assert_same(r, f"{name} on {grid} {shape}")


@pytest.mark.mpi(min_size=1)
def test_batchnorm_running_stats_on_grid(make_manager):
    """BatchNorm's running statistics on a grid equal one process's (SyncBatchNorm semantics)."""
    for grid, manager in grid_managers(make_manager):
        shape = sizes_for(grid, 3)[1]
        torch.manual_seed(1)
        ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)).double()
        model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
        x = torch.randn(2, 2, *shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        rows, cols = grid
        hs, ws = band_sizes(shape[0], rows, True), band_sizes(shape[1], cols, True)
        (i, j) = manager.domain_coords
        y0, x0 = offsets(hs)[i], offsets(ws)[j]
        for _ in range(2):
            ref(x)
            model(x[..., y0 : y0 + hs[i], x0 : x0 + ws[j]])
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model[1], name), getattr(ref[1], name), atol=ATOL, rtol=0)


# -- a model -------------------------------------------------------------------------------------


class ConvNormConv(nn.Module):
    """conv (circular longitude) -> GroupNorm -> SiLU -> strided conv -> GroupNorm -> conv."""

    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular")
        self.norm1 = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(3, 6)
        self.out = nn.Conv2d(6, 2, 3, padding="same")

    def forward(self, x):
        h = torch.nn.functional.silu(self.norm1(self.inc(x)))
        return self.out(torch.tanh(self.norm2(self.down(h))))


@pytest.mark.mpi(min_size=1)
def test_converted_model_on_grid(make_manager):
    """A converted conv-GroupNorm-conv model: forward, input grad, every param grad, and 3 SGD steps."""
    for grid, manager in grid_managers(make_manager):
        for shape in sizes_for(grid, 6):
            r = run_grid(ConvNormConv, (2, 2, *shape), manager, seed=11, steps=3)
            assert_same(r, f"model on {grid} {shape}")


class FuXiBlock(nn.Module):
    """FuXi's down/up block: k3 s2 p1 conv, GroupNorm, SiLU, ConvTranspose k2 s2, skip connection."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(2, 6, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(3, 6)
        self.up = nn.ConvTranspose2d(6, 2, 2, stride=2)

    def forward(self, x):
        return self.up(torch.nn.functional.silu(self.norm(self.down(x)))) + x


@pytest.mark.mpi(min_size=1)
def test_fuxi_block_on_grid(make_manager):
    """Strided down + transposed up + skip: needs stride-aligned block offsets (even blocks of even size)."""
    for grid, manager in grid_managers(make_manager):
        for shape in ((grid[0] * 6, grid[1] * 6), (grid[0] * 4, grid[1] * 8)):
            r = run_grid(FuXiBlock, (2, 2, *shape), manager, seed=7, steps=2)
            assert_same(r, f"FuXi block on {grid} {shape}")


@pytest.mark.mpi(min_size=4)
def test_converted_model_on_2x2_grid(make_manager):
    """The brief's case: the model on a 2x2 grid of ranks 0-3 (the others sit out), uneven in both dims."""
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.Get_rank() < 4 else MPI.UNDEFINED, world.Get_rank())
    try:
        if comm != MPI.COMM_NULL:
            manager = make_manager(4, comm=comm, domain_grid=(2, 2))
            for shape in ((12, 16), (13, 15), (11, 18)):
                r = run_grid(ConvNormConv, (2, 2, *shape), manager, seed=3)
                assert_same(r, f"model on 2x2 {shape}")
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()


# -- refusals ------------------------------------------------------------------------------------


def _block(x, manager):
    rows, cols = manager.domain_grid
    i, j = manager.domain_coords
    hs, ws = band_sizes(x.shape[-2], rows, True), band_sizes(x.shape[-1], cols, True)
    return x[..., offsets(hs)[i] : offsets(hs)[i] + hs[i], offsets(ws)[j] : offsets(ws)[j] + ws[j]]


REFUSED_AT_CONVERSION = {
    "upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), "Upsample"),
    "maxpool": (lambda: nn.MaxPool2d(2), "MaxPool2d"),
    "avgpool": (lambda: nn.AvgPool2d(3, 2, 1), "AvgPool2d"),
    "adaptive": (lambda: nn.AdaptiveAvgPool2d(1), "AdaptiveAvgPool2d"),
    "conv1d": (lambda: nn.Conv1d(2, 2, 3), "Conv1d"),
    "circular_pad_lon": (lambda: nn.CircularPad2d((1, 1, 0, 0)), "CircularPad2d"),
    "linear": (lambda: nn.Linear(12, 12), "Linear"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(REFUSED_AT_CONVERSION))
def test_refused_at_conversion_on_grid(name, make_manager):
    """What has no exact rule on a grid of more than one column: ConversionError on every rank, naming the path."""
    build, kind = REFUSED_AT_CONVERSION[name]
    for grid, manager in grid_managers(make_manager):
        model = nn.Sequential(nn.Identity(), nn.Sequential(build()))
        if grid[1] == 1:  # latitude bands: the 1-D rules (a longitude pad / Linear on the last dim stay local)
            convert_to_domain_parallel(model, manager)
            continue
        message = same_error_everywhere(manager.domain_group, lambda m=model, g=manager: convert_to_domain_parallel(m, g), ConversionError)
        assert "1.0" in message and kind in message and f"{grid[0]}x{grid[1]}" in message, message


FORWARD_REFUSED = {
    "layernorm_lon": (lambda: nn.LayerNorm(12), None),
    "maxpool_adopted": (lambda: nn.MaxPool2d(2), "DomainParallelMaxPool2d"),
    "upsample_adopted": (lambda: nn.Upsample(scale_factor=2), "DomainParallelUpsample"),
    "avgpool_adopted": (lambda: nn.AvgPool2d(2), "DomainParallelAvgPool2d"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(FORWARD_REFUSED))
def test_refused_in_forward_on_grid(name, make_manager):
    """A layer that reaches forward on a grid without a rule (LayerNorm over longitude only; a band wrapper made by
    hand) raises ConversionError on every rank before any data moves, naming the layer and the grid."""
    from credit_mpi.nn import base, resample

    build, wrapper = FORWARD_REFUSED[name]
    for grid, manager in grid_managers(make_manager):
        if grid[1] == 1:
            continue
        if wrapper is None:
            model = convert_to_domain_parallel(nn.Sequential(nn.Identity(), build()).double(), manager)
        else:
            model = nn.Sequential(nn.Identity(), base.adopt(getattr(resample, wrapper), build(), manager, -2, "1"))
        x = _block(torch.randn(2, 2, 2 * grid[0] + 2, 12, dtype=torch.float64), manager)
        message = same_error_everywhere(manager.domain_group, lambda m=model, x=x: m(x), ConversionError)
        assert "1 (" in message and f"{grid[0]}x{grid[1]}" in message, message


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_grid(make_manager):
    """Bad layouts and arguments: the same exception on every rank, naming the layer."""
    for grid, manager in grid_managers(make_manager):
        if grid[1] == 1:
            continue
        comm = manager.domain_group
        rows, cols = grid
        # a Conv1d wrapper made by hand (the converter refuses it): one spatial dim, no rule on a grid
        from credit_mpi.nn import base, conv

        conv1d = base.adopt(conv.DomainParallelConv1d, nn.Conv1d(2, 2, 3, padding=1).double(), manager, -2, "c1")
        msg = same_error_everywhere(comm, lambda m=conv1d: m(torch.zeros(1, 2, 4, dtype=torch.float64)), ConversionError)
        assert "c1 (DomainParallelConv1d)" in msg
        # shard_dim must be the latitude (second-to-last) dim
        conv3 = convert_to_domain_parallel(nn.Conv3d(2, 2, 3, padding=1).double(), manager, shard_dim=-3)
        msg = same_error_everywhere(comm, lambda m=conv3: m(torch.zeros(1, 2, 4, 4, 4, dtype=torch.float64)), ValueError)
        assert "shard_dim" in msg
        conv = convert_to_domain_parallel(nn.Conv2d(2, 2, 5, padding=2).double(), manager)
        # blocks that do not tile: the last rank of grid row 0 holds more latitude rows than the others of its row
        bad = torch.zeros(1, 2, 5 if manager.domain_rank == cols - 1 else 4, 4, dtype=torch.float64)
        msg = same_error_everywhere(comm, lambda m=conv, b=bad: m(b), ValueError)
        assert "do not tile" in msg
        # a halo wider than a neighbouring block (k5 p2 needs 2 columns; blocks of 1 longitude)
        narrow = torch.zeros(1, 2, 4, 1, dtype=torch.float64)
        msg = same_error_everywhere(comm, lambda m=conv, b=narrow: m(b), ConversionError)
        assert "longitude" in msg and "<root>" in msg
        # mismatched dtypes across ranks
        odd = torch.zeros(1, 2, 4, 4, dtype=torch.float32 if manager.domain_rank == 0 else torch.float64)
        msg = same_error_everywhere(comm, lambda m=conv, b=odd: m(b), ValueError)
        assert "float32" in msg and "<root>" in msg


# -- the plan ------------------------------------------------------------------------------------


def test_describe_on_a_grid():
    """describe(..., domain_grid=(rows, cols)): one plan per grid dim, the grid's refusals, no MPI."""
    from credit_mpi.nn import GridPlan, Plan, describe

    plan = describe(ConvNormConv(), (1, 2, 13, 40), domain_grid=(2, 4))
    assert isinstance(plan, GridPlan) and plan.exact
    assert plan.latitude.rows == describe(ConvNormConv(), (1, 2, 13, 40), 2).rows  # latitude: 2 bands of dim -2
    assert plan.longitude.rows == describe(ConvNormConv(), (1, 2, 13, 40), 4, shard_dim=-1).rows
    down = [r for r in plan.longitude.rows if r.path == "down"][0]
    assert (down.rows_in, down.rows_out, down.bands_in, down.bands_out) == (40, 20, (10, 10, 10, 10), (5, 5, 5, 5))
    assert "2x4 latitude x longitude grid: runs exactly" in str(plan) and "longitude (4 block column(s)" in str(plan)
    # too narrow in longitude: a k5 p2 halo of 2 columns from blocks of 1
    narrow = describe(nn.Conv2d(2, 2, 5, padding=2), (1, 2, 8, 4), domain_grid=(1, 4))
    assert narrow.latitude.exact and not narrow.longitude.exact and not narrow.exact
    # an (n, 1) grid is latitude bands: the plain plan
    bands = describe(ConvNormConv(), (1, 2, 13, 40), domain_grid=(4, 1))
    assert isinstance(bands, Plan) and bands.domain_size == 4
    with pytest.raises(ConversionError, match=r"1 \(Upsample\).*2x2 latitude x longitude"):
        describe(nn.Sequential(nn.Conv2d(2, 2, 3), nn.Upsample(scale_factor=2)), (1, 2, 8, 8), domain_grid=(2, 2))
    with pytest.raises(ValueError, match="shard_dim must be -2"):
        describe(ConvNormConv(), (1, 2, 8, 8), shard_dim=-1, domain_grid=(2, 2))
    with pytest.raises(ValueError, match="pair of positive integers"):
        describe(ConvNormConv(), (1, 2, 8, 8), domain_grid=(2,))


@pytest.mark.mpi(min_size=4)
def test_describe_takes_the_managers_grid(make_manager):
    """describe(model, shape, manager=m) on a grid manager plans the grid (what the converted model will run)."""
    from credit_mpi.nn import GridPlan, describe

    for grid, manager in grid_managers(make_manager):
        model = convert_to_domain_parallel(ConvNormConv(), manager)
        plan = describe(model, (1, 2, 16, 24), manager=manager)
        assert isinstance(plan, GridPlan) == (grid[1] > 1), (grid, type(plan))
        assert plan.exact
