"""CUDA-awareness detection and agreement, device binding, and (marker
``gpu``) the transport on real CUDA arrays.

The ``gpu`` tests skip cleanly without a GPU; ``tools/gpu-check`` runs them
on a GPU machine, serially and on several ranks sharing one GPU.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import gpu
from credit_mpi.transport import arrays, staging
from credit_mpi.validation import DomainParallelError


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Detection from the real environment (no override) and no device binding, restored afterwards."""
    monkeypatch.delenv(gpu.ENV_OVERRIDE, raising=False)
    for name in gpu._ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu, "_BOUND", None)
    monkeypatch.setattr(staging, "_WARNED_STAGING", False)
    monkeypatch.setattr(staging, "_ROUTES", staging.collections.Counter())
    yield
    staging.release_staging_buffers()


@pytest.fixture
def fresh(world):
    """A fresh duplicate of COMM_WORLD (collective), so no verdict is cached on it yet."""
    comm = world.Dup()
    yield comm
    comm.Free()




def _signals(override=None, value=None, kinds=None, env=None, mpi="Some MPI 1.0"):
    return {
        "override": override,
        "library": {"value": value, "symbol": None if value is None else "MPIX_Query_cuda_support", "library": "libmpi.so"},
        "memory_alloc_kinds": kinds,
        "env": env or {},
        "mpi": mpi,
    }


# --------------------------------------------------------------------------- serial: detection


def test_mpich_wheel_is_not_cuda_aware_and_says_why(self_comm):
    if not MPI.Get_library_version().startswith("MPICH"):
        pytest.skip("checks the PyPI mpich wheel's answer")
    report = gpu.cuda_awareness_report(self_comm)
    local = report["local"]
    if local["library"]["value"] != 0:
        pytest.skip(f"this MPICH reports CUDA support: {report['reason']}")
    assert report["cuda_aware"] is False and gpu.is_cuda_aware(self_comm) is False
    assert report["reason"].startswith("not CUDA-aware: MPICH")
    assert "MPIX_Query_cuda_support() returned 0" in report["reason"]
    assert "libmpi" in local["library"]["library"]
    assert local["override"] is None and report["agreed"] is True
    if local["memory_alloc_kinds"] is not None:  # MPICH >= 4.2 answers the MPI-4.1 info key
        assert "cuda" not in local["memory_alloc_kinds"]
        assert "mpi_memory_alloc_kinds" in report["reason"]


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("0", False), ("off", False)])
def test_override_wins(value, expected, monkeypatch, self_comm):
    monkeypatch.setenv(gpu.ENV_OVERRIDE, value)
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "0")  # would say "no" without the override
    report = gpu.cuda_awareness_report(self_comm)
    assert report["cuda_aware"] is expected
    assert f"{gpu.ENV_OVERRIDE}={value} overrides detection" in report["reason"]


def test_override_auto_detects(monkeypatch, self_comm):
    monkeypatch.setenv(gpu.ENV_OVERRIDE, "auto")
    report = gpu.cuda_awareness_report(self_comm)
    assert report["local"]["override"] is None and "overrides" not in report["reason"]


def test_bad_override_is_a_clear_error(monkeypatch, self_comm):
    monkeypatch.setenv(gpu.ENV_OVERRIDE, "maybe")
    with pytest.raises(ValueError, match=r"CREDIT_MPI_CUDA_AWARE='maybe'.*auto.*1.*0"):
        gpu.is_cuda_aware(self_comm)


@pytest.mark.parametrize(
    "signals, expected, words",
    [
        (_signals(value=1), True, "MPIX_Query_cuda_support() reports CUDA support"),
        (_signals(value=0), False, "returned 0"),
        (_signals(value=1, env={"MPICH_GPU_SUPPORT_ENABLED": "0"}), False, "MPICH_GPU_SUPPORT_ENABLED=0"),
        (_signals(value=1, env={"MPIR_CVAR_ENABLE_GPU": "0"}), False, "MPIR_CVAR_ENABLE_GPU=0"),
        (_signals(value=None, kinds="mpi,system,cuda:device"), True, "names cuda device memory"),
        (_signals(value=None, kinds="mpi,system,cuda"), True, "names cuda device memory"),
        (_signals(value=None, kinds="mpi, cuda:managed:device"), True, "names cuda device memory"),
        (_signals(value=None, kinds="mpi,system,cuda:host"), False, "names no cuda device memory"),
        (_signals(value=0, kinds="mpi,system"), False, "names no cuda device memory"),
        (_signals(value=1, mpi="MPI VERSION : CRAY MPICH version 8.1.29"), False, "only with MPICH_GPU_SUPPORT_ENABLED=1 (it is unset)"),
        (
            _signals(value=1, mpi="MPI VERSION : CRAY MPICH version 8.1.29", env={"MPICH_GPU_SUPPORT_ENABLED": "1"}),
            True,
            "reports CUDA support",
        ),
        (_signals(value=None, env={"MPICH_GPU_SUPPORT_ENABLED": "1"}), True, "Cray MPICH's GPU support on"),
        (_signals(value=0, env={"MPICH_GPU_SUPPORT_ENABLED": "1"}), False, "returned 0"),
        (_signals(value=None), False, "exports neither"),
        (_signals(override=True, value=0), True, "overrides detection"),
    ],
)
def test_decision_from_signals(signals, expected, words):
    verdict, reason = gpu._decide(signals)
    assert verdict is expected and words in reason
    assert reason.startswith("CUDA-aware" if expected else "not CUDA-aware")


