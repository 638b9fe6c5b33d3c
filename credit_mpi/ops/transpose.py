"""The pencil transpose: a tensor split along one dim re-split along another, one all-to-all, differentiable.

A spectral transform over the sharded dim (``torch.fft.rfft2`` over latitude
and longitude, the Legendre contraction of a spherical harmonic transform)
needs every latitude on one rank. The pencil decomposition (makani,
torch-harmonics' distributed SHT) moves the split instead of gathering the
field: ``pencil_transpose(t, dim, to_dim, comm)`` takes this rank's part of
a tensor split along ``dim`` (every rank's rows agreed: uneven bands) and
returns its part of the same tensor split along ``to_dim`` (``dim`` whole
now), by the layout ``sizes`` (default :func:`column_sizes`: ``to_dim``'s
size split as evenly as it goes, the first ranks one more: a longitude not
divisible by the rank count). Every rank sends rank ``s`` its rows of
``s``'s columns and joins what it receives in rank order: one ``Alltoallv``
of the transport (:mod:`credit_mpi.transport.moves`).

The adjoint is the transpose back (the reverse all-to-all of the gradient),
and the transpose back is the same op with the dims swapped and the rows'
layout as ``sizes``: :func:`pencil_transpose` of a column part along
``to_dim`` back to ``dim``.

Real (float32, float64) and complex (complex64, complex128) tensors move
alike (a complex part travels as its real view: two floats per element).
Per rank the forward receives the other ranks' rows of its columns,
``(H - h_r) w_r`` elements per other dim (``H`` the field's rows, ``h_r``
this rank's, ``w_r`` its columns): ``H W (P - 1) / P^2`` of a field of ``H
W`` on ``P`` even parts; :func:`received_elements` counts it, and
:func:`transpose_bytes` what describe() counts each rank sends.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from mpi4py import MPI

from ..engine import Counter, Op, run, run_planned
from ..layout import offsets, split
from ..partition import normalize_dim
from ..transport.moves import transport_name, transport_of
from ..validation import Local
from .along import transport_key

__all__ = ["pencil_transpose", "pencil_transposed", "column_sizes", "transpose_bytes", "received_elements"]

_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)

_RECEIVED = Counter()
received_elements = _RECEIVED.received  # elements of pencil_transpose forwards received from other ranks (this thread)


def column_sizes(size: int, n: int) -> list[int]:
    """The default layout of ``to_dim``: ``size`` in ``n`` parts, ``size // n`` each, the first ``size % n`` one more."""
    return split(int(size), int(n), uneven=True)


class _Plan(NamedTuple):
    dim: int  # split on input
    to_dim: int  # split on output
    comm: MPI.Comm
    counts: tuple[int, ...]  # every rank's size along dim (input)
    sizes: tuple[int, ...]  # every rank's size along to_dim (output)
    transfer: Any


