"""Layer rules, registered next to their classes: which torch module a layer replaces, where, and what it refuses.

Each ``credit_mpi.nn`` layer class says, with :func:`layer_rule` above its
definition, the torch module type it replaces (exact types: a subclass with
its own forward is judged by what that forward does), whether it runs on a
latitude x longitude grid of several columns too, and which arguments of
the original it refuses (a function of the module giving the reason, "" when
it converts). :func:`credit_mpi.nn.convert_to_domain_parallel`,
:func:`~credit_mpi.nn.describe` and the grid check read :data:`RULES` and
:data:`BANDS_ONLY`; adding a layer is its class, its rule and a test file.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["RULES", "BANDS_ONLY", "layer_rule", "refusal_of"]

#: original module type -> the credit_mpi layer that replaces it
RULES: dict[type, type] = {}
#: original module types whose layers know latitude bands only (a grid with more than one column refuses them)
BANDS_ONLY: set[type] = set()
_REFUSES: dict[type, Callable[[nn.Module], str]] = {}


def layer_rule(*originals: type, grid: bool = True, refuses: Callable[[nn.Module], str] | None = None):
    """Class decorator: the layer replaces each of ``originals`` (exact types) when a model is converted.

    Args:
        originals: The torch module types it replaces.
        grid: Whether it runs on a 2-D grid of several columns (else bands only).
        refuses: ``refuses(module) -> reason`` for the arguments it has no exact rule for ("" when it converts).
    """
    def register(cls: type) -> type:
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


def refusal_of(module: nn.Module) -> str:
    """Why ``module``'s rule refuses its arguments ("" when it converts, or has no rule)."""
    refuses = _REFUSES.get(type(module))
    return refuses(module) if refuses is not None else ""