def test_verdict_is_cached_on_the_communicator(monkeypatch, self_comm):
    first = gpu.cuda_awareness_report(self_comm)

    def fail(comm):
        raise AssertionError("signals must not be read again")

    monkeypatch.setattr(gpu, "_local_signals", fail)
    assert gpu.cuda_awareness_report(self_comm) is first
    assert gpu.is_cuda_aware(self_comm) is first["cuda_aware"]
    with pytest.raises(DomainParallelError, match="read again"):  # refresh reads them (collectively)
        gpu.cuda_awareness_report(self_comm, refresh=True)
    other = MPI.COMM_SELF.Dup()  # a new communicator decides afresh
    try:
        with pytest.raises(DomainParallelError, match="read again"):
            gpu.is_cuda_aware(other)
    finally:
        other.Free()


def test_local_rank_on_one_rank():
    assert gpu.local_rank(MPI.COMM_SELF) == (0, 1)


def test_bind_device_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(gpu, "_device_count", lambda library: 0)
    with pytest.raises(DomainParallelError, match="no CUDA device visible"):
        gpu.bind_device(MPI.COMM_SELF, library="torch")
    assert gpu.bound_device() is None


def test_bind_device_rejects_unknown_library():
    with pytest.raises(ValueError, match="jax"):
        gpu.bind_device(MPI.COMM_SELF, library="jax")


def test_bind_device_does_not_import_cupy_when_torch_is_loaded(monkeypatch):
    pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(gpu, "_device_count", lambda library: 1)
    monkeypatch.setattr(gpu, "_set_device", lambda library, index: calls.append((library, index)))
    had_cupy = "cupy" in sys.modules
    assert gpu.bind_device(MPI.COMM_SELF) == 0
    assert ("torch", 0) in calls and gpu.bound_device() == 0
    assert had_cupy or "cupy" not in sys.modules


# --------------------------------------------------------------------------- MPI: agreement and binding


@pytest.mark.mpi(min_size=1)
def test_every_rank_gets_the_same_verdict(fresh):
    report = gpu.cuda_awareness_report(fresh)
    verdicts = fresh.allgather((report["cuda_aware"], report["reason"]))
    assert len(set(verdicts)) == 1
    assert len(report["ranks"]) == fresh.Get_size()


@pytest.mark.mpi(min_size=2)
def test_one_disagreeing_rank_moves_everyone_to_staging(fresh, monkeypatch):
    torch = pytest.importorskip("torch")
    real = gpu._local_signals
    if fresh.Get_rank() == 1:  # this rank alone believes MPI is CUDA-aware
        monkeypatch.setattr(gpu, "_local_signals", lambda comm: dict(real(comm), override=True))
        monkeypatch.setenv(gpu.ENV_OVERRIDE, "1")
    report = gpu.cuda_awareness_report(fresh)
    assert report["cuda_aware"] is False and report["agreed"] is False
    assert "ranks disagree" in report["reason"] and "rank(s) 1" in report["reason"]
    assert [r["cuda_aware"] for r in report["ranks"]] == [r == 1 for r in range(fresh.Get_size())]

    # Every rank takes the staged path (never "direct"), and the data arrive.
    monkeypatch.setattr(arrays, "_SIMULATE_DEVICE", True)
    x = torch.arange(6.0) + fresh.Get_rank()
    out = torch.empty(6 * fresh.Get_size())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with staging.send_buffer(x, fresh) as send, staging.recv_buffer(out, fresh) as recv:
            fresh.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
    assert torch.equal(out, torch.cat([torch.arange(6.0) + r for r in range(fresh.Get_size())]))
    routes = fresh.allgather(dict(staging._ROUTES))
    assert all(r == {("staged", "send"): 1, ("staged", "recv"): 1} for r in routes)


