"""Helpers of the model-side tests: run a model on bands and compare it with one process."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import numpy as np
import torch
from mpi4py import MPI

import credit_mpi
from credit_mpi.nn import convert_to_domain_parallel
from credit_mpi.partition import band_range

#: The data path of the converted models of run_both (``CREDIT_MPI_TEST_TRANSPORT=torch``: every model test
#: through ``convert_to_domain_parallel(..., transport="torch")`` on gloo; the manager is bridged on first use).
TRANSPORT = os.environ.get("CREDIT_MPI_TEST_TRANSPORT", "mpi")


def transport_for(manager, transport=None) -> tuple[str, bool]:
    """``(transport, bridged here)``: ``transport`` (None: :data:`TRANSPORT`) for ``manager``; ``"torch"`` bridges
    the manager to gloo groups first when it is not (collective over its communicator: run_both is called on
    every rank of it), and the caller destroys that bridge again (the manager's communicator may be freed before
    the manager: tests/halo_reference.prefix_managers)."""
    transport = TRANSPORT if transport is None else transport
    if transport != "torch" or manager is None or manager.domain_parallel_size <= 1:
        return "mpi", False
    from credit_mpi import torch_bridge

    if torch_bridge.is_bridged(manager):
        return "torch", False
    credit_mpi.init_torch_distributed(manager, "gloo", timeout=timedelta(seconds=120))
    return "torch", True


def bands_of(total: int, manager) -> tuple[int, int]:
    return band_range(total, manager.domain_parallel_size, manager.domain_rank, uneven=True)


def to_dtype(model, dtype):
    """The real floating-point parameters and buffers of ``model`` in ``dtype``, its complex ones as they are (as
    ``.double()`` does: ``Module.to(torch.float64)`` casts a complex one to a real tensor, dropping the imaginary part;
    spectral weights of a model that computes its transforms in complex64 stay complex64)."""
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def run_both(build, shape, manager, *, seed=0, shard_dim=-2, dtype=torch.float64, replicated=False, steps=0, lr=0.05, sizes=None,
             custom_converters=None, transport=None):
    """Forward + backward of ``build()`` on one process and on bands; returns the pieces to compare.

    The loss is sum(out * weight) with a fixed random weight (each band: its rows; a replicated
    output: the whole weight divided by the domain size). Parameter gradients are reduced with
    reduce_gradients. ``sizes`` gives the band layout (default: array_split). With ``steps`` > 0, that many SGD steps are taken on both and the final
    parameters are returned too.
    """
    transport, bridged = transport_for(manager, transport)
    try:
        return _run_both(build, shape, manager, seed, shard_dim, dtype, replicated, steps, lr, sizes, custom_converters,
                         transport)
    finally:
        if bridged:
            credit_mpi.destroy_torch_distributed(manager)


def _run_both(build, shape, manager, seed, shard_dim, dtype, replicated, steps, lr, sizes, custom_converters, transport):
    torch.manual_seed(seed)
    ref = to_dtype(build(), dtype)
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager, shard_dim, custom_converters=custom_converters,
                                       transport=transport)
    gen = torch.Generator().manual_seed(seed + 1)
    xg = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    axis = shard_dim % len(shape)
    if sizes is None:
        start, stop = bands_of(shape[axis], manager)
    else:  # an explicit layout (e.g. uneven bands with stride-aligned offsets)
        assert sum(sizes) == shape[axis] and len(sizes) == manager.domain_parallel_size
        start = sum(sizes[: manager.domain_rank])
        stop = start + sizes[manager.domain_rank]
    comm = manager.domain_group
    d = manager.domain_parallel_size
    result = {}
    if steps:
        opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max(steps, 1)):
        xr = xg.clone().requires_grad_()
        out_ref = ref(xr)
        wg = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(seed + 2 + step), dtype=torch.float64).to(dtype)
        (out_ref * wg).sum().backward()
        xl = xg.narrow(axis, start, stop - start).clone().requires_grad_()
        out = model(xl)
        if replicated:
            loss = (out * wg).sum() / d
            gathered = out.detach()
        else:
            rows = out.shape[axis]
            o0 = comm.exscan(rows) or 0
            loss = (out * wg.narrow(axis, o0, rows)).sum()
            parts = comm.allgather(out.detach().to(torch.float64).numpy())
            gathered = torch.from_numpy(np.concatenate(parts, axis)).to(dtype)
        loss.backward()
        credit_mpi.reduce_gradients(model.parameters(), manager)
        result.update(
            out=gathered, out_ref=out_ref.detach(), gx=xl.grad, gx_ref=xr.grad.narrow(axis, start, stop - start),
            grads=[p.grad.clone() for p in model.parameters() if p.requires_grad],
            grads_ref=[p.grad.clone() for p in ref.parameters() if p.requires_grad],  # a frozen parameter has none
        )
        if steps:
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
    result["params"] = [p.detach().clone() for p in model.parameters()]
    result["params_ref"] = [p.detach().clone() for p in ref.parameters()]
    return result


def assert_same(r, atol=1e-12, rtol=1e-10):
    torch.testing.assert_close(r["out"], r["out_ref"], atol=atol, rtol=rtol)
    torch.testing.assert_close(r["gx"], r["gx_ref"], atol=atol, rtol=rtol)
    assert len(r["grads"]) == len(r["grads_ref"])
    for g, h in zip(r["grads"], r["grads_ref"], strict=True):
        torch.testing.assert_close(g, h, atol=atol, rtol=rtol)
    for g, h in zip(r["params"], r["params_ref"], strict=True):
        torch.testing.assert_close(g, h, atol=atol, rtol=rtol)


def same_error_everywhere(comm, fn, expected):
    """Call ``fn``; every rank must raise ``expected`` (checked collectively)."""
    name = None
    try:
        fn()
    except expected as exc:
        name = type(exc).__name__
        message = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported below
        name = f"unexpected {type(exc).__name__}: {exc}"
        message = ""
    names = comm.allgather(name)
    assert all(n == expected.__name__ for n in names), names
    return message


def world() -> MPI.Comm:
    return MPI.COMM_WORLD
