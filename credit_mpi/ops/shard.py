"""Sharding: this rank's band (or block) of a global array, or of every array of a batch; local slicing.

Ops of :mod:`credit_mpi.engine` (operations ``"shard_tensor"``,
``"shard_batch"`` and their 2-D forms ``"shard_tensor/2d"``,
``"shard_batch/2d"``). Sharding moves no data: the kernel narrows the
array to this rank's rows (and columns on a 2-D grid), differentiable like
a slice (a local adjoint: torch records the narrow itself). With
``check="collective"`` the facades run it through :func:`credit_mpi.engine.run_args`:
one agreement that every rank of the domain group passed the same array
description and arguments (a mistake on one rank is the same exception on
every rank); with ``check="local"`` (the reference's behaviour) the same
local check, plan and kernel run with no MPI call at all (:func:`local_run`).
The public functions are :func:`credit_mpi.shard_tensor` and
:func:`credit_mpi.shard_batch` (:mod:`credit_mpi.sharding`).

``args`` of every op: ``domain`` (the caller's :class:`~credit_mpi.manager.Domain`),
``uneven``; ``dim`` (tensor) or ``dims`` (batch: ndim -> dim) and
``transport`` (batch).
"""

from __future__ import annotations

from typing import Any

from ..blocks import block_slice, check_line, normalize_dims
from ..engine import Op, apply_agreed
from ..grid import block_sizes, grid_coords, grid_of
from ..layout import Layout
from ..partition import band_sizes, normalize_dim
from ..transport import arrays
from ..validation import Local, check_transport

__all__ = ["ShardTensor", "ShardBatch", "ShardTensor2d", "ShardBatch2d", "TENSOR", "BATCH", "TENSOR_2D", "BATCH_2D",
           "local_run"]


class _Shard(Op):
    """What the four sharding ops share: the plan is the agreed local one, the adjoint torch's own."""

    local_adjoint = True  # a slice: its backward is local (and autograd's state decides no MPI call)

    def plan(self, mine: Any, counts: list[int], comm: Any, args: dict) -> Any:
        return mine, args["domain"]


class ShardTensor(_Shard):
    """``x`` is the global array; the plan ``(info, axis, sizes)``."""

    name = "shard_tensor"

    def local(self, x: Any, args: dict) -> Local:
        domain, dim, uneven = args["domain"], args["dim"], args["uneven"]
        check_line(domain, dim)  # a single dim on a grid of several columns: every rank's error
        info = arrays.describe(x)
        axis = normalize_dim(dim, len(info.shape))
        sizes = band_sizes(info.shape[axis], domain.size, uneven, dim=dim)
        return Local((info, axis, sizes), (axis, uneven), (info.kind, info.shape, info.dtype, info.device_type))

    def explain(self, locals_: list[Local]) -> None:
        _different_arrays("shard_tensor", locals_)

    def kernel(self, x: Any, plan: Any) -> Any:
        (_, axis, sizes), domain = plan
        return arrays.narrow(x, axis, Layout.bands(sizes).start(domain.rank), sizes[domain.rank])


class ShardBatch(_Shard):
    """``x`` is the batch (a mapping); the plan ``{key: (info, axis, sizes)}`` of its 4-D / 5-D arrays."""

    name = "shard_batch"

    def local(self, batch: Any, args: dict) -> Local:
        domain, dims, uneven, transport = args["domain"], args["dims"], args["uneven"], args["transport"]
        check_line(domain, dims[5])  # a single dim on a grid of several columns: every rank's error
        check_transport(transport)  # inside the agreement: a bad transport on one rank is every rank's error
        if transport == "torch":
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        bands = {}
        for key, value in batch.items():
            if arrays.is_array(value) and value.ndim in dims:
                try:
                    info = arrays.describe(value)
                    axis = normalize_dim(dims[value.ndim], value.ndim)
                    bands[key] = (info, axis, band_sizes(info.shape[axis], domain.size, uneven, dim=dims[value.ndim]))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{exc} (in batch[{key!r}])") from None
        same = tuple((key, info.kind, info.shape, info.dtype, info.device_type, axis) for key, (info, axis, _) in bands.items())
        return Local(bands, (uneven, transport), same)

    def explain(self, locals_: list[Local]) -> None:
        _different_arrays("shard_batch", locals_)

    def kernel(self, batch: Any, plan: Any) -> dict:
        bands, domain = plan
        sharded = dict(batch)
        for key, (_, axis, sizes) in bands.items():
            sharded[key] = arrays.narrow(batch[key], axis, Layout.bands(sizes).start(domain.rank), sizes[domain.rank])
        return sharded


