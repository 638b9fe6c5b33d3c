"""``validate_sharding_constraints``: CREDIT's pre-flight check, answered by :func:`credit_mpi.nn.describe`.

CREDIT's function checks only that a band's height divides the attention
window sizes level by level. Here the verdict is the plan's: every layer that
does not run exactly on the band layout is one message (halo wider than a
band, stride alignment, a module without a rule), and the window sizes, when
given, are checked as CREDIT checks them, on every band height of the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..partition import band_sizes, normalize_dim
from .errors import ConversionError
from .plan import describe

__all__ = ["validate_sharding_constraints"]


def validate_sharding_constraints(
    model: nn.Module,
    local_h: int | None = None,
    window_sizes: Sequence[Any] | None = None,
    *,
    input_shape: tuple[int, ...],
    domain_size: int | None = None,
    manager: Any = None,
    shard_dim: int = -2,
) -> list[str]:
    """Everything that keeps ``model`` from running exactly on latitude bands, as a list of messages.

    Local: no MPI call, no data (a dry run on the meta device, as
    :func:`~credit_mpi.nn.describe`). An empty list means the plan runs
    exactly (``describe(...).exact``) and every window size fits.

    Args:
        model: The model, converted or not (it is not modified).
        local_h: CREDIT's argument: this rank's band height. Optional here
            (the bands follow from ``input_shape``); when given it must be one
            of the layout's band heights.
        window_sizes: CREDIT's argument: the attention window size of each
            encoder level (an int or an ``(h, w)`` pair); level ``i`` sees
            bands ``2**i`` times lower, as in CREDIT.
        input_shape: The GLOBAL input shape (CREDIT's function does not
            need it because it checks only the windows; the plan needs it).
        domain_size: Number of bands (default: the manager's, else 1).
        manager: A DomainParallelManager to take the domain size from.
        shard_dim: The sharded dim (default -2).

    Returns:
        One message per problem, as CREDIT's; an empty list when all checks pass.

    Raises:
        ValueError: ``local_h`` is not a band height of this layout.
    """
    try:
        plan = describe(model, tuple(input_shape), domain_size, manager, shard_dim)
    except ConversionError as exc:
        return [str(exc)]
    plans = [plan] if not hasattr(plan, "latitude") else [plan.latitude, plan.longitude]
    problems = [
        f"layer {row.path!r} ({row.kind}): does not run exactly on {p.domain_size} band(s): {row.note or 'see describe()'}"
        for p in plans
        for row in p.rows
        if not row.exact
    ]
    first = plans[0]
    heights = sorted(set(band_sizes(input_shape[normalize_dim(shard_dim, len(input_shape))], first.domain_size, uneven=True)))
    if local_h is not None and local_h not in heights:
        raise ValueError(f"local_h={local_h} is not a band height of input_shape={tuple(input_shape)} on "
                         f"{first.domain_size} band(s); the bands are {heights} rows high")
    for h0 in [local_h] if local_h is not None else heights:
        h = h0
        for level, ws in enumerate(window_sizes or ()):
            ws_h = ws[0] if isinstance(ws, (tuple, list)) else ws
            if h % ws_h:
                problems.append(f"Level {level}: local H={h} not divisible by window_size={ws_h} (bands of {h0} rows); "
                                "attention will fail: choose another domain_parallel_size or pad the field")
            h //= 2
    return problems
