"""The judge's walk over a call's arguments (run for every judged op) finds what pytree finds, in its order."""

import collections

import torch
from torch.utils._pytree import tree_flatten

from credit_mpi.nn.judge.registry import leaves_in, tensors_in
from credit_mpi.nn.judge.tracker import Extent

Pair = collections.namedtuple("Pair", "a b")


def _trees():
    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4.0)
    yield ()
    yield (a,)
    yield ((a, b), {"x": c, "dim": 1})
    yield ([a, (b, [c])], {"size": torch.Size([2, 3]), "bias": None, "mode": "nearest", "scale": 2.0})
    yield ((a, Pair(b, c)), {"d": collections.OrderedDict(z=c, y=a)})
    yield ((torch.max(c, 0), slice(1, 2), ...), {"dtype": torch.float32, "device": torch.device("cpu")})
    yield ((a, Extent(7, (3, 4)), -1), {"dims": [Extent(2), 3], "flag": True})
    yield ({"nested": {"k": [a, {"j": b}]}},)


def test_tensors_in_matches_pytree():
    for tree in _trees():
        want = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
        got = tensors_in(tree)
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True)), tree


def test_leaves_in_matches_pytree():
    for tree in _trees():
        want, got = tree_flatten(tree)[0], leaves_in(tree)
        assert len(got) == len(want), tree
        for g, w in zip(got, want, strict=True):
            assert g is w or (type(g) is type(w) and g == w), (tree, g, w)
        # an Extent stays an Extent (the pointwise rule refuses a block's size by it)
        assert [type(v) for v in got] == [type(v) for v in want]


# -- the pointwise fast path places what the rule places, and leaves every refusal to the rule ----------------

import pytest  # noqa: E402

from credit_mpi.nn import ConversionError  # noqa: E402
from credit_mpi.nn.judge import pointwise, registry  # noqa: E402
from credit_mpi.nn.judge.tracker import Sharded, Tracker  # noqa: E402


def _calls():
    w = torch.randn(3, 1, 1)
    yield "band + band", lambda x, y, r: x + y
    yield "band * number", lambda x, y, r: x * 2.0
    yield "number - band", lambda x, y, r: 1 - x
    yield "band * channel weight", lambda x, y, r: x * w
    yield "sigmoid", lambda x, y, r: torch.sigmoid(x)
    yield "in place", lambda x, y, r: x.clone().mul_(y)
    yield "where", lambda x, y, r: torch.where(x > 0, x, y)
    yield "clamp by keyword", lambda x, y, r: torch.clamp(x, min=0.0)
    yield "permuted band + band", lambda x, y, r: x.transpose(-1, -2) + y
    yield "band + band of one row", lambda x, y, r: x + r
    yield "band + size read from it", lambda x, y, r: x * x.shape[-2]
    yield "band to dtype", lambda x, y, r: x.to(torch.float64)


def _run(call, fast: bool):
    root = torch.nn.Identity()
    saved = pointwise._pointwise.fast
    pointwise._pointwise.fast = saved if fast else None
    registry._BY_FUNC.clear()
    try:
        x, y, r = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 1, 5)
        with Tracker(root, -2, band_sizes=lambda rows: [rows // 2, rows - rows // 2]) as tr:
            tr.mark_inputs((x, y, r))
            try:
                out = call(x, y, r)
            except ConversionError as e:
                return "refused", str(e).split(":")[0]
            return "placed", tr.get(out), tuple(out.shape)
    finally:
        pointwise._pointwise.fast = saved
        registry._BY_FUNC.clear()


@pytest.mark.parametrize("name,call", list(_calls()), ids=[n for n, _ in _calls()])
def test_pointwise_fast_path_is_the_rule(name, call):
    with_fast, without = _run(call, True), _run(call, False)
    assert with_fast == without
    if name in ("band + band", "band * channel weight", "sigmoid", "in place"):
        assert with_fast[1] == Sharded(2)
    if name == "band + band of one row":
        assert with_fast[0] == "refused"
