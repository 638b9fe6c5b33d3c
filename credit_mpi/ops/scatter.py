"""The scatter: one rank's global field cut into every rank's band (1-D) or block (2-D).

One op of :mod:`credit_mpi.engine` in two forms with their own operation
codes (a single dim, :class:`ScatterBands`; a ``(lat, lon)`` pair on a 2-D
domain grid, :class:`ScatterBlocks`). Only ``root`` holds the field; the
others pass anything (ignored). The agreement covers the root and
``uneven`` (and the dims for blocks); the root describes the array (its
failures are every rank's, inside the agreement), then tells the others
with one ``bcast`` in the plan (the dtype object itself travels, so record
dtypes work on every rank). Kernels: one ``Scatterv`` of row datatypes for
bands, one ``Alltoallw`` of subarray types for blocks (the root sends every
rank its block, the others never hold the field). Not differentiable, not
remembered (the root's array is not the others' key). The public function
is :func:`credit_mpi.scatter_tensor` (:mod:`credit_mpi.sharding`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..blocks import block_types, check_line, grid_comm, normalize_dims
from ..engine import Op
from ..grid import block_sizes, grid_coords, grid_of
from ..layout import offsets
from ..manager import domain_of
from ..partition import band_sizes, normalize_dim, row_datatypes
from ..transport import arrays, staging
from ..validation import Local, check_root

__all__ = ["ScatterBands", "ScatterBlocks", "BANDS", "BLOCKS"]


class _Scatter(NamedTuple):
    """What every rank knows after the agreement and the root's description."""

    comm: MPI.Comm
    rank: int
    root: int
    info: arrays.ArrayInfo
    dtype: Any
    axes: tuple[int, ...]  # the split dims: (axis,) for bands, (ay, ax) for blocks
    sizes: tuple  # per split dim, every part's extent
    grid: tuple[int, int]


class ScatterBands(Op):
    """The root's field cut into latitude bands along one dim."""

    name = "scatter_tensor"

    def local(self, x: Any, args: dict) -> Local:
        domain = domain_of(args["manager"])
        check_line(domain, args["dim"])  # a single dim on a grid of several columns: every rank's error
        root, uneven = args["root"], args["uneven"]
        check_root(root, domain.size)
        plan = None
        if domain.rank == root:
            info = arrays.describe(x)
            axis = normalize_dim(args["dim"], len(info.shape))
            plan = (info, arrays.dtype_of(x), (axis,), (band_sizes(info.shape[axis], domain.size, uneven, dim=args["dim"]),))
        return Local(plan, (root, uneven, repr(args["dim"])))  # dim too: a rank's other dim is not silently the root's

    def explain(self, locals_: list[Local]) -> None:
        if len({loc.calls[2] for loc in locals_}) > 1:
            detail = ", ".join(f"rank {r}: dim={loc.calls[2]}" for r, loc in enumerate(locals_))
            raise ValueError(f"scatter_tensor: ranks of the domain group passed different dims ({detail})")
        detail = ", ".join(f"rank {r}: root={loc.calls[0]}, uneven={loc.calls[1]}" for r, loc in enumerate(locals_))
        raise ValueError(f"scatter_tensor: ranks of the domain group passed different roots or uneven ({detail})")

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> _Scatter:
        domain = domain_of(args["manager"])
        data = self._comm(domain, comm)
        # every rank agreed on the root, which described the array: it tells the others
        info, dtype, axes, sizes = data.bcast(mine, root=args["root"])
        return _Scatter(data, domain.rank, args["root"], info, dtype, axes, sizes, grid_of(domain.manager, domain.size))

    def _comm(self, domain: Any, comm: MPI.Comm) -> MPI.Comm:
        return comm

    def _shape(self, p: _Scatter) -> list[int]:
        """This rank's part's shape."""
        shape = list(p.info.shape)
        shape[p.axes[0]] = p.sizes[0][p.rank]
        return shape

    def _out(self, x: Any, p: _Scatter) -> Any:
        shape = self._shape(p)
        return arrays.empty(x, shape) if p.rank == p.root else arrays.empty_described(p.info, shape, p.dtype)

    def kernel(self, x: Any, p: _Scatter) -> Any:
        out = self._out(x, p)
        (axis,), (sizes,), shape = p.axes, p.sizes, out.shape
        outer = math.prod(shape[:axis])
        row_bytes = math.prod(shape[axis + 1 :]) * p.info.itemsize
        if outer * row_bytes * p.info.shape[axis] == 0:
            return out
        comm, rank = p.comm, p.rank
        recv_type, send_type = row_datatypes(outer, sizes[rank], p.info.shape[axis], row_bytes)
        try:
            with staging.recv_buffer(out, comm) as recv:
                if rank == p.root:
                    with staging.send_buffer(arrays.contiguous(x), comm) as send:
                        comm.Scatterv([send, (list(sizes), offsets(sizes)), send_type], [recv, sizes[rank], recv_type], p.root)
                else:
                    comm.Scatterv(None, [recv, sizes[rank], recv_type], p.root)
        finally:
            send_type.Free()
            recv_type.Free()
        return out