@pytest.mark.mpi(min_size=2)
def test_override_on_every_rank_takes_the_direct_path_everywhere(make_manager, monkeypatch, rng):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv(gpu.ENV_OVERRIDE, "1")
    monkeypatch.setattr(arrays, "_SIMULATE_DEVICE", True)  # host memory: safe to hand to any MPI
    manager = make_manager()
    x = torch.from_numpy(rng.standard_normal((3, 2 * manager.domain_parallel_size, 5)))
    shard = credit_mpi.shard_tensor(x, dim=1, manager=manager)
    assert torch.equal(credit_mpi.gather_tensor(shard, dim=1, manager=manager), x)
    assert gpu.is_cuda_aware(manager.domain_group) is True
    routes = manager.domain_group.allgather(dict(staging._ROUTES))
    assert all(set(r) == {("direct", "send"), ("direct", "recv")} for r in routes)


@pytest.mark.mpi(min_size=2)
def test_bad_override_on_one_rank_fails_everywhere(fresh, monkeypatch):
    if fresh.Get_rank() == 0:
        monkeypatch.setenv(gpu.ENV_OVERRIDE, "sometimes")
    with pytest.raises(ValueError, match=r"'sometimes'.*on rank\(s\) 0"):
        gpu.is_cuda_aware(fresh)


@pytest.mark.mpi(min_size=1)
def test_local_rank_matches_the_node(world):
    local, size = gpu.local_rank(world)
    hosts = world.allgather(MPI.Get_processor_name())
    mine = MPI.Get_processor_name()
    assert size == hosts.count(mine)
    assert local == hosts[: world.Get_rank()].count(mine)


@pytest.mark.mpi(min_size=2)
def test_more_ranks_than_gpus_share_round_robin_and_warn(world, monkeypatch):
    local, size = gpu.local_rank(world)
    chosen = []
    monkeypatch.setattr(gpu, "_device_count", lambda library: 2)
    monkeypatch.setattr(gpu, "_set_device", lambda library, index: chosen.append(index))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        index = gpu.bind_device(world, library="torch")
    assert index == local % 2 and chosen == [local % 2] and gpu.bound_device() == index
    warned = [w for w in caught if "share 2 GPU(s)" in str(w.message)]
    assert len(warned) == (1 if local == 0 and size > 2 else 0)


@pytest.mark.mpi(min_size=2)
def test_no_gpu_on_one_rank_fails_everywhere(world, monkeypatch):
    monkeypatch.setattr(gpu, "_device_count", lambda library: 0 if world.Get_rank() == 1 else 1)
    monkeypatch.setattr(gpu, "_set_device", lambda library, index: None)
    with pytest.raises(DomainParallelError, match=r"no CUDA device visible.*rank\(s\) 1"):
        gpu.bind_device(world, library="torch")


# --------------------------------------------------------------------------- GPU group (skips without a GPU)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    return torch


def _cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA GPU visible to CuPy")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CuPy cannot use CUDA: {exc}")
    return cupy


def _make(library, host: np.ndarray, dtype: str):
    """``host`` as a device array of ``library`` with ``dtype`` (bfloat16 only for torch)."""
    if library == "torch":
        torch = _torch_cuda()
        t = torch.from_numpy(host)
        t = t > 0 if dtype == "bool" else t.to(getattr(torch, dtype))
        return t.cuda()
    cupy = _cupy()
    return cupy.asarray(host > 0 if dtype == "bool" else host.astype(dtype))


def _bound_manager(library, make_manager, world):
    """Skip without ``library``'s GPU; else bind this rank's GPU and make a manager over the world."""
    (_torch_cuda if library == "torch" else _cupy)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gpu.bind_device(world, library=library)
    return make_manager()


def _fresh(x):
    """A copy of ``x`` made by a kernel just now, same dtype (what MPI must wait for)."""
    return x.clone() if hasattr(x, "clone") else x.copy()


def _to_numpy(library, x):
    if library == "torch":
        torch = sys.modules["torch"]
        x = x.cpu()
        return (x.to(torch.float32) if x.dtype == torch.bfloat16 else x).numpy()
    return x.get()


CASES = [("torch", "float32"), ("torch", "bfloat16"), ("torch", "bool"), ("cupy", "float32"), ("cupy", "float16")]


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_gpu_bytes_reach_mpi_through_dlpack_without_copy(library, rng):
    x = _make(library, rng.standard_normal((64, 3)).astype(np.float32), "float32")
    pointer = x.data_ptr() if library == "torch" else x.data.ptr
    data = arrays._ops(x).as_bytes(x)
    view = MPI.buffer.frombuffer(data, readonly=True)  # what mpi4py hands to a CUDA-aware MPI
    assert view.address == pointer and view.nbytes == 64 * 3 * 4
    info = arrays.describe(x)
    assert info.kind == library and info.device_type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("library, dtype", CASES)
