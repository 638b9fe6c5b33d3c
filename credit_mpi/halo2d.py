"""The 2-D halo exchange's names, kept where they were: it is the halo op's two phases now.

:func:`credit_mpi.halo_exchange` with ``dim`` (or ``halo_width``, or
``boundary``) a pair pads a block of a 2-D domain grid: latitude first
(``hy`` rows, ``lat_boundary``: any row of the boundary table,
``"earth"`` folding across the pole), then longitude on the
latitude-padded block (``hx`` columns, ``lon_boundary``: ``"periodic"``,
the default when ``boundary`` is a single string, ``"zero"`` or
``"reflect"``), corners included. Both are the one phase of
:mod:`credit_mpi.ops.halo` (:func:`~credit_mpi.ops.halo.pad_phase`), where
the plan (:class:`~credit_mpi.ops.halo.Plan2d`), the kernels and the
argument checks live.
"""

from __future__ import annotations

from .ops.halo import LON_BOUNDARIES, Plan2d, check_boundaries, check_widths, received_elements

__all__ = ["LON_BOUNDARIES", "check_widths", "check_boundaries", "received_elements", "Plan2d"]
