"""The torch.distributed bridge: mirrored groups, the torch transport, bad input.

MPI tests run with the gloo backend on CPU (the same code path as NCCL but
the backend name); the NCCL tests are in the ``gpu`` group and skip without
a GPU. Every test leaves torch.distributed uninitialised.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import DomainParallelError, gather_tensor, shard_batch, shard_tensor

from .conftest import domain_sizes, reset_torch_distributed, run_python

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from credit_mpi import torch_bridge  # noqa: E402 (after the skips: needs torch.distributed)

TIMEOUT = timedelta(seconds=60)


@pytest.fixture(autouse=True)
def clean_torch():
    """No test may leave a torch default group behind (the next would see it)."""
    yield
    reset_torch_distributed()


def _mpi_ranks(sub: MPI.Comm, parent: MPI.Comm) -> list[int]:
    """Parent-communicator ranks of every member of ``sub``, in ``sub``'s order."""
    return sub.Get_group().Translate_ranks(list(range(sub.Get_size())), parent.Get_group())


def _user_init(rank: int, size: int) -> None:
    """Initialise torch.distributed the way a user might, with the given rank."""
    world = MPI.COMM_WORLD
    store = None
    if world.Get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    port = world.bcast(store.port if store is not None else None)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)


# -- serial ------------------------------------------------------------------


def test_import_does_not_import_torch():
    code = (
        "import sys, credit_mpi; assert 'torch' not in sys.modules, 'torch imported'; "
        "f = credit_mpi.init_torch_distributed; assert 'torch' in sys.modules; "
        "assert f is credit_mpi.torch_bridge.init_torch_distributed; "
        "from credit_mpi import *"
    )
    run_python(code)


def test_bad_transport_is_a_value_error():
    x = np.zeros((4, 4))
    with pytest.raises(ValueError, match="transport must be 'mpi' or 'torch', got 'nccl'"):
        gather_tensor(x, transport="nccl")
    with pytest.raises(ValueError, match="transport"):
        shard_batch({"x": x}, transport=None)


@pytest.mark.parametrize("timeout", [0, -1.0, "10", timedelta(seconds=0)])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        torch_bridge._timeout(timeout)


def test_no_manager_is_a_value_error():
    credit_mpi.destroy_domain_parallel()
    with pytest.raises(ValueError, match="initialize_domain_parallel"):
        credit_mpi.init_torch_distributed()


# -- MPI: the groups mirror the communicators -----------------------------------


