"""Nothing is judged outside the rules: what goes into a converted model, what comes out, and what is done with it.

A converted forward is judged op by op (:mod:`credit_mpi.nn.judge`); three things around it were not:

* **Its input.** A converted model takes each rank's band of the field (:func:`credit_mpi.shard_tensor`).
  Fed the whole field on every rank (the newcomer's first try), every layer took the ranks' copies for
  bands of a field ``domain size`` times as tall, and the run went on silently. When a forward's inputs
  differ from the last forward's (so: the first call, or a new shape; never on the repeated call of a
  training loop) every rank's floating inputs are compared (one ``Allgather`` of a few numbers per
  tensor: shape, sum, sum of squares, range): the same non-constant tensors on every rank of the
  domain are not bands, and every rank raises :class:`~credit_mpi.nn.ConversionError` before any
  layer moves data. (A constant input, the same on every band and the field, cannot be told apart.)
* **Its output.** The output's placement is known when the forward ends: a band along a dim is returned
  as a :class:`Band` (below); rows merged with another dim (``nn.Flatten()`` last: each rank's piece
  of a flattened field, which no gather puts back together) is a ConversionError that names what to
  do, in the run and in describe() alike.
* **What is done with its output.** A :class:`Band` is a light ``torch.Tensor`` subclass (no copy: an
  alias of the output) that carries the sharded dim and the manager. Outside converted forwards its
  ``__torch_function__`` applies the judge's own sets of names (:mod:`credit_mpi.nn.judge.pointwise`,
  :mod:`credit_mpi.nn.judge.reductions`):

  - elementwise ops (``out - y``, ``out ** 2``, ``.detach()``, ``.to()``) are bands again;
  - ``sum`` / ``mean`` / ``nansum`` / ``nanmean`` over the sharded dim (or every dim), and the losses
    ``F.mse_loss``, ``F.l1_loss``, ``F.smooth_l1_loss``, ``F.huber_loss`` (``nn.MSELoss`` & co. call
    them) with ``reduction="mean"`` or ``"sum"`` are the FIELD's: one ``Allreduce`` over the domain of
    the band's partial sum (and count), the same value on every rank. Their gradient is each band's
    part (the identity onto the band's partial), which is what :func:`credit_mpi.reduce_gradients`
    sums over the domain: a loss computed on every rank and ``loss.backward()`` on every rank give one
    process's gradients (any function of such values too: the chain rule goes through the field's
    value, replicated);
  - reading values and metadata (``.shape``, ``.numpy()``, ``.item()``, ``backward()``,
    ``torch.isclose``) is as for any tensor; :func:`credit_mpi.gather_tensor` gathers it;
  - anything else (a convolution, a reshape, a max over the sharded dim, a band fed to a model that
    was never converted) raises ConversionError, the same on every rank (it depends on the op only),
    naming :class:`~credit_mpi.nn.LatitudeWeightedMSELoss`, :func:`~credit_mpi.gather_tensor` and
    :func:`~credit_mpi.reduce_gradients`.

  Inside a converted forward (another converted model fed it) and in credit_mpi's own code (its
  losses and metrics take bands as they are) a Band is a plain tensor. The cost: one ``as_subclass``
  per forward output, and a Python ``__torch_function__`` per op applied to the output outside the
  model (a loss: a few ops a step). No layer, halo or gather path sees a Band (the gather unwraps it).
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import sharding
from ..transport import paths
from . import base
from .errors import ConversionError
from .judge.pointwise import POINTWISE
from .judge.registry import conversion_error, dims_of, op_name, rule_for, tensors_in
from .judge.tracker import Sharded, active_tracker, grid_columns
from .replicated import is_replicated

__all__ = ["Band", "check_inputs", "placed_output", "check_output", "check_layouts"]

_ELEMENTWISE = frozenset(POINTWISE) | {"type_as", "dropout", "alpha_dropout", "feature_alpha_dropout"}
_FIELD_REDUCE = frozenset(("sum", "mean", "nansum", "nanmean"))
_LOSSES = frozenset(("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"))
# values, metadata and autograd plumbing: as for any tensor (their results hold no band)
_AS_ANY = frozenset("""
__get__ __set__ attribute numpy tolist item __array__ backward register_hook retain_grad requires_grad_ size dim ndimension
numel nelement __len__ __repr__ __format__ __str__ __hash__ stride is_contiguous storage_offset data_ptr element_size
untyped_storage storage __reduce_ex__ __deepcopy__ __setstate__ __getstate__ isclose allclose equal __bool__ is_floating_point
is_complex get_device __dlpack__ __dlpack_device__ is_shared is_pinned _is_view __array_wrap__ as_subclass
""".split())


class Band(torch.Tensor):
    """A converted model's output on this rank: its band of the field along ``band_dim`` (see the module docstring).

    Attributes:
        band_dim: The sharded dim (non-negative).
        band_manager: The manager of the model that returned it.
        band_path: The model's data path (``transport=``): a loss on the band moves on it, as the model's layers.
    """

    band_dim: int
    band_manager: Any
    band_path: Any
    _credit_mpi_band = True  # what gather_tensor looks for (no import of this module there)

    def as_plain(self) -> torch.Tensor:
        """The same tensor as a plain ``torch.Tensor`` (an alias: same data, same autograd history)."""
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(self, torch.Tensor)

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, mpi4py's lowercase calls) as the plain tensor: the band's values, not its manager."""
        return self.as_plain().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") in ("__get__", "__set__") or active_tracker() is not None or _from_credit_mpi():
                return func(*args, **kwargs)  # judged by the tracker, credit_mpi's own code, an attribute: plain
            op = op_name(func)
            name = op if op.startswith("__") else op.rstrip("_")
            if name in _AS_ANY:
                return func(*args, **kwargs)
            bands = [t for t in tensors_in((args, kwargs)) if isinstance(t, Band)]
            first = bands[0]
            if name in _ELEMENTWISE:
                return _elementwise(func, args, kwargs, bands, name)
            if name in _FIELD_REDUCE:
                return _reduce(func, args, kwargs, first, name)
            if name in _LOSSES:
                return _loss(func, args, kwargs, first, name)
            mixed = _mixes_rows(name, args, kwargs, first)
            if mixed is None:
                if name in _JOINS:
                    return _join(func, args, kwargs, first, name)
                if isinstance(args[0], Band) and (_judged_as(name, "amax") or _judged_as(name, "softmax")):
                    return _along_other_dims(func, args, kwargs, args[0])
                return func(*args, **kwargs)  # leaves the rows alone (a slice, a view of other dims): a plain tensor
        raise _refused(first, f"{op}()", mixed)