def test_gpu_staged_round_trip_uses_pinned_memory(library, dtype, rng, self_comm, monkeypatch):
    monkeypatch.setenv(gpu.ENV_OVERRIDE, "0")
    x = _make(library, rng.standard_normal((257, 33)).astype(np.float32), dtype)
    x = _fresh(x)  # the staging copy must wait for the kernel that made it
    out = arrays.empty(x, x.shape)
    with pytest.warns(RuntimeWarning, match="staged through host memory"):
        with staging.send_buffer(x, self_comm) as send, staging.recv_buffer(out, self_comm) as recv:
            self_comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
    np.testing.assert_array_equal(_to_numpy(library, out), _to_numpy(library, x))
    owner = staging._STAGING["send"].owner
    if library == "torch":
        assert owner.is_pinned()
    else:
        assert type(owner).__name__ == "PinnedMemoryPointer"


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_gpu_direct_round_trip_when_cuda_aware(library, rng, self_comm):
    if not gpu.is_cuda_aware(self_comm):
        pytest.skip(f"MPI is not CUDA-aware here: {gpu.cuda_awareness_report(self_comm)['reason']}")
    x = _make(library, rng.standard_normal((128, 5)).astype(np.float32), "float32")
    x = _fresh(x)
    out = arrays.empty(x, x.shape)
    with staging.send_buffer(x, self_comm) as send, staging.recv_buffer(out, self_comm) as recv:
        self_comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
    np.testing.assert_array_equal(_to_numpy(library, out), _to_numpy(library, x))
    assert staging._ROUTES["direct", "send"] == 1


