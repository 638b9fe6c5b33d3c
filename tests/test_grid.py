"""The 2-D latitude x longitude domain grid: manager, blocks, 2-D halo, autograd, bad input.

Every MPI test runs every grid the world size allows (1xN, Nx1, 2x2, 2x3,
3x2, ...), even and uneven blocks in both dims, against a single-process
reference built from the same seed on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi.grid import check_grid, grid_neighbors, opposite_pieces
from credit_mpi.layout import offsets
from credit_mpi.partition import band_sizes

from .halo_reference import pad_numpy

LON_MODES = {"zero": "constant", "periodic": "wrap", "reflect": "reflect"}
LAT = ("zero", "periodic", "reflect", "earth")
LON = ("periodic", "zero", "reflect")
WIDTHS = ((1, 1), (2, 1), (1, 2))


def grids(n: int) -> list[tuple[int, int]]:
    return [(r, n // r) for r in range(1, n + 1) if n % r == 0]


def sizes_for(grid: tuple[int, int]) -> list[tuple[int, int]]:
    """(lat, lon) global sizes: even in both dims, uneven in both (where the grid allows), and mixed."""
    rows, cols = grid
    out = [(rows * 3, cols * 4), (rows * 3 + (rows > 1), cols * 4 + 2 * (cols > 2) + (cols == 2))]
    out.append((rows * 4 + (rows > 1), cols * 3))  # uneven latitude, even longitude (odd for cols odd)
    return out


def pad2d(g: np.ndarray, hy: int, hx: int, lat: str, lon: str) -> np.ndarray:
    """Single process: pad latitude (axis -2) first, then longitude (axis -1)."""
    p = pad_numpy(g, hy, g.ndim - 2, lat) if hy else g
    return np.pad(p, [(0, 0)] * (g.ndim - 1) + [(hx, hx)], mode=LON_MODES[lon])


def window(a, grid, coords, shape, hy=0, hx=0):
    """This block's window of the (padded) global ``a``: the block plus hy rows / hx columns each side."""
    hs, ws = band_sizes(shape[0], grid[0], True), band_sizes(shape[1], grid[1], True)
    i, j = coords
    y0, x0 = offsets(hs)[i], offsets(ws)[j]
    return a[..., y0 : y0 + hs[i] + 2 * hy, x0 : x0 + ws[j] + 2 * hx]


