"""The halo as one 1-D phase per split dim, its edges from the boundary table (credit_mpi.ops.halo, partition.BOUNDARIES).

Bands are one phase, a grid's blocks the latitude phase then the longitude
phase on the padded block; every outer edge is filled from the table. So a
new boundary is one row of the table: the test below adds one (numpy's
``"symmetric"``) and gets it on bands and on grids, forward and backward,
with nothing else changed. The adjoint is checked as the transpose of the
forward, phase by phase, for every row of the table (float64, real ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import partition
from credit_mpi.layout import Layout
from credit_mpi.ops import halo as op
from credit_mpi.partition import BOUNDARIES, Boundary
from credit_mpi.transport.limits import TAG_DOWN, TAG_E, TAG_N, TAG_S, TAG_UP, TAG_W

from .ops.conformance import grid_for

torch = pytest.importorskip("torch")


# --------------------------------------------------------------------------- serial: the phases are arithmetic


def test_bands_are_one_phase():
    (ph,) = op.phases(Layout.bands([3, 4, 3]), 1, (2,), (1,), ("zero",), (2, 3, 4, 6), (3, None))
    assert (ph.axis, ph.rows, ph.prev, ph.next, ph.tags, ph.padded, ph.fold) == (2, 4, 0, 2, (TAG_UP, TAG_DOWN), (2, 3, 6, 6), None)
    (edge,) = op.phases(Layout.bands([3, 4, 3]), 0, (2,), (1,), ("periodic",), (2, 3, 3, 6), (3, None))
    assert (edge.prev, edge.next) == (2, 1)  # the table's "wraps": the first band's neighbour before is the last
    (pole,) = op.phases(Layout.bands([3, 4, 3]), 2, (2,), (2,), ("earth",), (2, 3, 3, 6), (3, None))
    # the whole longitude on every rank: the fold is a roll by half of it, all local
    assert pole.next is None and pole.fold == op.Fold(3, (), (), 3)


def test_a_grid_is_the_latitude_phase_then_the_longitude_phase():
    layout = Layout(((3, 3), (4, 4)))
    lat, lon = op.phases(layout, 1, (1, 2), (2, 1), ("earth", "periodic"), (5, 3, 4), (2, 1))
    assert (lat.axis, lat.prev, lat.next, lat.tags) == (1, None, 3, (TAG_N, TAG_S))  # rank 1 sits at (0, 1)
    assert lat.fold.remote == ((0, 0, 4),) and lat.fold.local == () and lat.fold.half is None  # all on rank 0
    assert lon.shape == (5, 7, 4) and lon.padded == (5, 7, 6)  # the latitude-padded block: its columns carry the corners
    assert (lon.prev, lon.next, lon.tags, lon.fold) == (0, 0, (TAG_W, TAG_E), None)
    plan = op.Plan2d(None, (2, 2), 0, 1, 1, 2, 2, 1, "earth", "periodic", (5, 3, 4), (3, 3), (4, 4))
    assert plan.phases == (lat, lon)


def test_the_table_is_the_list_of_boundaries():
    assert credit_mpi.halo.HALO_BOUNDARIES == tuple(BOUNDARIES) == ("zero", "periodic", "reflect", "earth")
    assert op.LON_BOUNDARIES == ("periodic", "zero", "reflect")  # latitude-only rows ("earth") are no longitude's
    assert partition.halo_edge_rows("reflect", 5, 2, "after") == 2 and partition.halo_edge_rows("earth", 5, 2, "after") == 3


# --------------------------------------------------------------------------- on ranks


def _parts(n: int, grid: tuple[int, int] | None):
    """(global shape, this rank's slices) of a (2, H, W) field: uneven latitude bands, or blocks of ``grid``."""
    rows, cols = grid or (n, 1)
    shape = (2, 3 * rows + 1, 4 * cols + 2)  # uneven in both dims, an even longitude (earth)
    layout = Layout.of(shape[1:], (rows, cols), True)
    (y0, h), (x0, w) = layout.block(MPI.COMM_WORLD.Get_rank())
    return shape, (slice(None), slice(y0, y0 + h), slice(x0, x0 + w))


def _exchange(local, manager, grid, width, boundary):
    if grid is None:
        return credit_mpi.halo_exchange(local, width[0], -2, manager, boundary=boundary[0])
    return credit_mpi.halo_exchange(local, width, (-2, -1), manager, boundary=boundary)


def _window(padded, where, width, grid):
    """This rank's window of the padded global field."""
    _, ys, xs = where
    hy, hx = width[0], (width[1] if grid is not None else 0)
    x_slice = slice(xs.start, xs.stop + 2 * hx) if grid is not None else slice(None)
    return padded[:, ys.start : ys.stop + 2 * hy, x_slice]


@pytest.mark.mpi(min_size=1)
def test_a_new_boundary_is_one_table_entry(make_manager, monkeypatch):
    """numpy's "symmetric" (the edge row repeated in the mirror) as one row: bands and grids, forward and backward."""
    monkeypatch.setitem(partition.BOUNDARIES, "symmetric", Boundary("symmetric", mirror=0))
    n = MPI.COMM_WORLD.Get_size()
    for grid in (None, grid_for(n)):
        manager = make_manager(domain_grid=grid)
        shape, where = _parts(n, grid)
        g = np.random.default_rng(7).standard_normal(shape)
        width = (2, 1)
        pads = [(0, 0), (width[0], width[0]), (width[1], width[1]) if grid is not None else (0, 0)]
        expected = _window(np.pad(g, pads, mode="symmetric"), where, width, grid)
        got = _exchange(g[where].copy(), manager, grid, width, ("symmetric", "symmetric"))
        np.testing.assert_array_equal(got, expected, err_msg=f"grid {grid}")
        _check_transpose(g, where, manager, grid, width, ("symmetric", "symmetric"))
    op.phases.cache_clear()  # the remembered phases hold the patched row


def _check_transpose(g, where, manager, grid, width, boundary):
    """<halo(x), y> == <x, adjoint(y)> summed over the ranks (the backward is the forward's transpose)."""
    comm = MPI.COMM_WORLD
    x = torch.from_numpy(g[where].copy()).requires_grad_(True)
    out = _exchange(x, manager, grid, width, boundary)
    y = torch.from_numpy(np.random.default_rng(comm.Get_rank() + 11).standard_normal(tuple(out.shape)))
    (out * y).sum().backward()
    forward = comm.allreduce(float((out.detach() * y).sum()))
    backward = comm.allreduce(float((x.detach() * x.grad).sum()))
    assert np.isclose(forward, backward, rtol=1e-12, atol=1e-12), (grid, width, boundary, forward, backward)


@pytest.mark.mpi(min_size=1)
def test_every_row_of_the_table_has_the_transposed_backward(make_manager):
    n = MPI.COMM_WORLD.Get_size()
    g = None
    for grid in (None, grid_for(n)):
        manager = make_manager(domain_grid=grid)
        shape, where = _parts(n, grid)
        g = np.random.default_rng(3).standard_normal(shape)
        lons = (None,) if grid is None else op.LON_BOUNDARIES
        for lat in BOUNDARIES:
            for lon in lons:
                _check_transpose(g, where, manager, grid, (2, 1), (lat, lon))