class ShardTensor2d(_Shard):
    """``x`` is the global array; the plan ``(ay, ax, heights, widths)`` of the 2-D domain grid."""

    name = "shard_tensor/2d"

    def local(self, x: Any, args: dict) -> Local:
        domain, dim, uneven = args["domain"], args["dim"], args["uneven"]
        info = arrays.describe(x)
        ay, ax = normalize_dims(dim, len(info.shape))
        heights, widths = block_sizes((info.shape[ay], info.shape[ax]), _grid(domain), uneven, tuple(dim))
        return Local((ay, ax, heights, widths), ("2d", ay, ax, uneven), (info.kind, info.shape, info.dtype, info.device_type))

    def explain(self, locals_: list[Local]) -> None:
        raise ValueError("shard_tensor: ranks of the domain group passed different arrays or dims ("
                         + "; ".join(f"rank {r}: {loc.same} dims {loc.calls[1:3]}" for r, loc in enumerate(locals_)) + ")")

    def kernel(self, x: Any, plan: Any) -> Any:
        (ay, ax, heights, widths), domain = plan
        if domain.size <= 1:
            return x
        return block_slice(x, ay, ax, heights, widths, grid_coords(domain.rank, _grid(domain)))


class ShardBatch2d(_Shard):
    """``x`` is the batch; the plan ``{key: (info, ay, ax, heights, widths)}`` of its 4-D / 5-D arrays."""

    name = "shard_batch/2d"

    def local(self, batch: Any, args: dict) -> Local:
        domain, dims, uneven, transport = args["domain"], args["dims"], args["uneven"], args["transport"]
        check_transport(transport)  # inside the agreement: a bad transport on one rank is every rank's error
        if transport == "torch" and domain.size > 1:
            domain.manager.torch_group("domain")  # a clear error when the bridge is missing
        grid = _grid(domain)
        plans = {}
        for key, value in batch.items():
            if arrays.is_array(value) and value.ndim in dims:
                try:
                    info = arrays.describe(value)
                    d = dims[value.ndim]
                    ay, ax = normalize_dims(d, len(info.shape))
                    plans[key] = (info, ay, ax, *block_sizes((info.shape[ay], info.shape[ax]), grid, uneven, tuple(d)))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"{exc} (in batch[{key!r}])") from None
        same = tuple((k, i.kind, i.shape, i.dtype, i.device_type, ay, ax) for k, (i, ay, ax, _, _) in plans.items())
        return Local(plans, ("2d", uneven, transport), same)

    def explain(self, locals_: list[Local]) -> None:
        raise ValueError("shard_batch: ranks of the domain group passed different batches ("
                         + "; ".join(f"rank {r}: {loc.same}" for r, loc in enumerate(locals_)) + ")")

    def kernel(self, batch: Any, plan: Any) -> dict:
        plans, domain = plan
        if domain.size <= 1:
            return batch
        coords = grid_coords(domain.rank, _grid(domain))
        sharded = dict(batch)
        for key, (_, ay, ax, heights, widths) in plans.items():
            sharded[key] = block_slice(batch[key], ay, ax, heights, widths, coords)
        return sharded


TENSOR, BATCH, TENSOR_2D, BATCH_2D = ShardTensor(), ShardBatch(), ShardTensor2d(), ShardBatch2d()


def local_run(op: _Shard, x: Any, args: dict) -> Any:
    """``op`` with ``check="local"``: this rank's check, plan and kernel, no MPI call (as the reference)."""
    return apply_agreed(op, x, op.plan(op.local(x, args).plan, [], None, args))


def _grid(domain: Any) -> tuple[int, int]:
    return grid_of(domain.manager, domain.size)


def _different_arrays(what: str, locals_: list[Local]) -> None:
    """The 1-D sharding ops' ``explain``: name each rank's array(s)."""
    summaries = [_summary(loc.plan) for loc in locals_]
    if len(set(summaries)) == 1:
        return  # the same arrays and dims, different calls (uneven, transport): agree's DomainParallelError names them
    detail = "; ".join(f"rank {r}: {summary}" for r, summary in enumerate(summaries))
    raise ValueError(f"{what}: ranks of the domain group passed different arrays ({detail})")


def _summary(plan: Any) -> str:
    if isinstance(plan, dict):
        return "{" + ", ".join(f"{k!r}: {_summary(v)}" for k, v in plan.items()) + "}"
    info, axis = plan[0], plan[1]
    return f"{info.kind} {info.dtype} {info.shape} on {info.device} dim {axis}"