def raises_everywhere(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


# --------------------------------------------------------------------------- serial: index arithmetic


def test_check_grid():
    assert check_grid(None, 4) is None
    assert check_grid((2, 3), 6) == (2, 3)
    with pytest.raises(ValueError, match=r"rows \* cols must equal domain_parallel_size=4.*1x4, 2x2, 4x1"):
        check_grid((3, 2), 4)
    for bad in ((2,), (2, 2, 1), "2x2", (2.0, 2), (True, 4), (0, 4)):
        with pytest.raises(ValueError, match="domain_grid"):
            check_grid(bad, 4)


def test_neighbors():
    nb = grid_neighbors(0, (2, 3))
    assert nb == {"north": None, "south": 3, "west": 2, "east": 1, "northwest": None, "northeast": None,
                  "southwest": 5, "southeast": 4}
    assert grid_neighbors(4, (2, 3))["northeast"] == 2
    assert grid_neighbors(0, (1, 1))["east"] == 0  # one column: its own east and west


@pytest.mark.parametrize("lon", [2, 4, 6, 10, 12, 14, 36])
@pytest.mark.parametrize("cols", [1, 2, 3, 4, 5, 7])
def test_opposite_pieces(lon, cols):
    if cols > lon:
        pytest.skip("more columns than longitudes")
    widths = band_sizes(lon, cols, True)
    starts = offsets(widths)
    owner = [(c, x - starts[c]) for c in range(cols) for x in range(starts[c], starts[c] + widths[c])]
    for col in range(cols):
        got = [None] * widths[col]
        pairs = set()
        for other, mine, theirs, length in opposite_pieces(col, widths):
            assert (other, col) not in pairs or cols == 1  # at most one message per pair of ranks
            pairs.add((other, col))
            for k in range(length):
                got[mine + k] = (other, theirs + k)
        want = [owner[(starts[col] + k + lon // 2) % lon] for k in range(widths[col])]
        assert got == want
        # symmetric: every piece I receive is one the other column sends to me
        for other, mine, theirs, length in opposite_pieces(col, widths):
            assert (col, theirs, mine, length) in opposite_pieces(other, widths)
    with pytest.raises(ValueError, match="even number"):
        opposite_pieces(0, band_sizes(lon + 1, 1, True))


@pytest.mark.parametrize("lat", LAT)
@pytest.mark.parametrize("lon", LON)
@pytest.mark.parametrize("hy,hx", WIDTHS)
def test_halo_one_process(lat, lon, hy, hx, rng):
    g = rng.standard_normal((2, 3, 5, 8))
    out = credit_mpi.halo_exchange(g, (hy, hx), (-2, -1), boundary=(lat, lon))
    np.testing.assert_array_equal(out, pad2d(g, hy, hx, lat, lon))


def test_single_boundary_means_periodic_longitude(rng):
    g = rng.standard_normal((1, 1, 4, 6))
    np.testing.assert_array_equal(credit_mpi.halo_exchange(g, 1, (-2, -1), boundary="earth"), pad2d(g, 1, 1, "earth", "periodic"))


def test_bad_boundaries_and_widths(rng):
    g = rng.standard_normal((1, 1, 4, 6))
    with pytest.raises(ValueError, match="unknown longitude boundary 'earth'.*latitude edge"):
        credit_mpi.halo_exchange(g, (1, 1), (-2, -1), boundary=("zero", "earth"))
    with pytest.raises(ValueError, match="unknown latitude boundary 'wrap'"):
        credit_mpi.halo_exchange(g, (1, 1), (-2, -1), boundary=("wrap", "zero"))
    with pytest.raises(ValueError, match=r"halo_width\[1\] \(longitude\) must be >= 0"):
        credit_mpi.halo_exchange(g, (1, -1), (-2, -1))
    with pytest.raises(ValueError, match="pair"):
        credit_mpi.halo_exchange(g, (1, 1, 1), (-2, -1))
    with pytest.raises(ValueError, match="same axis twice"):
        credit_mpi.halo_exchange(g, (1, 1), (-1, 3))
    with pytest.raises(ValueError, match="must be even, got 5"):
        credit_mpi.halo_exchange(rng.standard_normal((1, 4, 5)), (1, 1), (-2, -1), boundary="earth")
    # transport="torch" runs on a grid since issue 23 (here, with no manager, it pads as "mpi" does); a bad name is refused
    via_torch = credit_mpi.halo_exchange(g, (1, 1), (-2, -1), transport="torch")
    assert np.array_equal(via_torch, credit_mpi.halo_exchange(g, (1, 1), (-2, -1)))
    with pytest.raises(ValueError, match="transport must be 'mpi' or 'torch', got 'nccl'"):
        credit_mpi.halo_exchange(g, (1, 1), (-2, -1), transport="nccl")


# --------------------------------------------------------------------------- MPI: the manager


@pytest.mark.mpi(min_size=1)
def test_manager_grid(make_manager, world):
    n = world.Get_size()
    plain = make_manager(n)
    assert plain.domain_grid == (n, 1) and plain.domain_cart is None
    assert plain.domain_coords == (plain.domain_rank, 0)
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        assert m.domain_grid == grid
        cart = m.domain_cart
        assert cart.Get_topo() == ([grid[0], grid[1]], [False, True], list(m.domain_coords))
        assert cart.Get_rank() == m.domain_rank
        assert m.domain_coords == divmod(m.domain_rank, grid[1])
        nb = m.grid_neighbor_ranks()
        assert (nb["north"], nb["south"]) == tuple(None if r < 0 else r for r in cart.Shift(0, 1))
        assert (nb["west"], nb["east"]) == cart.Shift(1, 1)
        assert f"domain_grid={grid}" in repr(m)
    m = credit_mpi.initialize_domain_parallel(None, n, domain_grid=(1, n))
    assert credit_mpi.get_domain_parallel_manager().domain_grid == (1, n)
    credit_mpi.destroy_domain_parallel()
    assert m.freed


@pytest.mark.mpi(min_size=1)
def test_manager_bad_grid(make_manager, world):
    n = world.Get_size()
    raises_everywhere(ValueError, r"rows \* cols must equal domain_parallel_size", lambda: make_manager(n, domain_grid=(n + 1, 1)))
    if n > 1:  # ranks that pass different grids: the same error on every rank
        mine = (1, n) if world.Get_rank() else (n, 1)
        raises_everywhere(ValueError, "different arguments.*domain_grid", lambda: make_manager(n, domain_grid=mine))


# --------------------------------------------------------------------------- MPI: blocks


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_shard_gather_scatter_roundtrip(make_manager, world, rng, kind):
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        for shape in sizes_for(grid):
            g = rng.standard_normal((2, 3, *shape))
            if kind == "torch":
                torch = pytest.importorskip("torch")
                g = torch.from_numpy(g)
            block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True)
            np.testing.assert_array_equal(np.asarray(block), window(np.asarray(g), grid, m.domain_coords, shape))
            again = credit_mpi.shard_tensor(g, (2, 3), m, uneven=True, check="collective")
            np.testing.assert_array_equal(np.asarray(again), np.asarray(block))
            full = credit_mpi.gather_tensor(block, (-2, -1), m)
            assert type(full) is type(g) and full.shape == g.shape
            np.testing.assert_array_equal(np.asarray(full), np.asarray(g))  # bit for bit
            out = credit_mpi.gather_tensor(block, (-2, -1), m, out=np.zeros_like(np.asarray(g)) if kind == "numpy" else g.clone() * 0)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(g))
            mine = credit_mpi.scatter_tensor(g if m.domain_rank == n - 1 else None, (-2, -1), m, root=n - 1, uneven=True)
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(block))
            batch = {"x": g, "y": g[:, :, None], "t": 3}
            sharded = credit_mpi.shard_batch(batch, (-2, -1), (-2, -1), m, uneven=True)
            np.testing.assert_array_equal(np.asarray(sharded["x"]), np.asarray(block))
            np.testing.assert_array_equal(np.asarray(sharded["y"])[:, :, 0], np.asarray(block))
            assert sharded["t"] == 3
        # 5-D: time between channels and latitude; even layout (uneven=False) when sizes divide
        g = rng.standard_normal((1, 2, 2, grid[0] * 2, grid[1] * 2))
        block = credit_mpi.shard_tensor(g, (-2, -1), m)
        np.testing.assert_array_equal(credit_mpi.gather_tensor(block, (-2, -1), m), g)


@pytest.mark.mpi(min_size=1)
def test_plain_manager_pair_dims_are_latitude_bands(make_manager, world, rng):
    n = world.Get_size()
    m = make_manager(n)  # no domain_grid: an (n, 1) grid
    g = rng.standard_normal((2, n * 2 + 1, 6))
    block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True)
    np.testing.assert_array_equal(block, credit_mpi.shard_tensor(g, -2, m, uneven=True))
    np.testing.assert_array_equal(credit_mpi.gather_tensor(block, (-2, -1), m), g)


