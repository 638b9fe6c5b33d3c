"""Exact full attention across bands (credit_mpi.nn.judge.attention, credit_mpi.ops.alltoall / ring).

Every model flattens (lat, lon) into tokens and attends every token to every other one. Each
case: describe()'s verdict is what the run does, and the run equals one process (float64:
forward, input gradient, parameter gradients), on the world's domain (1-4 ranks), even and
uneven bands.
The communication volume of each sdpa layout is counted against the theory.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import ConversionError, convert_to_domain_parallel  # noqa: E402
from credit_mpi.nn.judge import attention  # noqa: E402

from .nn_reference import same_error_everywhere  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402

F = torch.nn.functional
W = 3  # the field's width (longitude)


def _tokens_mask(kind: str, n: int, device) -> torch.Tensor | None:
    """A mask in the field's coordinates over ``n`` tokens (made from constants: the same on every rank).

    Made on the input's device: describe()'s dry run runs on the meta device.
    """
    if kind == "bool":
        return (torch.arange(n, device=device).unsqueeze(1) - torch.arange(n, device=device)).abs() % 3 != 1
    if kind == "float":
        return torch.cos(torch.arange(n * n, dtype=torch.float64, device=device).reshape(n, n))
    return None


class HandWritten(nn.Module):
    """softmax(q k^T) v over tokens (b, hw, c), by ``@`` (q k^T then a v) or by ``einsum``."""

    def __init__(self, c=4, spelling="matmul"):
        super().__init__()
        self.qkv, self.spelling = nn.Conv2d(c, 3 * c, 1), spelling

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.flatten(2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=1))  # (b, hw, c)
        if self.spelling == "einsum":
            a = torch.einsum("bqc,bkc->bqk", q, k).mul(c**-0.5).softmax(-1)
            o = torch.einsum("bqk,bkc->bqc", a, v)
        else:
            a = torch.softmax(torch.matmul(q, k.transpose(1, 2)) * c**-0.5, dim=-1)
            o = a @ v
        return o.transpose(1, 2).reshape(b, c, h, w) + x


class Heads(nn.Module):
    """F.scaled_dot_product_attention over (b, heads, hw, c / heads), with a global mask or is_causal."""

    def __init__(self, c=4, heads=2, mask="none", tokens=0):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1), heads
        self.mask, self.tokens = mask, tokens

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.reshape(b, self.heads, c // self.heads, h * w).transpose(-1, -2) for t in self.qkv(x).chunk(3, dim=1))
        mask = _tokens_mask(self.mask, self.tokens, x.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "causal")
        return self.out(o.transpose(-1, -2).reshape(b, c, h, w)) + x


class Memory(nn.Module):
    """Cross-attention of the tokens to a learned global memory (keys and values without bands), causal."""

    def __init__(self, c=4, heads=2, slots=5):
        super().__init__()
        self.q, self.kv, self.heads = nn.Conv2d(c, c, 1), nn.Parameter(torch.randn(1, heads, slots, 2 * c // heads)), heads

    def forward(self, x):
        b, c, h, w = x.shape
        q = self.q(x).reshape(b, self.heads, c // self.heads, h * w).transpose(-1, -2)
        k, v = self.kv.expand(b, -1, -1, -1).chunk(2, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(-1, -2).reshape(b, c, h, w) + x


class MHA(nn.Module):
    """nn.MultiheadAttention over the tokens, batch_first either way, with the weights and masks it takes."""

    def __init__(self, c=4, heads=2, batch_first=True, mask="none", tokens=0):
        super().__init__()
        self.attn = nn.MultiheadAttention(c, heads, batch_first=batch_first, bias=True)
        self.batch_first, self.mask, self.tokens = batch_first, mask, tokens

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # (b, hw, c)
        t = t if self.batch_first else t.transpose(0, 1)
        kw = {}
        if self.mask == "causal":
            kw = {"attn_mask": nn.Transformer.generate_square_subsequent_mask(self.tokens, device=x.device, dtype=x.dtype), "is_causal": True}
        elif self.mask == "padding":
            kw = {"key_padding_mask": torch.arange(self.tokens, device=x.device).repeat(b, 1) % 4 == 3}
        o, weights = self.attn(t, t, t, need_weights=True, **kw)
        o = o if self.batch_first else o.transpose(0, 1)
        o = o + weights.sum(-1, keepdim=True)  # the weights: this band's query rows, every key (rows sum to one)
        return o.transpose(1, 2).reshape(b, c, h, w) + x


class Encoder(nn.Module):
    """nn.TransformerEncoder (2 layers, no dropout) or a TransformerDecoderLayer (causal tgt_mask, memory = the tokens)."""

    def __init__(self, c=4, batch_first=True, decoder=False, tokens=0):
        super().__init__()
        if decoder:
            self.body = nn.TransformerDecoderLayer(c, 2, dim_feedforward=8, dropout=0.0, batch_first=batch_first)
        else:
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(c, 2, dim_feedforward=8, dropout=0.0,
                                                                         batch_first=batch_first), 2,
                                              enable_nested_tensor=False)
        self.batch_first, self.decoder, self.tokens = batch_first, decoder, tokens

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t if self.batch_first else t.transpose(0, 1)
        if self.decoder:
            mask = nn.Transformer.generate_square_subsequent_mask(self.tokens, device=x.device, dtype=x.dtype)
            o = self.body(t, t, tgt_mask=mask, tgt_is_causal=True)
        else:
            o = self.body(t)
        o = o if self.batch_first else o.transpose(0, 1)
        return o.transpose(1, 2).reshape(b, c, h, w) + x


def _verdict(name, block, d, manager):
    c = 6 if "3_heads" in name else 4
    for h in (2 * d, 2 * d + (d > 1)):  # even bands, then uneven ones
        plan = verdict_is_the_run(name, lambda h=h: nn.Sequential(nn.Conv2d(2, c, 3, padding=1), block(h * W)),
                                  (1, 2, h, W), manager)
        assert plan.exact, str(plan)


CASES = {
    "matmul": lambda n: HandWritten(),
    "einsum": lambda n: HandWritten(spelling="einsum"),
    "sdpa": lambda n: Heads(),
    "sdpa_causal": lambda n: Heads(mask="causal", tokens=n),
    "sdpa_bool_mask_3_heads": lambda n: Heads(c=6, heads=3, mask="bool", tokens=n),
    "sdpa_memory_causal": lambda n: Memory(),
    "mha_batch_first": lambda n: MHA(),
    "mha_causal": lambda n: MHA(batch_first=False, mask="causal", tokens=n),
    "mha_padding": lambda n: MHA(mask="padding", tokens=n),
    "transformer_encoder": lambda n: Encoder(),
    "transformer_decoder_causal": lambda n: Encoder(batch_first=False, decoder=True, tokens=n),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_is_exact(name, make_manager):
    """On the whole world's domain (CI runs 1, 2, 3 and 4 ranks: every domain size once)."""
    manager = make_manager()
    _verdict(name, CASES[name], manager.domain_parallel_size, manager)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["alltoall", "ring", "gather"])
