"""Halo exchange along the sharded dimension.

Each rank of a domain group holds a band of rows of a global field. Before a
convolution (or any stencil) it needs ``halo_width`` rows of its neighbours
on both sides. :func:`halo_exchange` returns the local band with those rows
added before and after along ``dim``:

* between ranks, the rows come from the neighbouring bands: the one edge
  swap (:func:`credit_mpi.transport.moves.swap_edges`), one round of at most
  four non-blocking messages (up to the previous rank, down to the next, and
  theirs back), none past the outer edges, so no rank count can deadlock;
  over MPI or, with ``transport="torch"``, the mirrored torch group. Each
  band's first and last ``halo_width`` rows travel packed contiguously (a
  derived datatype could send them in place, but MPICH moves strided types
  several times slower) and land in place in the output: no concatenation;
* at the two outer edges of the domain, ``boundary`` decides:

  ``"zero"``
      zeros (the reference's behaviour).
  ``"periodic"``
      the first and the last rank exchange with each other
      (``numpy.pad(mode="wrap")``, ``torch.nn.functional.pad(mode="circular")``).
  ``"reflect"``
      mirror without repeating the edge row (``mode="reflect"``).
  ``"earth"``
      across the pole, as CREDIT's ``TensorPadding(mode="earth")`` pads a
      global latitude x longitude field: the halo rows are the edge rows
      flipped in latitude and rolled by half the longitudes. The longitude
      is the last dimension; it must be whole on every rank (``dim`` may not
      be the last dimension) and even.

For every boundary the result equals the matching rows of the single-process
padded global field, for even and uneven bands. With no manager (or a domain
size of 1) the input is simply padded. A halo wider than a band that must
supply it raises ``ValueError`` on every rank.

With torch tensors that require grad, the exchange is differentiable (see
:mod:`credit_mpi.autograd`): the backward pass sends halo gradients back to
the ranks that own those rows and adds them.
"""

from __future__ import annotations

from typing import Any

from .engine import run_agreed, run_args
from .manager import DomainParallelManager, domain_of, live_domain_comm
from .ops import halo as op
from .ops.halo import check_boundary_name, check_width  # noqa: F401 - credit_mpi.nn checks a layer's arguments with them
from .partition import HALO_BOUNDARIES

__all__ = ["HALO_BOUNDARIES", "halo_exchange"]

_PAIR = (tuple, list)  # a pair of dims, widths or boundaries: the 2-D grid (blocks.is_grid_call, inlined)


def halo_exchange(
    x: Any,
    halo_width: int,
    dim: int = -2,
    manager: DomainParallelManager | None = None,
    *,
    boundary: str = "zero",
    check: bool = True,
    transport: str = "mpi",
) -> Any:
    """Pad the local band with ``halo_width`` rows of its neighbours on both sides.

    Collective over the manager's domain group.

    Args:
        x: This rank's band (numpy array or torch tensor).
        halo_width: Rows to add before and after along ``dim`` (>= 0).
        dim: The sharded dimension (default: -2, latitude in BCHW / BCTHW).
            A pair ``(lat_dim, lon_dim)`` (with ``halo_width`` and
            ``boundary`` optionally pairs too) exchanges the blocks of a 2-D
            ``domain_grid``, corners included (latitude first, then longitude
            on the latitude-padded block).
        manager: DomainParallelManager (uses the global singleton if None; with
            none, or a domain size of 1, the whole field is on this rank).
        boundary: ``"zero"``, ``"periodic"``, ``"reflect"`` or ``"earth"``
            (see the module docstring).
        check: Agree across the domain group on the bands' kind, dtype and
            every dimension but ``dim``, so a mismatch is the same exception
            on every rank. With ``False`` the ranks still agree (in the same
            single ``Allgather`` of a few integers) on everything that decides
            the MPI calls: the width, the boundary, the transport, the bytes
            per row, whether autograd records the exchange, and every band's
            rows (so a halo wider than a band is always caught).
        transport: ``"mpi"`` (default) moves the halo rows with MPI
            point-to-point messages; ``"torch"`` with torch.distributed point-to-point
            over ``manager.torch_domain_group`` (NCCL on GPUs; see
            :func:`credit_mpi.init_torch_distributed`). Bit-identical result.
            The backward pass of the differentiable exchange moves the halo
            gradients the same way; the agreement uses MPI either way.

    Returns:
        A new array of ``x``'s kind, dtype and device, ``2 * halo_width``
        rows longer along ``dim`` (host arrays: memory from the reuse pool
        of :func:`credit_mpi.release_output_pool`).

    Raises:
        ValueError: negative or non-integer ``halo_width``, ``dim`` out of
            range, unknown ``boundary`` or ``transport``, ``"earth"`` without
            the whole (or with an odd) longitude, a halo wider than a band.
        TypeError: unsupported array type, or bands of different kinds.
        DomainParallelError: ranks made different calls (a different width,
            boundary, transport, or a band that requires grad on some ranks only).
    """
    args = {"halo_width": halo_width, "dim": dim, "boundary": boundary, "transport": transport, "manager": manager}
    if (type(dim) is not int or type(halo_width) is not int) and (  # ints: bands (the per-call fast path's one test)
            isinstance(dim, _PAIR) or isinstance(halo_width, _PAIR)) or isinstance(boundary, _PAIR):  # pairs: the 2-D grid
        return run_args(op.BLOCKS, x, domain_of(manager).comm, args, check)
    comm = live_domain_comm(manager)  # a live manager's communicator: the per-call fast path asks nothing else
    if comm is None or comm.Get_size() <= 1:
        domain = domain_of(manager)  # raises for a freed manager or a bad stand-in
        if domain.size <= 1:  # the whole field is here: pad it (no agreement, no message)
            return run_agreed(op.BANDS, x, domain.comm, None, **args)
        comm = domain.comm
    return run_args(op.BANDS, x, comm, args, check)


def exchange_agreed(x: Any, halo_width: int, dim: int, manager: Any, boundary: str, sizes: tuple[int, ...]) -> Any:
    """:func:`halo_exchange` (one dim, MPI) with no agreement of its own: the caller's covered it (private).

    For the converted layers of :mod:`credit_mpi.nn`, whose one agreement per
    call covers everything this exchange's would (the band's dtype, device,
    every dim, requires_grad with the grad mode, the layer and so the width
    and boundary, and every band's rows: ``sizes``). The plan is remembered
    per call shape (:func:`credit_mpi.engine.run_agreed`).
    """
    comm = live_domain_comm(manager) or domain_of(manager).comm
    return run_agreed(op.BANDS, x, comm, sizes, halo_width=halo_width, dim=dim, boundary=boundary, transport="mpi", manager=manager)