@pytest.mark.mpi(min_size=2)
def test_single_dim_on_2d_grid_is_an_error(make_manager, world, rng):
    n = world.Get_size()
    m = make_manager(n, domain_grid=(1, n))
    g = rng.standard_normal((2, 4, n * 2))
    for call in (
        lambda: credit_mpi.shard_tensor(g, -2, m),
        lambda: credit_mpi.gather_tensor(g, -2, m),
        lambda: credit_mpi.halo_exchange(g, 1, -2, m),
        lambda: credit_mpi.scatter_tensor(g, -2, m),
        lambda: credit_mpi.shard_batch({"x": g[None]}, manager=m),
    ):
        raises_everywhere(ValueError, rf"domain grid is 1x{n}.*dim must be a pair", call)


@pytest.mark.mpi(min_size=2)
def test_gather_blocks_that_do_not_tile(make_manager, world, rng):
    n = world.Get_size()
    m = make_manager(n, domain_grid=(1, n))
    rows = 3 if world.Get_rank() else 4  # the same grid row, different latitudes
    block = rng.standard_normal((1, rows, 2))
    raises_everywhere(ValueError, "do not tile the 1x", lambda: credit_mpi.gather_tensor(block, (-2, -1), m))
    mine = rng.standard_normal((2 if world.Get_rank() else 3, 4, 2))
    raises_everywhere(ValueError, "blocks do not fit together", lambda: credit_mpi.gather_tensor(mine, (-2, -1), m))