def _from_credit_mpi() -> bool:
    """True when the op on a Band was called by credit_mpi's code (through torch's own Python frames)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("torch"):
            return name.startswith("credit_mpi.")
        frame = frame.f_back
    return False


def _judged_as(name: str, family: str) -> bool:
    """True when the judge's rule of ``name`` is that of ``family`` (``amax``: a reduction, ``softmax``: along a dim)."""
    rule = rule_for(name)
    return rule is not None and rule is rule_for(family)


_JOINS = frozenset(("cat", "concat", "concatenate", "stack"))
_ROW_MIXERS = frozenset("""interpolate upsample upsample_nearest upsample_bilinear pad roll flip rot90 matmul __matmul__
__rmatmul__ mm bmm einsum tensordot unfold fold grid_sample pixel_shuffle pixel_unshuffle batch_norm group_norm
instance_norm layer_norm scaled_dot_product_attention multi_head_attention_forward""".split())


def _mixes_rows(name: str, args: tuple, kwargs: dict, band: Band) -> str | None:
    """Why an op outside the model mixes the band's rows with other bands' (None: it leaves them alone, its result
    is a plain tensor). What mixes rows is refused as a model never converted would run it: on the band alone."""
    if name.startswith(("conv", "fft", "stft")) or "pool" in name or name in _ROW_MIXERS:
        return "it mixes the rows along the sharded dim, which one band alone does not hold (a model never converted?)"
    x = args[0] if args else None
    if _judged_as(name, "amax") or _judged_as(name, "softmax"):
        if not isinstance(x, Band):
            return "a band as an extra argument"
        dims = dims_of(args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else kwargs.get("dim"), x.ndim)
        if dims is None or any(d in dims for d in _band_dims(x)):
            return (f"it takes {name}() over the sharded dim, which one band alone does not hold (sum, mean, nansum, "
                    f"nanmean over it are the field's)")
    return None


