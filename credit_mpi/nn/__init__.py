"""credit_mpi.nn: the model side (imports torch; load it on demand, ``import credit_mpi`` does not)."""

from .training import (
    LatitudeWeightedMSELoss,
    clip_grad_norm_,
    global_loss,
    latitude_weighted_metrics,
    latitude_weighted_mse,
    latitude_weights,
)

__all__ = [
    "latitude_weights",
    "latitude_weighted_mse",
    "LatitudeWeightedMSELoss",
    "global_loss",
    "latitude_weighted_metrics",
    "clip_grad_norm_",
]
