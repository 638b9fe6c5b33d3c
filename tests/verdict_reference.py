"""The check of every function-rule test: describe()'s verdict is what the run does (exact, or refused on every rank)."""

from __future__ import annotations

from credit_mpi import DomainParallelError
from credit_mpi.nn import ConversionError, convert_to_domain_parallel, describe

from .nn_reference import assert_same, run_both, same_error_everywhere


def _outcome(comm, fn):
    """``(result, None)`` or ``(None, error)``: an error of the same type on every rank (asserted)."""
    try:
        return fn(), None
    except (ConversionError, DomainParallelError, ValueError) as exc:  # ValueError: a layer refusing the bands
        names = comm.allgather(type(exc).__name__)
        assert len(set(names)) == 1, names
        return None, exc


def verdict_is_the_run(name: str, build, shape: tuple, manager, seed: int = 3, same_op: bool = True, custom=None,
                       tolerance: tuple[float, float] = (1e-12, 1e-10), shard_dim: int = -2):
    """Plan ``build()`` for ``shape`` on the manager's bands and run it; returns the plan.

    Exact against one process (forward, input gradient, parameter gradients) when the plan
    says it runs exactly; the same ConversionError on every rank, naming the refused op's
    module and op, when it does not (``tolerance``: ``(atol, rtol)`` of "exact", float64 round-off unless the model
    computes in float32 inside, as torch-harmonics' spectral convolutions do; ``same_op=False``: the run may refuse a later op of the
    same forward: a reshape whose window count the model fixes splits a band into other
    windows than the whole field, which the dry run sees and the run cannot).
    """
    d, comm = manager.domain_parallel_size, manager.domain_group
    plan = describe(build().double(), shape, d, custom_converters=custom, shard_dim=shard_dim)
    result, error = _outcome(comm, lambda: run_both(build, shape, manager, seed=seed, custom_converters=custom,
                                                    shard_dim=shard_dim))
    flags = comm.allgather((plan.exact, error is None))
    assert all(f == flags[0] for f in flags), flags
    if plan.exact:
        assert error is None, f"{name} {shape} on {d}: plan exact, run raised {error}\n{plan}"
        assert_same(result, *tolerance)
        return plan
    row = next(r for r in plan.rows if not r.exact)
    refused = row.note.startswith("refused")
    # a layout the layers cannot join (a cat of bands of different rows), or with same_op=False a model's
    # own rank-local exception (einops on a band that is not whole windows): every rank raises it through
    # the forward guard, a DomainParallelError; a function without a rule: its ConversionError
    # a layer's own check of its input (a shard dim that is not spatial): its ValueError; a layout it cannot run
    # (a band with no output row, a halo wider than a band, a band of no row): its ConversionError
    expected = ConversionError if (refused and same_op) else (ConversionError, DomainParallelError, ValueError)
    assert isinstance(error, expected), f"{name} {shape} on {d}: plan says NO, run gave {error!r}\n{plan}"
    if same_op and refused:
        assert row.path.split(" (")[0] in str(error) and row.kind in str(error), (row, error)
    return plan


def refused_at_conversion(build, shape: tuple, manager) -> str | None:
    """describe()'s ConversionError where a model is refused before any forward (a module type), asserted to be what
    converting it raises on every rank; None when describe() makes a plan (then :func:`verdict_is_the_run`)."""
    try:
        describe(build().double(), shape, manager.domain_parallel_size)
    except ConversionError as exc:
        message = same_error_everywhere(manager.domain_group, lambda: convert_to_domain_parallel(build().double(), manager),
                                        ConversionError)
        assert message == str(exc), (message, str(exc))
        return message
    return None
