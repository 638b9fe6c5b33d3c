"""The collectives built on :mod:`credit_mpi.engine`, one file per operation.

Each module declares one :class:`~credit_mpi.engine.Op` (its name, cache
key, local check, plan, kernel, adjoint) and a public function of one line
that calls :func:`~credit_mpi.engine.run`. Imported on use (most need torch):
``from credit_mpi.ops.allgather_along import allgather_along``.
"""
