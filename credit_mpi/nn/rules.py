"""Layer rules, registered next to their classes: which torch module a layer replaces, where, and what it refuses.

Each ``credit_mpi.nn`` layer class says, with :func:`layer_rule` above its
definition, the torch module type it replaces (exact types: a subclass with
its own forward is judged by what that forward does), whether it runs on a
latitude x longitude grid of several columns too, and which arguments of
the original it refuses (a function of the module giving the reason, "" when
it converts). The module types kept as they are (pointwise activations,
padding of other dims, ``nn.Linear`` over the longitude) and those refused
by type have their rule here too (:func:`local_rule`). What the judge of
custom forwards must know of a layer is declared with its rule too
(:class:`LayerTraits`: it folds an ``F.pad`` of the field's edges into its
own padding, it takes statistics over the batch, it is the identity in its
current mode; the judge reads :func:`traits_of` and names no layer type).
:func:`credit_mpi.nn.convert_to_domain_parallel`,
:func:`~credit_mpi.nn.describe` and the grid check read :data:`RULES` and
:data:`BANDS_ONLY`; adding a layer is its class, its rule and a test file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

__all__ = ["RULES", "BANDS_ONLY", "POINTWISE", "PADDING", "REFUSED", "LayerTraits", "layer_rule", "refusal_of", "local_rule",
           "traits_of"]


class LayerTraits(NamedTuple):
    """What the judge of custom forwards must know of a layer (declared with :func:`layer_rule`)."""

    folds_edge_rows: bool = False  # an F.pad by zeros of the sharded dim just before it becomes its own padding (convs)
    batch_statistics: bool = False  # it takes statistics over the batch: windows moved into the batch are refused
    identity: Callable[[nn.Module], bool] | None = None  # identity(layer): the identity now, on any placement (dropout)
    # local_on(layer, x, dim): the layer reads no other row of dim ``dim`` of ``x`` (a LayerNorm over the last dims
    # that hold no band: channels-last tokens), so it runs locally on bands along that dim
    local_on: Callable[[nn.Module, Any, int], bool] | None = None

#: original module type -> the credit_mpi layer that replaces it
RULES: dict[type, type] = {}
#: original module types whose layers know latitude bands only (a grid with more than one column refuses them)
BANDS_ONLY: set[type] = set()
_REFUSES: dict[type, Callable[[nn.Module], str]] = {}
_TRAITS: dict[type, LayerTraits] = {}  # layer class -> its traits
_PLAIN = LayerTraits()


def layer_rule(*originals: type, grid: bool = True, refuses: Callable[[nn.Module], str] | None = None,
               folds_edge_rows: bool = False, batch_statistics: bool = False,
               identity: Callable[[nn.Module], bool] | None = None,
               local_on: Callable[[nn.Module, Any, int], bool] | None = None):
    """Class decorator: the layer replaces each of ``originals`` (exact types) when a model is converted.

    Args:
        originals: The torch module types it replaces.
        grid: Whether it runs on a 2-D grid of several columns (else bands only).
        refuses: ``refuses(module) -> reason`` for the arguments it has no exact rule for ("" when it converts).
        folds_edge_rows: An ``F.pad`` by zeros of the sharded dim right before the layer is folded into its
            padding (the layer pads the field's edges itself, so its output rows stay anchored on the field).
        batch_statistics: The layer's forward takes statistics over the batch (BatchNorm): an input whose
            bands were moved into the batch dim (windows) is refused.
        identity: ``identity(layer) -> bool``: the layer is the identity now (dropout in eval or with p=0), so
            it runs on an input of any placement.
        local_on: ``local_on(layer, x, dim) -> bool``: the layer reads no other row along dim ``dim`` of its
            input ``x`` (the bands are there after a permute), so it runs its original forward on those bands.
    """
    def register(cls: type) -> type:
        _TRAITS[cls] = LayerTraits(folds_edge_rows, batch_statistics, identity, local_on)
        _TRAITS_OF.clear()
        for original in originals:
            if original in RULES:
                raise ValueError(f"{original.__name__} already has a layer rule ({RULES[original].__name__})")
            RULES[original] = cls
            if not grid:
                BANDS_ONLY.add(original)
            if refuses is not None:
                _REFUSES[original] = refuses
        return cls

    return register


def traits_of(layer: nn.Module) -> LayerTraits:
    """The traits declared for ``layer``'s class (or the nearest base class with a layer rule); plain otherwise.
    Asked at every layer call of a converted forward: found once per class."""
    klass = type(layer)
    found = _TRAITS_OF.get(klass)
    if found is None:
        found = _TRAITS_OF[klass] = next((t for k in klass.__mro__ if (t := _TRAITS.get(k)) is not None), _PLAIN)
    return found


_TRAITS_OF: dict[type, LayerTraits] = {}  # per class, the traits_of answer (cleared when a rule is registered)


def refusal_of(module: nn.Module) -> str:
    """Why ``module``'s rule refuses its arguments ("" when it converts, or has no rule)."""
    refuses = _REFUSES.get(type(module))
    return refuses(module) if refuses is not None else ""


# -- module types kept as they are (no layer), or refused by type ------------------------------------

#: act on every element (or every row of the last dim) on its own: exact on bands as they are
POINTWISE: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Threshold, nn.LogSigmoid,
)

