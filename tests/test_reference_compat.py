"""The reference's documented sharding behaviour, with the manager stand-ins its unit tests use.

``credit.domain_parallel.sharding`` (shared/spec) documents ``shard_tensor``
as "Splits the tensor into equal chunks and returns only this rank's chunk":
a slice, no communication. Code and unit tests written for the reference
build the manager as a plain object or a ``unittest.mock.MagicMock`` with
only ``domain_parallel_size`` and ``domain_rank``; this module runs
credit_mpi with exactly such stand-ins, serially (every rank of an
``mpiexec`` job may run it too: nothing here communicates).

The single-process reference for a band is ``numpy.split`` /
``torch.chunk`` of the same global array (equal chunks), compared exactly.
"""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
import pytest
import torch
from mpi4py import MPI

import credit_mpi
from credit_mpi import gather_tensor, halo_exchange, scatter_tensor, shard_batch, shard_tensor, sharding, validation
from credit_mpi import manager as manager_module

# --------------------------------------------------------------------------- manager stand-ins


class TinyManager:
    """The smallest manager class a port would write: two attributes, nothing else."""

    def __init__(self, domain_parallel_size: int, domain_rank: int) -> None:
        self.domain_parallel_size = domain_parallel_size
        self.domain_rank = domain_rank


def namespace_manager(size: int, rank: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(domain_parallel_size=size, domain_rank=rank)


def mock_manager(size: int, rank: int) -> mock.MagicMock:
    """As the reference's tests do: a MagicMock with only the two attributes set (every other one is a mock)."""
    manager = mock.MagicMock()
    manager.domain_parallel_size = size
    manager.domain_rank = rank
    return manager


STAND_INS = {"SimpleNamespace": namespace_manager, "class": TinyManager, "MagicMock": mock_manager}


@pytest.fixture(params=list(STAND_INS))
def stand_in(request):
    """A factory ``(domain_parallel_size, domain_rank) -> manager stand-in``, one test per kind."""
    return STAND_INS[request.param]


@pytest.fixture(autouse=True)
def no_singleton(monkeypatch):
    """No global manager: ``manager=None`` means "no domain parallelism" here, as in a fresh process."""
    monkeypatch.setattr(manager_module, "_MANAGER", None)
    assert credit_mpi.get_domain_parallel_manager() is None


def make_array(kind: str, shape: tuple, dtype: str = "float64"):
    """A deterministic global array (values = flat index), numpy or torch."""
    x = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return x if kind == "numpy" else torch.from_numpy(x)


def reference_band(x, dim: int, n: int, rank: int):
    """The reference's chunk: equal split, this rank's piece (single process)."""
    if isinstance(x, np.ndarray):
        return np.split(x, n, axis=dim)[rank]
    return torch.chunk(x, n, dim=dim)[rank]


def assert_same_array(got, want) -> None:
    """Same kind, dtype, shape and values (exactly)."""
    assert type(got) is type(want), (type(got), type(want))
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
        got.dtype,
        got.shape,
        want.dtype,
        want.shape,
    )
    if isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want)
    else:
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- the reference's own unit-test style


def test_reference_style_shard_tensor_rank_1_of_4():
    manager = mock.MagicMock()
    manager.domain_parallel_size = 4
    manager.domain_rank = 1
    x = torch.arange(16.0).reshape(1, 1, 16, 1)
    result = shard_tensor(x, dim=-2, manager=manager)
    assert result.shape == (1, 1, 4, 1)
    assert torch.equal(result, torch.arange(4.0, 8.0).reshape(1, 1, 4, 1))


def test_reference_style_shard_tensor_5d():
    manager = mock.MagicMock()
    manager.domain_parallel_size = 2
    manager.domain_rank = 1
    x = torch.randn(2, 3, 2, 8, 16)  # B, C, T, H, W
    result = shard_tensor(x, dim=3, manager=manager)
    assert result.shape == (2, 3, 2, 4, 16)
    assert torch.equal(result, x[:, :, :, 4:8, :])


