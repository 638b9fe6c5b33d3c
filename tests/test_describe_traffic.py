"""describe() shows the traffic (issue 26, item 3): its bytes and messages are what the run sends, rank by rank.

A counting communicator (the domain group, subclassed: every MPI call the
layers make goes through it) records what each rank sends in a training
step after the first; the plan's numbers (:mod:`credit_mpi.nn.traffic`)
must equal it per layer (forward) and in total (forward, backward,
agreements), on 2-4 ranks, even and uneven bands.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import convert_to_domain_parallel, describe  # noqa: E402
from credit_mpi.nn.traffic import Traffic  # noqa: E402

from .halo_reference import band, prefix_managers  # noqa: E402


def _nbytes(buf) -> int:
    """Bytes of an mpi4py buffer argument (an array, or ``[array, ...]`` with counts and a datatype)."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(buf).nbytes


class CountingComm(MPI.Intracomm):
    """The domain group with every call the layers make counted: ``(bytes this rank sends, messages)`` per phase.

    Point-to-point: the message's bytes. Collectives (one message each): the
    bytes of this rank's data that the other ranks receive (what
    :mod:`credit_mpi.nn.traffic` counts). Agreements (the ``Allgather`` calls
    of :mod:`credit_mpi.agreement`) are counted apart.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.phase = None
        self.counts: dict = {}
        self.sends = 0  # point-to-point messages, every phase

    def _add(self, nbytes: int, agreement: bool = False) -> None:
        if self.phase is None:
            return
        t = Traffic(agreements=1) if agreement else Traffic(nbytes, 1)
        self.counts[self.phase] = self.counts.get(self.phase, Traffic()) + t

    def _others(self) -> int:
        return self.Get_size() - 1

    def Isend(self, buf, dest, tag=0):  # noqa: N802 - mpi4py's names
        self._add(_nbytes(buf))
        self.sends += 1
        return super().Isend(buf, dest, tag)

    def Allgather(self, sendbuf, recvbuf):  # noqa: N802
        self._add(_nbytes(sendbuf) * self._others(), sys._getframe(1).f_globals.get("__name__") == "credit_mpi.agreement")
        return super().Allgather(sendbuf, recvbuf)

    def Allgatherv(self, sendbuf, recvbuf):  # noqa: N802
        self._add(_nbytes(sendbuf) * self._others())
        return super().Allgatherv(sendbuf, recvbuf)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):  # noqa: N802
        self._add(_nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf) * self._others())
        return super().Allreduce(sendbuf, recvbuf, op)

    def Alltoallv(self, sendbuf, recvbuf):  # noqa: N802 - [array, counts]: the counts to the other ranks
        counts = list(sendbuf[1])
        self._add((sum(counts) - counts[self.Get_rank()]) * np.asarray(sendbuf[0]).itemsize)
        return super().Alltoallv(sendbuf, recvbuf)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):  # noqa: N802
        self._add(_nbytes(sendbuf))
        return super().Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):  # noqa: N802
        self._add(_nbytes(sendbuf) - _nbytes(recvbuf))  # the other ranks' parts of this rank's buffer
        return super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)

    def __getattribute__(self, name):
        if name in ("Send", "Ssend", "Irecv_init", "Send_init", "Iallgather", "Alltoallw", "Bcast",
                    "Ialltoallw", "Neighbor_alltoallw"):
            raise AssertionError(f"the counting communicator does not count {name}: add it")
        return super().__getattribute__(name)


@contextmanager
def counting(manager):
    """The manager's domain group replaced by a :class:`CountingComm` of the same communicator (no copy)."""
    real = manager._domain_group
    manager._domain_group = CountingComm(real)
    try:
        yield manager._domain_group
    finally:
        manager._domain_group = real