@pytest.mark.gpu
def test_gpu_array_on_another_device_is_refused(monkeypatch):
    torch = _torch_cuda()
    if torch.cuda.device_count() < 2:
        monkeypatch.setattr(gpu, "_BOUND", 1)  # pretend this rank was bound to a second GPU
        with pytest.raises(ValueError, match=r"cuda:0, but this rank's GPU is cuda:1"):
            arrays.describe(torch.zeros(2, device="cuda:0"))
    else:
        with pytest.raises(ValueError, match=r"cuda:1, but this rank's GPU is cuda:0"):
            arrays.describe(torch.zeros(2, device="cuda:1"))


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("library, dtype", CASES)
def test_gpu_shard_gather_scatter(library, dtype, make_manager, rng, world):
    manager = _bound_manager(library, make_manager, world)
    n, rank = manager.domain_parallel_size, manager.domain_rank
    host = rng.standard_normal((2, 3, 4 * n + 1, 6)).astype(np.float32)
    x = _make(library, host, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        shard = credit_mpi.shard_tensor(x, dim=-2, manager=manager, uneven=True)
        gathered = credit_mpi.gather_tensor(_fresh(shard), dim=-2, manager=manager)
        scattered = credit_mpi.scatter_tensor(x if rank == 0 else None, dim=-2, manager=manager, uneven=True)
        batch = credit_mpi.shard_batch({"x": x, "meta": 3}, manager=manager, uneven=True)
    for result in (shard, gathered, scattered, batch["x"]):
        assert type(result) is type(x) and arrays.describe(result).device == arrays.describe(x).device
    reference = np.array_split(_to_numpy(library, x), n, axis=-2)[rank]
    np.testing.assert_array_equal(_to_numpy(library, shard), reference)
    np.testing.assert_array_equal(_to_numpy(library, scattered), reference)
    np.testing.assert_array_equal(_to_numpy(library, gathered), _to_numpy(library, x))
    expected = "direct" if gpu.is_cuda_aware(manager.domain_group) else "staged"
    if n > 1:
        assert staging._ROUTES[expected, "send"] >= 1


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_gpu_array_on_one_rank_cpu_on_another_fails_everywhere(make_manager, world):
    torch = _torch_cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gpu.bind_device(world, library="torch")
    manager = make_manager()
    x = torch.zeros(2, 4 * manager.domain_parallel_size)
    if manager.domain_rank == 1:
        x = x.cuda()
    with pytest.raises(ValueError, match=r"on cpu.*on cuda:\d"):
        credit_mpi.shard_tensor(x, dim=-1, manager=manager)
    with pytest.raises(TypeError, match="device type"):
        credit_mpi.gather_tensor(x, dim=-1, manager=manager)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("library, dtype", [("torch", "float32"), ("torch", "bfloat16"), ("cupy", "float64")])
@pytest.mark.parametrize("boundary", ["zero", "periodic", "reflect", "earth"])
def test_gpu_halo_exchange_matches_padded_field(library, dtype, boundary, make_manager, rng, world):
    """halo_exchange on device arrays (outer > 1: the packed exchange) equals the padded global field."""
    from .halo_reference import band, pad_numpy

    manager = _bound_manager(library, make_manager, world)
    n = manager.domain_parallel_size
    g = _make(library, rng.standard_normal((2, 3, 3 * n + 1, 8)).astype(np.float32), dtype)
    host = _to_numpy(library, g)
    start, stop = band(host.shape[-2], manager)
    x = _fresh(g[..., start:stop, :])  # contiguous, made by a kernel just now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = credit_mpi.halo_exchange(x, 2, manager=manager, boundary=boundary)
    assert type(out) is type(x) and arrays.describe(out).device == arrays.describe(x).device
    expected = pad_numpy(host, 2, 2, boundary)[..., start : stop + 4, :]
    np.testing.assert_array_equal(_to_numpy(library, out), expected)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_gpu_halo_module_gradients_and_reduce_gradients(make_manager, rng, world):
    """HaloExchange + conv on CUDA: output, input gradient and the reduced weight gradient match one GPU."""
    torch = _torch_cuda()
    from .halo_reference import band, pad_torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        device = gpu.bind_device(world, library="torch")
    manager = make_manager()
    torch.manual_seed(0)  # the same weights on every rank
    conv = torch.nn.Conv2d(2, 2, 3, padding=(0, 1), padding_mode="circular", dtype=torch.float64).cuda(device)
    g = torch.from_numpy(rng.standard_normal((1, 2, 4 * manager.domain_parallel_size + 1, 8))).cuda(device)
    # one GPU: the whole field
    whole = g.clone().requires_grad_(True)
    reference = conv(pad_torch(whole, 1, "periodic"))
    (reference**2).sum().backward()
    ref_weight_grad, conv.weight.grad, conv.bias.grad = conv.weight.grad.clone(), None, None
    # the bands
    start, stop = band(g.shape[-2], manager)
    x = g[..., start:stop, :].clone().requires_grad_(True)
    halo = credit_mpi.HaloExchange(1, boundary="periodic", manager=manager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = conv(halo(x))
        (y**2).sum().backward()  # this band's share of the global loss
        credit_mpi.reduce_gradients(conv.parameters(), manager)
    torch.testing.assert_close(y, reference[..., start:stop, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, whole.grad[..., start:stop, :], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv.weight.grad, ref_weight_grad, rtol=1e-10, atol=1e-12)
    assert conv.weight.grad.device == x.device


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_gpu_large_transfers_back_to_back(library, make_manager, rng, world):
    """Transfers big enough to reuse buffers while copies may still be in flight.

    A gather of many small slices (several packed groups through one
    scratch buffer) and a halo exchange of wide edge blocks (two staged
    receives back to back), both against the host result.
    """
    manager = _bound_manager(library, make_manager, world)
    n = manager.domain_parallel_size
    from credit_mpi.transport.limits import PACK_BYTES, SLICE_BYTES

    from .halo_reference import band, pad_numpy

    field = rng.standard_normal((512, 8, 8 * n + 1, 32)).astype(np.float32)
    slice_bytes = field.shape[2] * field.shape[3] * 4
    assert slice_bytes < SLICE_BYTES and (n == 1 or 512 * 8 * slice_bytes > 2 * PACK_BYTES)  # packed, >= 3 groups
    start, stop = band(field.shape[2], manager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gathered = credit_mpi.gather_tensor(_fresh(_make(library, field[:, :, start:stop], "float32")), manager=manager)
    np.testing.assert_array_equal(_to_numpy(library, gathered), field)

    wide = rng.standard_normal((16, 8, 4 * n + 3, 1024)).astype(np.float32)
    start, stop = band(wide.shape[2], manager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        padded = credit_mpi.halo_exchange(_make(library, wide[:, :, start:stop], "float32"), 3, manager=manager, boundary="periodic")
    np.testing.assert_array_equal(_to_numpy(library, padded), pad_numpy(wide, 3, 2, "periodic")[:, :, start : stop + 6])


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_gpu_gradients_on_one_rank_cpu_on_another_fail_everywhere(make_manager, world):
    torch = _torch_cuda()
    manager = _bound_manager("torch", make_manager, world)
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3, device="cuda" if world.Get_rank() == 1 else "cpu")
    with pytest.raises(ValueError, match="device types"):
        credit_mpi.reduce_gradients([weight], manager)
