"""``HaloExchange``: the halo exchange as a ``torch.nn.Module`` (the reference package's name)."""

from __future__ import annotations

from typing import Any

import torch

from ..halo import check_boundary_name, check_width, halo_exchange
from ..manager import DomainParallelManager
from ..validation import check_int, check_transport
from .base import ManagerRef

__all__ = ["HaloExchange"]


class HaloExchange(torch.nn.Module):
    """Differentiable halo exchange as a module (the reference package's name).

    ``HaloExchange(halo_width, dim=-2, boundary="zero")(x)`` is
    :func:`credit_mpi.halo_exchange` with the global manager; pass
    ``manager=`` to use another one and ``transport="torch"`` to move the
    rows over the mirrored torch.distributed group. Typically followed by a
    convolution with no padding along ``dim`` (and circular padding along
    longitude); :meth:`trim` cuts rows off again, as CREDIT's does.

    With no manager, or a domain of one rank, the module still pads: the
    whole field is on this rank and gets its ``boundary`` rows (zeros for
    ``"zero"``), so a convolution with no padding along ``dim`` after it
    keeps the field's height on one rank as on many. CREDIT's
    ``HaloExchange.forward`` returns its input unchanged there (its layers
    then lose ``kernel - 1`` rows on one rank); code that wants that checks
    ``get_domain_parallel_manager()`` itself.
    """

    def __init__(
        self,
        halo_width: int,
        dim: int = -2,
        boundary: str = "zero",
        manager: DomainParallelManager | None = None,
        *,
        transport: str = "mpi",
    ) -> None:
        super().__init__()
        self.halo_width = check_width(halo_width)
        self.boundary = check_boundary_name(boundary)
        self.transport = check_transport(transport)
        self.dim = dim
        # through a ManagerRef, as every converted layer: deepcopy shares it, pickling names state_dict()
        self._manager_ref = ManagerRef(manager)

    @property
    def manager(self) -> DomainParallelManager | None:
        """The manager given at construction (None: the global one at each call)."""
        return self._manager_ref.manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with ``halo_width`` rows of the neighbouring bands (or of ``boundary``) on both sides of ``dim``.

        Collective over the domain group: every rank of it must call. See
        :func:`credit_mpi.halo_exchange` for the errors.
        """
        return halo_exchange(
            x, self.halo_width, self.dim, self.manager, boundary=self.boundary, transport=self.transport
        )

    @staticmethod
    def trim(x: Any, halo_before: int, halo_after: int, dim: int = -2) -> Any:
        """``x`` without its first ``halo_before`` and last ``halo_after`` entries along ``dim`` (a view).

        CREDIT's ``HaloExchange.trim``, with the same arguments and result,
        for torch tensors and numpy arrays: after a layer that kept the halo
        rows (a convolution with padding along ``dim``), this drops them.
        Local (no MPI call).

        Raises:
            ValueError: a negative count, or more rows trimmed than ``x`` has along ``dim``.
        """
        axis = dim % x.ndim
        total = x.shape[axis]
        before, after = check_int("halo_before", halo_before, minimum=0), check_int("halo_after", halo_after, minimum=0)
        if before + after > total:
            raise ValueError(
                f"HaloExchange.trim: halo_before={before} + halo_after={after} is more than the {total} entries of "
                f"dim {dim} (shape {tuple(x.shape)})"
            )
        index = [slice(None)] * x.ndim
        index[axis] = slice(before, total - after)
        return x[tuple(index)]

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, boundary={self.boundary!r}, transport={self.transport!r}"