class PencilTranspose(Op):
    """Split along ``dim`` (every rank's count agreed) -> split along ``to_dim`` by ``sizes``; adjoint: the way back."""

    name = "pencil_transpose"

    def key(self, t: Any, args: dict) -> Any:
        return transport_key(t, args, args["path"], args["dim"], args["to_dim"], args["sizes"])

    def local(self, t: Any, args: dict) -> Local:
        path = args["path"]
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES:
            raise TypeError(f"{path}: transposes float32/float64/complex64/complex128 tensors, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        transport = transport_name(args["transport"], path)
        dim, to = normalize_dim(args["dim"], t.ndim), normalize_dim(args["to_dim"], t.ndim)
        if dim == to:
            raise ValueError(f"{path}: dim and to_dim are both dim {dim}; give two different dims")
        sizes = args["sizes"]
        if sizes is not None and (not isinstance(sizes, tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes)):
            raise ValueError(f"{path}: sizes={sizes!r} must be a tuple of ints >= 0 (every rank's part of to_dim)")
        rest = tuple(s for i, s in enumerate(t.shape) if i != dim)  # equal on every rank; dim's size is the count
        calls = (path, dim, to, t.ndim, rest, str(t.dtype), sizes, transport)
        return Local((dim, to, t.shape[to]), calls, (), t.shape[dim])

    def plan(self, mine: Any, counts: list[int], comm: MPI.Comm, args: dict) -> _Plan:
        dim, to, size = mine
        n, sizes = comm.Get_size(), args["sizes"]
        sizes = tuple(column_sizes(size, n)) if sizes is None else tuple(int(s) for s in sizes)
        if len(sizes) != n or sum(sizes) != size:
            raise ValueError(f"{args['path']}: sizes={list(sizes)} must give each of the {n} ranks its part of dim "
                             f"{to} ({size} in all)")
        return _Plan(dim, to, comm, tuple(int(c) for c in counts), sizes, transport_of(args["transport"], comm))

    def kernel(self, t: torch.Tensor, p: _Plan) -> torch.Tensor:
        return exchange(t, p.dim, p.to_dim, p.counts, p.sizes, p.comm.Get_rank(), p.transfer, count=True)

    def adjoint(self, grad: torch.Tensor, p: _Plan) -> torch.Tensor:
        return exchange(grad, p.to_dim, p.dim, p.sizes, p.counts, p.comm.Get_rank(), p.transfer)


def exchange(t: torch.Tensor, dim: int, to: int, counts: tuple[int, ...], sizes: tuple[int, ...], rank: int,
             transfer: Any, count: bool = False) -> torch.Tensor:
    """One ``Alltoallv``: ``t`` (this rank's ``counts[rank]`` along ``dim``) to this rank's ``sizes[rank]`` of ``to``."""
    x = t.detach()
    mine = sizes[rank]
    starts = offsets(sizes)
    pieces = [x.narrow(to, starts[s], w).reshape(-1) for s, w in enumerate(sizes)]  # for rank s: its columns
    send = torch.cat(pieces) if pieces else x.new_empty(0)
    other = math.prod(s for i, s in enumerate(x.shape) if i not in (dim, to))
    recv_elems = [c * mine * other for c in counts]
    recv = torch.empty(sum(recv_elems), dtype=x.dtype, device=x.device)
    item = x.element_size()
    raw = (lambda a: torch.view_as_real(a)) if x.is_complex() else (lambda a: a)  # complex: its real view's bytes
    transfer.alltoallv(raw(send), [p.numel() * item for p in pieces], raw(recv), [e * item for e in recv_elems])
    if count:
        _RECEIVED.add(sum(recv_elems) - recv_elems[rank])
    parts, at = [], 0
    for c, e in zip(counts, recv_elems, strict=True):
        shape = list(x.shape)
        shape[dim], shape[to] = c, mine
        parts.append(recv[at : at + e].reshape(shape))
        at += e
    return torch.cat(parts, dim=dim)


def transpose_bytes(shape: tuple[int, ...], itemsize: int, dim: int, to: int, counts, sizes) -> list[tuple[int, int]]:
    """Every rank's ``(forward, backward)`` bytes sent in one :func:`pencil_transpose` of the global ``shape``
    (``counts`` every rank's part of ``dim``, ``sizes`` of ``to``): forward its rows of the other ranks' columns
    (one ``Alltoallv``), backward its columns of the other ranks' rows (the transpose back of the gradient)."""
    other = math.prod(s for i, s in enumerate(shape) if i not in (dim, to)) * itemsize
    total_rows, total_cols = sum(counts), sum(sizes)
    return [(counts[r] * (total_cols - sizes[r]) * other, sizes[r] * (total_rows - counts[r]) * other)
            for r in range(len(counts))]


_OP = PencilTranspose()


def _args(dim: int, to_dim: int, sizes: Any, path: str, transport: Any) -> dict:
    return {"dim": dim, "to_dim": to_dim, "sizes": None if sizes is None else tuple(sizes), "path": path,
            "transport": transport}


@torch.compiler.disable(recursive=True)  # under torch.compile: a graph break, the collective eager (see nn._comm._eager)
def pencil_transpose(t: torch.Tensor, dim: int, to_dim: int, comm: MPI.Comm, *, sizes: Any = None,
                     path: str = "pencil_transpose", transport: Any = "mpi") -> torch.Tensor:
    """This rank's part of a tensor split along ``dim``, re-split along ``to_dim`` (collective; differentiable).

    Args:
        t: This rank's part (float32/64, complex64/128), split along ``dim`` in rank order (any sizes:
            uneven bands); the other dims equal on every rank.
        dim: The dim split on input (whole on output).
        to_dim: The dim split on output (whole on input).
        comm: The domain's communicator.
        sizes: Every rank's part of ``to_dim`` afterwards (a sequence of ints, the same on every rank);
            None: :func:`column_sizes` of its size. The way back gives the input's rows here.
        path: Named in errors (the module that calls it).
        transport: ``"mpi"``, or a transport object over the same ranks (as :func:`credit_mpi.ops.reband.reband`).

    Raises:
        TypeError: ``t`` is not a float or complex tensor (on every rank alike).
        ValueError: the dims are not two dims of ``t``; ``sizes`` does not split ``to_dim``; the ranks'
            other dims, dtypes, sizes or autograd states differ (on every rank alike).
    """
    return run(_OP, t, comm, **_args(dim, to_dim, sizes, path, transport))


@torch.compiler.disable(recursive=True)
def pencil_transposed(t: torch.Tensor, dim: int, to_dim: int, comm: MPI.Comm, *, sizes: Any = None,
                      path: str = "pencil_transpose", transport: Any = "mpi") -> tuple:
    """:func:`pencil_transpose`, returning ``(part, every rank's part of dim before, of to_dim after)``: the layouts
    agreed (the way back gives the first as its ``sizes``)."""
    out, plan = run_planned(_OP, t, comm, **_args(dim, to_dim, sizes, path, transport))
    return out, plan.counts, plan.sizes
