"""Shifted and re-banded windows: the cyclic shift across bands (``torch.roll``), re-banding to whole windows, Swin-style attention.

Every collective is exact against one process (forward and gradient, float64) on even and uneven
bands; every model case is exact wherever ``describe()`` says so and refused on every rank where it
does not (tests/verdict_reference.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from credit_mpi.ops.reband import reband, whole_windows  # noqa: E402
from credit_mpi.ops.roll import roll_along  # noqa: E402



def raised_everywhere(world, fn):
    """Call ``fn`` on every rank; every rank raised, an exception of the same type (returns its message)."""
    try:
        fn()
        got = None
    except Exception as exc:  # noqa: BLE001 - compared below
        got = exc
    names = world.allgather(None if got is None else type(got).__name__)
    assert None not in names and len(set(names)) == 1, names
    return str(got)


def layouts(n):
    """Band sizes on ``n`` ranks: even, uneven, one empty band (n > 1)."""
    out = [[3] * n, [3 + (r % 2) for r in range(n)]]
    if n > 1:
        out.append([0] + [4] * (n - 1))
    return out


def field(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, sum(sizes), 3, dtype=torch.float64, generator=g)


def mine(whole, sizes, rank):
    start = sum(sizes[:rank])
    return whole[:, start : start + sizes[rank]]


def check_move(world, sizes_in, sizes_out, fn, ref):
    """``fn(band)`` on every rank equals this rank's band (layout ``sizes_out``) of ``ref(field)``; so does the gradient."""
    rank = world.Get_rank()
    whole = field(sizes_in).requires_grad_()
    weight = field(sizes_out, seed=1)
    x = mine(whole.detach(), sizes_in, rank).clone().requires_grad_()
    y = fn(x)
    expected = ref(whole)
    assert torch.equal(y, mine(expected.detach(), sizes_out, rank))
    (y * mine(weight, sizes_out, rank)).sum().backward()
    (expected * weight).sum().backward()
    assert torch.equal(x.grad, mine(whole.grad, sizes_in, rank))


@pytest.mark.mpi
def test_roll_along_is_torch_roll_of_the_field(world):
    n = world.Get_size()
    for sizes in layouts(n):
        total = sum(sizes)
        for shift in (1, -1, 4, -5, total + 2, 0):  # beyond one band: rows from several ranks
            check_move(world, sizes, sizes, lambda x, s=shift: roll_along(x, s, 1, world),
                       lambda f, s=shift: torch.roll(f, s, 1))


@pytest.mark.mpi
def test_reband_moves_rows_to_the_target_layout_and_back(world):
    n = world.Get_size()
    for sizes in layouts(n):
        target = whole_windows(sizes, 2)
        assert sum(target) == sum(sizes) and all(sum(target[: r + 1]) % 2 == 0 for r in range(n - 1))
        check_move(world, sizes, target, lambda x: reband(x, 1, world, window=2), lambda f: f * 1)
        back = list(reversed(sizes)) if n > 1 else sizes
        check_move(world, sizes, back, lambda x, b=back: reband(x, 1, world, sizes=b), lambda f: f * 1)


def test_whole_windows_rounds_every_band_end():
    assert whole_windows([3, 3, 2], 2) == (4, 2, 2)
    assert whole_windows([3, 3, 3], 4) == (4, 4, 1)
    assert whole_windows([1, 1, 7], 4) == (0, 4, 5)  # ends 1, 2, 9: 1 rounds down, 2 (a tie) up
    assert whole_windows([1, 0, 8], 4) == (0, 0, 9)  # a band left with no rows
    assert whole_windows([4, 4], 4) == (4, 4)
    with pytest.raises(ValueError, match="at least one row"):
        whole_windows([2, 2], 0)


@pytest.mark.mpi
def test_bad_moves_raise_on_every_rank(world):
    rank, n = world.Get_rank(), world.Get_size()
    x = field([3] * n)[:, :3]
    assert "not a layout" in raised_everywhere(world, lambda: reband(x, 1, world, sizes=[3] * n + [1]))
    shift = "1" if rank == n - 1 else 1  # one rank's bad argument: every rank raises
    assert "shift must be an int" in raised_everywhere(world, lambda: roll_along(x, shift, 1, world))
    if n > 1:  # ranks that disagree on the shift
        assert "roll_along" in raised_everywhere(world, lambda: roll_along(x, rank, 1, world))
    assert roll_along(x, 1, 1, world).shape == x.shape  # still in step
