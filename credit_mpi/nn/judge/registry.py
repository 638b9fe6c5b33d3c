"""The rule registry of the judge: which rule answers for each torch function, and how a rule refuses.

A rule is ``fn(tracker, func, args, kwargs, held) -> out``: ``held`` the
``(tensor, placement)`` pairs of the arguments that hold bands. It runs the
function (usually through :meth:`Tracker.run <credit_mpi.nn.judge.tracker.Tracker.run>`,
which places the outputs), or raises :class:`Refusal` with the reason; the
tracker turns a refusal into the ``ConversionError`` that names the
module's path and the op (:func:`conversion_error`). Register one with
:func:`rule`::

    @rule("flip")
    def flip(tr, func, args, kwargs, held):
        ...

One rule per name: a second registration of a name raises
:class:`DuplicateRule` when its module is imported. A rule that adds to
another family's rule (attention's global dims follow every pointwise op)
says so with :func:`wraps`: the wrapper gets the rule it wraps as its
first argument, so which rule runs never depends on import order.

A module rule (:func:`module_rule`) runs at the boundary of a module that
is judged by its forward (the whole-window re-band of a windowed module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ...partition import normalize_dim
from ..errors import ConversionError

__all__ = ["Refusal", "DuplicateRule", "rule", "wraps", "module_rule", "without_bands", "rule_for", "rule_of", "MISS", "module_rules",
           "rules_without_bands", "check_wrappers", "conversion_error",
           "op_name", "argument", "tensors_in", "leaves_in", "dims_of"]


class Refusal(Exception):
    """A rule's reason to refuse a torch function on bands (the tracker adds the module's path and the op)."""


class DuplicateRule(ValueError):
    """A torch function name registered twice (as a rule, or as a wrapper of one)."""


_BASE: dict[str, Callable] = {}  # name -> its rule
_WRAPPERS: dict[str, Callable] = {}  # name -> fn(base, tr, func, args, kwargs, held)
_TABLE: dict[str, Callable] = {}  # name -> the rule that runs (its wrapper around it, if any); built on demand
_BY_FUNC: dict = {}  # torch function -> (name, rule, fast path or None, reads only): built on demand, cleared with _TABLE
_MODULE_RULES: list[Callable] = []
_WITHOUT_BANDS: list[Callable] = []


def _register(table: dict, names: tuple[str, ...], fn: Callable, what: str) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DuplicateRule(f"{what} {twice} named twice by {fn.__module__}.{fn.__qualname__}")
    for name in names:
        if name in table:
            old = table[name]
            raise DuplicateRule(f"{what} {name!r} is registered twice: by {old.__module__}.{old.__qualname__} and by "
                                f"{fn.__module__}.{fn.__qualname__} (one per name; to add to a rule, use wraps())")
    for name in names:
        table[name] = fn
    _TABLE.clear()
    _BY_FUNC.clear()


def rule(*names: str, joins: bool = False, fast: Callable | None = None) -> Callable[[Callable], Callable]:
    """Register ``fn(tracker, func, args, kwargs, held)`` as the rule of the torch functions ``names``.

    ``joins``: the rule joins bands whose layouts may differ and re-bands them itself (``torch.cat``):
    the dry run does not report its parts' layouts as a conflict.
    ``fast``: ``fast(tracker, func, args, kwargs) -> out or MISS``, tried first at run time: the rule's
    common case decided from the records alone (no held list, no wrapper); MISS when it is not that case
    (the rule then runs as always). It must give what the rule (and its wrapper) would give.
    """
    def register(fn: Callable) -> Callable:
        fn.joins = joins
        fn.fast = fast
        _register(_BASE, names, fn, "the rule of")
        return fn

    return register


def wraps(*names: str) -> Callable[[Callable], Callable]:
    """Register ``fn(base, tracker, func, args, kwargs, held)`` around the rule of each of ``names`` (``base``)."""
    def register(fn: Callable) -> Callable:
        _register(_WRAPPERS, names, fn, "a wrapper of")
        return fn

    return register


def _composed(name: str) -> Callable | None:
    base, wrapper = _BASE.get(name), _WRAPPERS.get(name)
    if wrapper is None or base is None:
        return base

    def wrapped(tr, func, args, kwargs, held):
        return wrapper(base, tr, func, args, kwargs, held)

    wrapped.joins = base.joins
    wrapped.__doc__ = base.__doc__
    return wrapped


def rule_for(name: str) -> Callable | None:
    """The rule that runs for the torch function ``name`` (None: no rule)."""
    found = _TABLE.get(name)
    if found is None and name not in _TABLE:
        found = _TABLE[name] = _composed(name)
    return found


MISS = object()  # a fast path's answer: not its case, run the rule

# attribute reads that return no tensor and read no size along the band: with no rule, they pass untouched
_READS = frozenset("ndim dim dtype device is_floating_point is_complex is_contiguous is_cuda is_sparse is_quantized "
                   "is_meta layout element_size get_device is_leaf".split())


def rule_of(func: Callable) -> tuple[str, Callable | None, Callable | None, bool]:
    """``(name, rule, fast path, reads only)`` of a torch function (cached per function: the judge's hot path).

    The rule is the name's, else that of its out-of-place name (``add_``: ``add``'s); ``reads only``:
    an attribute read with no rule that returns no tensor (``x.ndim``, ``x.dtype``).
    """
    try:
        return _BY_FUNC[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return _rule_of(func)
    found = _BY_FUNC[func] = _rule_of(func)
    return found


def _rule_of(func: Callable) -> tuple[str, Callable | None, Callable | None, bool]:
    op = op_name(func)
    found = rule_for(op) or rule_for(op.rstrip("_") if not op.startswith("__") else op)
    # the base rule's fast path (it answers for the wrapper too: its case is one the wrapper adds nothing to)
    fast = getattr(_BASE.get(op) or _BASE.get(op.rstrip("_")), "fast", None) if found is not None else None
    return op, found, fast, found is None and op in _READS


def check_wrappers() -> None:
    """Every wrapper wraps a registered rule (called once every family is imported)."""
    dangling = sorted(set(_WRAPPERS) - set(_BASE))
    if dangling:
        raise DuplicateRule(f"wrappers of names that have no rule: {dangling}")


def without_bands(fn: Callable) -> Callable:
    """Register ``fn(tracker, func, args, kwargs) -> (handled, out)``: asked about a call that holds no band while
    the forward has contracted a field over the domain (``tracker.fields``: the inverse spreads it back)."""
    _WITHOUT_BANDS.append(fn)
    return fn


def rules_without_bands() -> list[Callable]:
    return _WITHOUT_BANDS


def module_rule(fn: Callable) -> Callable:
    """Register ``fn(tracker, module, args) -> None | (new args, leave(out) -> out)``: run before the forward of
    a module that is judged by its forward (the first rule that answers wins; ``leave`` gets its output)."""
    _MODULE_RULES.append(fn)
    return fn


def module_rules() -> list[Callable]:
    return _MODULE_RULES


def conversion_error(path: str, op: str, why: str) -> ConversionError:
    """The ``ConversionError`` of ``op`` at ``path`` (``.refused``: the three parts, for describe()'s plan)."""
    exc = ConversionError(
        f"{path} calls {op} on a tensor that holds latitude bands: {why}. Nothing ran on bands wrongly; "
        f"change the forward (a module the converter replaces, an op that leaves the sharded dim alone), or "
        f"pass custom_converters={{ThatModule: fn}} (credit_mpi.nn.keep_local if it never mixes rows along "
        f"the sharded dim)")
    exc.refused = (path, op, why)
    return exc


# -- what every rule reads from its call ------------------------------------------------------------


def op_name(func: Callable) -> str:
    """The name a torch function is registered under (``torch.roll`` and ``Tensor.roll``: ``"roll"``)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return name


def tensors_in(tree: Any) -> list:
    """The tensors in a tree of arguments (tuples, lists, dicts), in pytree's order.

    Called several times for every judged op: plain tuples, lists and dicts are walked here (pytree's
    generic walk cost half the judge's time); any other container pytree knows (a namedtuple,
    ``torch.return_types``, an OrderedDict) goes through :func:`~torch.utils._pytree.tree_flatten`.
    """
    out: list = []
    _collect(tree, out, True)
    return out


def leaves_in(tree: Any) -> list:
    """Every leaf of a tree of arguments (tensors, numbers, sizes' ints), as ``tree_flatten`` gives them."""
    out: list = []
    _collect(tree, out, False)
    return out


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, slice, type(Ellipsis)})


def _collect(x: Any, out: list, only_tensors: bool) -> None:
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            _collect(v, out, only_tensors)
    elif t is dict:
        for v in x.values():
            _collect(v, out, only_tensors)
    elif isinstance(x, torch.Tensor):
        out.append(x)
    elif t in _SCALARS or isinstance(x, (int, float)):  # an Extent is an int
        if not only_tensors:
            out.append(x)
    elif t is torch.Size:
        if not only_tensors:
            out.extend(x)
    else:  # another container pytree knows, or a leaf (an Extent, a memory format, a function)
        leaves = tree_flatten(x)[0]
        out.extend(v for v in leaves if isinstance(v, torch.Tensor)) if only_tensors else out.extend(leaves)


def argument(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """An argument given by position ``index`` or by keyword ``name``."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def dims_of(value: Any, ndim: int) -> list[int] | None:
    """``dim`` arguments as non-negative ints (None: every dim)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [normalize_dim(int(v), ndim) for v in value]
    return [normalize_dim(int(value), ndim)]
