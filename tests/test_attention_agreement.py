"""Attention's ``is_causal`` and masks are agreed on every path (issue 37, item 4).

A forward whose ranks call attention with different masking (``is_causal`` on one rank only, a mask on
some ranks, a mask of another shape) has no one-process meaning. Before the agreement the all-to-all
path returned wrong on every rank (each rank attended its heads with its own flag); the gather path
returned wrong on some and hung others; now every path raises on every rank, before anything is
attended. The agreed case stays exact (tests/test_attention.py).
"""

from __future__ import annotations

import copy

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from credit_mpi import DomainParallelError  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402
from credit_mpi.nn.judge import attention  # noqa: E402
from credit_mpi.partition import band_sizes  # noqa: E402

RANKS = MPI.COMM_WORLD.Get_size()
TOKENS_W = 3


def _mask(kind: str, rank: int, tokens: int):
    """Each rank's masking: ``(attn_mask, is_causal)``, differing on rank 0 (and the last rank) by ``kind``."""
    if kind == "causal_on_one":
        return None, rank == 0
    if kind == "mask_on_one":
        return (torch.ones(tokens, tokens, dtype=torch.bool).tril() if rank == 0 else None), False
    if kind == "mask_shape":
        return torch.zeros(1 if rank == RANKS - 1 else tokens, tokens, dtype=torch.float64), False
    raise ValueError(kind)


class Heads(nn.Module):
    """q, k, v of 12 heads over a band's tokens (the heads divide among 1-4 ranks: the all-to-all path)."""

    def __init__(self, kind: str, rank: int, tokens: int, memory: bool = False) -> None:
        super().__init__()
        self.qkv, self.kind, self.rank, self.tokens = nn.Conv2d(2, 36, 1), kind, rank, tokens
        self.memory = nn.Parameter(torch.randn(1, 12, 5, 2)) if memory else None

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.reshape(b, 12, 1, h * w).transpose(-1, -2) for t in self.qkv(x).chunk(3, dim=1))
        if self.memory is not None:
            k = v = self.memory.narrow(-1, 0, 1).expand(b, -1, -1, -1)
        mask, causal = _mask(self.kind, self.rank, self.tokens)
        if self.memory is not None and mask is not None:
            mask = mask[..., :1].expand(-1, 5) if mask.shape[-1] > 1 else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class MHA(nn.Module):
    def __init__(self, kind: str, rank: int, tokens: int) -> None:
        super().__init__()
        self.attn, self.kind, self.rank, self.tokens = nn.MultiheadAttention(2, 1, batch_first=True), kind, rank, tokens

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2)
        mask, causal = _mask(self.kind, self.rank, self.tokens)
        if causal:
            mask = nn.Transformer.generate_square_subsequent_mask(self.tokens, dtype=x.dtype)
        return self.attn(t, t, t, attn_mask=mask, is_causal=causal, need_weights=False)[0]


def _run(model, manager, rows: int):
    x = torch.randn(2, 2, rows, TOKENS_W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = band_sizes(rows, manager.domain_parallel_size, True)
    r = manager.domain_rank
    return model(x[:, :, sum(sizes[:r]) : sum(sizes[: r + 1])])


def _raised_everywhere(comm, fn) -> str:
    """Call ``fn``: every rank raises, an exception of the same type (checked collectively); returns the message."""
    try:
        fn()
        name, message = None, ""
    except (DomainParallelError, ValueError) as exc:
        name, message = type(exc).__name__, str(exc)
    names = comm.allgather(name)
    assert None not in names and len(set(names)) == 1, names
    return message


CASES = [(path, kind) for path in ("alltoall", "ring", "gather", "memory", "mha")
         for kind in ("causal_on_one", "mask_on_one", "mask_shape")
         if not (path == "mha" and kind == "mask_shape")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path,kind", CASES)
def test_attention_masking_agreed(path, kind, make_manager):
    """Ranks that call attention with different masking raise on every rank, on every path, even and uneven bands."""
    manager = make_manager()
    for rows in (2 * RANKS, 2 * RANKS + 1):
        tokens = rows * TOKENS_W
        build = MHA if path == "mha" else Heads
        extra = {"memory": True} if path == "memory" else {}
        model = convert_to_domain_parallel(build(kind, manager.domain_rank, tokens, **extra).double(), manager)
        before, attention.SDPA_PATH = attention.SDPA_PATH, path if path in ("alltoall", "ring", "gather") else "auto"
        try:
            message = _raised_everywhere(manager.domain_group, lambda m=model, r=rows: _run(m, manager, r))
        finally:
            attention.SDPA_PATH = before
        assert "attn" in message or "causal" in message or "mask" in message, message


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["alltoall", "ring", "gather"])
def test_agreed_causal_still_exact(path, make_manager):
    """The same is_causal on every rank: still one process's attention on each path (the agreement's tag is free)."""
    manager = make_manager()
    rows = 2 * RANKS + 1
    tokens = rows * TOKENS_W

    class Causal(Heads):
        def forward(self, x):
            b, c, h, w = x.shape
            q, k, v = (t.reshape(b, 12, 1, h * w).transpose(-1, -2) for t in self.qkv(x).chunk(3, dim=1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.manual_seed(2)
    ref = Causal("causal_on_one", 0, tokens).double()
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
    x = torch.randn(2, 2, rows, TOKENS_W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before, attention.SDPA_PATH = attention.SDPA_PATH, path
    try:
        out = _run(model, manager, rows)
    finally:
        attention.SDPA_PATH = before
    sizes = band_sizes(rows, manager.domain_parallel_size, True)
    r = manager.domain_rank
    want = ref(x)[:, :, sum(sizes[:r]) * TOKENS_W : sum(sizes[: r + 1]) * TOKENS_W]
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
