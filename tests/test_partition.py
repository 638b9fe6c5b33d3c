"""Ownership arithmetic and datatypes, in one process."""

import re

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi.layout import offsets
from credit_mpi.partition import band_range, band_sizes, normalize_dim, row_datatypes


@pytest.mark.parametrize("total", [0, 1, 5, 8, 720, 721])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_uneven_sizes_match_numpy_array_split(total, n):
    expected = [len(part) for part in np.array_split(np.arange(total), n)]
    assert band_sizes(total, n, uneven=True) == expected
    assert offsets(expected) == [int(p[0]) if len(p) else int(sum(expected[:i])) for i, p in enumerate(np.array_split(np.arange(total), n))]


def test_era5_latitudes_split_unevenly():
    assert band_sizes(721, 4, uneven=True) == [181, 180, 180, 180]
    assert band_range(721, 4, 0, uneven=True) == (0, 181)
    assert band_range(721, 4, 3, uneven=True) == (541, 721)


def test_even_split_is_the_reference_layout():
    assert band_sizes(720, 4) == [180] * 4
    assert [band_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_indivisible_size_names_size_ranks_and_option():
    with pytest.raises(ValueError, match=r"size 721 .* 4 domain-parallel ranks.*uneven=True"):
        band_sizes(721, 4)


@pytest.mark.parametrize(
    "bad,message", [((5, 0), "number of ranks must be >= 1, got 0"), ((-1, 2), "size must be >= 0, got -1")]
)
def test_bad_counts(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        band_sizes(*bad)


def test_band_range_rejects_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 4 is out of range for 4 ranks"):
        band_range(8, 4, 4)


@pytest.mark.parametrize("dim,ndim,expected", [(-2, 4, 2), (0, 1, 0), (3, 4, 3), (-5, 5, 0)])
def test_normalize_dim(dim, ndim, expected):
    assert normalize_dim(dim, ndim) == expected


@pytest.mark.parametrize(
    "dim,ndim,message",
    [
        (4, 4, "dim 4 is out of range for a 4-dimensional array (valid: -4 to 3)"),
        (-5, 4, "dim -5 is out of range for a 4-dimensional array (valid: -4 to 3)"),
        (0, 0, "cannot shard a 0-dimensional (scalar) array; need ndim >= 1"),
        (1.0, 3, "dim must be an integer, got 1.0"),
        ("x", 3, "dim must be an integer, got 'x'"),
    ],
)
def test_normalize_dim_rejects(dim, ndim, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        normalize_dim(dim, ndim)


def test_row_datatypes_place_a_band_in_the_global_layout():
    """Send with the send type, receive with the receive type: the band lands in place."""
    outer, total, post, start, rows = 3, 7, 5, 2, 3
    global_ = np.arange(outer * total * post, dtype=np.float32).reshape(outer, total, post)
    band = np.ascontiguousarray(global_[:, start : start + rows])
    send, recv = row_datatypes(outer, rows, total, post * 4)
    try:
        assert send.Get_size() == recv.Get_size() == outer * post * 4
        assert send.Get_extent()[1] == recv.Get_extent()[1] == post * 4
        out = np.zeros_like(global_)
        view = out.reshape(-1).view(np.uint8)[start * post * 4 :]
        MPI.COMM_SELF.Sendrecv([band, rows, send], 0, 0, [view, rows, recv], 0, 0)
        assert np.array_equal(out[:, start : start + rows], band)
        assert not out[:, :start].any() and not out[:, start + rows :].any()
    finally:
        send.Free()
        recv.Free()
