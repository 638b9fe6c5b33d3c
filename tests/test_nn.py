"""The model side (credit_mpi.nn): every layer and a set of models against one process (float64).

MPI tests run every domain size 1..W (sub-communicators over world ranks 0..d-1) with an even
and an uneven band layout; serial tests check the geometry against torch's shape formulas,
the converter's policy and the state_dict / parameter sharing.
"""

from __future__ import annotations

import copy

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import credit_mpi  # noqa: E402
from credit_mpi.layout import offsets  # noqa: E402
from credit_mpi.nn import ConversionError, convert_to_domain_parallel, describe, geometry, keep_local  # noqa: E402

from .halo_reference import prefix_managers  # noqa: E402
from .nn_reference import assert_same, run_both, same_error_everywhere  # noqa: E402

F = torch.nn.functional

# -- the layers ---------------------------------------------------------------------------------

CONVS = {
    "k3p1": lambda: nn.Conv2d(2, 3, 3, padding=1),
    "k3s2p1": lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1),
    "k5d2p4": lambda: nn.Conv2d(2, 3, 5, dilation=2, padding=4),
    "same7": lambda: nn.Conv2d(2, 3, 7, padding="same"),
    "same4": lambda: nn.Conv2d(2, 3, 4, padding="same"),
    "valid3": lambda: nn.Conv2d(2, 3, 3, padding="valid"),
    "circular": lambda: nn.Conv2d(2, 3, 3, padding=(2, 1), padding_mode="circular"),
    "reflect": lambda: nn.Conv2d(2, 3, 3, padding=2, padding_mode="reflect"),
    "replicate": lambda: nn.Conv2d(2, 3, (5, 3), padding=(2, 1), padding_mode="replicate"),
    "groups": lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False),
    "k4s2p1": lambda: nn.Conv2d(2, 3, 4, stride=2, padding=1),
    "k4s4": lambda: nn.Conv2d(2, 3, 4, stride=4),
    "k8s4p2": lambda: nn.Conv2d(2, 3, 8, stride=4, padding=2),
    "k3s3p0": lambda: nn.Conv2d(2, 3, 3, stride=3),
    "convT_k2s2": lambda: nn.ConvTranspose2d(2, 3, 2, stride=2),
    "convT_k4s2p1": lambda: nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1),
    "convT_k4s2p0": lambda: nn.ConvTranspose2d(2, 3, 4, stride=2),
    "convT_k3s2p1op1": lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
    "convT_k3s1p1": lambda: nn.ConvTranspose2d(2, 3, 3, padding=1),
    "convT_k3d2s3": lambda: nn.ConvTranspose2d(2, 4, 3, stride=3, dilation=2, groups=2),
    "convT_k1s2": lambda: nn.ConvTranspose2d(2, 3, 1, stride=2),
}
NORMS = {
    "groupnorm": lambda: nn.GroupNorm(2, 4),
    "instancenorm": lambda: nn.InstanceNorm2d(4, affine=True),
    "layernorm": None,  # needs the field size: built in the test
    "batchnorm": lambda: nn.BatchNorm2d(4),
}
RESAMPLE = {
    "nearest2": lambda: nn.Upsample(scale_factor=2, mode="nearest"),
    "nearest_size": lambda: nn.Upsample(size=None, scale_factor=(1.5, 2), mode="nearest"),
    "bilinear": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "bilinear_ac": lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
    "bicubic": lambda: nn.Upsample(scale_factor=2, mode="bicubic"),
    "bicubic_ac": lambda: nn.Upsample(scale_factor=3, mode="bicubic", align_corners=True),
    "bilinear_half": lambda: nn.Upsample(scale_factor=0.5, mode="bilinear"),
    "maxpool_k3s2p1": lambda: nn.MaxPool2d(3, 2, 1),
    "maxpool_k2": lambda: nn.MaxPool2d(2),
    "maxpool_ceil": lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True),
    "maxpool_dil": lambda: nn.MaxPool2d(3, 1, 1, dilation=2),
    "avgpool_k3s2p1": lambda: nn.AvgPool2d(3, 2, 1),
    "avgpool_nopad": lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False),
    "avgpool_ceil": lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avgpool_div": lambda: nn.AvgPool2d(2, divisor_override=3),
    "adaptive_half": lambda: nn.AdaptiveAvgPool2d((None, 3)),
    "adaptive_5x3": lambda: nn.AdaptiveAvgPool2d((5, 3)),
}


