"""Dropout on bands: refused in training, the identity in eval.

``nn.Dropout`` draws its mask from the rank's generator. On bands each rank
would draw the mask of its own band, and with the same seed on every rank
(what data-parallel training asks for) equal band positions draw the same
mask: the pattern repeats across latitude, and no layout gives one
process's result. So a converted ``nn.Dropout`` / ``nn.AlphaDropout`` (and
the channel dropouts ``nn.Dropout1d/2d/3d``, whose mask of whole channels each
band would draw on its own too) with ``p > 0`` raises :class:`ConversionError`
in training mode (on every rank: the converted forward shares it), and is the
identity in eval mode or with ``p == 0`` (exact), on any placement of its input.

The way out, when band-local masks are acceptable:
``custom_converters={nn.Dropout: credit_mpi.nn.keep_local}`` keeps the
module as it is; then seed each domain rank differently (for instance
``torch.manual_seed(seed + manager.domain_rank)`` before the step), or the
masks repeat across bands.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import DomainParallelModule
from .errors import ConversionError
from .rules import layer_rule
from .traffic import Traffic

__all__ = ["DomainParallelDropout", "DomainParallelAlphaDropout", "DomainParallelDropout1d", "DomainParallelDropout2d",
           "DomainParallelDropout3d", "dropout_refusal", "is_identity"]


def dropout_refusal(module: nn.Module) -> str:
    """Why ``module`` cannot run now ("" when it can: eval mode, ``p == 0``, or no bands)."""
    if not module.training or module.p == 0:
        return ""
    return (
        f"{module.dp_path} ({type(module).__name__.replace('DomainParallel', '')}, p={module.p}): dropout in training "
        f"draws each band's mask on its own rank (with one seed on every rank the pattern repeats across latitude): "
        f"no exact rule. Convert with custom_converters={{nn.{type(module).__name__.replace('DomainParallel', '')}: "
        f"credit_mpi.nn.keep_local}} to accept band-local masks (then seed each domain rank differently), or use p=0"
    )


def is_identity(module: nn.Module) -> bool:
    """True when the dropout is the identity now (eval mode or ``p == 0``): exact on any placement of its input."""
    return not (module.training and module.p)


class _DropoutMixin(DomainParallelModule):
    def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
        """The identity (eval, p=0) after dp_local: nothing, no agreement."""
        return lambda rank: Traffic()

    def dp_refusal(self, n, grid):
        """Training dropout on bands (one band: the one process's draw)."""
        return dropout_refusal(self) if n > 1 or grid is not None else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_local(x):
            return super().forward(x)
        why = dropout_refusal(self)
        if why:
            raise ConversionError(why)
        return super().forward(x)  # eval or p == 0: the identity


@layer_rule(nn.Dropout, identity=is_identity)
class DomainParallelDropout(_DropoutMixin, nn.Dropout):
    """``nn.Dropout`` on bands: refused in training (see the module docstring), the identity in eval."""


@layer_rule(nn.AlphaDropout, identity=is_identity)
class DomainParallelAlphaDropout(_DropoutMixin, nn.AlphaDropout):
    """``nn.AlphaDropout`` on bands: refused in training, the identity in eval."""


@layer_rule(nn.Dropout1d, identity=is_identity)
class DomainParallelDropout1d(_DropoutMixin, nn.Dropout1d):
    """``nn.Dropout1d`` (whole channels) on bands: refused in training with ``p > 0``, else the identity."""


@layer_rule(nn.Dropout2d, identity=is_identity)
class DomainParallelDropout2d(_DropoutMixin, nn.Dropout2d):
    """``nn.Dropout2d`` (whole channels) on bands: refused in training with ``p > 0``, else the identity."""


@layer_rule(nn.Dropout3d, identity=is_identity)
class DomainParallelDropout3d(_DropoutMixin, nn.Dropout3d):
    """``nn.Dropout3d`` (whole channels) on bands: refused in training with ``p > 0``, else the identity."""
