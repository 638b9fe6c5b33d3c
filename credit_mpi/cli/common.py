"""Helpers the ``credit-mpi`` subcommands share."""

from __future__ import annotations

import os

from mpi4py import MPI

__all__ = ["_launcher_size", "_mismatch_hint"]


def _launcher_size() -> int | None:
    """The rank count the launcher announced in the environment, if any."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "PALS_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def _mismatch_hint(comm: MPI.Comm) -> str:
    launched = _launcher_size()
    if comm.Get_size() == 1 and launched is not None and launched > 1:
        return (
            f"; the launcher started {launched} processes but MPI sees 1 rank in each: mpi4py is built "
            f"against a different MPI than this mpiexec/srun belongs to ({MPI.Get_library_version().splitlines()[0].strip()})"
        )
    return ""