@pytest.mark.parametrize("mask", ["none", "causal", "float"])
def test_every_sdpa_layout_is_exact(path, mask, make_manager, monkeypatch):
    """Each layout forced (alltoall where the heads divide: 4 heads on 2 and 4 ranks), with each kind of mask."""
    manager = make_manager()
    d = manager.domain_parallel_size
    heads = 4 if path != "alltoall" or 4 % d == 0 else d
    monkeypatch.setattr(attention, "SDPA_PATH", path)
    for h in (2 * d, 2 * d + 1):
        build = lambda h=h: nn.Sequential(nn.Conv2d(2, 4 * heads // 2, 3, padding=1),  # noqa: E731
                                          Heads(c=4 * heads // 2, heads=heads, mask=mask, tokens=h * W))
        assert verdict_is_the_run(f"sdpa {path} {mask}", build, (2, 2, h, W), manager, seed=h).exact


def _moved(path: str, manager, heads: int, c: int, h: int, monkeypatch) -> int:
    from credit_mpi.ops import allgather_along, alltoall, ring

    counter = {"gather": allgather_along, "alltoall": alltoall, "ring": ring}[path]
    monkeypatch.setattr(attention, "SDPA_PATH", path)
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, c, 1), Heads(c=c, heads=heads)).double(), manager)
    rows = h // manager.domain_parallel_size + (manager.domain_rank < h % manager.domain_parallel_size)
    x = torch.randn(1, 2, rows, W, dtype=torch.float64) + manager.domain_rank  # bands: each rank's own rows
    counter.received_elements(reset=True)
    with torch.no_grad():
        model(x)
    return counter.received_elements(reset=True)


