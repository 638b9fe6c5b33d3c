"""Row moves (credit_mpi.ops.rows: one op, named row maps): the conformance checks, inherited, for every map.

Each map (the cyclic shift, the reversal, a re-band, the group layout) is one subclass of
:class:`RowMoveConformance`, which adds to the collectives' checks (exact on even and uneven bands,
a one-rank perturbation raised on every rank):

* the adjoint: the gradient of the band is the band of the field's gradient (the move back);
* the traffic: what a counting communicator sees the move send, forward and backward, is what
  describe() counts for it (:func:`credit_mpi.ops.rows.moves_of`, :func:`credit_mpi.nn.traffic.move_traffic`);
* a bad parameter on one rank, or a map name that is no map, is every rank's exception.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi.layout import split
from credit_mpi.nn.traffic import Traffic, move_traffic, row_bytes
from credit_mpi.ops.group_rows import group_sizes, to_groups
from credit_mpi.ops.reband import reband
from credit_mpi.ops.rows import ROW_MAPS, flip_along, move_along, moves_of, roll_along, row_map

from ..test_describe_traffic import counting
from .conformance import Conformance, agreed_failure, one_channel_less, other_dtype, to_numpy, torch


def _band(whole, sizes, rank):
    start = sum(sizes[:rank])
    return whole[..., start : start + sizes[rank], :]


class RowMoveConformance(Conformance):
    """A row map's tests: say how to move a band (:meth:`move`) and what the field becomes (:meth:`reference`)."""

    kinds = ("torch",)
    shape = (2, 3, 0, 0)
    name = ""  # the row map
    params: dict = {}  # its parameters

    def move(self, part, comm, **change):
        return move_along(part, self.name, -2, comm, **{**self.params, **change})

    def reference(self, field):
        """The moved field (torch, differentiable) and its layout for ``n`` ranks: ``(tensor, sizes(n, field rows))``."""
        raise NotImplementedError

    def out_sizes(self, rows: int, n: int) -> list[int]:
        return split(rows, n, uneven=True)

    def call(self, part, manager, form, **change):
        return self.move(part, manager.domain_group, **change)

    def expected(self, field, manager, form):
        n, rank = manager.domain_parallel_size, manager.domain_rank
        moved = to_numpy(self.reference(torch.from_numpy(np.asarray(field))))
        return _band(moved, self.out_sizes(field.shape[-2], n), rank)

    @pytest.mark.mpi
    def test_the_adjoint_is_the_move_back(self, make_manager):
        manager = make_manager()
        n, rank, comm = manager.domain_parallel_size, manager.domain_rank, manager.domain_group
        rows = self.field_shape(manager, True)[-2]
        whole = torch.randn(2, 3, rows, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        whole.requires_grad_()
        moved = self.reference(whole)
        weight = torch.randn(moved.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        (moved * weight).sum().backward()
        x = _band(whole.detach(), split(rows, n, uneven=True), rank).clone().requires_grad_()
        y = self.move(x, comm)
        (y * _band(weight, self.out_sizes(rows, n), rank)).sum().backward()
        assert torch.equal(x.grad, _band(whole.grad, split(rows, n, uneven=True), rank))

    @pytest.mark.mpi(min_size=2)
    def test_the_traffic_is_what_describe_counts(self, make_manager):
        manager = make_manager()
        n, rank = manager.domain_parallel_size, manager.domain_rank
        rows = self.field_shape(manager, True)[-2]
        sizes = split(rows, n, uneven=True)
        x = torch.randn(2, 3, sizes[rank], 4, dtype=torch.float64).requires_grad_()
        self.move(x, manager.domain_group)  # the plan remembered: the counted call repeats it
        with counting(manager) as comm:
            comm.phase = "forward"
            y = self.move(x, comm)
            comm.phase = "backward"
            y.sum().backward()
            comm.phase = None
        counted = comm.counts
        _, _, moves = moves_of(self.name, tuple(sizes), **self.params)
        want = move_traffic(moves, n, row_bytes((2, 3, rows, 4), 2, 8), True)[rank]
        got = counted.get("forward", Traffic()) + counted.get("backward", Traffic())
        assert (got.forward_bytes, got.agreements) == (want.forward_bytes + want.backward_bytes, want.agreements), (
            counted, want)


class TestRoll(RowMoveConformance):
    name, params = "roll_along", {"shift": 5}

    def move(self, part, comm, **change):
        return roll_along(part, change.get("shift", 5), -2, comm, **{k: v for k, v in change.items() if k != "shift"})

    def reference(self, field):
        return torch.roll(field, 5, -2)

    perturbations = {"dtype": ({}, other_dtype), "a channel less": ({}, one_channel_less),
                     "shift": ({"shift": 4}, None), "shift type": ({"shift": 1.5}, None), "path": ({"path": "x"}, None)}


class TestFlip(RowMoveConformance):
    name = "flip_along"

    def move(self, part, comm, **change):
        return flip_along(part, -2, comm, **change)

    def reference(self, field):
        return torch.flip(field, (-2,))

    perturbations = {"dtype": ({}, other_dtype), "a channel less": ({}, one_channel_less),
                     "transport": ({"transport": "nccl"}, None), "path": ({"path": "x"}, None)}


class TestReband(RowMoveConformance):
    """Every band's rows moved to the reversed layout (the last ranks' sizes first)."""

    name = "reband"

    @property
    def params(self):
        return {"target": (None, 2, None)}  # whole windows of two rows

    def move(self, part, comm, **change):
        return reband(part, -2, comm, window=change.pop("window", 2), **change)

    def out_sizes(self, rows, n):
        from credit_mpi.ops.reband import whole_windows

        return list(whole_windows(split(rows, n, uneven=True), 2))

    def reference(self, field):
        return field * 1

    perturbations = {"dtype": ({}, other_dtype), "window": ({"window": 3}, None),
                     "sizes and window": ({"sizes": (1,)}, None)}


class TestGroups(RowMoveConformance):
    """The group layout of windows of 3 rows (the heights are multiples of 3: the model asks for that)."""

    name = "to_groups"
    params = {"window": 3, "least": 0}

    def field_shape(self, manager, uneven):
        n = manager.domain_parallel_size
        return self.shape[:-2] + (3 * (2 * n + uneven), 4)

    def move(self, part, comm, **change):
        return to_groups(part, -2, change.pop("window", 3), comm, **change)

    def out_sizes(self, rows, n):
        return list(group_sizes(rows, 3, n))

    def reference(self, field):
        rows = field.shape[-2]
        h = rows // 3
        n = MPI.COMM_WORLD.Get_size()
        order = [i1 * h + j for start, g in zip(np.cumsum([0] + split(h, n, uneven=True)), split(h, n, uneven=True),
                                                strict=False) for i1 in range(3) for j in range(start, start + g)]
        return field[..., order, :]

    perturbations = {"dtype": ({}, other_dtype), "window": ({"window": 1}, None), "least": ({"least": 99}, None),
                     "window type": ({"window": 3.0}, None)}


@pytest.mark.mpi
def test_a_name_that_is_no_map_is_every_ranks_error(world):
    x = torch.zeros(1, 3, 2, dtype=torch.float64)
    kind, message = agreed_failure(lambda: move_along(x, "shuffle", 1, world), world)
    assert kind == "ValueError" and "no row map 'shuffle'" in message and "roll_along" in message


def test_a_map_name_is_registered_once():
    with pytest.raises(ValueError, match="'flip_along' is registered already"):
        row_map("flip_along", "again")(lambda counts, path: (counts, counts, lambda j: j))
    assert {"roll_along", "flip_along", "reband", "to_groups", "from_groups"} <= set(ROW_MAPS)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "complex128"])
def test_a_move_carries_half_and_complex_bytes(world, dtype):
    """A row move is bytes, no arithmetic: a bf16 model's join re-bands its bf16 bands (examples/train_unet.py --bf16
    used to fail there with "float32/float64 tensors"), a spectrum its complex rows; bit for bit, gradient too."""
    n, rank = world.Get_size(), world.Get_rank()
    field = torch.arange(2 * 7 * 3, dtype=torch.float64).reshape(2, 7, 3)
    field = (field + 1j * field if dtype == "complex128" else field).to(getattr(torch, dtype))
    sizes = split(7, n, uneven=True)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    part = field[:, rows].clone().requires_grad_(dtype != "complex128")
    moved = roll_along(part, 3, 1, world)
    want = torch.roll(field, 3, 1)[:, rows]
    assert moved.dtype == field.dtype and torch.equal(moved, want)
    if part.requires_grad:
        moved.backward(torch.ones_like(moved))
        assert torch.equal(part.grad, torch.ones_like(part))
