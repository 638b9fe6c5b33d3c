"""halo_exchange against the single-process padded global field."""

from __future__ import annotations

import numpy as np
import pytest

from credit_mpi import halo_exchange

from .halo_reference import band, pad_numpy, pad_torch, prefix_managers

BOUNDARIES = ["zero", "periodic", "reflect", "earth"]


# -- one process: the halo is the padding of the whole field ----------------


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("width", [0, 1, 3])
def test_single_process_matches_pad(rng, boundary, width):
    g = rng.standard_normal((2, 3, 7, 6))
    for axis in (0, 1, 2):
        if boundary == "reflect" and width >= g.shape[axis]:
            continue
        if width > g.shape[axis] and boundary != "zero":
            continue
        np.testing.assert_array_equal(
            halo_exchange(g, width, dim=axis, boundary=boundary), pad_numpy(g, width, axis, boundary)
        )


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_single_process_torch_matches_torch_pad(rng, boundary):
    torch = pytest.importorskip("torch")
    g = torch.from_numpy(rng.standard_normal((2, 3, 7, 6)))
    out = halo_exchange(g, 2, boundary=boundary)
    assert isinstance(out, torch.Tensor) and out.dtype == g.dtype
    torch.testing.assert_close(out, pad_torch(g, 2, boundary), rtol=0, atol=0)


def test_earth_matches_credit_tensor_padding_layout():
    # 2 latitudes x 4 longitudes: the row across the north pole is row 0 rolled by 2
    g = np.arange(8.0).reshape(2, 4)
    out = halo_exchange(g, 1, dim=0, boundary="earth")
    np.testing.assert_array_equal(out[0], [2, 3, 0, 1])
    np.testing.assert_array_equal(out[-1], [6, 7, 4, 5])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"halo_width": -1}, "halo_width must be >= 0, got -1"),
        ({"halo_width": 1.5}, "halo_width must be an integer, got 1.5"),
        ({"halo_width": True}, "halo_width must be an integer, got True"),
        ({"halo_width": 1, "dim": 4}, "out of range"),
        ({"halo_width": 1, "boundary": "mirror"}, "unknown boundary"),
        ({"halo_width": 1, "dim": -1, "boundary": "earth"}, "full longitude"),
        ({"halo_width": 6, "boundary": "reflect"}, "does not fit"),
        ({"halo_width": 7, "boundary": "periodic"}, "does not fit"),
    ],
)
def test_bad_arguments(rng, kwargs, match):
    with pytest.raises(ValueError, match=match):
        halo_exchange(rng.standard_normal((2, 3, 6, 8)), **kwargs)


def test_earth_odd_longitude():
    with pytest.raises(ValueError, match="must be even, got 7"):
        halo_exchange(np.zeros((4, 7)), 1, dim=0, boundary="earth")


def test_unsupported_type():
    with pytest.raises(TypeError, match="unsupported array type"):
        halo_exchange([[1.0, 2.0]], 1, dim=0)


# -- real ranks -----------------------------------------------------------


def _check_all(rng, d, manager, shape_fn, axes, widths, kind="numpy"):
    for boundary in BOUNDARIES:
        for axis in axes:
            for total in (4 * d, 4 * d + d - 1):  # even and uneven bands
                g = rng.standard_normal(shape_fn(axis, total))
                for width in widths:
                    if boundary == "earth" and axis == g.ndim - 1:
                        continue
                    if boundary == "reflect" and width + 1 > total // d:
                        continue
                    start, stop = band(total, manager)
                    local = np.take(g, range(start, stop), axis=axis)
                    expected = np.take(pad_numpy(g, width, axis, boundary), range(start, stop + 2 * width), axis=axis)
                    if kind == "torch":
                        import torch

                        got = halo_exchange(torch.from_numpy(local), width, axis, manager, boundary=boundary).numpy()
                    else:
                        got = halo_exchange(local, width, axis, manager, boundary=boundary)
                    assert got.shape == expected.shape, (boundary, axis, total, width)
                    np.testing.assert_array_equal(got, expected, err_msg=f"{boundary} axis {axis} H {total} w {width}")


@pytest.mark.mpi(min_size=1)
def test_every_boundary_on_ranks(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            rng = np.random.default_rng(d)  # ranks outside earlier sub-communicators drew nothing
            _check_all(rng, d, manager, lambda axis, total: tuple(total if a == axis else s for a, s in enumerate((3, 5, 2, 6))), (0, 1, 2), (0, 1, 3))


@pytest.mark.mpi(min_size=1)
def test_torch_and_dtypes_on_ranks(rng, make_manager):
    torch = pytest.importorskip("torch")
    manager = make_manager()
    d = manager.domain_parallel_size
    total = 3 * d + 1
    g = rng.standard_normal((2, total, 8))
    start, stop = band(total, manager)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        full = torch.from_numpy(g).to(dtype)
        for boundary in BOUNDARIES:
            got = halo_exchange(full[:, start:stop].clone(), 2, 1, manager, boundary=boundary)
            assert got.dtype == dtype
            torch.testing.assert_close(got, pad_torch(full, 2, boundary)[:, start : stop + 4], rtol=0, atol=0)


@pytest.mark.mpi(min_size=2)
def test_one_dimensional_and_wide_rows(rng, make_manager):
    manager = make_manager()
    d = manager.domain_parallel_size
    for shape, axis in (((5 * d,), 0), ((5 * d, 3, 4), 0), ((2, 5 * d, 4, 3), 1)):
        g = rng.standard_normal(shape).astype(np.float32)
        start, stop = band(g.shape[axis], manager)
        local = np.take(g, range(start, stop), axis=axis)
        for boundary in ("zero", "periodic", "reflect"):
            expected = np.take(pad_numpy(g, 2, axis, boundary), range(start, stop + 4), axis=axis)
            np.testing.assert_array_equal(halo_exchange(local, 2, axis, manager, boundary=boundary), expected)


@pytest.mark.mpi(min_size=2)
def test_halo_wider_than_a_band_raises_everywhere(make_manager):
    manager = make_manager()
    d = manager.domain_parallel_size
    total = 3 * d - 1  # the last rank holds 2 rows, the others 3
    start, stop = band(total, manager)
    local = np.zeros((2, stop - start, 4))
    with pytest.raises(ValueError, match=r"domain rank \d+ holds 2 row\(s\)"):
        halo_exchange(local, 3, 1, manager)
    with pytest.raises(ValueError, match="reflect mirrors without repeating the edge row"):
        halo_exchange(local, 2, 1, manager, boundary="reflect")


@pytest.mark.mpi(min_size=2)
def test_disagreement_raises_everywhere(make_manager):
    manager = make_manager()
    rank = manager.domain_rank
    local = np.zeros((2, 4, 6))
    with pytest.raises(ValueError, match="do not fit together"):
        halo_exchange(local, 1, 1, manager, boundary="zero" if rank else "periodic")
    with pytest.raises(ValueError, match="do not fit together"):
        halo_exchange(np.zeros((2, 4, 6 + rank)), 1, 1, manager)
    with pytest.raises(ValueError, match=r"halo_width must be >= 0, got -1 \[on rank\(s\) 0 "):
        halo_exchange(local, -1 if rank == 0 else 1, 1, manager)
    with pytest.raises(ValueError, match="must be even"):
        halo_exchange(np.zeros((2, 4, 5)), 1, 1, manager, boundary="earth")
    with pytest.raises(TypeError, match="differ in array kind"):
        halo_exchange(local.astype(np.float32 if rank else np.float64), 1, 1, manager)