class ScatterBlocks(ScatterBands):
    """The root's field cut into the blocks of a 2-D domain grid (``dim`` a pair); agreed on the domain communicator."""

    name = "scatter_tensor/2d"

    def local(self, x: Any, args: dict) -> Local:
        domain = domain_of(args["manager"])
        root, uneven, dim = args["root"], args["uneven"], args["dim"]
        check_root(root, domain.size)
        plan = None
        if domain.rank == root:
            info = arrays.describe(x)
            ay, ax = normalize_dims(dim, len(info.shape))
            grid = grid_of(domain.manager, domain.size)
            plan = (info, arrays.dtype_of(x), (ay, ax), tuple(block_sizes((info.shape[ay], info.shape[ax]), grid, uneven, tuple(dim))))
        return Local(plan, ("2d", root, uneven, repr(dim)))

    def explain(self, locals_: list[Local]) -> None:
        detail = ", ".join(f"rank {r}: root={loc.calls[1]}, uneven={loc.calls[2]}, dim={loc.calls[3]}" for r, loc in enumerate(locals_))
        raise ValueError(f"scatter_tensor: ranks of the domain group passed different roots, uneven or dims ({detail})")

    def _comm(self, domain: Any, comm: MPI.Comm) -> MPI.Comm:
        return grid_comm(domain)  # the data moves on the Cartesian communicator (its ranks are the domain ranks)

    def _shape(self, p: _Scatter) -> list[int]:
        (ay, ax), (heights, widths) = p.axes, p.sizes
        i, j = grid_coords(p.rank, p.grid)
        shape = list(p.info.shape)
        shape[ay], shape[ax] = heights[i], widths[j]
        return shape

    def kernel(self, x: Any, p: _Scatter) -> Any:
        out = self._out(x, p)
        if math.prod(p.info.shape) == 0:
            return out
        comm, n = p.comm, p.comm.Get_size()
        recv_counts = [0] * n
        recv_counts[p.root] = math.prod(out.shape) * p.info.itemsize
        (ay, ax), (heights, widths) = p.axes, p.sizes
        with staging.recv_buffer(out, comm) as recv:
            if p.rank == p.root:
                types = block_types(p.info.shape, ay, ax, p.grid, list(heights), list(widths), p.info.itemsize)
                try:
                    with staging.send_buffer(arrays.contiguous(x), comm) as send:
                        comm.Alltoallw(
                            [send, ([0 if t is None else 1 for t in types], [0] * n), [MPI.BYTE if t is None else t for t in types]],
                            [recv, (recv_counts, [0] * n), [MPI.BYTE] * n],
                        )
                finally:
                    for t in types:
                        if t is not None:
                            t.Free()
            else:
                empty = np.empty(1, dtype=np.uint8)
                comm.Alltoallw([empty, ([0] * n, [0] * n), [MPI.BYTE] * n], [recv, (recv_counts, [0] * n), [MPI.BYTE] * n])
        return out


BANDS, BLOCKS = ScatterBands(), ScatterBlocks()
