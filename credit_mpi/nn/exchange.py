"""``HaloExchange``: the halo exchange as a ``torch.nn.Module`` (the reference package's name)."""

from __future__ import annotations

import torch

from ..halo import check_boundary_name, check_width, halo_exchange
from ..manager import DomainParallelManager
from ..validation import check_transport

__all__ = ["HaloExchange"]


class HaloExchange(torch.nn.Module):
    """Differentiable halo exchange as a module (the reference package's name).

    ``HaloExchange(halo_width, dim=-2, boundary="zero")(x)`` is
    :func:`credit_mpi.halo_exchange` with the global manager; pass
    ``manager=`` to use another one and ``transport="torch"`` to move the
    rows over the mirrored torch.distributed group. Typically followed by a
    convolution with no padding along ``dim`` (and circular padding along
    longitude).
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
        self.dim, self.manager = dim, manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return halo_exchange(
            x, self.halo_width, self.dim, self.manager, boundary=self.boundary, transport=self.transport
        )

    def extra_repr(self) -> str:
        return f"halo_width={self.halo_width}, dim={self.dim}, boundary={self.boundary!r}, transport={self.transport!r}"