def _model(shape=None) -> nn.Module:
    """Convolutions (kernel 3 and 5, stride 2, circular), a norm, pooling, upsampling and an overlapping transposed conv."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 5, stride=2, padding=2),
        nn.MaxPool2d(3, 1, 1),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"),
        nn.Upsample(scale_factor=3, mode="bilinear"),
        nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1),
    ).double()


def _step(model, x, comm, paths) -> None:
    """One forward (each layer's calls counted under its path, the innermost) and backward ("backward")."""
    hooks, stack = [], ["forward"]

    def enter(path):
        stack.append(path)
        comm.phase = path

    def leave():
        stack.pop()
        comm.phase = stack[-1]

    for path, m in model.named_modules():
        if path in paths:
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, p=path: enter(p)))
            hooks.append(m.register_forward_hook(lambda _m, _a, _o: leave()))
    try:
        comm.phase = "forward"
        out = model(x)
        comm.phase = "backward"
        out.as_subclass(torch.Tensor).square().sum().backward()  # the band's own sum: the model's traffic alone
    finally:
        comm.phase = None
        for h in hooks:
            h.remove()


def _attention(shape=None) -> nn.Module:
    """A convolution, then attention over every band's tokens (K and V gathered: ``allgather_along``)."""
    from .test_function_rules import GlobalAttention

    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), GlobalAttention(4)).double()


def _norms(shape) -> nn.Module:
    """Every norm (BatchNorm, InstanceNorm, LayerNorm over the field), average pooling and a global mean (then replicated)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.InstanceNorm2d(4, affine=True),
        nn.LayerNorm(tuple(shape[-2:])),
        nn.AvgPool2d(3, 2, 1),
        nn.AdaptiveAvgPool2d((1, None)),
        nn.Conv2d(4, 2, 1),  # on the replicated mean: computed locally, after one agreement
    ).double()


def _shifted_windows(shape=None) -> nn.Module:
    """Swin-style shifted windows (tests/test_windows.py): rolls across bands, re-banded to whole windows of 2 rows."""
    from .test_windows import SwinStyle

    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), SwinStyle(4, 2, 1)).double()


def _windows(shape=None) -> nn.Module:
    """Windows of 2 rows, no shift: re-banded to whole windows and back where the bands are not."""
    from .test_windows import SwinStyle

    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), SwinStyle(4, 2, 0)).double()


def _long_attention(shape=None) -> nn.Module:
    """CREDIT CrossFormer's long-distance attention (tests/test_long_attention.py): to the group layout and back."""
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .test_long_attention import long_attention

    return nn.Sequential(nn.Conv2d(2, 2, 1), long_attention(2)()).double()


def _hand_written(shape=None) -> nn.Module:
    """softmax(q k^T) v by ``@`` (tests/test_attention.py): the keys gathered for q k^T, the values for a v."""
    from .test_attention import HandWritten

    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), HandWritten(4)).double()


def _masked(shape) -> nn.Module:
    """sdpa with is_causal (gathered K/V: every rank's token count gathered too) and nn.MultiheadAttention with a
    causal attn_mask in the field's coordinates (its key and value gathered, and the counts)."""
    from .test_attention import MHA, Heads

    tokens = shape[-2] * shape[-1]
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), Heads(mask="causal", tokens=tokens),
                         MHA(batch_first=False, mask="causal", tokens=tokens)).double()


def _own_halo(shape=None) -> nn.Module:
    """A trusted block (custom_converters) that calls a HaloExchange itself (tests/test_verdict_models.py)."""
    from .test_verdict_models import own_halo

    return own_halo(1)().double()


def _custom(build):
    from .test_verdict_models import TRUSTED

    return TRUSTED if build is _own_halo else None


