"""shard_tensor / gather_tensor / shard_batch / scatter_tensor on real ranks.

Every rank draws the same global field from the same seed, so the expected
shard and the expected gather are computed in-process (numpy.array_split is
the single-process reference for the layout).
"""

import tracemalloc

import numpy as np
import pytest
import torch
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, scatter_tensor, shard_batch, shard_tensor
from credit_mpi.ops import gather as gather_op

from .conftest import domain_sizes

NUMPY_DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]

# (global shape, dim): 4-D BCHW, 5-D BCTHW, leading, trailing and middle dims.
CASES = [((2, 3, 12, 5), -2), ((1, 2, 2, 7, 6), -2), ((13, 4), 0), ((3, 11), -1), ((2, 9, 3), 1), ((5,), 0)]


def random_numpy(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def random_torch(rng, shape, dtype):
    if dtype == torch.bfloat16:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    name = str(dtype).removeprefix("torch.")
    return torch.from_numpy(random_numpy(rng, shape, {"bool": "bool"}.get(name, name)))


def reference_band(x, dim, n, rank):
    """The single-process answer: numpy.array_split's piece (equal chunks when divisible)."""
    axis = dim % x.ndim
    sizes = [len(p) for p in np.array_split(np.arange(x.shape[axis]), n)]
    start = sum(sizes[:rank])
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + sizes[rank])
    return x[tuple(index)]