@pytest.mark.mpi(min_size=1)
def test_groups_mirror_communicators(make_manager):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    for d in domain_sizes(n):
        manager = make_manager(d)
        assert credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT) is manager
        assert dist.get_rank() == world.Get_rank() and dist.get_world_size() == n
        domain = dist.get_process_group_ranks(manager.torch_domain_group)
        data_parallel = dist.get_process_group_ranks(manager.torch_data_parallel_group)
        assert domain == _mpi_ranks(manager.domain_group, world)
        assert data_parallel == _mpi_ranks(manager.data_parallel_group, world)
        assert dist.get_rank(manager.torch_domain_group) == manager.domain_rank
        assert dist.get_rank(manager.torch_data_parallel_group) == manager.dp_rank

        mesh = manager.device_mesh
        assert mesh.mesh_dim_names == ("dp", "domain")
        assert mesh.mesh.tolist() == np.arange(n).reshape(n // d, d).tolist()
        assert mesh.get_group("domain") is manager.torch_domain_group
        assert mesh.get_group("dp") is manager.torch_data_parallel_group
        assert mesh.get_local_rank("domain") == manager.domain_rank
        assert mesh.get_local_rank("dp") == manager.dp_rank

        credit_mpi.destroy_torch_distributed(manager)
        assert manager.torch_domain_group is None and manager.device_mesh is None
        assert not dist.is_initialized()
        manager.free()


@pytest.mark.mpi(min_size=1)
def test_allreduce_over_mirrored_groups_equals_mpi(make_manager):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    rng = np.random.default_rng(1000 + world.Get_rank())  # different data per rank
    for d in domain_sizes(n):
        manager = credit_mpi.init_torch_distributed(make_manager(d), "gloo", timeout=TIMEOUT)
        for mpi_comm, torch_group in (
            (manager.data_parallel_group, manager.torch_data_parallel_group),
            (manager.domain_group, manager.torch_domain_group),
        ):
            local = rng.integers(-(2**40), 2**40, size=37, dtype=np.int64)
            expected = np.empty_like(local)
            mpi_comm.Allreduce(local, expected, op=MPI.SUM)
            got = torch.from_numpy(local.copy())
            dist.all_reduce(got, group=torch_group)
            np.testing.assert_array_equal(got.numpy(), expected)
        manager.free()
        assert not dist.is_initialized()


# -- MPI: the torch transport ------------------------------------------------


def _bits(a):
    """Raw bytes of a numpy array or CPU tensor, for bit-for-bit comparison."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).view(np.uint8).tobytes()
    return a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


CASES = [
    # (shape, dim, dtype, uneven)
    ((2, 3, 12, 5), -2, "float32", False),  # 12 rows divide evenly over 1..4 ranks
    ((2, 3, 7, 5), -2, "float32", True),
    ((2, 3, 7, 5), -2, "bfloat16", True),
    ((2, 3, 12, 6), -2, "bfloat16", False),
    ((12, 2, 3), 0, "float32", False),  # leading dim: bands are contiguous
    ((2, 1, 3, 9, 4), -2, "float64", True),
    ((5, 3, 4), 0, "float16", True),
    ((3, 4, 11), -1, "bool", True),
    ((2, 2), -2, "int8", True),  # fewer rows than ranks: some bands are empty
    # slices of >= sharding.SLICE_BYTES: gathered per outer slice, straight into place
    ((2, 3, 12, 2048), -2, "float32", False),
    ((3, 12, 4096), 1, "bfloat16", False),
    ((2, 13, 2048), 1, "float32", True),
]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_torch_transport_gathers_like_mpi(make_manager, rng, kind):
    n = MPI.COMM_WORLD.Get_size()
    for d in domain_sizes(n):
        manager = credit_mpi.init_torch_distributed(make_manager(d), "gloo", timeout=TIMEOUT)
        for shape, dim, dtype, uneven in CASES:
            if dtype == "bfloat16" and kind == "numpy":
                continue  # numpy has no bfloat16
            full = torch.from_numpy(rng.standard_normal(shape) * 100)
            full = (full > 0) if dtype == "bool" else full.to(getattr(torch, dtype))
            if kind == "numpy":
                full = full.numpy()
            band = shard_tensor(full, dim, manager, uneven=uneven)
            for check in (True, False):
                via_mpi = gather_tensor(band, dim, manager, check=check)
                via_torch = gather_tensor(band, dim, manager, check=check, transport="torch")
                assert type(via_torch) is type(full) and via_torch.dtype == full.dtype
                assert tuple(via_torch.shape) == tuple(full.shape)
                assert _bits(via_torch) == _bits(via_mpi) == _bits(full), (shape, dim, dtype, d, check)
        manager.free()


@pytest.mark.mpi(min_size=1)
def test_torch_transport_non_contiguous_input(make_manager, rng):
    n = MPI.COMM_WORLD.Get_size()
    manager = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    full = torch.from_numpy(rng.standard_normal((3, 2 * n, 5)))
    band = shard_tensor(full, 1, manager).transpose(0, 2).contiguous().transpose(0, 2)
    assert not band.is_contiguous()
    assert torch.equal(gather_tensor(band, 1, manager, transport="torch"), full)


@pytest.mark.mpi(min_size=2)  # on one rank gather_tensor returns x, ignoring out= (main's behaviour)
def test_torch_transport_into_out(make_manager, rng):
    n = MPI.COMM_WORLD.Get_size()
    manager = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    full = rng.standard_normal((2, 3 * n + 1, 4)).astype(np.float32)
    band = shard_tensor(full, 1, manager, uneven=True)
    out = np.full_like(full, np.nan)
    assert gather_tensor(band, 1, manager, out=out, transport="torch") is out
    assert _bits(out) == _bits(full)


@pytest.mark.mpi(min_size=1)
def test_shard_batch_torch_transport(make_manager, rng):
    n = MPI.COMM_WORLD.Get_size()
    manager = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    batch = {
        "x": torch.from_numpy(rng.standard_normal((2, 3, 2, 5 * n, 4))),
        "y": rng.standard_normal((2, 3, 5 * n + 1, 4)),
        "t": 7,
    }
    via_mpi = shard_batch(batch, manager=manager, uneven=True)
    via_torch = shard_batch(batch, manager=manager, uneven=True, transport="torch")
    assert via_torch.keys() == via_mpi.keys() and via_torch["t"] == 7
    for key in ("x", "y"):
        assert _bits(via_torch[key]) == _bits(via_mpi[key])


@pytest.mark.mpi(min_size=2)
def test_torch_transport_without_bridge_is_a_clear_error(make_manager):
    manager = make_manager(MPI.COMM_WORLD.Get_size())
    band = np.zeros((2, 3))
    with pytest.raises(DomainParallelError, match="init_torch_distributed"):
        gather_tensor(band, 0, manager, transport="torch")
    with pytest.raises(DomainParallelError, match="init_torch_distributed"):
        shard_batch({"x": np.zeros((1, 1, 4, 4))}, manager=manager, transport="torch")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("boundary", ["zero", "periodic", "reflect", "earth"])
def test_halo_torch_transport_like_mpi(make_manager, rng, boundary):
    n = MPI.COMM_WORLD.Get_size()
    for d in domain_sizes(n):
        manager = credit_mpi.init_torch_distributed(make_manager(d), "gloo", timeout=TIMEOUT)
        for shape, dtype, width in (
            ((2, 3, 4 * d + 1, 6), "float32", 2),  # uneven bands
            ((2, 1, 3 * d, 8), "bfloat16", 1),
            ((1, 2, 2, 4 * d, 4), "float64", 3),
            ((2, 2 * d, 4), "bool", 0),
        ):
            full = torch.from_numpy(rng.standard_normal(shape) * 10)
            full = (full > 0) if dtype == "bool" else full.to(getattr(torch, dtype))
            for kind in ("numpy", "torch"):
                if kind == "numpy" and dtype == "bfloat16":
                    continue
                band = shard_tensor(full if kind == "torch" else full.numpy(), -2, manager, uneven=True)
                via_mpi = credit_mpi.halo_exchange(band, width, -2, manager, boundary=boundary)
                via_torch = credit_mpi.halo_exchange(band, width, -2, manager, boundary=boundary, transport="torch")
                assert type(via_torch) is type(via_mpi) and tuple(via_torch.shape) == tuple(via_mpi.shape)
                assert _bits(via_torch) == _bits(via_mpi), (shape, dtype, width, d, kind)
        manager.free()


@pytest.mark.mpi(min_size=2)
def test_halo_torch_transport_forward_with_grad(make_manager, rng, monkeypatch):
    """Forward and backward both move rows over the torch group (the backward: halo gradients go home)."""
    from credit_mpi.transport import torch_moves

    calls = []
    real = torch_moves.TorchMoves.exchange
    monkeypatch.setattr(torch_moves.TorchMoves, "exchange", lambda *args: calls.append(1) or real(*args))
    n = MPI.COMM_WORLD.Get_size()
    manager = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    band = shard_tensor(torch.from_numpy(rng.standard_normal((1, 2, 3 * n, 4))), -2, manager)
    x = band.clone().requires_grad_(True)
    y = band.clone().requires_grad_(True)
    via_torch = credit_mpi.halo_exchange(x, 1, manager=manager, boundary="periodic", transport="torch")
    via_mpi = credit_mpi.halo_exchange(y, 1, manager=manager, boundary="periodic")
    assert torch.equal(via_torch, via_mpi)
    via_torch.square().sum().backward()
    via_mpi.square().sum().backward()
    assert torch.equal(x.grad, y.grad)
    assert len(calls) == 2  # one forward, one backward


@pytest.mark.mpi(min_size=2)
def test_halo_torch_transport_without_bridge(make_manager):
    manager = make_manager(MPI.COMM_WORLD.Get_size())
    with pytest.raises(DomainParallelError, match="init_torch_distributed"):
        credit_mpi.halo_exchange(np.zeros((2, 4)), 1, 0, manager, transport="torch")


def test_halo_bad_transport():
    with pytest.raises(ValueError, match="transport must be 'mpi' or 'torch'"):
        credit_mpi.halo_exchange(np.zeros((2, 4)), 1, 0, transport="gloo")


# -- MPI: existing torch.distributed, teardown ----------------------------------------


@pytest.mark.mpi(min_size=1)
def test_user_initialised_torch_is_kept(make_manager):
    world = MPI.COMM_WORLD
    _user_init(world.Get_rank(), world.Get_size())
    manager = make_manager(1)
    credit_mpi.init_torch_distributed(manager, timeout=TIMEOUT)  # backend None: keep gloo
    assert dist.get_backend(manager.torch_domain_group) == "gloo"
    assert dist.get_process_group_ranks(manager.torch_data_parallel_group) == list(range(world.Get_size()))
    manager.free()  # destroys the bridge's groups, not the user's default group
    assert manager.torch_domain_group is None
    assert dist.is_initialized()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world.Get_size()


@pytest.mark.mpi(min_size=1)
def test_two_managers_share_the_default_group(make_manager):
    n = MPI.COMM_WORLD.Get_size()
    first = credit_mpi.init_torch_distributed(make_manager(n), "gloo", timeout=TIMEOUT)
    second = credit_mpi.init_torch_distributed(make_manager(1), timeout=TIMEOUT)
    credit_mpi.destroy_torch_distributed(first)
    assert dist.is_initialized()  # still used by the second bridge
    assert dist.get_process_group_ranks(second.torch_domain_group) == [MPI.COMM_WORLD.Get_rank()]
    second.free()
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_singleton_manager_and_teardown_through_destroy_domain_parallel():
    credit_mpi.initialize_domain_parallel(None, 1)
    manager = credit_mpi.init_torch_distributed(backend="gloo", timeout=TIMEOUT)
    assert manager is credit_mpi.get_domain_parallel_manager()
    credit_mpi.destroy_domain_parallel()
    assert manager.freed and manager.torch_domain_group is None
    assert not dist.is_initialized()


# -- MPI: bad input ------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["nosuch", "", 3])
def test_unknown_backend(make_manager, backend):
    manager = make_manager(1)
    with pytest.raises(ValueError, match="backend"):
        credit_mpi.init_torch_distributed(manager, backend, timeout=TIMEOUT)
    assert not dist.is_initialized() and manager.torch_domain_group is None


@pytest.mark.mpi(min_size=1)
def test_nccl_without_cuda(make_manager):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="'nccl'"):
        credit_mpi.init_torch_distributed(make_manager(1), "nccl", timeout=TIMEOUT)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_failure_while_building_groups_leaves_torch_as_it_was(make_manager, monkeypatch):
    """An error after the default group was made (here: in the device mesh) destroys it, so a retry works."""
    manager = make_manager()

    def broken(*args):
        raise RuntimeError("injected failure while building the device mesh")

    monkeypatch.setattr(torch_bridge, "_device_mesh", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
    assert not dist.is_initialized() and manager.torch_domain_group is None
    monkeypatch.undo()
    assert credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT).torch_domain_group is not None
    credit_mpi.destroy_torch_distributed(manager)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_init_twice(make_manager):
    manager = credit_mpi.init_torch_distributed(make_manager(1), "gloo", timeout=TIMEOUT)
    group = manager.torch_domain_group
    with pytest.raises(ValueError, match="already called for this manager"):
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
    assert manager.torch_domain_group is group  # the first bridge is intact
    manager.free()
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=2)
def test_torch_world_of_another_size(make_manager):
    # Every rank is its own one-rank torch world.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    manager = make_manager(1)
    with pytest.raises(DomainParallelError, match="world size 1"):
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=TIMEOUT)
    assert manager.torch_domain_group is None


@pytest.mark.mpi(min_size=2)
def test_torch_rank_order_differs_from_mpi(make_manager):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    _user_init(n - 1 - world.Get_rank(), n)
    manager = make_manager(1)
    with pytest.raises(DomainParallelError, match="rank order differs.*MPI rank 0 is torch rank"):
        credit_mpi.init_torch_distributed(manager, timeout=TIMEOUT)
    assert manager.torch_domain_group is None


@pytest.mark.mpi(min_size=2)
def test_torch_initialised_on_some_ranks_only(make_manager):
    if MPI.COMM_WORLD.Get_rank() == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(DomainParallelError, match="initialised on rank"):
        credit_mpi.init_torch_distributed(make_manager(1), "gloo", timeout=TIMEOUT)


# -- GPU: NCCL -----------------------------------------------------------------


def _nccl_skip_reason():
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected")."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from credit_mpi import gpu as gpu_module

    _, local_size = gpu_module.local_rank(MPI.COMM_WORLD)
    if local_size > torch.cuda.device_count():
        return f"NCCL needs one GPU per rank: {local_size} ranks on this node, {torch.cuda.device_count()} GPU(s)"
    return None


@pytest.fixture
def nccl_ready():
    reason = _nccl_skip_reason()
    if reason:
        pytest.skip(reason)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.mpi(min_size=1)
def test_nccl_groups_and_allreduce(make_manager, nccl_ready):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    for d in domain_sizes(n):
        manager = credit_mpi.init_torch_distributed(make_manager(d), timeout=TIMEOUT)  # None -> nccl
        assert dist.get_backend(manager.torch_domain_group) == "nccl"
        assert manager.device_mesh.device_type == "cuda"
        assert dist.get_process_group_ranks(manager.torch_domain_group) == _mpi_ranks(manager.domain_group, world)
        local = torch.arange(5, dtype=torch.int64, device="cuda") + world.Get_rank()
        expected = np.empty(5, dtype=np.int64)
        manager.data_parallel_group.Allreduce(local.cpu().numpy(), expected, op=MPI.SUM)
        dist.all_reduce(local, group=manager.torch_data_parallel_group)
        np.testing.assert_array_equal(local.cpu().numpy(), expected)
        manager.free()


@pytest.mark.gpu
@gpu
@pytest.mark.mpi(min_size=1)
def test_nccl_transport_gathers_like_mpi(make_manager, rng, nccl_ready):
    n = MPI.COMM_WORLD.Get_size()
    manager = credit_mpi.init_torch_distributed(make_manager(n), "nccl", timeout=TIMEOUT)
    full = rng.standard_normal((2, 3, 4 * n + 1, 5)).astype(np.float32)
    band = shard_tensor(full, -2, manager, uneven=True)
    assert _bits(gather_tensor(band, -2, manager, transport="torch")) == _bits(full)
    cuda_full = torch.from_numpy(full).to(torch.bfloat16).cuda()
    cuda_band = shard_tensor(cuda_full, -2, manager, uneven=True)
    got = gather_tensor(cuda_band, -2, manager, transport="torch")
    assert got.is_cuda and torch.equal(got.view(torch.int16), cuda_full.view(torch.int16))
    assert torch.equal(gather_tensor(cuda_band, -2, manager).view(torch.int16), got.view(torch.int16))
    padded = credit_mpi.halo_exchange(cuda_band, 1, manager=manager, boundary="earth", transport="torch")
    expected = credit_mpi.halo_exchange(cuda_band, 1, manager=manager, boundary="earth")
    assert padded.is_cuda and torch.equal(padded.view(torch.int16), expected.view(torch.int16))
    manager.free()


def test_halo_module_takes_a_transport():
    module = credit_mpi.HaloExchange(1, boundary="periodic", transport="torch")
    assert module.transport == "torch" and "transport='torch'" in repr(module)
    with pytest.raises(ValueError, match="transport must be 'mpi' or 'torch', got 'nccl'"):
        credit_mpi.HaloExchange(1, transport="nccl")


# -- NCCL needs one GPU per rank (checked on CPU with CUDA faked) ---------------


def _fake_cuda(monkeypatch, gpus: int, uuid=lambda index: f"GPU-{index}") -> None:
    """torch sees ``gpus`` CUDA devices; device ``i`` has UUID ``uuid(i)``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuid(index)))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    real = dist.is_backend_available
    monkeypatch.setattr(dist, "is_backend_available", lambda name: name == "nccl" or real(name))


