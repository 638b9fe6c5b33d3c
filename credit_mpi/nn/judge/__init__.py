"""The judge of custom forwards: every torch function a converted forward applies to a band, judged by its rule.

* :mod:`~credit_mpi.nn.judge.tracker`: the ``TorchFunctionMode`` that follows
  each tensor's placement through one forward (and describe()'s dry run)
  and asks the registry for the rule of every function that touches a band;
* :mod:`~credit_mpi.nn.judge.registry`: :func:`rule` (one per torch function
  name, a duplicate raises), :func:`wraps` (a rule around another family's),
  :class:`Refusal` (a rule's reason to refuse);
* one module per family of rules: :mod:`~credit_mpi.nn.judge.pointwise`,
  :mod:`~credit_mpi.nn.judge.reductions`, :mod:`~credit_mpi.nn.judge.shapes`,
  :mod:`~credit_mpi.nn.judge.indexing`, :mod:`~credit_mpi.nn.judge.conv_pool`,
  :mod:`~credit_mpi.nn.judge.rows`, :mod:`~credit_mpi.nn.judge.attention`,
  :mod:`~credit_mpi.nn.judge.spectral`;
* :mod:`~credit_mpi.nn.judge.recompute`: a recomputation in backward (activation checkpointing)
  judged as its forward; a custom autograd Function whose forward moves rows refused.
* :mod:`~credit_mpi.nn.judge.longitude`: on a latitude x longitude grid, the longitude's own tracker.

Importing this package registers every rule (:mod:`credit_mpi.nn` imports it).
"""

from . import (  # noqa: F401 - each family registers its rules at import
    attention,
    conv_pool,
    indexing,
    longitude,
    pointwise,
    recompute,
    reductions,
    rows,
    shapes,
    spectral,
)
from .registry import DuplicateRule, Refusal, check_wrappers, rule, wraps
from .tracker import Extent, Sharded, Tracker, active_tracker

check_wrappers()

__all__ = ["rule", "wraps", "Refusal", "DuplicateRule", "Tracker", "Sharded", "Extent", "active_tracker"]