def _mha_moved(manager, c: int, rows: int, monkeypatch) -> int:
    from credit_mpi.ops import allgather_along

    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, c, 1), MHA(c=c, heads=2)).double(), manager)
    allgather_along.received_elements(reset=True)
    with torch.no_grad():
        model(torch.randn(1, 2, rows, W, dtype=torch.float64) + manager.domain_rank)  # each rank's own rows
    return allgather_along.received_elements(reset=True)


@pytest.mark.mpi(min_size=2)
def test_each_layout_moves_what_the_theory_says(make_manager, monkeypatch):
    """Elements received per rank in the forward, for N tokens of d features (all heads) on P ranks.

    K/V gather and ring: every other band's K and V, 2 (N - n_rank) d (2 N d (P - 1) / P on even
    bands); all-to-all: q, k, v each (N - n_rank) d / P, the output (P - 1) n_rank d / P
    (4 N d (P - 1) / P^2 on even bands).
    """
    manager = make_manager()
    p, c = manager.domain_parallel_size, 4 * manager.domain_parallel_size
    for h in (4 * p, 4 * p + 1):
        rows = h // p + (manager.domain_rank < h % p)
        n, mine = h * W, rows * W
        assert _moved("gather", manager, p, c, h, monkeypatch) == 2 * (n - mine) * c
        assert _moved("ring", manager, p, c, h, monkeypatch) == 2 * (n - mine) * c
        # q, k, v: (N - n_rank) d / P each; the output back: this band's tokens from the P - 1 others
        assert _moved("alltoall", manager, p, c, h, monkeypatch) == (3 * (n - mine) + (p - 1) * mine) * c // p
        assert _mha_moved(manager, c, rows, monkeypatch) == (n - mine) * c  # self-attention: one gather of E = c
        if h % p == 0:
            assert 2 * (n - mine) * c == 2 * n * c * (p - 1) // p
            assert (3 * (n - mine) + (p - 1) * mine) * c // p == 4 * n * c * (p - 1) // p**2


class BandMask(nn.Module):
    """A mask made from the band's own tokens (its rows are this band's, not the field's): refused."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Conv2d(4, 12, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.reshape(b, 2, 2, h * w).transpose(-1, -2) for t in self.qkv(x).chunk(3, dim=1))
        mask = q.sum(-1, keepdim=True) > 0  # (b, 2, hw, 1): a band
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(-1, -2).reshape(b, c, h, w)


class AddedMask(HandWritten):
    """q k^T plus a mask in the field's coordinates added by hand: the scores' rows are a band, the mask's are not."""

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.flatten(2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=1))
        n = k.shape[1] * 2  # a size stored for the whole field (two bands here)
        a = (q @ k.transpose(1, 2) + torch.zeros(n, n, dtype=x.dtype)).softmax(-1)
        return (a @ v).transpose(1, 2).reshape(b, c, h, w)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("module,match", [
    (BandMask, r"calls scaled_dot_product_attention\(\).*mask holds bands"),
    (lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)), None),
])
def test_what_is_refused_is_refused_on_every_rank(module, match, make_manager):
    manager = make_manager()
    if match is None:  # dropout in training inside nn.MultiheadAttention
        class Drop(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)

            def forward(self, x):
                t = x.flatten(2).transpose(1, 2)
                return self.attn(t, t, t)[0].transpose(1, 2).reshape(x.shape)

        module, match = Drop, r"calls multi_head_attention_forward\(\).*dropout=0.5 in training"
    model = convert_to_domain_parallel(module().double(), manager)
    x = torch.randn(1, 4, 2, W, dtype=torch.float64)
    message = same_error_everywhere(manager.domain_group, lambda: model(x), ConversionError)
    import re

    assert re.search(match, message), message