def _along_other_dims(func, args, kwargs, x: Band) -> Any:
    """A reduction or a softmax over dims other than the sharded one: a band (its dim moved past the reduced ones)."""
    dims = dims_of(args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else kwargs.get("dim"), x.ndim) or []
    moved = x.band_dim - sum(1 for d in dims if d < x.band_dim)
    out = func(*args, **kwargs)
    return tree_map_only(torch.Tensor, lambda t: _wrap(t, x.band_dim if t.ndim == x.ndim else moved, x.band_manager, x)
                         if t.ndim in (x.ndim, x.ndim - len(dims)) else t, out)


def _join(func, args, kwargs, band: Band, name: str) -> Any:
    """``torch.cat`` / ``stack`` of bands (and tensors of the band's rows) along another dim: a band."""
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    back = band.ndim - band.band_dim
    if name != "stack" and dim % band.ndim == band.band_dim:
        raise _refused(band, f"{name}()", "it joins along the sharded dim: each rank would join its own bands")
    rows = band.shape[band.band_dim]
    if any(not isinstance(t, Band) and (t.ndim < back or t.shape[t.ndim - back] != rows) for t in parts):
        return func(*args, **kwargs)  # not all of the band's rows: a plain tensor
    out = func(*args, **kwargs)
    return _wrap(out, out.ndim - back, band.band_manager, band)


def _refused(band: Band, op: str, why: str) -> ConversionError:
    return ConversionError(
        f"{op} on a band returned by a converted model (dim {band.band_dim} holds this rank's rows of the field), "
        f"outside the model: {why}. Outside a converted model elementwise ops keep the band, sum / mean / nansum / "
        f"nanmean and F.mse_loss / F.l1_loss / F.smooth_l1_loss / F.huber_loss (reduction 'mean' or 'sum') are the "
        f"field's, the same on every rank; for a latitude-weighted loss use credit_mpi.nn.LatitudeWeightedMSELoss; "
        f"for anything else gather the field first (credit_mpi.gather_tensor(out, {band.band_dim - 0}, manager)) "
        f"or move the op into the model; call credit_mpi.reduce_gradients(model.parameters(), manager) after "
        f"backward (it sums each band's part of the gradients)")


def _wrap(t: Any, dim: int, manager: Any, like: Band | None = None) -> Any:
    """``t`` as a Band along ``dim``; its data path is ``like``'s, else the converted forward's running now."""
    if not isinstance(t, torch.Tensor) or isinstance(t, Band):
        return t
    out = torch.Tensor.as_subclass(t, Band)
    out.band_dim, out.band_manager = dim, manager
    out.band_path = like.band_path if like is not None else paths.current()
    return out


def _elementwise(func, args, kwargs, bands: list[Band], name: str) -> Any:
    first = bands[0]
    ndims = {(b.ndim - b.band_dim) for b in bands}
    if len(ndims) > 1 or len({id(b.band_manager) for b in bands}) > 1:
        raise _refused(first, f"{name}()", "it combines bands along different dims (or of different models' domains)")
    back = ndims.pop()  # the band's dim counted from the end
    rows = first.shape[first.band_dim]
    for t in tensors_in((args, kwargs))[: 1 if name in ("to", "type", "type_as") else None]:
        if isinstance(t, Band) or t.ndim < back:
            continue
        if t.shape[t.ndim - back] not in (1, rows):
            raise _refused(first, f"{name}()", f"it combines the band ({rows} rows along dim {first.band_dim}) with a "
                                               f"tensor of {t.shape[t.ndim - back]} rows there (the whole field? "
                                               f"shard it: credit_mpi.shard_tensor)")
    if any(t.shape[t.ndim - back] != rows for t in bands):
        raise _refused(first, f"{name}()", "it combines bands of different rows")
    out = func(*args, **kwargs)
    return tree_map_only(torch.Tensor, lambda t: _wrap(t, t.ndim - back, first.band_manager, first) if t.ndim >= back else t, out)