def _heights(d: int, base: int) -> list[int]:
    return [base * d, base * d + d - 1] if d > 1 else [base, base + 1]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_layers(name, make_manager):
    channels = 4 if name in ("groups",) else 2
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d, 8):
                r = run_both(CONVS[name], (2, channels, h, 6), manager, seed=d * 100 + h)
                assert_same(r)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_layers(name, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d, 3):
                build = NORMS[name] or (lambda h=h: nn.LayerNorm((4, h, 5)))
                r = run_both(lambda b=build: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), b(), nn.Conv2d(4, 2, 3, padding=1)),
                             (2, 3, h, 5), manager, seed=d * 10 + h)
                assert_same(r)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_layers_one_sample(name, make_manager):
    """One sample: the per-sample statistics are the batch-norm kernels' channels as they are (and LayerNorm's
    elementwise gradients one row, no sum)."""
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d, 3):
                build = NORMS[name] or (lambda h=h: nn.LayerNorm((4, h, 5)))
                r = run_both(lambda b=build: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), b(), nn.Conv2d(4, 2, 3, padding=1)),
                             (1, 3, h, 5), manager, seed=d * 10 + h + 1)
                assert_same(r)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(RESAMPLE))
def test_resample_layers(name, make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d, 6):
                if name == "adaptive_5x3" and h // d < 3:
                    continue
                r = run_both(RESAMPLE[name], (2, 2, h, 6), manager, seed=d * 10 + h)
                assert_same(r)


@pytest.mark.mpi(min_size=1)
def test_global_average_pool_is_replicated(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            for h in _heights(d, 3):
                for size in (1, (1, 3)):  # every spatial dim's mean (one sum), and the latitude's alone
                    def build(size=size):
                        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(size))

                    r = run_both(build, (2, 2, h, 5), manager, seed=h, replicated=True)
                    assert_same(r)


@pytest.mark.mpi(min_size=1)
def test_batchnorm_over_domain_and_data_parallel(make_manager):
    """SyncBatchNorm semantics over every rank: output, gradients and running statistics."""
    world = MPI.COMM_WORLD
    size = world.Get_size()
    for d in [k for k in range(1, size + 1) if size % k == 0]:
        manager = make_manager(d)
        dp = manager.data_parallel_size
        torch.manual_seed(3)
        ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=None), nn.Conv2d(3, 2, 3, padding=1)).double()
        model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
        h = 4 * d + d - 1
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2 * dp, 2, h, 5, generator=gen, dtype=torch.float64)
        w = torch.randn(2 * dp, 2, h, 5, generator=gen, dtype=torch.float64)
        for _ in range(2):
            xr = x.clone().requires_grad_()
            (ref(xr) * w).sum().div(dp).backward()
            start, stop = credit_mpi.partition.band_range(h, d, manager.domain_rank, uneven=True)
            i = manager.dp_rank
            xl = x[2 * i : 2 * i + 2, :, start:stop].clone().requires_grad_()
            out = model(xl)
            (out * w[2 * i : 2 * i + 2, :, start:stop]).sum().backward()
            credit_mpi.reduce_gradients(model.parameters(), manager)
            torch.testing.assert_close(xl.grad, xr.grad[2 * i : 2 * i + 2, :, start:stop] * dp, atol=1e-12, rtol=1e-10)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-10)
                p.grad = q.grad = None
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model[1], name), getattr(ref[1], name), atol=1e-12, rtol=1e-10)


# -- models -------------------------------------------------------------------------------------


class FuXiBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.act = nn.SiLU()
        self.up = nn.ConvTranspose2d(8, 3, 2, stride=2)

    def forward(self, x):
        return self.up(self.act(self.norm(self.down(x)))) + x


class CrossEmbed(nn.Module):
    """WXFormer's cross embedding: kernels 4, 8, 16, 32 at one stride, paddings (k - s) // 2, concatenated."""

    def __init__(self, stride):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(2, 2, k, stride=stride, padding=(k - stride) // 2) for k in (4, 8, 16, 32))

    def forward(self, x):
        return torch.cat([c(x) for c in self.convs], dim=1)


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inc = nn.Conv2d(2, 4, 7, padding="same")
        self.circ = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.down = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.out = nn.Conv2d(12, 2, 1)

    def forward(self, x):
        a = torch.relu(self.circ(self.inc(x)))
        b = self.up(torch.relu(self.norm(self.down(a))))
        return self.out(torch.cat([a, b], dim=1))


def decoder():
    return nn.Sequential(
        nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1), nn.GELU(),
        nn.ConvTranspose2d(3, 3, 4, stride=2), nn.GELU(),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
    )


