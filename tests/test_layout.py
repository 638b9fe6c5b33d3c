"""credit_mpi.layout: the one place that answers who owns which rows and columns (serial, pure arithmetic)."""

import numpy as np
import pytest

from credit_mpi.layout import Layout, offsets, split
from credit_mpi.partition import band_range, band_sizes, halo_neighbors


@pytest.mark.parametrize("total,n", [(721, 4), (8, 2), (5, 8), (0, 3)])
def test_bands_match_array_split(total, n):
    layout = Layout.bands(split(total, n, uneven=True))
    parts = np.array_split(np.arange(total), n)
    assert [layout.stop(r) - layout.start(r) for r in range(n)] == [len(p) for p in parts]
    for r, part in enumerate(parts):
        assert (layout.start(r), layout.stop(r)) == band_range(total, n, r, uneven=True)
        for index in part:
            assert layout.owner(int(index)) == r
    assert layout.starts() == offsets(band_sizes(total, n, uneven=True)) == offsets(layout.sizes[0])


def test_grid_blocks_and_coords():
    layout = Layout.of((5, 7), (2, 3), uneven=True)
    assert layout.sizes == ((3, 2), (3, 2, 2)) and layout.grid == (2, 3) and layout.shape == (5, 7)
    assert layout.coords(4) == (1, 1)
    assert layout.block(4) == ((3, 2), (3, 2))
    assert layout.owner(6, d=1) == 2


def test_neighbors_match_partition():
    for n in (1, 2, 3):
        for periodic in (False, True):
            for r in range(n):
                assert Layout.bands([1] * n).neighbors(r, periodic=periodic) == halo_neighbors(r, n, periodic)


def test_encode_decode_round_trip():
    assert Layout.decode(Layout.encode((721, 1440))) == (721, 1440)
    assert Layout.decode(Layout.encode((9,)), 1) == (9,)
    with pytest.raises(ValueError, match="too wide"):
        Layout.encode((1, 1 << 32))


def test_errors_are_the_partition_ones():
    with pytest.raises(ValueError, match="Cannot shard dim -2 of size 5 evenly across 2"):
        Layout.of((5,), (2,), uneven=False, dims=(-2,))
    with pytest.raises(ValueError, match="out of range"):
        Layout.bands([1, 1]).owner(2)