def gather_with_peak(band, dim, manager):
    """gather_tensor's result and the peak of the Python-tracked memory (numpy) during it."""
    gather_tensor(band, dim, manager)  # warm up
    tracemalloc.start()
    try:
        out = gather_tensor(band, dim, manager)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bits_equal(a, b):
    """Bit-for-bit equality (NaN-safe, signed zeros distinguished)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        )
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip_every_dtype_dim_and_domain_size(world, make_manager, rng, dtype):
    for d in domain_sizes(world.Get_size()):
        m = make_manager(d)
        for shape, dim in CASES:
            x = random_numpy(rng, shape, dtype)
            band = shard_tensor(x, dim, m, uneven=True)
            assert isinstance(band, np.ndarray) and band.flags.c_contiguous
            assert bits_equal(band, reference_band(x, dim, d, m.domain_rank))
            gathered = gather_tensor(band, dim, m)
            assert isinstance(gathered, np.ndarray) and bits_equal(gathered, x)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_every_dtype_dim_and_domain_size(world, make_manager, rng, dtype):
    for d in domain_sizes(world.Get_size()):
        m = make_manager(d)
        for shape, dim in CASES:
            x = random_torch(rng, shape, dtype)
            band = shard_tensor(x, dim, m, uneven=True)
            assert isinstance(band, torch.Tensor) and band.is_contiguous() and band.device == x.device
            expected = reference_band(x.view(torch.uint8) if dtype == torch.bool else x, dim, d, m.domain_rank)
            assert bits_equal(band.view(torch.uint8) if dtype == torch.bool else band, expected)
            assert bits_equal(gather_tensor(band, dim, m), x)


@pytest.mark.mpi(min_size=2)
def test_even_default_matches_reference_chunks(world, make_manager, rng):
    n = world.Get_size()
    m = make_manager()
    x = torch.from_numpy(rng.standard_normal((2, 3, 4 * n, 8)))
    band = shard_tensor(x, manager=m)
    assert torch.equal(band, torch.chunk(x, n, dim=-2)[m.domain_rank])
    assert torch.equal(gather_tensor(band, manager=m), x)


@pytest.mark.mpi(min_size=2)
def test_indivisible_size_without_uneven_fails_on_every_rank(world, make_manager):
    n = world.Get_size()
    m = make_manager()
    x = np.zeros((2, 4 * n + 1, 3))
    with pytest.raises(ValueError, match=rf"size {4 * n + 1} evenly across {n} domain-parallel ranks.*uneven=True"):
        shard_tensor(x, 1, m)
    with pytest.raises(ValueError, match=r"^Cannot shard dim -2 .*uneven=True.*\(in batch\['x'\]\)"):
        shard_batch({"x": np.zeros((1, 1, 4 * n + 1, 2))}, manager=m)


@pytest.mark.mpi(min_size=2)
def test_era5_latitudes_uneven(world, make_manager, rng):
    m = make_manager()
    x = rng.standard_normal((1, 2, 721, 16)).astype(np.float32)
    band = shard_tensor(x, manager=m, uneven=True)
    sizes = [len(p) for p in np.array_split(np.arange(721), world.Get_size())]
    assert band.shape == (1, 2, sizes[m.domain_rank], 16)
    assert bits_equal(gather_tensor(band, manager=m), x)
    assert bits_equal(gather_tensor(band, manager=m, check=False), x)


@pytest.mark.mpi(min_size=2)
def test_more_ranks_than_rows_gives_empty_bands(world, make_manager, rng):
    m = make_manager()
    x = rng.standard_normal((3, 1, 4))
    band = shard_tensor(x, 1, m, uneven=True)
    assert band.shape == (3, 1 if m.domain_rank == 0 else 0, 4)
    assert bits_equal(gather_tensor(band, 1, m), x)


@pytest.mark.mpi(min_size=2)
def test_non_contiguous_inputs(world, make_manager, rng):
    m = make_manager()
    n = world.Get_size()
    base = rng.standard_normal((6, 4 * n, 5)).astype(np.float32)
    x = base.transpose(2, 1, 0)  # (5, 4n, 6), not contiguous
    band = shard_tensor(x, 1, m)
    assert bits_equal(band, reference_band(x, 1, n, m.domain_rank))
    strided_band = band[:, :, ::1].T.copy().T  # same values, Fortran order
    assert bits_equal(gather_tensor(strided_band, 1, m), x)
    t = torch.from_numpy(base).permute(2, 1, 0)
    assert bits_equal(gather_tensor(shard_tensor(t, 1, m), 1, m), t.contiguous())


@pytest.mark.mpi(min_size=1)
def test_no_manager_or_domain_size_one_returns_input(world, make_manager):
    x = np.arange(12.0).reshape(3, 4)
    assert credit_mpi.get_domain_parallel_manager() is None
    assert shard_tensor(x) is x and gather_tensor(x) is x
    batch = {"x": x}
    assert shard_batch(batch) is batch
    m = make_manager(1)
    assert shard_tensor(x, manager=m) is x and gather_tensor(x, manager=m) is x
    assert shard_batch(batch, manager=m) is batch


@pytest.mark.mpi(min_size=2)
def test_global_singleton_is_used(world, rng):
    n = world.Get_size()
    m = credit_mpi.initialize_domain_parallel(None, n)
    try:
        x = rng.standard_normal((2, 2 * n, 3))
        band = shard_tensor(x, dim=1)
        assert band.shape == (2, 2, 3)
        assert bits_equal(gather_tensor(band, dim=1), x)
        assert shard_batch({"x": x[None, None]})["x"].shape == (1, 1, 2, 2, 3)
    finally:
        credit_mpi.destroy_domain_parallel()
    assert m.freed


@pytest.mark.mpi(min_size=2)
def test_shard_batch_like_the_reference(world, make_manager, rng):
    n = world.Get_size()
    m = make_manager()
    batch = {
        "x": torch.from_numpy(rng.standard_normal((2, 3, 2, 4 * n, 6))),  # 5-D: shard dim -2
        "y": torch.from_numpy(rng.standard_normal((2, 3, 4 * n, 6))).float(),  # 4-D
        "static": np.asarray(rng.standard_normal((1, 1, 4 * n, 6))),  # numpy 4-D
        "forcing": torch.zeros(2, 3, 4 * n),  # 3-D: unchanged
        "index": torch.tensor([1, 2]),  # 1-D: unchanged
        "stop_forecast": False,
        "datetime": "2020-01-01",
    }
    out = shard_batch(batch, manager=m)
    assert out is not batch and set(out) == set(batch)
    r = m.domain_rank
    assert torch.equal(out["x"], torch.chunk(batch["x"], n, dim=-2)[r])
    assert torch.equal(out["y"], torch.chunk(batch["y"], n, dim=-2)[r])
    assert np.array_equal(out["static"], np.split(batch["static"], n, axis=-2)[r])
    for key in ("forcing", "index", "stop_forecast", "datetime"):
        assert out[key] is batch[key]
    # other dims per rank count, uneven
    out = shard_batch(
        {"x": batch["x"][..., :-1], "y": batch["y"][:, :, :-1]},
        spatial_dims_5d=-1, spatial_dims_4d=2, manager=m, uneven=True,
    )
    assert torch.equal(out["x"], reference_band(batch["x"][..., :-1], -1, n, r))
    assert torch.equal(out["y"], reference_band(batch["y"][:, :, :-1], 2, n, r))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("uneven", [False, True])
def test_scatter_matches_shard(world, make_manager, rng, uneven):
    n = world.Get_size()
    m = make_manager()
    for x in (rng.standard_normal((2, 4 * n + uneven, 3)).astype(np.float32),
              torch.from_numpy(rng.standard_normal((3, 4 * n + uneven))).to(torch.bfloat16)):
        for root in (0, n - 1):
            dim = 1
            band = scatter_tensor(x if m.domain_rank == root else None, dim, m, root=root, uneven=uneven)
            assert bits_equal(band, shard_tensor(x, dim, m, uneven=uneven))


@pytest.mark.mpi(min_size=2)
def test_gather_mismatched_shapes_fail_on_every_rank_naming_each_shape(world, make_manager):
    m = make_manager()
    r = m.domain_rank
    with pytest.raises(ValueError, match=r"do not fit together along dim 1.*rank 0: numpy float64 \(2, 3, 4\).*rank 1: numpy float64 \(2, 3, 5\)"):
        gather_tensor(np.zeros((2, 3, 4 + r % 2)), dim=1, manager=m)
    with pytest.raises(ValueError, match="do not fit together"):
        gather_tensor(np.zeros((2,) * (2 + r % 2)), dim=0, manager=m)
    with pytest.raises(ValueError, match="do not fit together"):
        gather_tensor(np.zeros((2, 2)), dim=r % 2, manager=m)
    with pytest.raises(TypeError, match="differ in array kind, dtype or device"):
        gather_tensor(np.zeros((2, 2), dtype=np.float32 if r % 2 else np.float64), manager=m)
    with pytest.raises(TypeError, match="differ in array kind"):
        gather_tensor(torch.zeros(2, 2) if r % 2 else np.zeros((2, 2), dtype=np.float32), manager=m)
    # the domain communicator still works
    x = np.full((2, 1), float(r))
    assert gather_tensor(x, dim=1, manager=m).tolist() == [list(map(float, range(world.Get_size())))] * 2


@pytest.mark.mpi(min_size=2)
def test_local_error_on_one_rank_is_raised_on_every_rank(world, make_manager):
    m = make_manager()
    bad = m.domain_rank == 1
    with pytest.raises(ValueError, match=r"dim 5 is out of range .* \[on rank\(s\) 1 of credit_mpi.domain\[0\]\]"):
        gather_tensor(np.zeros((2, 2)), dim=5 if bad else 0, manager=m)
    with pytest.raises(TypeError, match=r"unsupported array type builtins.list.*\[on rank\(s\) 1 "):
        gather_tensor([1, 2] if bad else np.zeros(2), dim=0, manager=m)
    with pytest.raises(ValueError, match="ranks of the domain group passed different arrays"):
        shard_tensor(np.zeros((4, 2 + bad)), dim=0, manager=m, uneven=True, check="collective")


@pytest.mark.mpi(min_size=2)
def test_gather_scratch_for_small_slices_is_bounded(world, make_manager, rng, monkeypatch):
    """Small slices go through packed groups: the scratch never exceeds PACK_BYTES (one slice at least)."""
    from credit_mpi.transport import limits

    monkeypatch.setattr(limits, "PACK_BYTES", 1 << 15)
    m = make_manager()
    band = rng.standard_normal((64, 4, 256)).astype(np.float32)  # slices of n * 4 KiB < SLICE_BYTES
    out, peak = gather_with_peak(band, 1, m)
    slice_bytes = out.nbytes // 64
    assert peak - out.nbytes <= max(1 << 15, slice_bytes) + 8192, (peak, out.nbytes)


@pytest.mark.mpi(min_size=2)
def test_gather_extra_memory_is_small(world, make_manager, rng):
    """No list of n shards and no concatenate: the output is the only big allocation."""
    m = make_manager()
    band = rng.standard_normal((4, 64, 256)).astype(np.float32)
    out, peak = gather_with_peak(band, 1, m)
    assert peak - out.nbytes <= 0.25 * out.nbytes, (peak, out.nbytes)


@pytest.mark.mpi(min_size=2)
def test_gather_into_out(world, make_manager, rng):
    n = world.Get_size()
    m = make_manager()
    x = rng.standard_normal((2, 2 * n + 1, 3))
    band = shard_tensor(x, 1, m, uneven=True)
    out = np.empty_like(x)
    assert gather_tensor(band, 1, m, out=out) is out and bits_equal(out, x)
    out[:] = 0
    assert gather_tensor(band, 1, m, out=out, check=False) is out and bits_equal(out, x)
    t = torch.from_numpy(x)
    tout = torch.empty_like(t)
    assert gather_tensor(shard_tensor(t, 1, m, uneven=True), 1, m, out=tout) is tout and torch.equal(tout, t)
    with pytest.raises(ValueError, match=rf"out must be a C-contiguous numpy float64 array of shape \(2, {2 * n + 1}, 3\)"):
        gather_tensor(band, 1, m, out=np.empty((2, 2 * n, 3)))
    with pytest.raises(ValueError, match="or None on every rank"):
        gather_tensor(band, 1, m, out=out if m.domain_rank == 0 else None)
    with pytest.raises(ValueError, match="non-contiguous"):
        gather_tensor(band, 1, m, out=np.empty((3, 2 * n + 1, 2)).transpose(2, 1, 0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("device", [False, True], ids=["host", "device-memory"])
@pytest.mark.parametrize("slice_bytes,pack_bytes", [(0, 1 << 22), (1 << 40, 1 << 22), (1 << 40, 1)])
def test_both_gather_strategies(world, make_manager, rng, monkeypatch, slice_bytes, pack_bytes, device):
    """Per-slice Iallgather(v) and packed groups (one slice or several per group) give the same bits.

    ``device-memory`` takes the branches for buffers in GPU memory (blocking
    collectives; a stream sync before each reuse of the packing scratch),
    with host arrays standing in. (Host gathers on small domains go point
    to point: ``P2P_RANKS = 0`` turns that off here.)
    """
    from credit_mpi.transport import arrays, limits

    monkeypatch.setattr(limits, "P2P_RANKS", 0)
    monkeypatch.setattr(limits, "SLICE_BYTES", slice_bytes)
    monkeypatch.setattr(limits, "PACK_BYTES", pack_bytes)
    syncs = []
    if device:
        monkeypatch.setattr(arrays, "in_device_memory", lambda buf: True)
        monkeypatch.setattr(arrays, "sync_stream", syncs.append)
    m = make_manager()
    n = world.Get_size()
    for shape, dim in [((3, 2, 4 * n, 5), -2), ((3, 4 * n + 1, 7), 1), ((2, 3, n + 1), -1), ((4 * n + 3, 2), 0)]:
        x = rng.standard_normal(shape).astype(np.float32)
        band = shard_tensor(x, dim, m, uneven=True)
        syncs.clear()
        assert bits_equal(gather_tensor(band, dim, m), x)
        outer = int(np.prod(shape[: dim % len(shape)]))
        packed_groups = outer if (slice_bytes, pack_bytes) == (1 << 40, 1) and outer > 1 else 1
        assert len(syncs) == (packed_groups - 1 if device else 0), (shape, len(syncs))


class _BlockingOnly(MPI.Intracomm):
    """A communicator whose non-blocking all-gathers fail (what CUDA-aware Open MPI does with device pointers)."""

    def Iallgather(self, *args, **kwargs):
        raise AssertionError("Iallgather on device memory")

    def Iallgatherv(self, *args, **kwargs):
        raise AssertionError("Iallgatherv on device memory")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("uneven", [False, True])
def test_device_memory_slices_use_blocking_collectives(world, rng, monkeypatch, uneven):
    from credit_mpi.transport import arrays, limits

    monkeypatch.setattr(limits, "SLICE_BYTES", 0)  # one all-gather per outer slice
    monkeypatch.setattr(limits, "P2P_RANKS", 0)  # host memory too: the collective strategies
    monkeypatch.setattr(arrays, "in_device_memory", lambda buf: True)
    comm = _BlockingOnly(world)
    n, rank = world.Get_size(), world.Get_rank()
    sizes = [3 + (uneven and r == 0) for r in range(n)]
    x = rng.standard_normal((4, sum(sizes), 5)).astype(np.float32)
    start = sum(sizes[:rank])
    send = np.ascontiguousarray(x[:, start : start + sizes[rank]]).reshape(-1).view(np.uint8)
    out = np.empty_like(x)
    gather_op.allgather_rows(comm, send, out.reshape(-1).view(np.uint8), 4, sizes, 5 * 4)
    assert bits_equal(out, x)
    monkeypatch.setattr(arrays, "in_device_memory", lambda buf: False)
    with pytest.raises(AssertionError, match="on device memory"):  # the host path is non-blocking
        gather_op.allgather_rows(comm, send, out.reshape(-1).view(np.uint8), 4, sizes, 5 * 4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("p2p_ranks,slice_bytes", [(0, 1 << 18), (8, 1 << 40), (8, 0)], ids=["collective", "p2p-vector", "p2p-blocks"])
@pytest.mark.parametrize("sizes", ["even", "uneven", "empty bands"])
def test_point_to_point_gather(world, rng, monkeypatch, p2p_ranks, slice_bytes, sizes):
    """Point to point (a band in one vector-typed message, or a contiguous message per block) and collectives: the same bits.

    Even and uneven bands, and ranks with no rows at all (they send and
    receive nothing); a second gather of another shape right after it does
    not pick up any message of the first.
    """
    from credit_mpi.transport import limits

    monkeypatch.setattr(limits, "P2P_RANKS", p2p_ranks)
    monkeypatch.setattr(limits, "SLICE_BYTES", slice_bytes)
    n, rank = world.Get_size(), world.Get_rank()
    rows = {"even": [3] * n, "uneven": [3 + r % 2 for r in range(n)], "empty bands": [2 * (r % 2) for r in range(n)]}[sizes]
    for outer, row in [(4, 5), (1, 7), (3, 1)]:
        x = rng.standard_normal((outer, sum(rows), row)).astype(np.float32)
        world.Bcast(x)
        start = sum(rows[:rank])
        send = np.ascontiguousarray(x[:, start : start + rows[rank]]).reshape(-1).view(np.uint8)
        out = np.full_like(x, np.nan)
        gather_op.allgather_rows(world, send, out.reshape(-1).view(np.uint8), outer, rows, row * 4)
        assert bits_equal(out, x), (outer, row)


@pytest.mark.mpi(min_size=1)
def test_gather_into_out_with_one_rank_copies(make_manager, rng):
    x = rng.standard_normal((2, 3, 4))
    for manager in (None, make_manager(1)):
        out = np.zeros_like(x)
        assert gather_tensor(x, 1, manager, out=out) is out and bits_equal(out, x)
        t = torch.from_numpy(x)
        tout = torch.zeros_like(t)
        assert gather_tensor(t, 1, manager, out=tout) is tout and torch.equal(tout, t)
        with pytest.raises(ValueError, match="out must be a C-contiguous"):
            gather_tensor(x, 1, manager, out=np.zeros((2, 4, 4)))


@pytest.mark.mpi(min_size=2)
def test_one_element_strided_tensor(make_manager):
    """torch calls a one-element tensor contiguous whatever its stride (found by the property tests)."""
    m = make_manager()
    x = torch.arange(2 * m.domain_world_size, dtype=torch.float32)[::2]  # stride 2
    band = x[m.domain_rank : m.domain_rank + 1]
    assert band.is_contiguous() and band.stride() == (2,)
    assert torch.equal(gather_tensor(band, 0, m), x)