def test_reference_style_shard_tensor_indivisible():
    manager = mock.MagicMock()
    manager.domain_parallel_size = 3
    manager.domain_rank = 0
    with pytest.raises(ValueError, match="Cannot shard"):
        shard_tensor(torch.zeros(1, 1, 16, 4), dim=-2, manager=manager)


def test_reference_style_shard_tensor_single_rank():
    manager = mock.MagicMock()
    manager.domain_parallel_size = 1
    manager.domain_rank = 0
    x = torch.randn(1, 2, 8, 4)
    assert shard_tensor(x, manager=manager) is x


def test_reference_style_shard_batch():
    manager = mock.MagicMock()
    manager.domain_parallel_size = 2
    manager.domain_rank = 0
    batch = {
        "x": torch.randn(2, 3, 1, 8, 16),
        "y": torch.randn(2, 3, 8, 16),
        "static": torch.randn(8, 16),
        "forecast_hour": torch.tensor([6]),
        "index": 7,
    }
    result = shard_batch(batch, manager=manager)
    assert result["x"].shape == (2, 3, 1, 4, 16)
    assert result["y"].shape == (2, 3, 4, 16)
    assert torch.equal(result["x"], batch["x"][:, :, :, :4])
    assert torch.equal(result["y"], batch["y"][:, :, :4])
    assert result["static"] is batch["static"]
    assert result["forecast_hour"] is batch["forecast_hour"]
    assert result["index"] == 7


# --------------------------------------------------------------------------- shard_tensor, documented behaviour

# (global shape, dim): 4-D BCHW along H (-2 and 2), 5-D BCTHW along H (3 and -2), and the other dims.
SHARD_CASES = [
    ((2, 3, 24, 5), -2),
    ((2, 3, 24, 5), 2),
    ((1, 2, 2, 24, 6), 3),
    ((1, 2, 2, 24, 6), -2),
    ((24, 3), 0),
    ((3, 24), -1),
    ((2, 24, 3), 1),
]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("shape,dim", SHARD_CASES)
def test_every_rank_of_every_size(stand_in, kind, shape, dim):
    """Every rank of domains of 1..8 gets its equal chunk; the chunks put back together are the input."""
    x = make_array(kind, shape)
    for n in (1, 2, 3, 4, 6, 8):  # the divisors of 24 up to 8
        bands = []
        for rank in range(n):
            band = shard_tensor(x, dim, stand_in(n, rank))
            assert_same_array(band, reference_band(x, dim, n, rank))
            bands.append(band)
        whole = np.concatenate(bands, axis=dim) if kind == "numpy" else torch.cat(bands, dim=dim)
        assert_same_array(whole, x)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_values_of_rank_1(stand_in, kind):
    x = make_array(kind, (1, 1, 16, 1))
    band = shard_tensor(x, -2, stand_in(4, 1))
    assert tuple(band.shape) == (1, 1, 4, 1)
    assert [float(v) for v in band.reshape(-1)] == [4.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("dim", [3, -2])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_5d_along_lat(stand_in, kind, dim):
    """5-D (B, C, T, H, W): dim 3 and dim -2 are the same axis and give the same band."""
    x = make_array(kind, (2, 3, 4, 12, 5))
    band = shard_tensor(x, dim, stand_in(3, 1))
    assert tuple(band.shape) == (2, 3, 4, 4, 5)
    assert_same_array(band, x[:, :, :, 4:8, :])


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.int64, np.bool_, torch.float32, torch.bfloat16, torch.int32, torch.complex64]
)
def test_kind_and_dtype_are_kept(stand_in, dtype):
    if isinstance(dtype, torch.dtype):
        x = (torch.arange(2 * 8 * 3) % 5).reshape(2, 8, 3).to(dtype)
    else:
        x = (np.arange(2 * 8 * 3) % 5).reshape(2, 8, 3).astype(dtype)
    band = shard_tensor(x, 1, stand_in(2, 1))
    assert_same_array(band, reference_band(x, 1, 2, 1))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("shape,dim,n", [((1, 1, 10, 4), -2, 4), ((2, 3, 2, 7, 6), 3, 2), ((9, 2), 0, 4)])
