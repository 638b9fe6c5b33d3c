"""init_torch_distributed fails fast on a stale rendezvous (MASTER_ADDR/MASTER_PORT left over).

A ``MASTER_ADDR`` that nobody listens on used to wait torch's default timeout
(30 minutes) and end in a C++ trace; now connecting is bounded by
``connect_timeout`` and every rank raises the same DomainParallelError that
names the variables and how to unset them.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import credit_mpi
from credit_mpi import DomainParallelError

from .conftest import reset_torch_distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from credit_mpi import torch_bridge  # noqa: E402

# TEST-NET-1 (RFC 5737): documentation only, never routed, so a connect never succeeds
STALE_ADDR = "192.0.2.1"


@pytest.fixture(autouse=True)
def clean_torch():
    yield
    reset_torch_distributed()


@pytest.mark.parametrize("value", [0, -2.0, "5", timedelta(0), True])
def test_bad_connect_timeout(value):
    with pytest.raises(ValueError, match="connect_timeout"):
        torch_bridge._timeout(value, torch_bridge.CONNECT_TIMEOUT, "connect_timeout")


def test_default_connect_timeout_is_seconds_not_minutes():
    assert torch_bridge._timeout(None, torch_bridge.CONNECT_TIMEOUT, "connect_timeout") == timedelta(seconds=60)


@pytest.mark.mpi(min_size=1)
def test_stale_master_addr_fails_fast_on_every_rank(make_manager, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", STALE_ADDR)
    monkeypatch.setenv("MASTER_PORT", "29517")
    manager = make_manager()
    start = time.monotonic()
    with pytest.raises(DomainParallelError) as info:
        credit_mpi.init_torch_distributed(manager, "gloo", connect_timeout=2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"MASTER_ADDR={STALE_ADDR}" in message and "MASTER_PORT=29517" in message, message
    assert "unset MASTER_ADDR MASTER_PORT" in message, message
    assert "connect_timeout=2 s" in message, message
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert not dist.is_initialized()
    assert manager.comm.allgather(type(info.value).__name__) == ["DomainParallelError"] * manager.comm.Get_size()

    # without the stale variables the same manager bridges at once
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    credit_mpi.init_torch_distributed(manager, "gloo", timeout=60)
    assert dist.get_world_size() == manager.comm.Get_size()
    credit_mpi.destroy_torch_distributed(manager)


@pytest.mark.mpi(min_size=1)
def test_master_port_not_a_number_on_rank0_is_an_error_everywhere(make_manager, monkeypatch):
    manager = make_manager()
    if manager.comm.Get_rank() == 0:  # only rank 0's environment decides the address
        monkeypatch.setenv("MASTER_PORT", "twenty")
    with pytest.raises(ValueError, match="MASTER_PORT must be a port number, got 'twenty'.*unset MASTER_ADDR"):
        credit_mpi.init_torch_distributed(manager, "gloo", timeout=60)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_bad_connect_timeout_on_one_rank_raises_everywhere(make_manager):
    manager = make_manager()
    value = -1 if manager.comm.Get_rank() == manager.comm.Get_size() - 1 else 30
    with pytest.raises(ValueError, match="connect_timeout must be positive"):
        credit_mpi.init_torch_distributed(manager, "gloo", connect_timeout=value)
    assert not dist.is_initialized()


@pytest.mark.mpi(min_size=1)
def test_stale_master_addr_is_short(make_manager, monkeypatch, capfd):
    """No C++ frames from torch's retries, no chained torch exception: one message (rank 0 checks the address)."""
    monkeypatch.setenv("MASTER_ADDR", STALE_ADDR)
    monkeypatch.setenv("MASTER_PORT", "29518")
    manager = make_manager()
    with pytest.raises(DomainParallelError, match=f"{STALE_ADDR} is not an address of rank 0's node") as info:
        credit_mpi.init_torch_distributed(manager, "gloo", connect_timeout=30)
    cause = info.value.__cause__
    assert cause is None or not isinstance(cause.__cause__, RuntimeError)  # torch's error is named, not chained
    err = capfd.readouterr().err
    assert "frame #" not in err and "TCPStore.cpp" not in err, err[-3000:]
    assert not dist.is_initialized()
