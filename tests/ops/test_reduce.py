"""reduce_gradients (credit_mpi.ops.reduce): the conformance checks, inherited.

A rank's "part" is a parameter whose gradient is its band of the field times (rank + 1); the
result is that gradient summed over the domain group (integer values: exact in any order).
"""

from __future__ import annotations

import numpy as np

import credit_mpi

from .conformance import Conformance, torch


class TestReduceGradients(Conformance):
    kinds = ("torch",)

    def values(self, rng, shape):
        return rng.integers(-8, 8, shape).astype(np.float64)

    def part(self, field, manager, form):
        p = torch.nn.Parameter(torch.zeros(field.shape[:-2] + (3, 4), dtype=field.dtype))
        p.grad = field[..., :3, :4].clone() * (manager.domain_rank + 1)
        return [p]

    def call(self, part, manager, form, **change):
        params = [torch.nn.Parameter(p.detach().clone()) for p in part]
        for new, old in zip(params, part, strict=True):
            new.grad = None if old.grad is None else old.grad.clone()
        credit_mpi.reduce_gradients(params, manager, **change)
        return params[0].grad

    def expected(self, field, manager, form):
        n = manager.domain_parallel_size
        return field[..., :3, :4] * (n * (n + 1) // 2)

    perturbations = {
        "over": ({"over": "domain_only"}, None),
        "over on one rank": ({"over": "data_parallel"}, None),
        "a gradient missing": ({}, lambda part: [torch.nn.Parameter(part[0].detach().clone())]),
        "dtype": ({}, lambda part: [_with_grad(part[0].grad.float())]),
    }


def _with_grad(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p