def test_automatic_backend_avoids_nccl_when_ranks_share_a_gpu(monkeypatch):
    _fake_cuda(monkeypatch, 1)
    assert torch_bridge._choose_backend(None, False, None) == "nccl"
    assert torch_bridge._choose_backend(None, False, "4 ranks on this node share 1 GPU(s)") == "gloo"
    assert torch_bridge._choose_backend(None, True, "shared") is None  # keeps the user's default group


@pytest.mark.mpi(min_size=2)
def test_explicit_nccl_with_ranks_sharing_a_gpu_fails_everywhere(make_manager, monkeypatch):
    _fake_cuda(monkeypatch, 1)  # every rank of this job is on one node that has one GPU
    with pytest.raises(ValueError, match=r"ranks \[0, 1.*share GPU GPU-0 on .*NCCL needs one GPU per rank.*backend='gloo'"):
        credit_mpi.init_torch_distributed(make_manager(), "nccl", timeout=TIMEOUT)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=2)
def test_ranks_that_each_see_their_own_gpu_do_not_share(world, monkeypatch):
    """One visible GPU per rank (CUDA_VISIBLE_DEVICES per rank): different devices, NCCL is fine."""
    _fake_cuda(monkeypatch, 1, uuid=lambda index: f"GPU-of-rank-{world.Get_rank()}")
    assert torch_bridge._ranks_per_gpu_over_one(world) is None
    _fake_cuda(monkeypatch, 2)  # two GPUs on the node: ranks r and r + 2 share GPU-(r % 2)
    rank, size = world.Get_rank(), world.Get_size()
    reason = torch_bridge._ranks_per_gpu_over_one(world)
    assert (reason is None) == (rank + 2 >= size and rank - 2 < 0), reason
