"""Spherical harmonic transforms on latitude bands: torch-harmonics' ``RealSHT`` / ``InverseRealSHT``, exactly.

``RealSHT`` is an ``rfft`` along the longitude (local on a band) and a
Legendre contraction over the latitude (every latitude of a mode ``m``);
``InverseRealSHT`` the contraction over the degrees ``l`` and an ``irfft``.
A converted model replaces each (exact types, found by name: torch-harmonics
is an optional dependency) by a module that runs them as the distributed SHT
of torch-harmonics and makani does, by the pencil transpose
(:func:`credit_mpi.ops.transpose.pencil_transpose`):

* :class:`BandedRealSHT`: ``rfft`` along the longitude of the band (the
  ``mmax`` modes kept), one transpose to every latitude of this rank's
  orders ``m`` (:func:`~credit_mpi.ops.transpose.column_sizes` of ``mmax``),
  the contraction with those orders' weights. Its output, ``(..., lmax,
  mmax)``, is held split along the orders ``m`` (the last dim; the degrees
  ``l`` whole): a spectral filter over ``(channels, l)`` (SFNO's) runs on it
  locally, judged like any band;
* :class:`BandedInverseRealSHT`: the contraction over ``l`` of this rank's
  orders, one transpose back to latitude bands (the even split of ``nlat``,
  :func:`credit_mpi.layout.split`: the layout ``shard_tensor`` gives), the
  ``irfft`` along the longitude.

So a transform pair moves the half spectrum twice (one all-to-all each way),
forward and, in backward, the transposes' adjoints. In describe()'s dry run
each runs the original module on the field and reports its transpose as a
plan row with its traffic. On a domain of one band the original runs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..layout import offsets
from ..transport import paths
from .judge.spectral import report_transpose
from .judge.tracker import Sharded, active_tracker

__all__ = ["BandedRealSHT", "BandedInverseRealSHT", "sht_converter"]

_NAMES = {"RealSHT", "InverseRealSHT"}


def sht_converter(module: nn.Module) -> Any:
    """The converter of a torch-harmonics ``RealSHT`` / ``InverseRealSHT`` (exact types), None for any other module."""
    kind = type(module)
    if kind.__name__ not in _NAMES or not kind.__module__.startswith("torch_harmonics"):
        return None
    return (lambda m, manager, shard_dim: BandedRealSHT(m, manager)) if kind.__name__ == "RealSHT" else (
        lambda m, manager, shard_dim: BandedInverseRealSHT(m, manager))


def _helpers(module: nn.Module) -> Any:
    """The module that defines ``module``'s class (its ``rfft`` / ``irfft`` with torch-harmonics' own truncation)."""
    return sys.modules[type(module).__module__]


def _my_orders(mmax: int, comm) -> tuple[int, int]:
    from ..ops.transpose import column_sizes

    sizes = column_sizes(mmax, comm.Get_size())
    rank = comm.Get_rank()
    return offsets(sizes)[rank], sizes[rank]


class _Banded(nn.Module):
    def __init__(self, sht: nn.Module, manager: Any) -> None:
        super().__init__()
        self.sht, self.manager = sht, manager
        self.register_forward_hook(_placed)

    def _domain(self):
        size = getattr(self.manager, "domain_parallel_size", 1)
        return None if size <= 1 else self.manager.domain_group

    def _path(self) -> str:
        tr = active_tracker()
        return tr.stack[-1][0] if tr is not None else type(self.sht).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sht, tr = self.sht, active_tracker()
        if tr is None or tr.manager is None:  # describe()'s dry run: the field's transform, its transpose reported
            out = sht(x)
            if tr is not None:
                grid, coeffs = (x, out) if self.splits_orders else (out, x)
                _dry_report(tr, self._path(), type(sht).__name__, grid, coeffs, forward=self.splits_orders)
            return out
        comm = self._domain()
        return sht(x) if comm is None else self._on_bands(x, tr, comm)

    def _on_bands(self, x: torch.Tensor, tr: Any, comm: Any) -> torch.Tensor:
        raise NotImplementedError


def _contract(y: torch.Tensor, w: torch.Tensor, equation: str) -> torch.Tensor:
    """``einsum(equation, y, w)`` of complex ``y`` and real Legendre weights ``w``: the real and imaginary parts apart."""
    re = torch.einsum(equation, y.real.contiguous(), w)
    im = torch.einsum(equation, y.imag.contiguous(), w)
    return torch.complex(re.contiguous(), im.contiguous())


class BandedRealSHT(_Banded):
    """torch-harmonics' ``RealSHT`` on latitude bands: its output split along the orders ``m`` (see the module doc)."""

    splits_orders = True

    def _on_bands(self, x: torch.Tensor, tr: Any, comm: Any) -> torch.Tensor:
        from ..ops.transpose import pencil_transposed

        sht = self.sht
        y = _helpers(sht).rfft(x, nmodes=sht.mmax, dim=-1, norm="forward")  # (..., rows, mmax): local on the band
        y, counts, _ = pencil_transposed(y, -2, -1, comm, path=self._path(), transport=paths.current().transport(comm))  # (..., nlat, this rank's orders)
        if sum(counts) != sht.nlat:  # (agreed: every rank raises it)
            raise ValueError(f"{self._path()}: RealSHT of {sht.nlat} latitudes on bands of {list(counts)} rows")
        start, count = _my_orders(sht.mmax, comm)
        w = sht.weights[start : start + count].to(x.dtype)  # (orders, lmax, nlat)
        return _contract(y.transpose(-1, -2), w, "...mk,mlk->...lm")  # (..., lmax, this rank's orders)


