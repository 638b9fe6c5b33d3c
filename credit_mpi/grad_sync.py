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
"""

from __future__ import annotations

from collections.abc import Iterable

from mpi4py import MPI

from .manager import DomainParallelManager, get_domain_parallel_manager
from .transport import arrays, staging
from .validation import Local, agree

__all__ = ["reduce_gradients"]

# dtypes MPI cannot add directly are reduced in float32
_WIDEN = {"torch.float16", "torch.bfloat16"}

# over= -> (sum over the domain group, mean over the data-parallel group)
_OVER = {"all": (True, True), "domain": (True, False), "data_parallel": (False, True)}


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

    def valid_over() -> str:
        if not isinstance(over, str) or over not in _OVER:
            raise ValueError(f"reduce_gradients: over must be one of {sorted(_OVER)}, got {over!r}")
        return over

    if manager is None:
        valid_over()  # a single process: nothing to agree on
        return
    grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]

    def local() -> Local:
        # Which gradients exist, their dtypes, sizes and device types, and
        # which groups reduce decide the Allreduce calls: agreed whatever
        # ``check`` says.
        return Local(valid_over(), (over, tuple((i, str(g.dtype), g.numel(), g.device.type) for i, g in grads)))

    def explain(locals_: list[Local]) -> None:
        overs = [loc.calls[0] for loc in locals_]
        if len(set(overs)) > 1:
            detail = ", ".join(f"rank {r}: {o!r}" for r, o in enumerate(overs))
            raise ValueError(f"reduce_gradients: ranks passed different over= ({detail}); pass the same on every rank")
        ranks = [r for r, loc in enumerate(locals_) if loc.calls != locals_[0].calls]
        raise ValueError(
            "reduce_gradients: ranks hold gradients for different parameters, dtypes, sizes or device types "
            f"(rank(s) {ranks} differ from rank 0); run the same model and backward pass on every rank"
        )

    agree(manager.comm, "reduce_gradients", local, check=check, explain=explain)
    groups: dict[str, list] = {}
    for _, g in grads:
        groups.setdefault(str(g.dtype), []).append(g)
    sum_domain, mean_dp = _OVER[over]
    domain = manager.domain_parallel_size if sum_domain else 1
    dp = manager.data_parallel_size if mean_dp else 1
    if not groups:
        return
    import torch  # the gradients are torch tensors, so torch is loaded already

    for dtype in sorted(groups):
        tensors = groups[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        if dtype in _WIDEN:
            flat = flat.float()
        datatype = arrays.mpi_datatype(flat)
        for comm, size in ((manager.domain_group, domain), (manager.data_parallel_group, dp)):
            if size > 1:  # device gradients: direct or host-staged, as staging decides for comm
                with staging.recv_buffer(flat, comm, inout=True) as buf:
                    comm.Allreduce(MPI.IN_PLACE, [buf, datatype], op=MPI.SUM)
        if dp > 1:
            flat.div_(dp)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
