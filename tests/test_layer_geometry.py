"""A layer's row geometry and traffic are written once, on its class (issue 23, item 6).

``describe()`` (credit_mpi/nn/plan.py) and the traffic count (traffic.py) read
``dp_geometry`` / ``dp_traffic`` / ``dp_refusal`` / ``dp_replicated`` of the layer: neither names a
layer type, so a new layer is its class, its ``layer_rule``, its geometry, and a test (the toy below).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from torch import nn

import credit_mpi.nn as cnn
from credit_mpi.nn import geometry, rules
from credit_mpi.nn.base import DomainParallelModule
from credit_mpi.nn.traffic import Traffic, halo_rule, row_bytes

NN = Path(cnn.__file__).resolve().parent
LAYER_MODULES = {"conv", "resample", "norm", "dropout", "attention", "exchange"}


def _imported(path: Path) -> set[str]:
    """The credit_mpi.nn submodules a module imports (``from . import x`` and ``from .x import y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [a.name for a in node.names])
    return found


@pytest.mark.parametrize("name", ["plan.py", "traffic.py"])
def test_plan_and_traffic_name_no_layer_type(name):
    src = (NN / name).read_text()
    layer_imports = {m for m in _imported(NN / name) if m.split(".")[0] in LAYER_MODULES} - {"exchange"}
    assert not layer_imports, f"{name} imports layer modules {layer_imports}: read the layer's dp_geometry/dp_traffic"
    named = set(re.findall(r"\b(_\w+Mixin|DomainParallel(?!Module\b|Manager\b)\w+)\b", src))
    assert not named, f"{name} names layer classes {named}"


class PairSum(nn.Module):
    """A toy torch layer: row i of the output is rows i and i + 1 of the input summed (one row fewer)."""

    def forward(self, x):
        return x[..., :-1, :] + x[..., 1:, :]


def _toy_layer():
    """Its domain-parallel layer: only the class, its rule and its geometry (the dry run calls the local forward)."""

    class DomainParallelPairSum(DomainParallelModule, PairSum):
        def dp_geometry(self, sizes, sd, h_out=None):
            return geometry.RowGeometry(geometry.conv_layout(sizes, 2, 1, 1, 0, 0), 1, "zero", "toy: one row after")

        def dp_traffic(self, shape_in, shape_out, dtype, axis, n, width, grad, weight_grad):
            return halo_rule(n, width, row_bytes(shape_in, axis, dtype.itemsize), "zero", grad)

    return rules.layer_rule(PairSum)(DomainParallelPairSum)


@pytest.fixture
def toy():
    cls = _toy_layer()
    yield cls
    rules.RULES.pop(PairSum, None)


def test_a_toy_layer_shows_up_in_describe(toy):
    model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), PairSum()).double()
    plan = cnn.describe(model, (1, 1, 10, 4), 3)
    row = plan.rows[-1]
    assert row.kind == "PairSum"
    assert (row.rows_in, row.rows_out, row.bands_in) == (10, 9, (4, 3, 3))
    assert (row.halo_before, row.halo_after, row.exact) == (0, 1, True)
    assert row.note == "toy: one row after"
    assert sum(row.bands_out) == 9
    row_b = 4 * 8  # one row: 1 x 1 x 4 float64
    # a one-row halo with each neighbour (the layout's symmetric width), the same back (the conv's output needs grad)
    one, two = Traffic(row_b, 1, row_b, 1, 1), Traffic(2 * row_b, 2, 2 * row_b, 2, 1)
    assert row.traffic == (one, two, one)
    assert "PairSum" in str(plan)


def test_a_toy_layers_layout_problem_is_reported(toy):
    row = cnn.describe(nn.Sequential(PairSum()).double(), (1, 1, 3, 4), 3).rows[-1]
    assert (row.bands_in, row.exact, row.traffic) == ((1, 1, 1), False, None)
    assert "domain rank 2 (rows 2:3) would compute no output row (of 2)" in row.note
