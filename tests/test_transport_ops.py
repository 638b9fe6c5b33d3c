"""The six comm-level ops on the transport protocol: MPI and torch.distributed give the same bits, forward and backward.

all-gather along a dim, all-to-all (heads), re-band, roll, the group layout,
the ring attention and the sum over the ranks are each written once against
:mod:`credit_mpi.transport.moves`; here every one runs on uneven bands over
``transport="mpi"`` (an ``MpiMoves``), over ``TorchMoves`` of a gloo group
(the code path of NCCL but the backend's name), and over MPI with CPU
tensors taken as device memory (``_SIMULATE_DEVICE``: the staged path and
the CUDA-aware one), and must equal the single-process result and each
other bit for bit (the sum over the ranks: MPI's and torch's to round-off,
each library adding in its own order). A bad or mismatched transport is an
error on every rank.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi
from credit_mpi import gpu
from credit_mpi.layout import Layout, split
from credit_mpi.transport import arrays, staging

from .conftest import reset_torch_distributed

torch = pytest.importorskip("torch")
if not pytest.importorskip("torch.distributed").is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from credit_mpi.ops.allgather_along import allgather_along  # noqa: E402 (after the skips: torch)
from credit_mpi.ops.allreduce import allreduce_sum  # noqa: E402
from credit_mpi.ops.alltoall import alltoall  # noqa: E402
from credit_mpi.ops.group_rows import from_groups, grouped  # noqa: E402
from credit_mpi.ops.reband import reband, rebanded  # noqa: E402
from credit_mpi.ops.ring import ring_attention  # noqa: E402
from credit_mpi.ops.rows import roll_along  # noqa: E402
from credit_mpi.transport.torch_moves import TorchMoves  # noqa: E402


@pytest.fixture
def over_torch(make_manager):
    """A manager of the whole world with gloo groups mirroring it, and the TorchMoves of its domain (torch reset after)."""
    manager = credit_mpi.init_torch_distributed(make_manager(), "gloo", timeout=timedelta(seconds=60))
    try:
        yield manager, TorchMoves(manager.torch_group("domain"))
    finally:
        reset_torch_distributed()


def _bits(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _band(full: torch.Tensor, dim: int, sizes, rank: int) -> torch.Tensor:
    return full.narrow(dim, Layout.bands(tuple(sizes)).start(rank), sizes[rank])


def _cases(comm: MPI.Comm):
    """``name -> (run(transport, *inputs) -> output, inputs, expected output)`` on uneven bands of one field."""
    n, rank = comm.Get_size(), comm.Get_rank()
    gen = torch.Generator().manual_seed(11)
    rows = 2 * n + 1
    sizes = split(rows, n, uneven=True)
    full = torch.randn(2, 3, rows, 5, dtype=torch.float64, generator=gen)
    band = _band(full, 2, sizes, rank)
    target = tuple(reversed(sizes))  # another layout of the same rows
    heads = torch.randn(1, 2 * n, rows, 4, dtype=torch.float64, generator=gen)  # (B, H, N, E): H divides among the ranks
    q = torch.randn(1, 3, rows, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 3, rows + n, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(1, 3, rows + n, 2, dtype=torch.float64, generator=gen)
    k_sizes = split(rows + n, n, uneven=True)
    window, height = 2, 4 * n  # the group layout: H a multiple of the window
    tall = torch.randn(1, 2, height, 3, dtype=torch.float64, generator=gen)
    tall_sizes = split(height, n, uneven=True)
    qb, kb, vb = _band(q, 2, sizes, rank), _band(k, 2, k_sizes, rank), _band(v, 2, k_sizes, rank)
    mine = 2 * rank, 2 * rank + 2
    return {
        "allgather_along": (lambda t, x: allgather_along(x, 2, comm, transport=t), (band,), full),
        "alltoall": (lambda t, x: alltoall(alltoall(x, 1, 2, comm, transport=t), 2, 1, comm, keep=x.shape[2], transport=t),
                     (_band(heads, 2, sizes, rank),), _band(heads, 2, sizes, rank)),
        "alltoall heads": (lambda t, x: alltoall(x, 1, 2, comm, transport=t), (_band(heads, 2, sizes, rank),),
                           heads[:, mine[0] : mine[1]]),
        "reband": (lambda t, x: reband(x, 2, comm, sizes=target, transport=t), (band,), _band(full, 2, target, rank)),
        "roll": (lambda t, x: roll_along(x, n + 2, 2, comm, transport=t), (band,),
                 _band(torch.roll(full, n + 2, 2), 2, sizes, rank)),
        "groups": (lambda t, x: from_groups(grouped(x, 2, window, comm, transport=t)[0], 2, window, tall_sizes, comm,
                                            transport=t), (_band(tall, 2, tall_sizes, rank),), _band(tall, 2, tall_sizes, rank)),
        "ring": (lambda t, a, b, c: ring_attention(a, b, c, comm, is_causal=True, transport=t), (qb, kb, vb),
                 _band(_sdpa_causal(q, k, v), 2, sizes, rank)),
        "allreduce": (lambda t, x: allreduce_sum(x, comm, transport=t), (band.sum(2),), full.sum(2)),
    }


_REDUCTIONS = ("allreduce",)  # MPI's Allreduce and torch's all_reduce: the same bits on every rank, not each other's


def _sdpa_causal(q, k, v):
    """torch's causal attention of every query token to every key token (key j attends query i when j <= i)."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _forward_backward(run, inputs, transport):
    """The op's output and the gradients of every input (``sum(out * w)``, ``w`` the same on every rank)."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    out = run(transport, *xs)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * w).sum().backward()
    return [out] + [x.grad for x in xs]


@pytest.mark.mpi(min_size=1)
def test_the_ops_over_torch_equal_mpi_bit_for_bit(over_torch):
    (manager, moves) = over_torch
    comm = manager.domain_group
    for name, (run, inputs, expected) in _cases(comm).items():
        via_mpi = _forward_backward(run, inputs, "mpi")
        via_torch = _forward_backward(run, inputs, moves)
        torch.testing.assert_close(via_mpi[0], expected, rtol=1e-12, atol=1e-12, msg=name)
        if name in _REDUCTIONS:  # each library adds in its own order: equal to round-off
            for a, b in zip(via_torch, via_mpi, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
            continue
        assert [_bits(t) for t in via_torch] == [_bits(t) for t in via_mpi], name


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aware", ["0", "1"])  # staged through host buffers / device pointers to a CUDA-aware MPI
def test_the_ops_on_device_memory_paths_equal_the_host_path(make_manager, monkeypatch, aware):
    manager = make_manager()
    comm = manager.domain_group
    host = {name: _forward_backward(run, inputs, "mpi") for name, (run, inputs, _) in _cases(comm).items()}
    monkeypatch.setattr(staging, "_WARNED_STAGING", True)
    monkeypatch.setattr(staging, "_ROUTES", staging.collections.Counter())
    monkeypatch.setenv(gpu.ENV_OVERRIDE, aware)
    monkeypatch.setattr(arrays, "_SIMULATE_DEVICE", True)
    fresh = make_manager()  # a new communicator: its CUDA-awareness verdict is made under the override
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, (run, inputs, _) in _cases(fresh.domain_group).items():
            got = _forward_backward(run, inputs, "mpi")
            assert [_bits(t) for t in got] == [_bits(t) for t in host[name]], (name, aware)
    staging.release_staging_buffers()
    route = "direct" if aware == "1" else "staged"
    if comm.Get_size() > 1:
        assert staging._ROUTES[route, "send"] > 0 and staging._ROUTES[route, "recv"] > 0, dict(staging._ROUTES)
        assert ("host", "send") not in staging._ROUTES, dict(staging._ROUTES)


@pytest.mark.mpi(min_size=1)
def test_a_bad_transport_is_an_error_on_every_rank(make_manager):
    manager = make_manager()
    comm = manager.domain_group
    band = torch.zeros(2, comm.Get_size() + comm.Get_rank(), 3, dtype=torch.float64)
    bad = "nccl" if comm.Get_rank() == 0 else "mpi"
    with pytest.raises(ValueError, match="transport"):
        roll_along(band, 1, 1, comm, transport=bad)
    with pytest.raises(ValueError, match="transport='nccl' is not a transport"):
        allgather_along(band, 1, comm, transport="nccl")
    roll_along(band, 1, 1, comm)  # the domain is usable after the error


@pytest.mark.mpi(min_size=2)
def test_ranks_on_different_transports_raise_together(over_torch):
    (manager, moves) = over_torch
    comm = manager.domain_group
    band = torch.ones(3, 2, dtype=torch.float64)
    with pytest.raises(credit_mpi.DomainParallelError, match="TorchMoves"):
        reband(band, 0, comm, sizes=(3,) * comm.Get_size(), transport=moves if comm.Get_rank() == 0 else "mpi")


@pytest.mark.mpi(min_size=1)
def test_the_layouts_come_from_the_plan_of_the_call(make_manager):
    """rebanded() and grouped() return the layouts their own call agreed (no state kept between calls)."""
    manager = make_manager()
    comm = manager.domain_group
    n, rank = comm.Get_size(), comm.Get_rank()
    sizes = tuple(split(6 * n + 1, n, uneven=True))
    _, before, after = rebanded(torch.zeros(1, sizes[rank], 2, dtype=torch.float64), 1, comm, 4)
    assert before == sizes and sum(after) == sum(sizes) and all(e % 4 == 0 for e in np.cumsum(after)[:-1])
    tall = tuple(split(4 * n, n, uneven=True))
    part, layout = grouped(torch.zeros(1, tall[rank], 2, dtype=torch.float64), 1, 2, comm)
    assert layout == tall and part.shape[1] == 4
    _, before, _ = rebanded(torch.zeros(1, after[rank], 2, dtype=torch.float64), 1, comm, 4)
    assert before == after  # the second call's own layout, not the first one's