class BandedInverseRealSHT(_Banded):
    """torch-harmonics' ``InverseRealSHT`` of coefficients split along the orders ``m``, back to latitude bands."""

    splits_orders = False

    def _on_bands(self, x: torch.Tensor, tr: Any, comm: Any) -> torch.Tensor:
        from ..ops.transpose import pencil_transpose

        sht = self.sht
        if tr.get(x) != Sharded(x.ndim - 1):  # (decided by the forward's structure: the same on every rank)
            from .errors import ConversionError

            raise ConversionError(f"{self._path()}: InverseRealSHT takes the coefficients split along the orders m "
                                  f"(a RealSHT's output on bands), got {tr.get(x)}")
        start, count = _my_orders(sht.mmax, comm)
        w = sht.pct[start : start + count].to(x.real.dtype)  # (orders, nlat, lmax)
        y = _contract(x.transpose(-1, -2), w, "...ml,mkl->...km")  # (..., nlat, this rank's orders)
        y = pencil_transpose(y, -1, -2, comm, path=self._path(), transport=paths.current().transport(comm))  # (..., this band's latitudes, mmax)
        return _helpers(sht).irfft(y, n=sht.nlon, dim=-1, norm="forward")


def _dry_report(tr, path: str, what: str, grid: torch.Tensor, coeffs: torch.Tensor, forward: bool) -> None:
    """describe()'s dry run: the one transpose of a transform (the half spectrum of ``nlat`` latitudes, ``mmax`` orders)."""
    if tr.band_sizes is None or len(tr.band_sizes(grid.shape[-2])) <= 1:
        return
    from ..ops.transpose import column_sizes

    lat = tr.layout_of(grid) if forward else None
    counts = lat if lat is not None and sum(lat) == grid.shape[-2] else tr.band_sizes(grid.shape[-2])
    n, mmax = len(counts), coeffs.shape[-1]
    shape = tuple(grid.shape[:-1]) + (mmax,)
    itemsize = 2 * grid.element_size()  # complex of the grid's real dtype
    grad = (grid if forward else coeffs).requires_grad
    orders = column_sizes(mmax, n)
    if forward:
        report_transpose(tr, path, what, shape, itemsize, grad, len(shape) - 2, len(shape) - 1, list(counts), orders, True)
    else:
        report_transpose(tr, path, what, shape, itemsize, grad, len(shape) - 1, len(shape) - 2, orders,
                         column_sizes(grid.shape[-2], n), False)


def _placed(module: _Banded, args: tuple, out: Any) -> None:
    """After the tracker placed the output as a band of the sharded dim: a RealSHT's is split along the orders."""
    tr = active_tracker()
    if tr is None or not isinstance(out, torch.Tensor) or tr.trusted:
        return
    if module.splits_orders:
        tr.set(out, Sharded(out.ndim - 1))
        if tr.manager is None and tr.band_sizes is not None:
            from ..ops.transpose import column_sizes

            n = len(tr.band_sizes(args[0].shape[-2]))
            if tr.band_sizes(out.shape[-1]) != column_sizes(out.shape[-1], n):
                tr.keep_layout(out, column_sizes(out.shape[-1], n))
