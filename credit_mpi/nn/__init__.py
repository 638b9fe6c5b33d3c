"""The model side: run an existing torch model on latitude bands, exact against one process.

``convert_to_domain_parallel(model, manager)`` replaces each layer that mixes
rows along the sharded dim by a ``DomainParallel*`` wrapper (same parameters,
same ``state_dict`` keys) and refuses what it has no rule for;
``describe(model, input_shape, domain_size)`` prints the plan (halo rows, what each rank sends,
stride alignment, minimum band height) before any data moves.

The training-loop helpers (latitude weights, the band-share loss, global
metrics, ``clip_grad_norm_``) live in :mod:`credit_mpi.nn.training`;
checkpoints that resume bit for bit (``save_checkpoint``,
``load_checkpoint``) in :mod:`credit_mpi.nn.checkpoint`.

Importing this subpackage imports torch (``import credit_mpi`` does not).
"""

from . import judge  # noqa: F401 - registers the judge's rules for custom forwards
from .checkpoint import load_checkpoint, save_checkpoint
from .conv import (
    DomainParallelConv1d,
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose1d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelPeriodicConv2d,
)
from .convert import convert_to_domain_parallel, keep_local
from .dropout import (
    DomainParallelAlphaDropout,
    DomainParallelDropout,
    DomainParallelDropout1d,
    DomainParallelDropout2d,
    DomainParallelDropout3d,
)
from .errors import ConversionError
from .exchange import HaloExchange
from .norm import (
    DomainParallelBatchNorm1d,
    DomainParallelBatchNorm2d,
    DomainParallelBatchNorm3d,
    DomainParallelGroupNorm,
    DomainParallelInstanceNorm1d,
    DomainParallelInstanceNorm2d,
    DomainParallelInstanceNorm3d,
    DomainParallelLayerNorm,
)
from .outside import Band
from .plan import GridPlan, Plan, PlanRow, describe
from .resample import (
    DomainParallelAdaptiveAvgPool1d,
    DomainParallelAdaptiveAvgPool2d,
    DomainParallelAdaptiveAvgPool3d,
    DomainParallelAvgPool1d,
    DomainParallelAvgPool2d,
    DomainParallelAvgPool3d,
    DomainParallelInterpolate,
    DomainParallelMaxPool1d,
    DomainParallelMaxPool2d,
    DomainParallelMaxPool3d,
    DomainParallelUpsample,
)
from .traffic import Traffic
from .training import (
    LatitudeWeightedMSELoss,
    clip_grad_norm_,
    global_loss,
    latitude_weighted_metrics,
    latitude_weighted_mse,
    latitude_weights,
)
from .validate import validate_sharding_constraints

__all__ = [
    "convert_to_domain_parallel",
    "HaloExchange",
    "keep_local",
    "describe",
    "validate_sharding_constraints",
    "Plan",
    "PlanRow",
    "Traffic",
    "GridPlan",
    "ConversionError",
    "Band",
    "DomainParallelConv1d",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose1d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
    "DomainParallelGroupNorm",
    "DomainParallelInstanceNorm1d",
    "DomainParallelInstanceNorm2d",
    "DomainParallelInstanceNorm3d",
    "DomainParallelLayerNorm",
    "DomainParallelBatchNorm1d",
    "DomainParallelBatchNorm2d",
    "DomainParallelBatchNorm3d",
    "DomainParallelUpsample",
    "DomainParallelInterpolate",
    "DomainParallelMaxPool1d",
    "DomainParallelMaxPool2d",
    "DomainParallelMaxPool3d",
    "DomainParallelAvgPool1d",
    "DomainParallelAvgPool2d",
    "DomainParallelAvgPool3d",
    "DomainParallelAdaptiveAvgPool1d",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAdaptiveAvgPool3d",
    "DomainParallelDropout",
    "DomainParallelAlphaDropout",
    "DomainParallelDropout1d",
    "DomainParallelDropout2d",
    "DomainParallelDropout3d",
    "latitude_weights",
    "latitude_weighted_mse",
    "LatitudeWeightedMSELoss",
    "global_loss",
    "latitude_weighted_metrics",
    "clip_grad_norm_",
    "save_checkpoint",
    "load_checkpoint",
]