def _band_dims(band: Band) -> tuple[int, ...]:
    """The dims the domain splits: the band's, and on a latitude x longitude grid the next one too."""
    return (band.band_dim,) if grid_columns(band.band_manager) <= 1 else (band.band_dim, band.band_dim + 1)


def _reduce(func, args, kwargs, band: Band, name: str) -> Any:
    x = args[0]
    if not isinstance(x, Band):
        raise _refused(band, f"{name}()", "a band as a reduction's extra argument")
    index_kw = "dim"
    dims = dims_of(args[1] if len(args) > 1 else kwargs.get(index_kw), x.ndim)
    if dims is not None and not dims:
        dims = None
    split = _band_dims(x)
    if dims is not None and not any(d in dims for d in split):
        out = func(*args, **kwargs)
        keep = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        moved = x.band_dim if keep else x.band_dim - sum(1 for d in dims if d < x.band_dim)
        return _wrap(out, moved, x.band_manager, x)
    if dims is not None and not all(d in dims for d in split):
        raise _refused(band, f"{name}()", "it reduces over the latitude of a latitude x longitude block but not its "
                                          "longitude (no rule outside the model: gather the field first)")
    dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    return field_reduction(x.as_plain() if isinstance(x, Band) else x, name, dims, keepdim, dtype, x.band_manager, x.band_path)


def field_reduction(x: torch.Tensor, op: str, dims: list[int] | None, keepdim: bool, dtype: Any, manager: Any,
                    path: Any = None) -> torch.Tensor:
    """``op`` (sum, mean, nansum, nanmean) of the field over ``dims`` (None: every dim) from this rank's band ``x``:
    one ``Allreduce`` of the partial sums and counts over the domain group; the same value on every rank, whose
    gradient is each band's part (the identity onto the band's partial sum)."""
    from ..ops.allreduce import allreduce_sum

    reduced = list(range(x.ndim)) if dims is None else sorted(set(dims))
    nan = op.startswith("nan")
    part = (torch.nansum if nan else torch.sum)(x, reduced, keepdim=keepdim, dtype=dtype)
    if op in ("mean", "nanmean"):
        count = ((~torch.isnan(x)).sum(reduced, keepdim=keepdim) if nan else
                 torch.full(part.shape, float(math.prod(x.shape[k] for k in reduced)), device=part.device))
    else:
        count = torch.zeros((0,), device=part.device)
    packed = torch.cat([part.detach().reshape(-1).to(torch.float64), count.reshape(-1).to(torch.float64)])
    comm = manager.domain_group
    transport = "mpi" if path is None else path.transport(comm)
    total = allreduce_sum(packed, comm, transport=transport, path=f"{op}() of a band outside the model")
    field = total[: part.numel()].reshape(part.shape).to(part.dtype)
    out = part + (field - part.detach())  # the field's value; the gradient: the band's part
    if op in ("mean", "nanmean"):
        out = out / total[part.numel():].reshape(part.shape).to(part.dtype)
    return out


def _loss(func, args, kwargs, band: Band, name: str) -> Any:
    names = ("input", "target")
    pred, target = (args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names))
    reduction = kwargs.get("reduction", "mean")
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        raise _refused(band, f"{name}()", "the legacy size_average / reduce arguments (use reduction=)")
    if not isinstance(pred, torch.Tensor) or not isinstance(target, torch.Tensor) or pred.shape != target.shape:
        raise _refused(band, f"{name}()", "its input and target are not two bands of one shape")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("size_average", "reduce")}
    elementwise = _elementwise(func, args, {**kwargs, "reduction": "none"}, [t for t in (pred, target) if isinstance(t, Band)], name)
    if reduction == "none":
        return elementwise
    if reduction not in ("mean", "sum"):
        raise _refused(band, f"{name}()", f"reduction={reduction!r}")
    return field_reduction(elementwise.as_plain(), reduction, None, False, None, band.band_manager, band.band_path)


