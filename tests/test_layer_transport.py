"""A converted model's data path (issue 35): ``convert_to_domain_parallel(..., transport="torch")``.

Every layer's and every rule's data (halos, the overlapped conv's halo, overlap-add, statistics,
domain sums, row moves, joins and re-bands, attention's gathers and all-to-alls) moves through the
torch group that mirrors the domain group (gloo here, NCCL on GPUs); the agreements stay MPI's.
Checked: exact against one process on 1-4 ranks (even and uneven bands), not one byte of a forward
or backward through :class:`~credit_mpi.transport.moves.MpiMoves` (every move counted on the
protocol's two implementations), the transport agreed (a rank converted with another one raises on
every rank), no device or stream synchronisation on the torch path (the adapters' sync functions
counted with a simulated device, where the MPI path stages and synchronises per exchange).

Every model test of tests/nn_reference.run_both runs this path too with ``CREDIT_MPI_TEST_TRANSPORT=torch``.
"""

from __future__ import annotations

import copy
import importlib.util
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import credit_mpi
from credit_mpi.transport import adapters, arrays, paths
from credit_mpi.transport.moves import MpiMoves
from credit_mpi.transport.torch_moves import TorchMoves

from .conftest import ROOT
from .nn_reference import assert_same, run_both, same_error_everywhere
from .test_spectral import FNOBlock

TIMEOUT = timedelta(seconds=120)
_MOVES = ("post", "exchange", "allgatherv", "alltoallv", "allreduce", "allgather_slices")


