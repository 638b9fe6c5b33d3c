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
