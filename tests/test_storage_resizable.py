"""A user's tensor that went through credit_mpi's host path keeps a resizable storage.

torch marks the storage of a tensor it hands numpy (``Tensor.numpy()``) unresizable for good; the transport takes
numpy's view through DLPack instead, so a tensor that was gathered, sharded, exchanged or reduced can still be
resized (FSDP2 frees and regathers its parameters' storage).
"""

import pytest
import torch
from mpi4py import MPI

import credit_mpi
from credit_mpi.nn import latitude_weights
from credit_mpi.ops.statistics import gather_statistics
from credit_mpi.transport import arrays


def _resizable(t: torch.Tensor) -> bool:
    try:
        t.detach().resize_(t.numel() + 7)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64])
def test_host_views_leave_the_storage_resizable(dtype):
    t = torch.ones(3, 4, dtype=dtype)
    view = arrays.host_bytes(t)
    view[:] = 0  # shares memory
    assert not t.any()
    assert _resizable(t)
    if arrays.host_numpy(t) is not None:
        assert _resizable(t)


@pytest.mark.mpi(min_size=1)
def test_collectives_leave_a_users_tensor_resizable():
    """shard_tensor's and gather_tensor's inputs, a reduced gradient, gathered statistics and latitudes stay resizable."""
    world = MPI.COMM_WORLD
    with credit_mpi.DomainParallelManager(None, world.Get_size()) as manager:
        _round_trip(manager, world.Get_size())


def _round_trip(manager, n):
    x = torch.arange(2 * 3 * 5 * n, dtype=torch.float64).reshape(2, 3, 5 * n)
    band = credit_mpi.shard_tensor(x, -1, manager)
    whole = credit_mpi.gather_tensor(band, -1, manager)
    assert torch.equal(whole, x)
    grad = torch.ones(4, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = grad
    credit_mpi.reduce_gradients([p], manager)
    stats = torch.full((3,), float(manager.domain_rank))
    assert gather_statistics(stats, manager.domain_group)[:, 0].tolist() == list(range(manager.domain_parallel_size))
    latitudes = torch.linspace(90.0, -90.0, 4 * n, dtype=torch.float64)
    latitude_weights(latitudes, manager)
    # what the user handed in (a gathered result lives in the transport's pooled numpy memory, as from_numpy's does)
    assert _resizable(x) and _resizable(band) and _resizable(p.grad)
    assert _resizable(stats) and _resizable(latitudes)


def test_lazy_views_are_never_exported_raw():
    """DLPack exports a negative view's raw data with its sign bit dropped: the views resolve it, or raise."""
    x = torch.tensor([1.0, 2.0])
    neg = torch._neg_view(x)
    assert arrays.host_numpy(neg).tolist() == [-1.0, -2.0]
    conj = torch.tensor([1 + 1j]).conj()
    assert arrays.host_numpy(conj).tolist() == [1 - 1j]
    for lazy in (neg, conj):
        with pytest.raises(RuntimeError):
            arrays.host_bytes(lazy)