# --------------------------------------------------------------------------- MPI: the 2-D halo


@pytest.mark.mpi(min_size=1)
def test_halo_2d_matches_single_process_padding(make_manager, world, rng):
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        for shape in sizes_for(grid):
            g = rng.standard_normal((2, 2, *shape))
            block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True)
            for lat in LAT:
                if lat == "earth" and shape[1] % 2:
                    continue
                for lon in LON:
                    for hy, hx in WIDTHS:
                        out = credit_mpi.halo_exchange(block, (hy, hx), (-2, -1), m, boundary=(lat, lon))
                        want = window(pad2d(g, hy, hx, lat, lon), grid, m.domain_coords, shape, hy, hx)
                        assert out.shape == want.shape
                        np.testing.assert_array_equal(out, want, err_msg=f"{grid} {shape} {lat} {lon} {(hy, hx)}")


@pytest.mark.mpi(min_size=1)
def test_halo_2d_other_dims_and_check_false(make_manager, world, rng):
    n = world.Get_size()
    grid = grids(n)[len(grids(n)) // 2]
    m = make_manager(n, domain_grid=grid)
    shape = (grid[0] * 3 + 1, grid[1] * 4)
    g = rng.standard_normal((shape[0], 2, shape[1], 3)).astype(np.float32)  # lat axis 0, lon axis 2
    moved = np.moveaxis(g, (0, 2), (-2, -1))
    block = credit_mpi.shard_tensor(g, (0, 2), m, uneven=True)
    out = credit_mpi.halo_exchange(block, (2, 1), (0, 2), m, boundary=("earth", "periodic"), check=False)
    want = window(pad2d(moved, 2, 1, "earth", "periodic"), grid, m.domain_coords, shape, 2, 1)
    np.testing.assert_array_equal(out, np.moveaxis(want, (-2, -1), (0, 2)))


@pytest.mark.mpi(min_size=1)
def test_halo_2d_bad_input_everywhere(make_manager, world, rng):
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        g = rng.standard_normal((1, grid[0] * 2, grid[1] * 2 + 1))
        block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True)
        if grid[0] > 1:
            with pytest.raises(ValueError, match="halo_width=3.*does not fit"):
                credit_mpi.halo_exchange(block, (3, 1), (-2, -1), m)
        if grid[1] > 1:
            with pytest.raises(ValueError, match="halo_width=3.*does not fit"):
                credit_mpi.halo_exchange(block, (1, 3), (-2, -1), m, boundary=("zero", "periodic"))
        with pytest.raises(ValueError, match=r"number of longitudes \(dim 2\) must be even, got"):
            credit_mpi.halo_exchange(block, (1, 1), (-2, -1), m, boundary="earth")
        if n > 1:  # one rank asks for another width: the same error everywhere, no hang
            width = (1, 2) if world.Get_rank() == n - 1 else (1, 1)
            with pytest.raises(ValueError, match="different calls"):
                credit_mpi.halo_exchange(block, width, (-2, -1), m)