# -- the converted forward's inputs and outputs (installed in credit_mpi.nn.base) -----------------------


def check_inputs(comm: Any, args: tuple, kwargs: dict, shard_dim: int = -2, manager: Any = None) -> None:
    """Raise on every rank when every rank of ``comm`` was given the same non-constant floating inputs (the whole
    field, not bands), or bands of another layout (:func:`check_layouts`). Collective: one ``allgather`` of a few
    numbers per floating tensor."""
    try:
        if manager is not None:
            check_layouts(shard_dim, manager, args, kwargs)
        layout = None
    except ConversionError as exc:  # raised below on every rank, after the allgather every rank makes
        layout = str(exc)
    tensors = [t for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim >= 2 and not is_replicated(t)
               and not t.is_meta]
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        mine = []
        for t in tensors:
            d = t.detach().to(torch.float64)
            mine.append((tuple(t.shape), str(t.dtype), float(d.sum()), float((d * d).sum()),
                         float(d.amax() - d.amin()) if t.numel() else 0.0))
    everyone = comm.allgather((mine, layout))
    wrong = [(r, e[1]) for r, e in enumerate(everyone) if e[1] is not None]
    if wrong:
        raise ConversionError(f"{wrong[0][1]} [rank(s) {', '.join(str(r) for r, _ in wrong)}]")
    if not mine or any(e[0] != mine for e in everyone) or all(m[4] == 0 for m in mine):
        return
    shapes = ", ".join(str(m[0]) for m in mine)
    raise ConversionError(
        f"every rank of the domain ({comm.Get_size()} ranks) was given the same input {shapes}: the whole field on "
        f"every rank, not its bands. A converted model takes each rank's band of the field: "
        f"x = credit_mpi.shard_tensor(field, dim, manager) (and credit_mpi.gather_tensor(out, dim, manager) gives "
        f"the field of the output); nothing ran")


def check_output(tracker: Any, out: Any) -> None:
    """Refuse an output whose rows are merged with another dim (no gather puts it together)."""
    for t in tensors_in(out):
        p = tracker.get(t)
        if isinstance(p, Sharded) and (p.outer != 1 or p.inner != 1) and tracker.as_band(t, p) is None:
            raise conversion_error(
                tracker.stack[0][0], "its output",
                f"the output {tuple(t.shape)} holds the band's rows merged with another dim ({p.describe()}, e.g. "
                f"nn.Flatten() or a reshape last): each rank returns its piece of a flattened field, which no gather "
                f"puts back together; return a tensor with the rows as a dim of their own (flatten after "
                f"credit_mpi.gather_tensor, or reshape back to (..., rows, cols) before returning)")


def placed_output(tracker: Any, manager: Any, out: Any) -> Any:
    """The root's output at run time: checked (:func:`check_output`) and each band returned as a :class:`Band`."""
    if tracker is None:
        return out
    tracker.trusted += 1  # credit_mpi's own code: nothing of it judged
    try:
        return _placed(tracker, manager, out)
    finally:
        tracker.trusted -= 1


def _placed(tracker: Any, manager: Any, out: Any) -> Any:
    check_output(tracker, out)

    root_is_layer = bool(tracker.stack[0][1])  # a converted layer as the root: its output is a band along shard_dim

    def placed(t: torch.Tensor) -> Any:
        p = tracker.get(t)
        if p is None and root_is_layer and t.is_floating_point() and not is_replicated(t) and t.ndim:
            p = tracker.band(t)
        if not isinstance(p, Sharded) or is_replicated(t):
            return t
        q = p if p.outer == 1 and p.inner == 1 else tracker.as_band(t, p)
        return t if q is None else _wrap(t, q.dim, manager)

    return tree_map_only(torch.Tensor, placed, out)


base.placed_output = placed_output
base.inputs_checked = check_inputs


# -- bands made by shard_tensor: fed to a model never converted, or to a converted model of another layout -------

_MADE: dict[int, tuple] = {}  # id -> (weakref to the band, its dim, its domain's communicator)
_HOOK: list = []  # the global module pre-hook's handle while bands are alive


