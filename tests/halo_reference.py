"""Single-process references for the halo tests: the padded global field."""

from __future__ import annotations

import contextlib

import numpy as np
from mpi4py import MPI

import credit_mpi

NUMPY_MODES = {"zero": "constant", "periodic": "wrap", "reflect": "reflect"}
TORCH_MODES = {"zero": "constant", "periodic": "circular", "reflect": "reflect"}


def pad_numpy(g: np.ndarray, width: int, axis: int, boundary: str) -> np.ndarray:
    """``g`` padded by ``width`` rows on both sides of ``axis``."""
    if boundary == "earth":
        rolled = np.roll(g, g.shape[-1] // 2, axis=-1)
        top = np.flip(np.take(rolled, range(width), axis=axis), axis=axis)
        bottom = np.flip(np.take(rolled, range(g.shape[axis] - width, g.shape[axis]), axis=axis), axis=axis)
        return np.concatenate([top, g, bottom], axis=axis)
    pads = [(0, 0)] * g.ndim
    pads[axis] = (width, width)
    return np.pad(g, pads, mode=NUMPY_MODES[boundary])


def pad_torch(g, width: int, boundary: str):
    """``g`` (..., H, W) padded by ``width`` rows along H, as CREDIT / torch do it (differentiable)."""
    import torch
    import torch.nn.functional as F

    if width == 0:
        return g
    if boundary == "earth":  # CREDIT's TensorPadding(mode="earth"), latitude part
        rolled = torch.roll(g, shifts=g.shape[-1] // 2, dims=-1)
        top = torch.flip(rolled[..., :width, :], (-2,))
        bottom = torch.flip(rolled[..., -width:, :], (-2,))
        return torch.cat([top, g, bottom], dim=-2)
    if boundary == "zero":
        return F.pad(g, (0, 0, width, width))
    shape = g.shape
    flat = g.reshape(-1, 1, *shape[-2:])  # torch's reflect/circular need a batch and channel dim
    return F.pad(flat, (0, 0, width, width), mode=TORCH_MODES[boundary]).reshape(*shape[:-2], -1, shape[-1])


@contextlib.contextmanager
def prefix_managers(make_manager):
    """``[(d, manager)]`` for d = 1..world size, each over world ranks 0..d-1 (only those this rank is in).

    Collective over COMM_WORLD (every rank creates its managers in the same
    ascending order). The sub-communicators are freed afterwards; the
    managers by ``make_manager``'s fixture. A test marked
    ``@pytest.mark.one_domain_size`` gets d = the world size only
    (``make_manager.domain_sizes``, tests/conftest.py).
    """
    world = MPI.COMM_WORLD
    sizes = getattr(make_manager, "domain_sizes", range(1, world.Get_size() + 1))
    comms = [world.Split(0 if world.Get_rank() < d else MPI.UNDEFINED, world.Get_rank()) for d in sizes]
    try:
        yield [(d, make_manager(d, comm=comm)) for d, comm in zip(sizes, comms, strict=True) if comm != MPI.COMM_NULL]
    finally:
        for comm in comms:
            if comm != MPI.COMM_NULL:
                comm.Free()


@contextlib.contextmanager
def first_ranks(make_manager, d: int):
    """A manager over world ranks 0..d-1 (None on the others), its communicator freed afterwards (collective)."""
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.Get_rank() < d else MPI.UNDEFINED, world.Get_rank())
    try:
        yield None if comm == MPI.COMM_NULL else make_manager(d, comm=comm)
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()


def band(total: int, manager: credit_mpi.DomainParallelManager) -> tuple[int, int]:
    from credit_mpi.partition import band_range

    return band_range(total, manager.domain_parallel_size, manager.domain_rank, uneven=True)
