"""The model side's public exceptions (exported from :mod:`credit_mpi.nn`)."""

from __future__ import annotations

from ..validation import DomainParallelError

__all__ = ["ConversionError", "DomainParallelError"]


class ConversionError(DomainParallelError):
    """A module the converter has no exact rule for (raised on every rank), or a layout a layer cannot run."""