def unet() -> nn.Module:
    spec = importlib.util.spec_from_file_location("train_unet", ROOT / "examples" / "train_unet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UNet()


class Everything(nn.Module):
    """One of each mover: conv halo, GroupNorm/BatchNorm statistics, a domain mean (squeeze-excite), a roll, an
    interpolation to a size (a join re-band), a transposed conv's overlap-add, a pooled skip joined by cat."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.g = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.pool, self.c2, self.b = nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.up, self.out = nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.g(self.c1(x)))
        y = y * y.mean((2, 3), keepdim=True)  # squeeze-excite: a domain sum
        z = self.b(self.c2(self.pool(y)))
        z = torch.roll(z, 1, dims=-2)  # a row move
        near = F.interpolate(z, size=(y.shape[-2], y.shape[-1]))  # nearest to a size
        return self.out(torch.cat([y, self.up(z) + near], 1))


class Attention(nn.Module):
    """Tokens of every latitude row attend to every band's (sdpa: the K/V gather, or the head all-to-all)."""

    def __init__(self, c=4, heads=2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Conv2d(2, 3 * c, 1), nn.Conv2d(c, 2, 1), heads

    def forward(self, x):
        b, _, lat, lon = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=1)
        c = q.shape[1]

        def tokens(t):
            return t.reshape(b, self.heads, c // self.heads, lat * lon).transpose(-1, -2)

        o = F.scaled_dot_product_attention(tokens(q), tokens(k), tokens(v))
        return self.proj(o.transpose(-1, -2).reshape(b, c, lat, lon)) + x


def _even_offsets(d: int) -> list[int]:
    """Uneven bands whose offsets are even (Everything's pooled branch joins its transposed conv's output)."""
    return [4] * (d - 1) + [6]


# build, shape (of the domain size d), band sizes (None: array_split, uneven where it does not divide)
BUILDS = {"unet": (unet, lambda d: (2, 2, 16, 8), None),
          "everything": (Everything, lambda d: (2, 2, sum(_even_offsets(d)), 6), _even_offsets),
          "attention": (Attention, lambda d: (1, 2, 7, 4), None),
          "fno": (FNOBlock, lambda d: (1, 3, 2 * d + 3, 8), None)}  # the pencil transposes (uneven bands)


@pytest.fixture
def bridged(make_manager):
    """A manager over the world whose torch groups mirror it (gloo); the torch state reset afterwards."""
    from .conftest import reset_torch_distributed

    reset_torch_distributed()
    made = []

    def make(**kwargs):
        manager = credit_mpi.init_torch_distributed(make_manager(**kwargs), "gloo", timeout=TIMEOUT)
        made.append(manager)
        return manager

    yield make
    reset_torch_distributed()


class Count:
    """Every call of the transport protocol's data methods on MpiMoves and TorchMoves, while installed."""

    def __init__(self, monkeypatch) -> None:
        self.calls = {"MpiMoves": 0, "TorchMoves": 0}
        for cls in (MpiMoves, TorchMoves):
            for name in _MOVES:
                original = getattr(cls, name)

                def counted(self_, *args, _original=original, _cls=cls.__name__, **kwargs):
                    self.calls[_cls] += 1
                    return _original(self_, *args, **kwargs)

                monkeypatch.setattr(cls, name, counted)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_model_through_the_torch_group_equals_one_process(name, bridged):
    """Forward, input gradient and reduced parameter gradients of two SGD steps: one process's (float64)."""
    manager = bridged()
    build, shape, sizes = BUILDS[name]
    d = manager.domain_parallel_size
    assert_same(run_both(build, shape(d), manager, transport="torch", steps=2, sizes=sizes and sizes(d)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2, 3, 4)
def test_no_byte_of_a_step_moves_over_mpi(bridged, monkeypatch):
    """The torch path's forward and backward move everything on TorchMoves; the MPI path everything on MpiMoves."""
    manager = bridged()
    torch.manual_seed(0)
    ref = Everything().double()
    sizes = _even_offsets(manager.domain_parallel_size)
    full = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    start = sum(sizes[: manager.domain_rank])
    x = full.narrow(-2, start, sizes[manager.domain_rank]).contiguous()
    seen = {}
    for transport in ("torch", "mpi"):
        model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager, transport=transport)
        model(x.clone().requires_grad_()).square().sum().backward()  # the first step plans (and agrees) everything
        count = Count(monkeypatch)
        model(x.clone().requires_grad_()).square().sum().backward()
        seen[transport] = dict(count.calls)
        monkeypatch.undo()
    assert seen["torch"]["MpiMoves"] == 0 and seen["torch"]["TorchMoves"] > 0, seen
    assert seen["mpi"]["TorchMoves"] == 0 and seen["mpi"]["MpiMoves"] > 0, seen


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2, 3)
def test_the_overlapped_conv_moves_on_the_torch_group(bridged, monkeypatch):
    """The conv whose halo travels while its interior rows compute (issue 26) posts on the model's transport."""
    from credit_mpi.nn import conv

    monkeypatch.setattr(conv, "OVERLAP", True)
    real, calls = conv.overlapped_conv, []
    monkeypatch.setattr(conv, "overlapped_conv", lambda *a, **k: calls.append(1) or real(*a, **k))
    manager = bridged()
    count = Count(monkeypatch)
    assert_same(run_both(lambda: nn.Sequential(nn.Conv2d(2, 3, 5, padding=2), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1)),
                         (1, 2, 5 * manager.domain_parallel_size + 1, 6), manager, transport="torch"))
    assert calls and count.calls["TorchMoves"] > 0 and count.calls["MpiMoves"] == 0, (calls, count.calls)


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2)
def test_a_grid_model_through_the_torch_group_equals_one_process(make_manager):
    """On a 2-D latitude x longitude grid (blocks): the halo's two phases and the norms on the torch group."""
    from .conftest import reset_torch_distributed

    size = MPI.COMM_WORLD.Get_size()
    reset_torch_distributed()
    try:
        manager = credit_mpi.init_torch_distributed(make_manager(size, domain_grid=(1, size)), "gloo", timeout=TIMEOUT)
        build = lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ConvTranspose2d(4, 2, 2, stride=2))  # noqa: E731
        torch.manual_seed(0)
        ref = build().double()
        model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager, transport="torch")
        full = torch.randn(1, 2, 6, 8, dtype=torch.float64)
        x = credit_mpi.shard_tensor(full, (-2, -1), manager)
        out = credit_mpi.gather_tensor(model(x), (-2, -1), manager)
        torch.testing.assert_close(out, ref(full), atol=1e-12, rtol=1e-10)
    finally:
        reset_torch_distributed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2)