# --------------------------------------------------------------------------- MPI: autograd


def _reference_halo(torch, g, hy, hx, lat, lon):
    from .halo_reference import pad_torch

    p = pad_torch(g, hy, lat)
    if lon == "zero":
        return torch.nn.functional.pad(p, (hx, hx))
    mode = {"periodic": "circular", "reflect": "reflect"}[lon]
    return torch.nn.functional.pad(p.reshape(-1, 1, p.shape[-1]), (hx, hx), mode=mode).reshape(*p.shape[:-1], -1)


@pytest.mark.mpi(min_size=1)
def test_halo_2d_autograd_and_double_backward(make_manager, world, rng):
    torch = pytest.importorskip("torch")
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        for shape in sizes_for(grid)[:2]:
            for lat, lon, (hy, hx) in (("earth", "periodic", (1, 2)), ("reflect", "zero", (2, 1)), ("periodic", "reflect", (1, 1)),
                                       ("zero", "periodic", (2, 2))):
                if lat == "earth" and shape[1] % 2:
                    continue
                g = torch.from_numpy(rng.standard_normal((2, *shape)))
                padded_shape = (2, shape[0] + 2 * hy, shape[1] + 2 * hx)
                weights = [torch.from_numpy(rng.standard_normal(padded_shape)) for _ in range(n)]
                vs = [torch.from_numpy(rng.standard_normal((2, *shape))) for _ in range(n)]
                # single process: every rank's window of the padded field, weighted, summed
                gx = g.clone().requires_grad_(True)
                ws = [w.clone().requires_grad_(True) for w in weights]
                ref_pad = _reference_halo(torch, gx, hy, hx, lat, lon)
                coords = [divmod(r, grid[1]) for r in range(n)]
                loss = sum((window(ref_pad, grid, c, shape, hy, hx) * window(w, grid, c, shape, hy, hx)).sum()
                           for c, w in zip(coords, ws, strict=True))
                (ref_grad,) = torch.autograd.grad(loss, gx, create_graph=True)
                loss2 = sum((window(ref_grad, grid, c, shape) * window(v, grid, c, shape)).sum() for c, v in zip(coords, vs, strict=True))
                ref_wgrads = torch.autograd.grad(loss2, ws)
                # distributed
                r, c = m.domain_rank, m.domain_coords
                block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True).clone().requires_grad_(True)
                w = window(weights[r], grid, c, shape, hy, hx).clone().requires_grad_(True)
                out = credit_mpi.halo_exchange(block, (hy, hx), (-2, -1), m, boundary=(lat, lon))
                assert out.grad_fn is not None
                np.testing.assert_array_equal(out.detach().numpy(), window(ref_pad, grid, c, shape, hy, hx).detach().numpy())
                (grad,) = torch.autograd.grad((out * w).sum(), block, create_graph=True)
                torch.testing.assert_close(grad, window(ref_grad, grid, c, shape), rtol=0, atol=1e-12)
                (wgrad,) = torch.autograd.grad((grad * window(vs[r], grid, c, shape)).sum(), w)
                torch.testing.assert_close(wgrad, window(ref_wgrads[r], grid, c, shape, hy, hx), rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_gather_2d_autograd(make_manager, world, rng):
    torch = pytest.importorskip("torch")
    n = world.Get_size()
    for grid in grids(n):
        m = make_manager(n, domain_grid=grid)
        shape = sizes_for(grid)[1]
        g = torch.from_numpy(rng.standard_normal((2, *shape)))
        weight = torch.from_numpy(rng.standard_normal((2, *shape)))
        block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True).clone().requires_grad_(True)
        full = credit_mpi.gather_tensor(block, (-2, -1), m)
        (full * weight).sum().backward()
        torch.testing.assert_close(block.grad, window(weight, grid, m.domain_coords, shape), rtol=0, atol=0)