def _made(t: Any, dim: Any, domain: Any) -> None:
    """:func:`credit_mpi.shard_tensor`'s band ``t`` remembered (weakly) until it dies."""
    if not isinstance(t, torch.Tensor) or domain.manager is None:
        return
    key = id(t)
    _MADE[key] = (weakref.ref(t, lambda _ref, key=key: _forget(key)), dim, getattr(domain.manager, "domain_group", None))
    if not _HOOK:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        _HOOK.extend((register_module_forward_pre_hook(_fed), register_module_forward_hook(_done)))


def _forget(key: int) -> None:
    entry = _MADE.get(key)
    if entry is not None and entry[0]() is None:
        del _MADE[key]
    if not _MADE:
        while _HOOK:
            _HOOK.pop().remove()


def made_band(t: Any) -> tuple | None:
    """``(dim, communicator)`` of a band :func:`credit_mpi.shard_tensor` returned (this very tensor), else None."""
    entry = _MADE.get(id(t))
    return entry[1:] if entry is not None and entry[0]() is t else None


def _converted(module: torch.nn.Module) -> bool:
    """True for a module converted (or holding one: DDP, torch.compile), or credit_mpi's own, or one without
    parameters (a transform such as a normaliser: elementwise, not a model)."""
    if type(module).__module__.startswith("credit_mpi."):
        return True
    if next(module.parameters(), None) is None:
        return True
    return any(isinstance(m, base.DomainParallelModule) or isinstance(m.__dict__.get("forward"), base.ForwardGuard)
               for m in module.modules())


_FED: dict = {}  # id(module) -> (agreements entered before its forward, the band's shape): unconverted, given a band


def _fed(module: torch.nn.Module, args: tuple) -> None:
    """The global module pre-hook while shard_tensor's bands live: an unconverted model given one is watched."""
    if not args or active_tracker() is not None or made_band(args[0]) is None or _converted(module):
        return
    from ..watchdog import STATE

    _FED[id(module)] = (STATE.seq, tuple(args[0].shape))


def _done(module: torch.nn.Module, args: tuple, out: Any) -> None:
    """... and when its forward made no collective (no agreement: a model written for the whole field, not one
    that exchanges halos itself with credit_mpi.halo_exchange), it raises. Every rank runs the same program and
    the collectives are every rank's: each raises here alike."""
    if not _FED or id(module) not in _FED:
        return
    from ..watchdog import STATE

    seq, shape = _FED.pop(id(module))
    if STATE.seq != seq:
        return
    raise ConversionError(
        f"{type(module).__name__} was given a band of the field (credit_mpi.shard_tensor's, {shape}) but was never "
        f"converted (and its forward made no domain communication): it computed on the band alone, as if it were "
        f"the whole field. Convert it first: model = credit_mpi.convert_to_domain_parallel(model, manager)")


def check_layouts(shard_dim: int, manager: Any, args: tuple, kwargs: dict) -> None:
    """Bands of another layout fed to a converted model (shard_tensor's or a converted model's along another dim,
    or of another domain): raise (the same on every rank: it depends on the program, not on the data)."""
    for t in tensors_in((args, kwargs)):
        if isinstance(t, Band):
            dim, comm = t.band_dim, getattr(t.band_manager, "domain_group", None)
        elif (made := made_band(t)) is not None:
            dim, comm = made
        else:
            continue
        ours = shard_dim % t.ndim
        theirs = tuple(d % t.ndim for d in dim) if isinstance(dim, (tuple, list)) else (dim % t.ndim,)
        if ours not in theirs or (comm is not None and comm != manager.domain_group):
            raise ConversionError(
                f"a converted model (sharded along dim {ours} over its manager's domain) was given a band along dim "
                f"{theirs if len(theirs) > 1 else theirs[0]}"
                + (" of another domain" if comm is not None and comm != manager.domain_group else "")
                + ": shard the field as the model was converted (credit_mpi.shard_tensor(x, shard_dim, manager))")


sharding.BAND_MADE.append(_made)
