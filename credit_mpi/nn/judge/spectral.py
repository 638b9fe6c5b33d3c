"""Spectral rules: ``torch.fft`` transforms over the sharded dim by the pencil transpose, and complex views.

A discrete Fourier transform along the sharded dim needs every row of the
field. ``torch.fft.fft/ifft/rfft/irfft``, ``fft2/ifft2/rfft2/irfft2`` and
``fftn/ifftn/rfftn/irfftn`` over dims that include it run as separable
one-dim transforms (the normalisation of a multi-dim transform is the
product of the one-dim ones, for every ``norm``):

1. the transforms along the other dims, locally on the band (an ``rfft``
   along the longitude first: the half spectrum moves, not the field);
2. the pencil transpose (:func:`credit_mpi.ops.transpose.pencil_transpose`):
   the split moved from the sharded dim to another one (another
   transformed dim, the longitude's modes, else the last dim), so that every
   rank holds every row of its columns; one ``Alltoallv``;
3. the transform along the sharded dim, locally.

A transform over several dims stops there (:func:`_to_spectrum`): its result
is held split along that other transformed dim (a spectrum as bands of its
longitude modes, the latitude modes whole), where every rule applies to it
as to any band: a slice of the latitude modes is local, a weight over the
modes meets a band as its entries (the einsum rule). Its inverse (input split
along a transformed dim) runs the transforms along the whole dims first, then
one transpose back to the bands the forward found (``Tracker.spectra``: a
field of that many rows moved off its bands; else their even split) and the
last transform. So a forward transform and its inverse move the spectrum once
each: two all-to-alls a pair, as theory. A one-dim transform along the
sharded dim, an ``rfft`` along it with other dims after, or an ``irfft``
along another dim after it (an ``irfft2`` of latitude bands, not of a held
spectrum) transposes there and back: two.
Autograd goes through the transposes (their adjoints are the transposes
back) and torch's own transforms. A size ``n``/``s`` along the sharded dim is
taken when it is the band's (read from ``x.shape``: an
:class:`~credit_mpi.nn.judge.tracker.Extent`) or the field's rows; a
truncation or zero padding along it is refused, as is any transform on a
latitude x longitude domain grid (the longitude is split there too).

``torch.view_as_real`` / ``view_as_complex`` keep the band (the sharded dim
is not the complex pair's).

In describe()'s dry run the transform runs on the field and each transpose
is a plan row of its own, ``pencil_transpose() (<op>[, back])``, with its traffic
(:func:`credit_mpi.ops.transpose.transpose_bytes`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...partition import normalize_dim
from ...transport import paths
from .field_sizes import keep_bands
from .registry import Refusal, argument, op_name, rule
from .tracker import Extent, Sharded, Tracker, tracked_columns

__all__ = ["FFT_OPS"]

# op name -> (kind, multi): kind "c2c" (complex to complex), "r2c" (real to half spectrum), "c2r" (its inverse);
# multi: "1" one dim (n, dim), "2" two dims (s, dim=(-2, -1)), "n" any dims (s, dim=None: all, or the last len(s))
FFT_OPS: dict[str, tuple[str, str, bool]] = {
    "fft_fft": ("c2c", "1", False), "fft_ifft": ("c2c", "1", True),
    "fft_rfft": ("r2c", "1", False), "fft_irfft": ("c2r", "1", True),
    "fft_fft2": ("c2c", "2", False), "fft_ifft2": ("c2c", "2", True),
    "fft_rfft2": ("r2c", "2", False), "fft_irfft2": ("c2r", "2", True),
    "fft_fftn": ("c2c", "n", False), "fft_ifftn": ("c2c", "n", True),
    "fft_rfftn": ("r2c", "n", False), "fft_irfftn": ("c2r", "n", True),
}


def _dims_and_sizes(op: str, x: torch.Tensor, args: tuple, kwargs: dict) -> tuple[list[int], list[Any]]:
    """The transformed dims (normalised, in torch's order) and the size asked for along each (None: its own)."""
    kind, multi, _ = FFT_OPS[op]
    if multi == "1":
        dims = [normalize_dim(int(argument(args, kwargs, 2, "dim", -1)), x.ndim)]
        sizes = [argument(args, kwargs, 1, "n", None)]
        return dims, sizes
    s = argument(args, kwargs, 1, "s", None)
    dim = argument(args, kwargs, 2, "dim", (-2, -1) if multi == "2" else None)
    if dim is None:
        dims = list(range(x.ndim)) if s is None else list(range(x.ndim - len(s), x.ndim))
    else:
        dims = [normalize_dim(int(d), x.ndim) for d in ([dim] if isinstance(dim, int) else dim)]
    sizes = [None] * len(dims) if s is None else list(s)
    if len(sizes) != len(dims):
        raise Refusal(f"s={s!r} and dim={dim!r} differ in length")  # (torch's own error on one process)
    return dims, sizes


def _one(x: torch.Tensor, step: str, d: int, n: Any, norm: Any) -> torch.Tensor:
    """One one-dim transform ``step`` ("fft", "ifft", "rfft", "irfft") of ``x`` along ``d``; a band with no entries
    along another dim (a rank with none of a spectrum's kept modes): the transform of one zero entry cut to none (in
    the graph; torch's FFT backends refuse empty tensors)."""
    empty = [e for e in range(x.ndim) if e != d and x.shape[e] == 0]
    if empty and x.shape[d]:
        e = empty[0]
        shape = list(x.shape)
        shape[e] = 1
        return _one(torch.cat([x, x.new_zeros(shape)], e), step, d, n, norm).narrow(e, 0, 0)
    return getattr(torch.fft, step)(x, n=n, dim=d, norm=norm)


def _steps(kind: str, inverse: bool, dims: list[int], sizes: list[Any]) -> list[tuple[str, int, Any]]:
    """The separable one-dim transforms ``(step, dim, n)`` of a multi-dim one, in an order torch's result allows."""
    c2c = "ifft" if inverse else "fft"
    if kind == "c2c":
        return [(c2c, d, n) for d, n in zip(dims, sizes, strict=True)]
    last, n_last = dims[-1], sizes[-1]
    rest = [(c2c, d, n) for d, n in zip(dims[:-1], sizes[:-1], strict=True)]
    if kind == "r2c":  # the real transform along the last dim first, then the complex ones
        return [("rfft", last, n_last)] + rest
    return rest + [("irfft", last, n_last)]  # c2r: the complex ones first, the real one last


@rule(*FFT_OPS)
def _fft(tr: Tracker, func, args, kwargs, held):
    """A transform over dims that do not include the sharded one: local; over it: the pencil transpose around it."""
    op = op_name(func)
    x = args[0] if args else kwargs.get("input")
    p = tr.get(x)
    if p is None:
        raise Refusal("a band as a transform's argument other than its input")
    dims, sizes = _dims_and_sizes(op, x, args, kwargs)
    if tracked_columns(tr) > 1:
        raise Refusal("a Fourier transform of a band has no rule on a latitude x longitude domain grid yet (the "
                      "longitude is split there too)")
    if p.dim not in dims:
        return tr.run(func, args, kwargs, p)
    if p.outer * p.inner != 1:
        raise Refusal(f"it transforms a dim that holds the bands' rows merged with another dim ({p.describe()}); "
                      f"transform the field before the merge")
    kind, _, inverse = FFT_OPS[op]
    norm = argument(args, kwargs, 3, "norm", None)
    steps = _steps(kind, inverse, dims, sizes)
    if (kept := _kept_order(kind, steps, p.dim)) is not None:  # a spectrum: one transpose, held split along `to`
        y = x
        for s, d, m in kept[:-1]:  # along the other dims: local on the band (whole there)
            y = _one(y, s, d, m, norm)
        step, _, n = kept[-1]
        return _to_spectrum(tr, y, p, step, int(n) if isinstance(n, Extent) else n, norm, _to_dim(p.dim, dims, x.ndim),
                            op, inverse)
    k = next(i for i, (_, d, _) in enumerate(steps) if d == p.dim)
    step, _, n = steps[k]
    if isinstance(n, Extent):  # read from a band's shape: the field's rows (credit_mpi.nn.judge.field_sizes)
        n = int(n)
    if step in ("rfft", "irfft") and x.ndim < 2:
        raise Refusal("a real transform along the sharded dim of a tensor of one dim (no other dim to split)")
    to = _to_dim(p.dim, dims, x.ndim)
    y = x
    for s, d, m in steps[:k]:  # along the other dims: local on the band
        y = _one(y, s, d, m, norm)
    y = _along_sharded(tr, y, p, step, n, norm, to, op)
    for s, d, m in steps[k + 1 :]:
        y = _one(y, s, d, m, norm)
    tr.set(y, p)
    return y


def _kept_order(kind: str, steps: list, dim: int) -> list | None:
    """The one-dim steps of a transform over more than one dim with the one along the sharded ``dim`` last (the
    complex ones commute; an ``rfft`` stays first, an ``irfft`` last), so that after one transpose nothing else runs
    along the split dim; None: a one-dim transform, or an ``rfft`` / ``irfft`` that must run along another dim after
    the sharded one (the transpose there and back)."""
    if len(steps) < 2:
        return None
    mine = next(s for s in steps if s[1] == dim)
    others = [s for s in steps if s[1] != dim]
    if kind == "r2c" and steps[0][1] == dim:
        return None
    if kind == "c2r" and steps[-1][1] != dim:
        return None
    return others + [mine]


def _to_spectrum(tr: Tracker, y: torch.Tensor, p: Sharded, step: str, n: Any, norm: Any, to: int, op: str,
                 inverse: bool) -> torch.Tensor:
    """The last step, along the sharded dim, of a multi-dim transform: one transpose to the split along ``to`` (a
    transformed dim, done), the transform; the result stays split along ``to`` (a spectrum held as bands of its
    modes; an inverse's: bands of the grid's rows as the forward found them, else their even split)."""
    path = tr.stack[-1][0]
    d = p.dim
    home = tr.spectra.get(y.shape[to]) if inverse else None
    if tr.manager is None:  # the dry run: the field's transform, its one transpose reported
        from ...ops.transpose import column_sizes
        from .rows import dim_sizes

        counts = dim_sizes(tr, y, p)
        field = sum(counts)
        out = _one(y, step, d, _length(step, n, field), norm)
        sizes = list(home) if home is not None else column_sizes(y.shape[to], len(counts))
        _report(tr, path, op, y, d, to, counts, sizes, not inverse)
    else:
        from ...ops.transpose import pencil_transposed

        comm = tr.manager.domain_group
        moves = paths.current().transport(comm)
        whole, counts, sizes = pencil_transposed(y, d, to, comm, sizes=home, path=path, transport=moves)
        field = sum(counts)
        out = _one(whole, step, d, _length(step, n, field), norm)
    if not inverse:
        tr.spectra[field] = tuple(int(c) for c in counts)
    q = Sharded(to)
    tr.set(out, q)
    keep_bands(tr, out, q, tuple(sizes))
    return out


def _to_dim(dim: int, dims: list[int], ndim: int) -> int:
    """The dim split while the sharded one is whole: the last other transformed dim, else the last other dim."""
    others = [d for d in dims if d != dim]
    return others[-1] if others else max(d for d in range(ndim) if d != dim)


def _length(step: str, n: int | None, field: int) -> int | None:
    """The transform's length along the sharded dim (None: its own): an irfft's output rows as asked; for the others
    the field's rows, or refused (zero padding or truncation of the field)."""
    if n is None or step == "irfft":
        return n
    return None if int(n) == field else _refuse_length(n)


def _refuse_length(n: Any) -> None:
    raise Refusal(f"a length n/s={int(n)} along the sharded dim that is not the field's rows (zero padding or "
                  f"truncation of the field) has no rule")


def _along_sharded(tr: Tracker, y: torch.Tensor, p: Sharded, step: str, n: Any, norm: Any, to: int,
                   op: str) -> torch.Tensor:
    """The one-dim transform ``step`` along the sharded dim: the transpose, the transform, the transpose back."""
    path = tr.stack[-1][0]
    d = p.dim
    if tr.manager is None:  # the dry run: the field's transform, its two transposes reported
        from ...ops.transpose import column_sizes
        from .rows import dim_sizes

        counts = dim_sizes(tr, y, p)
        field = sum(counts)
        m = _length(step, n, field)
        out = _one(y, step, d, m, norm)
        n_ranks = len(counts)
        _report(tr, path, op, y, d, to, counts, column_sizes(y.shape[to], n_ranks), True)
        back = counts if out.shape[d] == field else column_sizes(out.shape[d], n_ranks)
        _report(tr, path, op, out, to, d, column_sizes(out.shape[to], n_ranks), back, False)
        if back != counts and tr.band_sizes(out.shape[d]) != back:
            tr.keep_layout(out, back)
        return out
    from ...ops.transpose import pencil_transpose, pencil_transposed

    comm = tr.manager.domain_group
    moves = paths.current().transport(comm)  # the converted model's data path (transport=)
    whole, counts, _ = pencil_transposed(y, d, to, comm, path=path, transport=moves)
    field = sum(counts)
    m = _length(step, n, field)  # (after the transpose: every rank has the agreed field rows, the same decision)
    out = _one(whole, step, d, m, norm)
    back = tuple(counts) if out.shape[d] == field else None  # the input's bands, or the even split of a new length
    return pencil_transpose(out, to, d, comm, sizes=back, path=path, transport=moves)


def _report(tr: Tracker, path: str, op: str, t: torch.Tensor, dim: int, to: int, counts: list, sizes: list,
            to_columns: bool) -> None:
    """In the dry run: one transpose of the field ``t`` from split ``dim`` (``counts``) to split ``to`` (``sizes``) for
    describe()'s plan: its row (the sharded dim's bands before and after) and its traffic."""
    report_transpose(tr, path, op.removeprefix("fft_"), tuple(t.shape), t.element_size(), t.requires_grad, dim, to,
                     counts, sizes, to_columns)


def report_transpose(tr: Tracker, path: str, what: str, shape: tuple, itemsize: int, grad: bool, dim: int, to: int,
                     counts: list, sizes: list, to_columns: bool) -> None:
    """In the dry run: one :func:`~credit_mpi.ops.transpose.pencil_transpose` of a field of ``shape`` from split ``dim``
    (``counts``) to split ``to`` (``sizes``), a row of describe()'s plan ``pencil_transpose() (<what>[, back])`` with
    its traffic; ``to_columns``: the way from the bands (else the way back to them)."""
    on_move = tr.on_move
    if on_move is None:
        return
    from ...ops.transpose import transpose_bytes
    from ..traffic import Traffic

    moved = transpose_bytes(shape, itemsize, dim, to, counts, sizes)
    traffic = [Traffic(f, 1, *((b, 1) if grad else (0, 0)), 1) for f, b in moved]
    bands, rows = (counts, shape[dim]) if to_columns else (sizes, shape[to])
    whole = [rows] * len(bands)
    kind = f"pencil_transpose() ({what}{'' if to_columns else ', back'})"
    on_move(path, kind, rows, bands if to_columns else whole, whole if to_columns else bands, traffic)


@rule("view_as_real")
def _view_as_real(tr: Tracker, func, args, kwargs, held):
    """A complex band as pairs of floats in a new last dim: the band stays where it is."""
    return tr.run(func, args, kwargs, tr.get(args[0]))


@rule("view_as_complex")
def _view_as_complex(tr: Tracker, func, args, kwargs, held):
    """Pairs of floats in the last dim as complex numbers: the band stays unless it is that last dim."""
    x, p = args[0], tr.get(args[0])
    if p.dim == x.ndim - 1:
        raise Refusal("it takes the sharded dim as the complex pairs' dim")
    return tr.run(func, args, kwargs, p)
