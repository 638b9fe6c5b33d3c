"""The agreement in one place: one digest, and remembered plans that never outlive their communicator."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi import gather_tensor, halo_exchange, shard_tensor, validation


def _entries(comm) -> int:
    return sum(1 for entry in validation._AGREED.values() if entry.comm is comm)


def test_one_digest_is_stable_and_64_bits():
    assert validation.digest(b"credit") == validation.digest(b"credit")
    assert validation.digest(b"credit") != validation.digest(b"credit_mpi")
    assert -(1 << 63) <= validation.digest(b"x") < 1 << 63


@pytest.mark.mpi(min_size=2)
def test_free_forgets_the_remembered_plans(make_manager):
    n = MPI.COMM_WORLD.Get_size()
    manager = make_manager(n)
    band = shard_tensor(np.arange(4.0 * 3 * n).reshape(1, 4 * n, 3), -2, manager)
    for _ in range(2):  # the second call repeats the remembered agreement
        halo_exchange(band, 1, -2, manager)
        gather_tensor(band, -2, manager)
    comm = manager.domain_group
    assert _entries(comm) == 2
    manager.free()
    assert _entries(comm) == 0


@pytest.mark.mpi(min_size=2)
def test_a_remembered_plan_does_not_keep_its_communicator_alive():
    comm = MPI.COMM_WORLD.Dup()
    validation.agree_cached(comm, "halo_exchange", ("test-key",), lambda: validation.Local(None, (), (), 0), lambda plan, counts: counts)
    assert _entries(comm) == 1
    ref = next(entry for entry in validation._AGREED.values() if entry.comm is comm)._comm
    comm.Free()
    del comm
    validation.agree(MPI.COMM_WORLD, "collective", lambda: validation.Local(None, (), (), 0))  # the watchdog's "last call"
    gc.collect()
    assert ref() is None
    validation.forget_agreements(MPI.COMM_WORLD)  # drops the entries of dead communicators too
    assert all(entry.comm is not None for entry in validation._AGREED.values())


@pytest.mark.mpi(min_size=2)
def test_free_forgets_the_converted_layers_halo_plans(make_manager):
    """A converted conv's halo plans (agreed by the layer, kept by the engine) go with manager.free() too."""
    torch = pytest.importorskip("torch")
    import credit_mpi
    from credit_mpi.engine import AGREED_PLANS

    n = MPI.COMM_WORLD.Get_size()
    manager = make_manager(n)
    conv = credit_mpi.convert_to_domain_parallel(torch.nn.Conv2d(1, 1, 3, padding=1).double(), manager)
    band = shard_tensor(torch.zeros(1, 1, 4 * n, 5, dtype=torch.float64), -2, manager)
    conv(band)
    comm = manager.domain_group
    assert any(key[0] == id(comm) for key in AGREED_PLANS)
    manager.free()
    assert not any(key[0] == id(comm) or plan.comm is comm for key, plan in AGREED_PLANS.items())