def test_indivisible_is_a_value_error_in_the_reference_words(stand_in, kind, shape, dim, n):
    x = make_array(kind, shape)
    size = shape[dim]
    words = rf"^Cannot shard dim {dim} of size {size} evenly across {n} domain-parallel ranks"
    for rank in range(n):  # every rank raises the same (a local check of the same arguments)
        with pytest.raises(ValueError, match=words) as info:
            shard_tensor(x, dim, stand_in(n, rank))
        assert "uneven=True" in str(info.value)  # credit_mpi's extra help follows the reference's words


def test_uneven_opt_in_with_a_stand_in(stand_in):
    """credit_mpi's addition: ``uneven=True`` splits like numpy.array_split, still locally."""
    x = make_array("numpy", (2, 10, 3))
    bands = [shard_tensor(x, 1, stand_in(4, r), uneven=True) for r in range(4)]
    for band, want in zip(bands, np.array_split(x, 4, axis=1), strict=True):
        assert_same_array(band, want)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_size_one_and_no_manager_return_the_input_itself(stand_in, kind):
    x = make_array(kind, (1, 2, 7, 3))  # 7: not divisible by anything but 1, so nothing is split
    assert shard_tensor(x, -2, stand_in(1, 0)) is x
    assert shard_tensor(x, -2, None) is x
    assert shard_tensor(x) is x


def test_no_manager_uses_the_singleton(stand_in, monkeypatch):
    """``manager=None`` means the global singleton (here a stand-in put in its place)."""
    monkeypatch.setattr(manager_module, "_MANAGER", stand_in(4, 2))
    x = make_array("torch", (1, 1, 16, 2))
    assert_same_array(shard_tensor(x), x[:, :, 8:12])
    assert_same_array(shard_batch({"x": x})["x"], x[:, :, 8:12])


# --------------------------------------------------------------------------- shard_batch


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_shard_batch_with_a_stand_in(stand_in, kind):
    n = 4
    batch = {
        "x": make_array(kind, (2, 3, 2, 8, 5)),  # 5-D: sharded along -2
        "y": make_array(kind, (2, 4, 8, 5)),  # 4-D: sharded along -2
        "one_d": make_array(kind, (8,)),
        "two_d": make_array(kind, (8, 5)),
        "three_d": make_array(kind, (3, 8, 5)),
        "name": "era5",
        "step": 3,
        "dates": ["2020-01-01", "2020-01-02"],
        "nothing": None,
    }
    for rank in range(n):
        out = shard_batch(batch, manager=stand_in(n, rank))
        assert out is not batch and list(out) == list(batch)
        assert_same_array(out["x"], reference_band(batch["x"], -2, n, rank))
        assert_same_array(out["y"], reference_band(batch["y"], -2, n, rank))
        for key in ("one_d", "two_d", "three_d", "name", "step", "dates", "nothing"):
            assert out[key] is batch[key], key
    assert tuple(batch["x"].shape) == (2, 3, 2, 8, 5)  # the input dict is not changed


def test_shard_batch_other_dims(stand_in):
    """``spatial_dims_5d`` / ``spatial_dims_4d`` pick the dimension per rank count of dims."""
    batch = {"x": make_array("torch", (2, 6, 4, 3, 5)), "y": make_array("numpy", (6, 2, 3, 4))}
    out = shard_batch(batch, spatial_dims_5d=1, spatial_dims_4d=0, manager=stand_in(3, 2))
    assert_same_array(out["x"], batch["x"][:, 4:6])
    assert_same_array(out["y"], batch["y"][4:6])


def test_shard_batch_size_one_and_no_manager(stand_in):
    batch = {"x": make_array("torch", (1, 1, 2, 7, 3)), "step": 1}
    for manager in (stand_in(1, 0), None):
        out = shard_batch(batch, manager=manager)
        assert out is batch  # credit_mpi: the input comes back unchanged
        assert out["x"] is batch["x"]