# the heights of the even and the uneven bands of each model (windows of 2 need an even field)
_EVEN = (_shifted_windows, _windows, _long_attention)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("build", "requires_grad", "sdpa"), [
    (_model, False, "auto"), (_model, True, "auto"),
    (_attention, False, "auto"), (_attention, True, "auto"),  # 2 heads: all-to-all on 2 ranks, the ring on 3 and 4
    (_attention, True, "gather"), (_norms, True, "auto"),
    (_shifted_windows, True, "auto"), (_windows, True, "auto"), (_long_attention, True, "auto"),
    (_hand_written, True, "auto"), (_own_halo, True, "auto"), (_masked, True, "gather"),
])
def test_describe_traffic_equals_what_the_run_sends(build, requires_grad, sdpa, make_manager, monkeypatch):
    """Per layer (the rows of a module that moves rows itself, in total) and in total, forward and backward."""
    from credit_mpi.nn.judge import attention

    monkeypatch.setattr(attention, "SDPA_PATH", sdpa)
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d == 1:
                continue
            for rows in (8 * d, 8 * d + (2 if build in _EVEN else 3)):  # even and uneven bands (array_split, as here)
                shape = (1, 2, rows, 6 if build not in _EVEN else 4)
                plan = describe(build(shape), shape, d, requires_grad=requires_grad, custom_converters=_custom(build))
                assert plan.exact and plan.traffic is not None, str(plan)
                model = convert_to_domain_parallel(build(shape), manager, custom_converters=_custom(build))
                a, b = band(rows, manager)
                x = torch.randn(shape, dtype=torch.float64).narrow(2, a, b - a).contiguous().requires_grad_(requires_grad)
                # a module's own moves happen at its boundary (before its hooks) and between its layers: those
                # modules are counted with their parent, and compared in the total
                moving = {r.path for r in plan.rows if r.note in _MOVE_NOTES}
                paths = {r.path for r in plan.rows} - moving
                with counting(manager) as comm:
                    _step(model, x, comm, paths)  # the first call of each layer shape plans (and agrees on its table)
                    comm.counts.clear()
                    _step(model, x, comm, paths)
                rank = manager.domain_rank
                counted = comm.counts
                for path in paths:
                    mine = sum((r.traffic[rank] for r in plan.rows if r.path == path), Traffic())
                    got = counted.get(path, Traffic())
                    assert (got.forward_bytes, got.forward_messages, got.agreements) == (
                        mine.forward_bytes, mine.forward_messages, mine.agreements), (d, rows, rank, path, got, mine)
                total = plan.traffic[rank]
                forward = sum((counted.get(p, Traffic()) for p in paths | {"forward"}), Traffic())
                back = counted.get("backward", Traffic())
                assert (forward.forward_bytes, forward.forward_messages, forward.agreements) == (
                    total.forward_bytes, total.forward_messages, total.agreements), (d, rows, rank, forward, total)
                assert (back.forward_bytes, back.forward_messages, back.agreements) == (
                    total.backward_bytes, total.backward_messages, 0), (d, rows, rank, back, total)
                assert total.forward_messages and total.backward_messages


def _move_notes() -> set:
    """describe()'s notes of the rules' gathers and joins, and of their row moves (each row map's own label)."""
    from credit_mpi.nn import plan
    from credit_mpi.ops import group_rows, reband  # noqa: F401 - their row maps register at import
    from credit_mpi.ops.rows import ROW_MAPS

    return set(plan._MOVES.values()) | {row_map.label for row_map in ROW_MAPS.values()}


_MOVE_NOTES = _move_notes()


def test_describe_prints_the_traffic():
    """The table's columns: the most any rank sends forward / backward, its messages and agreements, and a total."""
    plan = describe(_model(), (1, 2, 24, 6), 3)
    text = str(plan)
    assert "sends fwd/bwd" in text and "msgs fwd/bwd" in text and "\ntotal" in text
    first = plan.rows[0].traffic  # the input needs no gradient: the first conv sends its halo forward only
    assert [t.backward_messages for t in first] == [0, 0, 0] and [t.forward_messages for t in first] == [1, 2, 1]
    assert describe(_model(), (1, 2, 24, 6), 1).traffic == (Traffic(),)


@pytest.mark.mpi(min_size=2)
def test_the_benchmarks_local_pad_sends_no_halo(make_manager):
    """bench_model's baseline (credit_mpi.nn.conv.local_halos): the same shapes, no point-to-point message."""
    from credit_mpi.nn.conv import local_halos

    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            if d == 1:
                continue
            shape = (1, 2, 8 * d + 3, 6)
            model = convert_to_domain_parallel(_model(), manager)
            a, b = band(shape[2], manager)
            x = torch.randn(shape, dtype=torch.float64).narrow(2, a, b - a).contiguous().requires_grad_()
            with counting(manager) as comm:
                real = model(x)
                assert comm.sends
                comm.sends = 0
                with local_halos():
                    out = model(x)
                    out.sum().backward()
                assert comm.sends == 0 and out.shape == real.shape
            torch.testing.assert_close(model(x), real, rtol=0, atol=0)  # restored