#: module types with no exact rule on bands, and why
REFUSED: dict[type, str] = {
    nn.AdaptiveMaxPool1d: "no rule for a max over windows that cross bands (use AdaptiveAvgPool or a custom converter)",
    nn.AdaptiveMaxPool2d: "no rule for a max over windows that cross bands (use AdaptiveAvgPool or a custom converter)",
    nn.AdaptiveMaxPool3d: "no rule for a max over windows that cross bands (use AdaptiveAvgPool or a custom converter)",
}

#: torch's padding modules (kept when they leave the sharded dim or pad the field's edges by zeros; judged by F.pad)
PADDING: tuple[type, ...] = tuple(
    getattr(nn, f"{kind}Pad{n}d") for kind in ("Zero", "Constant", "Circular", "Reflection", "Replication") for n in (1, 2, 3)
    if hasattr(nn, f"{kind}Pad{n}d")
)

# constant padding of the sharded dim: the field's edges, on the first and last band (credit_mpi.nn.judge)
_CONSTANT_PADS = tuple(getattr(nn, f"{kind}Pad{n}d") for kind in ("Zero", "Constant") for n in (1, 2, 3)
                       if hasattr(nn, f"{kind}Pad{n}d"))


def _pads_sharded_dim(module: nn.Module, shard_dim: int) -> bool:
    """True unless the padding module leaves the sharded dim alone (``padding`` lists (before, after) from the last dim)."""
    pad = tuple(module.padding)
    if shard_dim >= 0:
        return True  # which dim the padding hits depends on the input's ndim: refuse
    pair = -shard_dim - 1
    return 2 * pair + 1 < len(pad) and (pad[2 * pair] != 0 or pad[2 * pair + 1] != 0)


def _padding_rule(module: nn.Module, shard_dim: int, grid: tuple[int, int] | None) -> str:
    if _pads_sharded_dim(module, shard_dim) and (grid or type(module) not in _CONSTANT_PADS):
        return "it pads the sharded dim (only the global edges may be padded: use the conv's own padding)"
    if grid and _pads_sharded_dim(module, -1):
        return (f"it pads the longitude (the last dim), which the {grid[0]}x{grid[1]} domain grid "
                f"splits (use the conv's own padding, e.g. padding_mode='circular')")
    return ""


def _linear_rule(shard_dim: int, grid: tuple[int, int] | None) -> str:
    if shard_dim == -1:
        return "nn.Linear acts on the last dim, which is the sharded one"
    if grid:
        return f"nn.Linear acts on the last dim, the longitude, which the {grid[0]}x{grid[1]} domain grid splits"
    return ""


def local_rule(module: nn.Module, shard_dim: int, grid: tuple[int, int] | None) -> str | None:
    """The rule of a module type kept as it is: "" when ``module`` is kept, the reason when it is refused, None
    when its type has no such rule (a layer's, or none: its forward is judged). ``grid``: the domain grid's
    ``(rows, cols)`` when it has more than one column, else None."""
    kind = type(module)
    if kind in POINTWISE:
        return ""
    if kind in PADDING:
        return _padding_rule(module, shard_dim, grid)
    if kind is nn.Linear:
        return _linear_rule(shard_dim, grid)
    return REFUSED.get(kind)