def test_shard_batch_indivisible(stand_in):
    batch = {"ok": make_array("torch", (1, 1, 8, 2)), "bad": make_array("numpy", (1, 1, 2, 10, 2))}
    with pytest.raises(
        ValueError, match=r"^Cannot shard dim -2 of size 10 evenly across 4 domain-parallel ranks.*in batch\['bad'\]"
    ):
        shard_batch(batch, manager=stand_in(4, 3))


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("shape,dim", [((1, 2, 12, 3), -2), ((2, 1, 2, 12, 3), 3), ((12, 4), 0)])
def test_shard_tensor_gradient_is_the_slice_gradient(stand_in, shape, dim):
    g = torch.Generator().manual_seed(11)
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    for n, rank in ((3, 1), (4, 3), (2, 0)):
        x = base.clone().requires_grad_(True)
        ref = base.clone().requires_grad_(True)
        band = shard_tensor(x, dim, stand_in(n, rank))
        want = reference_band(ref, dim, n, rank)
        assert band.requires_grad
        weight = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (band * weight).sum().backward()
        (want * weight).sum().backward()
        assert torch.equal(x.grad, ref.grad)
        assert torch.count_nonzero(x.grad) == weight.numel()  # this rank's rows only, zeros elsewhere


def test_shard_batch_gradient_is_the_slice_gradient(stand_in):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 2, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    out = shard_batch({"x": x, "y": y}, manager=stand_in(2, 1))
    (out["x"].square().sum() + 3 * out["y"].sum()).backward()
    want_x = torch.zeros_like(x)
    want_x[..., 4:8, :] = 2 * x.detach()[..., 4:8, :]
    want_y = torch.zeros_like(y)
    want_y[..., 4:8, :] = 3
    assert torch.equal(x.grad, want_x) and torch.equal(y.grad, want_y)


# --------------------------------------------------------------------------- no MPI call


class RecordingComm(MPI.Intracomm):
    """A handle on COMM_SELF that records every attribute used on it (every MPI call goes through one)."""

    def __getattribute__(self, name):
        if not name.startswith("__") and name != "used":
            object.__getattribute__(self, "used").append(name)
        return super().__getattribute__(name)


def recording_manager(size: int, rank: int) -> TinyManager:
    manager = TinyManager(size, rank)
    comm = RecordingComm(MPI.COMM_SELF)
    object.__setattr__(comm, "used", [])
    manager.domain_group = comm
    return manager


def _forbidden(*args, **kwargs):
    raise AssertionError("credit_mpi made an agreement (an MPI collective) in a local function")


@pytest.fixture
def mpi_forbidden(monkeypatch):
    """Every way credit_mpi reaches MPI from the sharding functions raises."""
    monkeypatch.setattr(validation, "agree", _forbidden)
    monkeypatch.setattr(validation, "allgather_or_raise", _forbidden)
    monkeypatch.setattr(sharding, "_agree", _forbidden)  # the collective check (the shard ops through the engine)
    monkeypatch.setattr(sharding, "run_args", _forbidden)
    monkeypatch.setattr(manager_module.Domain, "comm", property(_forbidden))


def test_the_no_mpi_harness_sees_the_collective_path():
    """The recorder and the patches lie on the collective path (so their silence below means something)."""
    manager = recording_manager(2, 0)  # size 2 over COMM_SELF: the agreement runs on one process, no partner needed
    x = make_array("numpy", (2, 8, 3))
    assert_same_array(shard_tensor(x, 1, manager, check="collective"), x[:, :4])
    assert {"Get_size", "Allgather"} <= set(manager.domain_group.used)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sharding, "_agree", _forbidden)
        with pytest.raises(AssertionError, match="agreement"):
            shard_tensor(x, 1, recording_manager(2, 0), check="collective")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_shard_tensor_and_shard_batch_make_no_mpi_call(mpi_forbidden, kind):
    for n in (2, 3, 4):
        for rank in range(n):
            manager = recording_manager(n, rank)
            x = make_array(kind, (2, 3, 12, 4))
            assert_same_array(shard_tensor(x, -2, manager), reference_band(x, -2, n, rank))
            assert_same_array(shard_tensor(x, -2, manager, check="local"), reference_band(x, -2, n, rank))
            assert_same_array(shard_tensor(x, -2, manager, check=False), reference_band(x, -2, n, rank))
            batch = {"x": make_array(kind, (1, 2, 2, 12, 4)), "y": x, "step": 5}
            out = shard_batch(batch, manager=manager)
            assert_same_array(out["x"], reference_band(batch["x"], -2, n, rank))
            with pytest.raises(ValueError, match="^Cannot shard"):
                shard_tensor(make_array(kind, (1, 1, 13, 2)), -2, manager)
            assert manager.domain_group.used == []
    grad = torch.zeros(1, 1, 12, 2, requires_grad=True)
    shard_tensor(grad, -2, recording_manager(4, 1)).sum().backward()
    assert grad.grad.sum() == 6


