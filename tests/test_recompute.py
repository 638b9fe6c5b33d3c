"""A recomputation in backward runs under the forward's rules, or is refused on every rank before data moves.

Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) around a block judged by its
forward (a roll of the sharded dim, a domain mean, attention over every band's tokens): the block's
recomputation in backward is judged as its forward was (credit_mpi.nn.judge.recompute), so the
gradients are one process's (before, reentrant: wrong by 0.7-9.9; non-reentrant: torch's CheckpointError).
A custom ``torch.autograd.Function`` whose forward gathers every band's keys and whose backward
recomputes the attention on its own: refused (ConversionError naming the Function) on every rank, and
describe() says so; one whose forward stays in the band (a memory-saving activation) runs exactly.
Every case through ``verdict_is_the_run``: 1-4 ranks, even and uneven bands.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = nn.functional


class Roll(nn.Module):
    def forward(self, x):
        return x + 0.5 * torch.roll(torch.tanh(x), 1, -2)


class DomainMean(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * (x - x.mean((-2, -1), keepdim=True))


class Attention(nn.Module):
    """Full attention over the tokens of every band (flatten, sdpa, back)."""

    def __init__(self, c=2):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).chunk(3, -1)
        out = F.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, c, h, w)


class Checkpointed(nn.Module):
    """A conv, then ``block`` under torch.utils.checkpoint (reentrant or not), then a conv."""

    def __init__(self, block, reentrant: bool):
        super().__init__()
        self.a, self.b, self.block, self.reentrant = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1), block, reentrant

    def forward(self, x):
        return self.b(checkpoint(self.block, self.a(x), use_reentrant=self.reentrant))


class RecomputedAttention(torch.autograd.Function):
    """Attention whose backward recomputes the scores (as memory-saving kernels do)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return F.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def backward(ctx, g):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), g)


class CustomAttention(Attention):
    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).chunk(3, -1)
        return RecomputedAttention.apply(q, k, v).transpose(1, 2).reshape(b, c, h, w)


class Swish(torch.autograd.Function):
    """A memory-saving activation (timm's SwishAutoFn): the forward stays in the band."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class SwishModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.a(Swish.apply(self.a(x)))


BLOCKS = {"roll": Roll, "domain_mean": DomainMean, "attention": Attention}


def _heights(d: int) -> tuple[int, ...]:
    return (4 * d, 4 * d + (d > 1))  # even bands, then uneven ones


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_checkpointed_block_is_judged_in_backward(block, reentrant, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                plan = verdict_is_the_run(f"checkpoint {block}", lambda: Checkpointed(BLOCKS[block](), reentrant),
                                          (2, 2, h, 5), manager)
                assert plan.exact, str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_custom_function_that_gathers_is_refused_on_every_rank(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                plan = verdict_is_the_run("custom attention", CustomAttention, (2, 2, h, 5), manager)
                assert plan.exact == (d == 1), str(plan)
                if d > 1:
                    assert "RecomputedAttention.apply()" in str(plan), str(plan)


@pytest.mark.mpi(min_size=1)
@pytest.mark.one_domain_size
def test_custom_function_within_the_band_runs_exactly(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d):
                assert verdict_is_the_run("swish", SwishModel, (2, 2, h, 5), manager).exact