def cube_embedding():
    return nn.Sequential(nn.Conv3d(2, 4, (2, 4, 4), stride=(2, 4, 4)), nn.GroupNorm(2, 4), nn.Conv3d(4, 4, 3, padding=1))


MODELS = {
    "fuxi": (FuXiBlock, 8, 6),
    "crossembed_s2": (lambda: CrossEmbed(2), 16, 8),
    "crossembed_s4": (lambda: CrossEmbed(4), 16, 8),
    "unet": (UNet, 8, 6),
    "decoder": (decoder, 4, 3),
    "cube": (cube_embedding, 8, 8),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models(name, make_manager):
    build, base, width = MODELS[name]
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            # even bands, then uneven ones (array_split; with a skip connection: stride-aligned offsets)
            h = base * d * (2 if name.startswith("crossembed") and d > 1 else 1)
            layouts = [(h, None)]
            if name in ("fuxi", "unet"):
                layouts.append((h + 2, [base + 2 if r == 0 else base for r in range(d)]))
            else:
                layouts.append((h + 1, None))
            for h, sizes in layouts:
                shape = (2, 2, 4, h, width) if name == "cube" else (2, 3 if name == "fuxi" else 2, h, width)
                r = run_both(build, shape, manager, seed=h * 7 + d, sizes=sizes)
                assert_same(r)


@pytest.mark.mpi(min_size=1)
def test_five_training_steps_equal_one_process(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            sizes = [10 if r == 0 else 8 for r in range(d)]
            r = run_both(UNet, (2, 2, sum(sizes), 6), manager, seed=11, steps=5, sizes=sizes)
            assert_same(r, atol=1e-11)


@pytest.mark.mpi(min_size=1)
def test_bfloat16_within_tolerance(make_manager):
    with prefix_managers(make_manager) as managers:
        for d, manager in managers:
            r = run_both(FuXiBlock, (2, 3, 8 * d, 6), manager, seed=4, dtype=torch.bfloat16)
            torch.testing.assert_close(r["out"], r["out_ref"], atol=0.1, rtol=0.05)
            torch.testing.assert_close(r["gx"], r["gx_ref"], atol=0.1, rtol=0.05)


@pytest.mark.mpi(min_size=1)
def test_domain_of_one_is_the_original_bit_for_bit(make_manager):
    manager = make_manager(1)
    torch.manual_seed(0)
    ref = UNet().double()
    model = convert_to_domain_parallel(copy.deepcopy(ref), manager)
    x = torch.randn(2, 2, 10, 6, dtype=torch.float64)
    assert torch.equal(model(x), ref(x))
    assert torch.equal(convert_to_domain_parallel(copy.deepcopy(ref), None)(x), ref(x))


# -- refusals: the same exception on every rank ------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_refusals_raise_on_every_rank(make_manager):
    manager = make_manager()
    comm = manager.domain_group
    for bad in (nn.AdaptiveMaxPool2d(2),
                nn.MaxPool2d(2, return_indices=True)):
        msg = same_error_everywhere(comm, lambda b=bad: convert_to_domain_parallel(b, manager), ConversionError)
        assert "custom_converters" in msg

    class Mystery(nn.Module):
        def forward(self, x):
            return x.rot90(1, (-2, -1))

    # a module without a rule is judged by what its forward does (credit_mpi.nn.judge), when it runs
    # (on a domain of one rank the band is the whole field: nothing to judge, the forward is exact)
    x = torch.randn(1, 1, 2, 3, dtype=torch.float64) + manager.domain_rank  # bands: each rank's own rows
    for model, where, op in ((nn.Sequential(nn.ReLU(), Mystery()), "1 (Mystery)", "rot90()"),
                             (nn.Sequential(nn.Conv2d(1, 1, 1), nn.Flatten(), nn.Linear(6, 2)), "2 (Linear)", "linear()")):
        converted = convert_to_domain_parallel(model.double(), manager)
        if manager.domain_parallel_size == 1:
            assert torch.equal(converted(x), model(x))
            continue
        msg = same_error_everywhere(comm, lambda c=converted: c(x), ConversionError)
        assert where in msg and op in msg and "custom_converters" in msg, msg
    assert isinstance(ConversionError("x"), credit_mpi.DomainParallelError)
    # marked local, it converts; a custom converter is used
    assert convert_to_domain_parallel(Mystery(), manager, custom_converters={Mystery: keep_local}).__class__ is Mystery
    assert convert_to_domain_parallel(nn.Linear(2, 2), manager, -1, custom_converters={nn.Linear: lambda m, mg, sd: nn.Identity()}).__class__ is nn.Identity
    same_error_everywhere(comm, lambda: convert_to_domain_parallel(nn.Linear(2, 2), manager, -1), ConversionError)


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_on_every_rank(make_manager):
    manager = make_manager()
    comm = manager.domain_group
    d = manager.domain_parallel_size
    model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.GroupNorm(1, 2)), manager)
    width = 5 if manager.domain_rank == 0 else 6
    same_error_everywhere(comm, lambda: model(torch.zeros(1, 2, 4, width)), ValueError)
    # a band too thin for the halo: named layer and minimum height
    thin = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 7, padding=3)), manager)
    msg = same_error_everywhere(comm, lambda: thin(torch.zeros(1, 2, 2, 4)), ConversionError)
    assert "0 (" not in msg and "at least 3 row" in msg, msg
    # a strided layer where some band would own no output row
    strided = convert_to_domain_parallel(nn.Conv2d(2, 2, 4, stride=4), manager)
    rows = 1 if manager.domain_rank else 4 * d
    msg = same_error_everywhere(comm, lambda: strided(torch.zeros(1, 2, rows, 4)), ConversionError)
    assert "no output row" in msg
    # a shard dim that is not spatial
    chan = convert_to_domain_parallel(nn.Conv2d(2, 2, 3), manager, shard_dim=1)
    same_error_everywhere(comm, lambda: chan(torch.zeros(1, 2, 4, 4)), ValueError)
    # (double backward of an overlap-add runs: tests/test_nn_overlap_add.py)