def test_a_rank_converted_with_another_transport_raises_on_every_rank(bridged):
    manager = bridged()
    transport = "torch" if MPI.COMM_WORLD.Get_rank() == 0 else "mpi"
    model = credit_mpi.convert_to_domain_parallel(nn.Conv2d(1, 1, 3, padding=1).double(), manager, transport=transport)
    x = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    same_error_everywhere(manager.domain_group, lambda: model(x), credit_mpi.DomainParallelError)


def test_bad_transports_raise():
    with pytest.raises(ValueError, match="not a transport"):
        paths.path_of("nccl", None)
    assert paths.path_of("mpi", None) is paths.MPI_PATH
    assert paths.path_of("torch", None) is paths.MPI_PATH  # one band: nothing moves
    assert paths.current() is paths.MPI_PATH  # outside a converted forward


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2)
def test_torch_without_the_bridge_names_init_torch_distributed(make_manager):
    manager = make_manager()
    with pytest.raises(credit_mpi.DomainParallelError, match="init_torch_distributed"):
        credit_mpi.convert_to_domain_parallel(nn.Conv2d(1, 1, 3), manager, transport="torch")


class Syncs:
    """Calls of the torch adapter's stream and device synchronisations and of its one wait per exchange, while installed."""

    def __init__(self, monkeypatch) -> None:
        self.calls = {"sync_stream": 0, "sync_device": 0, "wait_event": 0}
        torch_adapter = adapters.adapter_of(torch.zeros(1))
        for name in self.calls:
            def counted(x, _name=name):
                self.calls[_name] += 1

            monkeypatch.setattr(torch_adapter, name, staticmethod(counted))


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_sizes(2, 3)
def test_a_step_on_the_torch_path_synchronises_nothing(bridged, monkeypatch):
    """With a simulated device (CPU tensors taken for device memory and sent to a "CUDA-aware" MPI): on the torch
    path (stream-ordered: NCCL on GPUs) a step synchronises neither a stream nor the device, nor waits on an event:
    zero host syncs a step. On the CUDA-aware MPI path every exchange waits once, on an event of the producing stream
    (``wait_event``), and never for the whole device or a stream's later work."""
    from credit_mpi import gpu

    manager = bridged()
    torch.manual_seed(0)
    ref = Everything().double()
    sizes = _even_offsets(manager.domain_parallel_size)
    full = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    x = full.narrow(-2, sum(sizes[: manager.domain_rank]), sizes[manager.domain_rank]).contiguous()
    monkeypatch.setattr(arrays, "_SIMULATE_DEVICE", True)
    monkeypatch.setattr(arrays, "host_bytes", lambda x, adapter=None: None)  # every array: "device memory"
    monkeypatch.setattr(arrays, "host_numpy", lambda x, adapter=None: None)
    monkeypatch.setattr(gpu, "is_cuda_aware", lambda comm=None: True)
    seen, moves = {}, {}
    for transport in ("torch", "mpi"):
        model = credit_mpi.convert_to_domain_parallel(copy.deepcopy(ref), manager, transport=transport)
        model(x.clone().requires_grad_()).square().sum().backward()
        with monkeypatch.context() as step:
            syncs, count = Syncs(step), Count(step)
            out = model(x.clone().requires_grad_())
            out.square().sum().backward()
            seen[transport], moves[transport] = dict(syncs.calls), dict(count.calls)
        torch.testing.assert_close(out, ref(full).narrow(-2, sum(sizes[: manager.domain_rank]), sizes[manager.domain_rank]))
    assert seen["torch"] == {"sync_stream": 0, "sync_device": 0, "wait_event": 0}, seen
    assert seen["mpi"]["sync_stream"] == seen["mpi"]["sync_device"] == 0, seen
    assert seen["mpi"]["wait_event"] == moves["mpi"]["MpiMoves"] > 0, (seen, moves)
