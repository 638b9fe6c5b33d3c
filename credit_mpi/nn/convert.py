"""``convert_to_domain_parallel``: the module-type -> wrapper table, and the refusal of what has no rule.

Policy (every module of the model, the root included, is visited once):

1. ``custom_converters`` first: ``{ModuleType: fn(module, manager, shard_dim) -> replacement}``
   (matched on the exact type, then on its base classes; CREDIT's one-argument ``fn(module)``
   works too, its layers getting this manager). :func:`keep_local`
   as the function marks a type as local (the user vouches that it never
   mixes rows along the sharded dim).
2. The layer rules (exact types; each registered next to its class with
   :func:`credit_mpi.nn.rules.layer_rule`: which type it replaces, bands
   and/or the grid, the arguments it refuses): convolutions, transposed
   convolutions, normalisations, upsampling, pooling -> their ``DomainParallel*`` wrapper;
   ``nn.Dropout`` / ``nn.AlphaDropout`` / ``nn.Dropout1d/2d/3d`` -> a wrapper that is the identity in
   eval and refuses training (:mod:`credit_mpi.nn.dropout`).
3. Padding modules (``nn.CircularPad2d((1, 1, 0, 0))``: circular longitude)
   that leave the sharded dim alone, constant ones (``nn.ZeroPad2d``) that pad it
   (the field's edges, on the first and last band), and modules that act on each row on its own (activations,
   ``nn.Linear`` / ``nn.Identity`` acting on the last dim when that is not
   the sharded one, ...) stay as they are.
4. Every other module (containers, custom modules, ``nn.Softmax``,
   ``nn.PixelShuffle``, ``nn.Flatten``, a subclass of an activation) is kept
   and its children converted; its own ``forward`` is judged function by
   function while the converted model runs and in ``describe()``'s dry run
   (:mod:`credit_mpi.nn.judge`): what leaves the sharded dim alone
   passes, what mixes rows along it raises ``ConversionError`` naming the
   module's path and the op.
5. Refused here, on every rank, naming the module's path and
   ``custom_converters``: ``nn.Linear`` when ``shard_dim`` is the last dim,
   adaptive max pooling. (Attention, ``nn.MultiheadAttention``
   and ``nn.Transformer*``, is judged by its forward as in 4.: exact,
   :mod:`credit_mpi.nn.judge.attention`.)

On a 2-D latitude x longitude domain grid of more than one column
(``domain_grid=(rows, cols)``, ``cols > 1``) the last two dims of every layer
input are split (latitude = ``shard_dim``, which must be -2, and longitude):
convolutions (2-D/3-D, transposed too) and the norms run on blocks; the
layers without a grid rule (1-D layers, upsampling, pooling) and padding
modules or ``nn.Linear`` that act on the longitude are refused here.

The conversion is deterministic (the same model gives the same verdict on
every rank) and moves no data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..grid import grid_of
from ..manager import DomainParallelManager, get_domain_parallel_manager
from ..transport import paths
from ..validation import check_int
from . import conv, dropout, judge, norm, resample  # noqa: F401 - the layers register their rules; judge the custom forwards
from .base import DomainParallelModule, adopt, guard_forward
from .eager import judged_eagerly, keep_eager
from .errors import ConversionError
from .rules import BANDS_ONLY, PADDING, RULES, local_rule, refusal_of
from .sht import sht_converter

__all__ = ["convert_to_domain_parallel", "keep_local", "ConversionError", "RULES"]


def keep_local(module: nn.Module, manager: Any, shard_dim: int) -> nn.Module:
    """A custom converter that keeps ``module`` as it is: it acts on each band on its own.

    ``custom_converters={MyBlock: keep_local}`` is the user's statement that
    ``MyBlock`` never mixes rows along the sharded dim.
    """
    return module


def convert_to_domain_parallel(
    model: nn.Module,
    manager: DomainParallelManager | None = None,
    shard_dim: int = -2,
    *,
    custom_converters: dict[type, Callable[[nn.Module, Any, int], nn.Module]] | None = None,
    transport: Any = "mpi",
) -> nn.Module:
    """Convert ``model`` to run on latitude bands; USE THE RETURN VALUE (the root may be replaced).

    The parameters are shared with ``model`` (the same Parameter objects) and
    ``state_dict()`` keys are unchanged, so a checkpoint of either loads into
    the other. On a domain of size 1 (or with no manager) the converted model
    computes exactly what ``model`` does. ``model``'s submodules are replaced
    in place in their parents (``model`` itself keeps working only where no
    wrapper replaced a child).

    Args:
        model: The model (any ``nn.Module``).
        manager: DomainParallelManager (the global singleton if None).
        shard_dim: The sharded dimension of the layers' inputs (default -2: latitude).
        custom_converters: ``{ModuleType: fn(module, manager, shard_dim) -> replacement}``,
            checked before the built-in table (see :func:`keep_local`).
        transport: What every layer's and every rule's data (halos, overlap-add, statistics, domain
            sums, re-bands, attention's gathers and all-to-alls) moves on: ``"mpi"`` (default),
            ``"torch"`` (the torch.distributed group mirroring the domain group: NCCL on GPUs, gloo on
            CPU; :func:`credit_mpi.init_torch_distributed` first), or a transport object over the
            domain ranks (``TorchMoves(manager.torch_group("domain"))``). The agreements stay MPI
            collectives of host metadata; the ranks agree on the transport at every forward's start.
            See :mod:`credit_mpi.transport.paths` and docs/gpus.rst.

    Returns:
        The converted model.

    Raises:
        ConversionError: a module without a rule (named by its path), on every rank alike.
        ValueError: ``transport`` is not a transport.
        DomainParallelError: ``transport="torch"`` on a manager without torch groups.
        TypeError: ``model`` is not an ``nn.Module`` or a converter is not callable.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_domain_parallel needs a torch.nn.Module, got {type(model).__name__}")
    shard_dim = check_int("shard_dim", shard_dim)
    custom = check_custom(custom_converters)
    manager = get_domain_parallel_manager() if manager is None else manager
    path = paths.path_of(transport, manager)
    return guard_forward(_convert(model, "", manager, shard_dim, custom), manager, shard_dim, path)


def check_custom(custom_converters: dict | None) -> dict:
    """``custom_converters`` as a dict, checked: module types to callables (TypeError otherwise)."""
    custom = dict(custom_converters or {})
    for key, fn in custom.items():
        if not isinstance(key, type) or not callable(fn):
            raise TypeError(f"custom_converters maps module types to callables, got {key!r}: {fn!r}")
    return custom


def _call_custom(fn: Callable, module: nn.Module, manager, shard_dim: int) -> Any:
    """``fn(module, manager, shard_dim)``, or CREDIT's ``fn(module)`` when ``fn`` takes one argument.

    A CREDIT-style factory builds its layers without a manager (``DomainParallelConv2d(conv)``:
    the global one, or none yet): the layers it returns get this conversion's manager (a module
    with ``dp_adopt_manager(manager)`` is given it that way).
    """
    try:
        inspect.signature(fn).bind(module, manager, shard_dim)
    except TypeError:
        out = fn(module)
        for m in out.modules() if isinstance(out, nn.Module) else ():
            if isinstance(m, DomainParallelModule) and m.dp_manager is None:
                m.dp_manager = manager
            elif callable(getattr(m, "dp_adopt_manager", None)):  # credit_mpi.nn.compat's layers
                m.dp_adopt_manager(manager)
        return out
    except ValueError:  # no signature to read (a builtin): credit_mpi's three arguments
        pass
    return fn(module, manager, shard_dim)


def _custom_for(module: nn.Module, custom: dict) -> Callable | None:
    for cls in type(module).__mro__:
        if cls in custom:
            return custom[cls]
    return sht_converter(module)  # torch-harmonics' RealSHT / InverseRealSHT (credit_mpi.nn.sht), else None


def _convert(module: nn.Module, path: str, manager, shard_dim: int, custom: dict) -> nn.Module:
    label = path or "<root>"
    fn = _custom_for(module, custom)
    if fn is not None:
        out = _call_custom(fn, module, manager, shard_dim)
        if not isinstance(out, nn.Module):
            raise TypeError(f"the custom converter for {type(module).__name__} at {label} returned {type(out).__name__}, not an nn.Module")
        out._dp_trusted = True  # the user's rule: its forward is not judged function by function
        return out
    kind = type(module)
    if isinstance(module, DomainParallelModule):  # converted already: the same wrapper with this manager
        return adopt(kind, module, manager, shard_dim, label)
    grid = _grid_with_columns(manager)
    if kind in RULES:
        _check_supported(module, label)
        if grid and kind in BANDS_ONLY:
            _refuse(module, label, f"it has no exact rule on a {grid[0]}x{grid[1]} latitude x longitude domain grid yet "
                                   f"(use latitude bands: domain_grid=None or ({grid[0] * grid[1]}, 1))")
        return adopt(RULES[kind], module, manager, shard_dim, label)
    why = local_rule(module, shard_dim, grid)  # a type kept as it is (credit_mpi.nn.rules), or refused
    if why:
        _refuse(module, label, why)
    if why is not None:  # kept as it is; a pad runs eagerly under torch.compile, as the judge must see it (nn.eager)
        return keep_eager(module) if isinstance(module, PADDING) and judged_eagerly(module, path, manager) else module
    for name, child in list(module.named_children()):
        new = _convert(child, f"{path}.{name}" if path else name, manager, shard_dim, custom)
        if new is not child:
            module._modules[name] = new
    # its own forward is judged function by function while it runs (credit_mpi.nn.judge): eagerly under torch.compile
    return keep_eager(module) if judged_eagerly(module, path, manager) else module


def _grid_with_columns(manager: Any) -> tuple[int, int] | None:
    """The manager's ``(rows, cols)`` when it is a 2-D grid of more than one column (blocks), else None."""
    if manager is None or manager.domain_parallel_size <= 1:
        return None
    grid = grid_of(manager, manager.domain_parallel_size)
    return grid if grid[1] > 1 else None


def _check_supported(module: nn.Module, label: str) -> None:
    why = refusal_of(module)  # the layer's own rule (credit_mpi.nn.rules)
    if why:
        _refuse(module, label, why)


def _refuse(module: nn.Module, label: str, why: str) -> None:
    raise ConversionError(
        f"cannot convert {label} ({type(module).__name__}) to run on bands along the sharded dim: {why}. "
        f"Pass custom_converters={{{type(module).__name__}: fn}} with fn(module, manager, shard_dim) returning "
        f"a replacement, or credit_mpi.nn.keep_local if it never mixes rows along the sharded dim"
    )