# -- serial: geometry, converter, checkpoints --------------------------------------------------


@pytest.mark.parametrize("k,s,d,p", [(3, 1, 1, 1), (3, 2, 1, 1), (4, 2, 1, 1), (5, 3, 2, 2), (7, 4, 1, 0), (2, 2, 1, 0)])
@pytest.mark.parametrize("sizes", [[5], [4, 4], [5, 4, 4], [3, 7, 2, 9]])
def test_conv_geometry_matches_torch(k, s, d, p, sizes):
    h = sum(sizes)
    if d * (k - 1) + 1 > h + 2 * p:
        return
    lay = geometry.conv_layout(sizes, k, s, d, p, p)
    y = F.conv2d(torch.zeros(1, 1, h, 1), torch.zeros(1, 1, k, 1), stride=(s, 1), padding=(p, 0), dilation=(d, 1))
    assert lay.out_size == y.shape[2]
    assert sum(lay.out_sizes) == lay.out_size and lay.bands[0].out_start == 0
    for a, b in zip(lay.bands, lay.bands[1:], strict=False):
        assert a.out_stop == b.out_start
    for ceil in (False, True):
        if p <= k // 2:
            pooled = F.max_pool2d(torch.zeros(1, 1, h, 1), (k, 1), (s, 1), (p, 0), (d, 1), ceil_mode=ceil)
            assert geometry.conv_out_size(h, k, s, d, p, p, ceil) == pooled.shape[2]


@pytest.mark.parametrize("k,s,d,p,op", [(2, 2, 1, 0, 0), (4, 2, 1, 1, 0), (4, 2, 1, 0, 0), (3, 2, 1, 1, 1), (3, 3, 2, 0, 2)])
def test_transposed_geometry_matches_torch(k, s, d, p, op):
    for sizes in ([5], [3, 4], [2, 5, 3]):
        h = sum(sizes)
        lay = geometry.transposed_layout(sizes, k, s, d, p, op)
        y = F.conv_transpose2d(torch.zeros(1, 1, h, 1), torch.zeros(1, 1, k, 1), stride=(s, 1), padding=(p, 0),
                               output_padding=(op, 0), dilation=(d, 1))
        assert lay.out_size == y.shape[2] == sum(lay.out_sizes)
        assert [b.out_start for b in lay.bands] == [0] + [s * a for a in offsets(sizes)[1:]]


def test_state_dict_and_parameters_are_shared():
    torch.manual_seed(0)
    ref = UNet()
    keys = list(ref.state_dict())
    params = list(ref.parameters())
    model = convert_to_domain_parallel(ref, None)
    assert list(model.state_dict()) == keys
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    other = UNet()
    model.load_state_dict(other.state_dict())
    assert torch.equal(params[0], other.state_dict()["inc.weight"])
    other.load_state_dict(model.state_dict())
    bn = convert_to_domain_parallel(nn.Sequential(nn.BatchNorm2d(3)), None)
    assert list(bn.state_dict()) == list(nn.Sequential(nn.BatchNorm2d(3)).state_dict())
    assert isinstance(model.inc, nn.Conv2d) and type(model.inc).__name__ == "DomainParallelConv2d"
    root = convert_to_domain_parallel(nn.Conv2d(1, 1, 3), None)
    assert type(root).__name__ == "DomainParallelConv2d"
    assert model.double().inc.weight.dtype == torch.float64