@pytest.mark.mpi(min_size=2)
def test_a_mask_added_by_hand_is_refused_on_every_rank(make_manager):
    manager = make_manager()
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 4, 1), AddedMask()).double(), manager)
    x = torch.randn(1, 2, 2, W, dtype=torch.float64)
    message = same_error_everywhere(manager.domain_group, lambda: model(x), ConversionError)
    assert "calls add()" in message and "rows along the sharded dim" in message and "attn_mask=" in message, message


# -- the ops themselves ------------------------------------------------------------------------------


def _parts(comm, seed=0):
    """Uneven token bands (3 or 4 tokens a rank) of global q, k, v, and this rank's offset and count."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = [3 + r % 2 for r in range(size)]
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    q, k = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64)
    return (q, k, v), sum(sizes[:rank]), sizes[rank]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_ring_attention_is_sdpa(mask, world):
    """ring_attention of the bands == sdpa of the field: output, dq, dk, dv (uneven bands, masks in global coordinates)."""
    from credit_mpi.ops.ring import ring_attention

    (q, k, v), o, n = _parts(world)
    kw = {"is_causal": True} if mask == "causal" else {}
    if mask in ("bool", "float"):
        kw["attn_mask"] = _tokens_mask(mask, q.shape[-2], q.device)
    weight = torch.randn(q.shape[:-1] + (5,), dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*whole, **kw) * weight).sum().backward()
    mine = [t[:, :, o : o + n].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, world, **kw)
    (out * weight[:, :, o : o + n]).sum().backward()
    ref = F.scaled_dot_product_attention(q, k, v, **kw)[:, :, o : o + n]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(mine, whole, strict=True):
        torch.testing.assert_close(got.grad, want.grad[:, :, o : o + n], rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(min_size=1)
def test_alltoall_there_and_back(world):
    """Token bands -> heads (uneven bands) is the field's heads of this rank; back is the band; the gradient is the reverse."""
    from credit_mpi.ops.alltoall import alltoall

    size, rank = world.Get_size(), world.Get_rank()
    (q, _, _), o, n = _parts(world)
    x = torch.cat([q] * size, dim=1)  # 3 * size heads
    mine = x[:, :, o : o + n].clone().requires_grad_()
    heads = alltoall(mine, 1, 2, world)
    assert torch.equal(heads, x[:, 3 * rank : 3 * rank + 3])
    back = alltoall(heads, 2, 1, world, keep=n)
    assert torch.equal(back, mine.detach())
    weight = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (heads * weight[:, 3 * rank : 3 * rank + 3]).sum().backward()
    assert torch.equal(mine.grad, weight[:, :, o : o + n])


@pytest.mark.mpi(min_size=2)
def test_bad_calls_of_the_ops_raise_on_every_rank(world):
    from credit_mpi import DomainParallelError
    from credit_mpi.ops.alltoall import alltoall
    from credit_mpi.ops.ring import ring_attention

    size = world.Get_size()
    (q, k, v), o, n = _parts(world)
    mine = [t[:, :, o : o + n] for t in (q, k, v)]
    msg = same_error_everywhere(world, lambda: alltoall(torch.zeros(2, size + 1, 3, dtype=torch.float64), 1, 2, world), ValueError)
    assert f"size {size + 1} does not split evenly among {size} ranks" in msg
    msg = same_error_everywhere(world, lambda: ring_attention(*mine, world, attn_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError)
    assert "not in the field's coordinates" in msg
    odd = [t[..., : 4 if world.Get_rank() else 3] if i < 2 else t for i, t in enumerate(mine)]  # rank 0's features differ
    same_error_everywhere(world, lambda: ring_attention(*odd, world), DomainParallelError)
    assert ring_attention(*mine, world).shape == (2, 3, n, 5)  # still in step


@pytest.mark.mpi(min_size=2)
def test_a_transformer_layer_with_dropout_in_training_is_refused_on_every_rank(make_manager):
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True)  # dropout 0.1

        def forward(self, x):
            return self.layer(x.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(x.shape)

    manager = make_manager()
    model = convert_to_domain_parallel(Layer().double(), manager)
    x = torch.randn(1, 4, 2, W, dtype=torch.float64)
    message = same_error_everywhere(manager.domain_group, lambda: model(x), ConversionError)
    assert "dropout=0.1 in training" in message, message
    model.eval()
    assert model(x).shape == x.shape  # in eval: no dropout, exact (the verdict cases above)