@pytest.mark.mpi(min_size=4)
def test_conv_net_on_2x2_grid_matches_one_process(make_manager, world, rng):
    """A two-layer conv net on a 2x2 grid (halo then conv without padding): forward and every gradient."""
    torch = pytest.importorskip("torch")
    if world.Get_size() != 4:
        pytest.skip("a 2x2 grid of the whole world")
    m = make_manager(4, domain_grid=(2, 2))
    torch.manual_seed(5)
    net = torch.nn.ModuleList([torch.nn.Conv2d(2, 3, 3, padding=0), torch.nn.Conv2d(3, 2, 5, padding=0)]).double()
    shape = (9, 14)  # uneven latitude, even longitude (earth)
    g = torch.from_numpy(rng.standard_normal((2, 2, *shape)))
    target = torch.from_numpy(rng.standard_normal((2, 2, *shape)))

    def run(x, halo):
        y = torch.tanh(net[0](halo(x, 1)))
        return net[1](halo(y, 2))

    # one process
    x = g.clone().requires_grad_(True)
    ref = run(x, lambda t, k: _reference_halo(torch, t, k, k, "earth", "periodic"))
    ((ref - target) ** 2).sum().backward()
    ref_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    # 2x2 grid
    block = credit_mpi.shard_tensor(g, (-2, -1), m, uneven=True).clone().requires_grad_(True)
    out = run(block, lambda t, k: credit_mpi.halo_exchange(t, (k, k), (-2, -1), m, boundary=("earth", "periodic")))
    np.testing.assert_allclose(out.detach().numpy(), window(ref.detach().numpy(), (2, 2), m.domain_coords, shape), rtol=0, atol=1e-12)
    ((out - credit_mpi.shard_tensor(target, (-2, -1), m, uneven=True)) ** 2).sum().backward()
    np.testing.assert_allclose(block.grad.numpy(), window(x.grad.numpy(), (2, 2), m.domain_coords, shape), rtol=0, atol=1e-12)
    for p, want in zip(net.parameters(), ref_grads, strict=True):
        total = p.grad.clone()  # a parameter's gradient is the sum of every block's part
        m.domain_group.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
        np.testing.assert_allclose(total.numpy(), want.numpy(), rtol=0, atol=1e-11)


@pytest.mark.mpi(min_size=4)
def test_bench_halo_grid_row(world):
    """The bench's 1-D vs 2-D row at 4 ranks: bytes counted by hand for a 2 x 8 x 12 field, width (1, 1), earth."""
    from credit_mpi.cli import bench

    if world.Get_size() != 4:
        pytest.skip("the row is defined at 4 ranks")
    row = bench.halo_grid_comparison(world, (2, 8, 12), 1, repeats=1)
    # 4x1: bands of 2 rows; the poles are local (one column), interior ranks get 2 rows, edge ranks 1: 6 rows of 12
    # 2x2: 4x6 blocks; each gets 1 row of 6 (neighbour), 1 pole row of 6 (opposite column), 2 columns of 4 + 2 rows
    assert (row["grid_1d"], row["grid_2d"]) == ("4x1", "2x2")
    assert row["bytes_1d"] == 6 * 12 * 2 * 4 and row["max_bytes_1d"] == 2 * 12 * 2 * 4
    assert row["bytes_2d"] == 4 * (6 + 6 + 2 * 6) * 2 * 4 and row["max_bytes_2d"] == (6 + 6 + 2 * 6) * 2 * 4
    assert row["time_1d"].median > 0 and row["time_2d"].median > 0
