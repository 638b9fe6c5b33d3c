"""The conformance checks every collective's test inherits (tests/ops/test_<op>.py).

A collective's test class says how to call its op on this rank's part and
what the single-process result is; :class:`Conformance` then checks, for
each form the op has (latitude bands, blocks of a 2-D grid):

* exactness: equal to the single-process result on even and uneven parts,
  for numpy arrays and torch tensors, float32 and float64 (bit for bit: a
  collective moves data, it does no arithmetic);
* agreement: each of the op's one-rank perturbations (an argument, the
  part's shape, dtype or kind given differently on the last rank only)
  makes every rank raise the same exception (type and message), and the
  ranks stay in step: the next good call works.

A new op gets both by inheriting and filling in :meth:`Conformance.call`,
:meth:`Conformance.expected` and :attr:`Conformance.perturbations`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import credit_mpi

torch = pytest.importorskip("torch")

KINDS = ("numpy", "torch")
DTYPES = ("float32", "float64")


def grid_for(n: int) -> tuple[int, int]:
    """A 2-D domain grid of ``n`` ranks with more than one column where ``n`` allows (1 rank: (1, 1))."""
    return (n // 2, 2) if n % 2 == 0 else (1, n)


def as_kind(a: np.ndarray, kind: str) -> Any:
    return torch.from_numpy(a.copy()) if kind == "torch" else a


def to_numpy(a: Any) -> np.ndarray:
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def agreed_failure(fn: Callable[[], Any], comm: MPI.Comm) -> tuple[str, str]:
    """Run ``fn`` on every rank; every rank must raise, the same type and message (returned)."""
    try:
        fn()
        mine = None
    except Exception as exc:  # noqa: BLE001 - compared across ranks below
        mine = (type(exc).__name__, str(exc))
    everyone = comm.allgather(mine)
    assert None not in everyone, f"some ranks did not raise: {everyone}"
    assert len(set(everyone)) == 1, f"ranks raised differently: {everyone}"
    return everyone[0]


class Conformance:
    """Base class of a collective's tests (see the module docstring). Subclasses set what is below."""

    forms: tuple[str, ...] = ("bands",)  # "bands" (dim -2) and/or "blocks" (dims (-2, -1) on a 2-D grid)
    kinds: tuple[str, ...] = KINDS  # the array kinds the op takes
    shape: tuple[int, ...] = (2, 3, 0, 0)  # the global field; the two split dims sized by :meth:`field_shape`

    def call(self, part: Any, manager: Any, form: str, **change: Any) -> Any:
        """The op on this rank's ``part`` (``change``: arguments given instead of the defaults)."""
        raise NotImplementedError

    def expected(self, field: np.ndarray, manager: Any, form: str) -> np.ndarray:
        """This rank's single-process result from the global ``field``."""
        raise NotImplementedError

    #: name -> (change to the arguments, change to the part), applied on the last rank only
    perturbations: dict[str, tuple[dict, Callable[[Any], Any] | None]] = {}

    # ------------------------------------------------------------------ the inherited checks

    def manager(self, make_manager: Callable, form: str) -> Any:
        n = MPI.COMM_WORLD.Get_size()
        return make_manager(n, domain_grid=grid_for(n)) if form == "blocks" else make_manager(n)

    def field_shape(self, manager: Any, uneven: bool) -> tuple[int, ...]:
        rows, cols = manager.domain_grid
        return self.shape[:-2] + (3 * rows + (rows > 1 and uneven), 4 * cols + (cols > 1 and uneven))

    def values(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """The global field's values (float64; integers where the op adds, so sums are exact in any order)."""
        return rng.standard_normal(shape)

    def part(self, field: Any, manager: Any, form: str) -> Any:
        """This rank's input: its band or block of the global field."""
        dim = (-2, -1) if form == "blocks" else -2
        return credit_mpi.shard_tensor(field, dim, manager, uneven=True)

    @pytest.mark.mpi
    @pytest.mark.parametrize("form", ["bands", "blocks"])
    def test_exact_for_every_kind_dtype_and_split(self, make_manager, form):
        if form not in self.forms:
            pytest.skip(f"{type(self).__name__} has no {form} form")
        manager = self.manager(make_manager, form)
        rng = np.random.default_rng(7)
        for uneven in (False, True):
            field = self.values(rng, self.field_shape(manager, uneven))
            for kind in self.kinds:
                for dtype in DTYPES:
                    f = field.astype(dtype)
                    got = self.call(self.part(as_kind(f, kind), manager, form), manager, form)
                    assert isinstance(got, torch.Tensor if kind == "torch" else np.ndarray), (kind, type(got))
                    got = to_numpy(got)
                    want = self.expected(f, manager, form)
                    assert got.dtype == want.dtype and got.shape == want.shape, (kind, dtype, uneven, got.shape, want.shape)
                    np.testing.assert_array_equal(got, want)

    @pytest.mark.mpi(min_size=2)
    @pytest.mark.parametrize("form", ["bands", "blocks"])
    def test_a_one_rank_perturbation_makes_every_rank_raise(self, make_manager, form):
        if form not in self.forms:
            pytest.skip(f"{type(self).__name__} has no {form} form")
        assert self.perturbations, f"{type(self).__name__} lists no perturbations"
        manager = self.manager(make_manager, form)
        comm = MPI.COMM_WORLD
        last = comm.Get_rank() == comm.Get_size() - 1
        field = self.values(np.random.default_rng(8), self.field_shape(manager, True))
        good = self.part(as_kind(field, self.kinds[0]), manager, form)
        for name, (change, mutate) in self.perturbations.items():
            part = mutate(good) if last and mutate is not None else good
            args = change if last else {}
            kind, message = agreed_failure(lambda: self.call(part, manager, form, **args), comm)  # noqa: B023
            assert kind in ("ValueError", "TypeError", "DomainParallelError"), (name, kind, message)
            np.testing.assert_array_equal(to_numpy(self.call(good, manager, form)), self.expected(field, manager, form))


def other_dtype(part: Any) -> Any:
    return part.astype(np.float32) if isinstance(part, np.ndarray) else part.float()


def other_kind(part: Any) -> Any:
    return torch.from_numpy(np.ascontiguousarray(part)) if isinstance(part, np.ndarray) else part.numpy()


def one_column_less(part: Any) -> Any:
    return part[..., :-1].copy() if isinstance(part, np.ndarray) else part[..., :-1].clone()


def one_channel_less(part: Any) -> Any:
    # numpy or torch alike: an error on the perturbed rank alone would leave the others waiting
    return part[:, :-1].copy() if isinstance(part, np.ndarray) else part[:, :-1].clone()


#: the perturbations of a part every collective on bands/blocks refuses
PART_PERTURBATIONS = {
    "dtype": ({}, other_dtype),
    "kind": ({}, other_kind),
    "a dim other than the split ones": ({}, one_channel_less),
}