def test_describe_lists_halos_and_refuses_thin_bands():
    plan = describe(UNet(), (1, 2, 16, 8), domain_size=4)
    assert plan.exact
    rows = {r.path: r for r in plan.rows}
    assert (rows["inc"].halo_before, rows["inc"].halo_after, rows["inc"].min_rows) == (3, 3, 3)
    assert rows["down"].stride == 2
    assert "inc" in str(plan) and "runs exactly" in str(plan)
    thin = describe(UNet(), (1, 2, 8, 8), domain_size=4)
    assert not thin.exact and not rows["inc"].note
    assert "NO" in str(thin)


def test_import_credit_mpi_does_not_import_torch():
    from .conftest import run_python

    run_python("import sys, credit_mpi; assert 'torch' not in sys.modules; credit_mpi.convert_to_domain_parallel; assert 'torch' in sys.modules")


@pytest.mark.mpi(min_size=1)
def test_example_train_unet_matches_one_process():
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("train_unet", ROOT / "examples" / "train_unet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    size = MPI.COMM_WORLD.Get_size()
    dp = 2 if size == 4 else 1
    lat = 24 if size == 3 else 16  # stride-aligned band offsets for the skip connection
    assert module.main(["--steps", "3", "--data-parallel", str(dp), "--lat", str(lat), "--lon", "16"]) == 0


def test_describe_accepts_dropout_in_training_on_one_band():
    """One band is one process: its dropout draw is the one-process draw (as the run, which judges nothing there)."""
    model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Dropout(0.5))
    assert describe(model, (1, 1, 8, 4), 1).exact
    assert not describe(model, (1, 1, 8, 4), 2).exact


class Transposed(nn.Module):
    """Latitude and longitude swapped: the bands along the last dim (a placement the layers do not run on)."""

    def forward(self, x):
        return x.transpose(-1, -2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", [nn.Dropout, nn.Dropout2d])
def test_dropout_in_eval_or_with_p_0_runs_and_in_training_is_refused(kind, make_manager):
    """The identity in eval or with p=0, on bands and on windows moved into the batch (any placement): exact; in
    training with p > 0 refused on every rank (each band would draw its own mask), as describe() says."""
    manager = make_manager()
    d, comm = manager.domain_parallel_size, manager.domain_group
    for p, train in ((0.5, False), (0.0, True), (0.5, True))[: 3 if d > 1 else 2]:  # (one band: torch's own draw)
        def build(p=p, train=train):
            return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), kind(p), Transposed(), kind(p), Transposed()).train(train)

        plan = describe(build().double(), (2, 2, 4 * d, 3), d)
        assert plan.exact == (not (train and p)), str(plan)
        if plan.exact:
            assert_same(run_both(build, (2, 2, 4 * d, 3), manager))
        else:
            msg = same_error_everywhere(comm, lambda b=build: run_both(b, (2, 2, 4 * d, 3), manager), ConversionError)
            assert "dropout in training" in msg and f"p={p}" in msg, msg


def test_layer_rules_are_registered_next_to_their_classes():
    """nn/rules.py: each layer's decorator fills the table convert reads; a second rule for a type is refused."""
    from credit_mpi.nn import rules

    assert rules.RULES[nn.Conv2d] is credit_mpi.nn.DomainParallelConv2d
    assert nn.MaxPool2d in rules.BANDS_ONLY and nn.Conv2d not in rules.BANDS_ONLY
    assert "return_indices" in rules.refusal_of(nn.MaxPool2d(2, return_indices=True))
    assert rules.refusal_of(nn.MaxPool2d(2)) == "" and rules.refusal_of(nn.ReLU()) == ""
    with pytest.raises(ValueError, match="already has a layer rule"):
        rules.layer_rule(nn.Conv2d)(type("Another", (), {}))
    # what the judge of custom forwards reads of a layer is declared with its rule (the judge names no layer type)
    conv, norm = (cls.__new__(cls) for cls in (credit_mpi.nn.DomainParallelConv2d, credit_mpi.nn.DomainParallelBatchNorm2d))
    assert rules.traits_of(conv).folds_edge_rows and rules.traits_of(norm).batch_statistics
    assert rules.traits_of(nn.Conv2d(1, 1, 1)) == rules.LayerTraits()  # a torch module: nothing declared
    assert rules.RULES[nn.Conv2d] is credit_mpi.nn.DomainParallelConv2d
