"""agreement.agree_values, the one "every rank must have the same values": and the callers moved onto it.

A value that differs on one rank (or a compute() that raises there) is the same exception on every
rank, with the caller's message; Free parts are carried, not compared; the counts carry one int each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from credit_mpi.agreement import DomainParallelError, Free, agree_values
from credit_mpi.nn import latitude_weighted_metrics

from .ops.conformance import agreed_failure


def _explain(values):
    raise ValueError(f"test: values differ: {values}")


@pytest.mark.mpi
def test_equal_values_agree_and_counts_carry_one_int_each():
    comm = MPI.COMM_WORLD
    value, counts = agree_values(comm, "test", lambda: {"a": (1, 2.5), "x": np.arange(3), "mine": Free(comm.rank)},
                                 _explain, count=lambda v: 10 * v["mine"].value)
    assert value["a"] == (1, 2.5) and value["mine"].value == comm.rank
    assert counts == [10 * r for r in range(comm.Get_size())]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["a value", "array bytes", "raises", "another agreement"])
def test_one_rank_different_raises_on_every_rank(how):
    comm = MPI.COMM_WORLD
    last = comm.rank == comm.Get_size() - 1
    array = np.arange(2000.0)  # longer than numpy's repr shows: compared by its bytes

    def compute():
        if how == "raises" and last:
            raise TypeError("bad on the last rank")
        if how == "array bytes":
            return {"x": array + (1e-9 if last else 0.0)}
        return {"a": 2 if last and how == "a value" else 1}

    what = "other" if how == "another agreement" and last else "test"
    kind, message = agreed_failure(lambda: agree_values(comm, what, compute, _explain), comm)
    expected = {"a value": "ValueError", "array bytes": "ValueError", "raises": "TypeError",
                "another agreement": DomainParallelError.__name__}[how]
    assert kind == expected, (kind, message)
    assert agree_values(comm, "test", lambda: 1, _explain)[0] == 1  # in step afterwards


@pytest.mark.mpi(min_size=2)
def test_metrics_statistics_of_another_shape_on_one_rank(make_manager):
    comm = MPI.COMM_WORLD
    manager = make_manager(comm.Get_size())
    channels = 3 if comm.rank == comm.Get_size() - 1 else 2
    pred = torch.ones(1, channels, 4, 5, dtype=torch.float64)
    weights = torch.ones(4, 1, dtype=torch.float64)
    kind, message = agreed_failure(lambda: latitude_weighted_metrics(pred, pred, weights, manager, check=True), comm)
    assert kind == "ValueError" and "latitude_weighted_metrics: ranks of" in message and "disagree" in message, message