# --------------------------------------------------------------------------- what needs a real manager


@pytest.mark.parametrize("check", ["collective", True])
def test_collective_check_with_a_stand_in_names_domain_group(stand_in, check):
    x = make_array("numpy", (1, 1, 8, 2))
    for call in (
        lambda m: shard_tensor(x, -2, m, check=check),
        lambda m: shard_batch({"x": x}, manager=m, check=check),
    ):
        with pytest.raises(TypeError, match=r"domain_group=.*mpi4py intracommunicator.*DomainParallelManager"):
            call(stand_in(2, 0))
    # a domain of one communicates nothing, so the stand-in is enough
    assert shard_tensor(x, -2, stand_in(1, 0), check=check) is x


@pytest.mark.parametrize("check", ["global", "Collective", "", None, 1, 0, "true"])
def test_invalid_check_is_a_value_error(stand_in, check):
    x = make_array("numpy", (1, 1, 8, 2))
    for manager in (stand_in(2, 1), stand_in(1, 0), None):  # checked whatever the domain size
        with pytest.raises(
            ValueError, match=r"check must be 'local' or 'collective' \(or True / False\), got " + repr(check)
        ):
            shard_tensor(x, -2, manager, check=check)
        with pytest.raises(ValueError, match=r"check must be 'local' or 'collective'"):
            shard_batch({"x": x}, manager=manager, check=check)


def test_collective_functions_with_a_stand_in_name_domain_group(stand_in):
    band = make_array("numpy", (1, 1, 4, 2))
    manager = stand_in(2, 1)
    calls = {
        "gather_tensor": lambda: gather_tensor(band, -2, manager),
        "scatter_tensor": lambda: scatter_tensor(band, -2, manager),
        "halo_exchange": lambda: halo_exchange(band, 1, -2, manager),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"manager {type(manager).__name__} has domain_group=") as info:
            call()
        assert "only shard_tensor and shard_batch (local) work with a manager stand-in" in str(info.value), name
    # a domain of one: the gather is the identity, as in the reference
    assert gather_tensor(band, -2, stand_in(1, 0)) is band


def test_incomplete_stand_ins_are_refused_clearly():
    x = make_array("numpy", (1, 1, 8, 2))
    with pytest.raises(TypeError, match="SimpleNamespace has no domain_rank"):
        shard_tensor(x, -2, types.SimpleNamespace(domain_parallel_size=2))
    with pytest.raises(TypeError, match="has no domain_parallel_size"):
        shard_tensor(x, -2, types.SimpleNamespace(domain_rank=0))
    with pytest.raises(ValueError, match="domain_rank=2 is out of range for domain_parallel_size=2"):
        shard_tensor(x, -2, namespace_manager(2, 2))
    with pytest.raises(ValueError, match="manager.domain_parallel_size must be >= 1, got 0"):
        shard_tensor(x, -2, namespace_manager(0, 0))
    with pytest.raises(TypeError, match="manager.domain_rank must be an int, got float 0.5"):
        shard_tensor(x, -2, namespace_manager(2, 0.5))
    bare = mock.MagicMock()  # domain_rank left unset: a MagicMock answers __index__ with 1; not taken for a rank
    bare.domain_parallel_size = 2
    with pytest.raises(TypeError, match="manager.domain_rank must be an int, got MagicMock"):
        shard_tensor(x, -2, bare)
