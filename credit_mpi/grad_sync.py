"""Gradient reduction for domain-parallel (x data-parallel) training.

In domain parallelism the ranks of a domain group hold the same parameters
but different latitude bands of the same sample. If each rank's loss is its
band's share of the global loss (e.g. the band's sum of squared errors
divided by the *global* number of points, or the loss of the gathered field),
the gradient of the global loss is the **sum** of the ranks' gradients; the
data-parallel group then averages over samples (**mean**). The reference's
plain average over all ranks equals this only when every band carries the
same weight, which uneven bands (721 latitudes on 2 ranks) break.

:func:`reduce_gradients` does both reductions in place, with one flat buffer
per dtype and one ``Allreduce`` per group and dtype. Gradients on a GPU are
reduced in place on the device when MPI is CUDA-aware, else staged through
host memory (:mod:`credit_mpi.transport.staging` decides, as for every collective).

With torch's own data-parallel wrapper (DDP over
``manager.torch_data_parallel_group``), DDP already averages over the
data-parallel group during ``backward()``; ``over="domain"`` then adds the
missing half, the sum over the domain group. Both are linear, so their order
does not matter: after ``reduce_gradients(model.parameters(), over="domain")``
every rank holds the gradient of the mean over the samples of the global
loss (docs/torch_bridge.rst, tests/test_ddp_recipe.py).

The reduction is an op of :mod:`credit_mpi.engine`, :mod:`credit_mpi.ops.reduce`.
"""

from __future__ import annotations

from collections.abc import Iterable

from .engine import run
from .manager import DomainParallelManager, get_domain_parallel_manager
from .ops.reduce import REDUCE, check_over

__all__ = ["reduce_gradients"]


def reduce_gradients(
    parameters: Iterable,
    manager: DomainParallelManager | None = None,
    *,
    check: bool = True,
    over: str = "all",
) -> None:
    """Sum parameter gradients over the domain group, then average them over the data-parallel group.

    Collective over the manager's parent communicator. Parameters whose
    ``grad`` is ``None`` are skipped; every rank must have gradients for the
    same parameters (checked when ``check``).

    ``over`` picks the reductions: ``"all"`` (both, for training without a
    torch wrapper), ``"domain"`` (only the sum over the domain group: call it
    after ``loss.backward()`` of a model wrapped in DDP over
    ``manager.torch_data_parallel_group``, which does the data-parallel mean
    itself) or ``"data_parallel"`` (only the mean over the data-parallel
    group).

    Args:
        parameters: torch parameters (e.g. ``model.parameters()``), the same
            model on every rank.
        manager: DomainParallelManager (the global singleton if None; with
            none, nothing happens).
        check: Kept for the API's symmetry: the ranks always agree first
            (one ``Allgather`` of a few integers over the parent communicator)
            on which gradients exist, on their dtypes, sizes and device types
            and on ``over``, since these decide the reductions, so a mismatch
            is one ``ValueError`` on every rank instead of garbage or a hang.
        over: ``"all"``, ``"domain"`` or ``"data_parallel"`` (see above).

    Raises:
        ValueError: ranks hold gradients for different parameters; ``over``
            is not one of the three names or differs between ranks.
    """
    manager = get_domain_parallel_manager() if manager is None else manager
    params = list(parameters)
    if manager is None:
        check_over(over)  # a single process: nothing to agree on
        return
    grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    run(REDUCE, grads, manager.comm, check=check, over=over, manager=manager)
