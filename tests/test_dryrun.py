"""describe()'s dry run and the run do not part ways (reliability round 3 on the model side).

Each verdict goes through tests/verdict_reference.py ``verdict_is_the_run`` (exact against one process
where the plan says so, the same ConversionError on every rank where it does not), on the world's domain
(CI runs the file on 1, 2, 3 and 4 ranks):

1. a band and a tensor every rank holds whole (a :class:`~credit_mpi.nn.replicated.Replicated` global
   mean): the dry run marked a layer's output replicated by the MODEL input's axis, so after a reshape
   (a 5-D input, 4-D layers) it took a column mean (``AdaptiveAvgPool2d((None, 1))``, rows kept: a band)
   for a replicated one and refused ``y + r``, which the run lets through; one row broadcast to a band is
   exact, the field's rows are refused, by both;
2. a Python value read in the forward (``.item()``, ``float(t)``, ``t.tolist()``): of a tensor every rank
   holds whole it is a row of the plan (not seen on the meta device) and exact; of a band it is refused
   by both (each rank would read its own rows);
3. a band of no row (more ranks than rows): every layer raises one ConversionError on every rank, naming
   the layer, the bands and what would run (a global mean used to fail on the empty rank alone while the
   others waited in its allgather: an MPI error);
4. an unbatched ``(C, H, W)`` input: describe()'s row takes the layer's spatial dim as the layer does;
5. a converted layer on a replicated input gives a replicated output, also through a BatchNorm (buffers).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from credit_mpi.nn import ConversionError, convert_to_domain_parallel, describe  # noqa: E402

from .bounded import bounded  # noqa: E402
from .nn_reference import bands_of, same_error_everywhere  # noqa: E402
from .verdict_reference import verdict_is_the_run  # noqa: E402


def domain(make_manager):
    """``[(d, manager)]`` of the world's domain: CI runs the file on 1, 2, 3 and 4 ranks, each domain size once."""
    manager = make_manager()
    return [(manager.domain_parallel_size, manager)]


# -- 1. a band and a replicated partner -----------------------------------------------------------------------


class Columns(nn.Module):
    """A 5-D input (batch, channels, time, lat, lon), a 3-D conv, then 4-D: an adaptive mean added back to the band.

    ``(None, 1)``: the mean over longitude, rows kept (a band); ``(1, None)`` / ``(1, 1)``: over latitude, one
    row on every rank (replicated), broadcast back; ``conv``: a padded conv on the mean first (local on a
    replicated input); ``stored``: the mean expanded to the field's rows (a size stored in ``__init__``).
    """

    def __init__(self, out=(None, 1), conv=False, stored=None):
        super().__init__()
        self.c = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(out)
        self.k = nn.Conv2d(4, 4, 3, padding=1) if conv else None
        self.stored = stored

    def forward(self, x):
        y = self.c(x)
        b, c, t, h, w = y.shape
        y = y.reshape(b, c * t, h, w)
        r = self.pool(y)
        if self.k is not None:
            r = self.k(r)
        if self.stored is not None:
            r = r.expand(b, c * t, self.stored, w)
        return (y + r).reshape(b, c, t, h, w)


def heights(d: int) -> tuple[int, ...]:
    """Even bands, then uneven ones (4 rows a band)."""
    return (4 * d, 4 * d + 1) if d > 1 else (4,)


@pytest.mark.mpi(min_size=1)
def test_a_band_and_a_replicated_partner_is_one_judgement(make_manager):
    """Rows kept (a band, was refused by the dry run only), one replicated row (with and without a conv on it):
    exact in both; a replicated tensor of the field's rows: the band's rows of it (credit_mpi.nn.judge.field_values), exact."""
    cases = {"rows kept, conv": lambda: Columns(conv=True), "one row, conv": lambda: Columns((1, None), conv=True),
             "global": lambda: Columns(1)}
    for d, manager in domain(make_manager):
        for h in heights(d):
            shape = (1, 2, 2, h, 4)
            for name, build in cases.items():
                with bounded(f"{name} {shape} on {d}"):
                    assert verdict_is_the_run(name, build, shape, manager).exact
            with bounded(f"stored {shape} on {d}"):
                plan = verdict_is_the_run("stored", lambda h=h: Columns((1, None), stored=h), shape, manager)
            assert plan.exact, str(plan)


def test_describe_marks_replicated_by_the_layers_own_axis():
    """The column mean of a reshaped 5-D input is a band in the plan (its input rows kept), a latitude mean
    replicated: read on the layer's axis, not on the model input's."""
    for out, replicated in (((None, 1), False), ((1, None), True)):
        plan = describe(Columns(out, conv=True).double(), (1, 2, 2, 12, 4), 3)
        conv = next(r for r in plan.rows if r.path == "k")
        assert plan.exact and (conv.note == "replicated input: computed locally") == replicated, str(plan)


class SqueezeExcite(nn.Module):
    """A squeeze-excite gate whose global mean goes through a BatchNorm (training) and a padded 3x3 conv: BatchNorm
    computes with its running-statistics buffers (no Parameters), whose output was a plain tensor, then taken for a
    band of one row on every rank: the conv's halo read the other ranks' copies (silently wrong, ~0.3 on 3 ranks)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.squeeze, self.bn, self.excite = nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2), nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        return y * torch.sigmoid(self.excite(torch.relu(self.bn(self.squeeze(self.pool(y))))))


@pytest.mark.mpi(min_size=1)
def test_a_layer_on_a_replicated_input_gives_a_replicated_output(make_manager):
    """Exact, and every layer after the global mean computes locally on a replicated input (describe() says so)."""
    for d, manager in domain(make_manager):
        for h in heights(d):
            with bounded(f"squeeze-excite {h} on {d}"):
                plan = verdict_is_the_run("squeeze-excite", SqueezeExcite, (2, 2, h, 6), manager)
            local = [r.path for r in plan.rows if r.note == "replicated input: computed locally"]
            assert plan.exact and (d == 1 or local == ["squeeze", "bn", "excite"]), str(plan)


# -- 2. a Python value read in the forward ---------------------------------------------------------------------


class Reads(nn.Module):
    """A conv, then a data-dependent read: ``how`` names which (of a parameter, a global mean, or the band)."""

    def __init__(self, how):
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.how = how

    def forward(self, x):
        y = self.c(x)
        if self.how == "param" and float(self.c.weight.detach().abs().sum()) > 1e9:  # a weight check: a parameter
            raise ValueError("weights blew up")
        if self.how == "buffer":
            y = y * (1 + int(self.steps))  # a buffer's count
        if self.how == "mean" and bool(torch.isnan(self.pool(y)).any()):  # a global mean: whole on every rank
            raise ValueError("not finite")
        if self.how == "strict" and not bool(torch.isfinite(self.pool(y)).all()):  # False in the dry run: it raises
            raise ValueError("not finite")
        if self.how == "mean_list":
            self.last = self.pool(y).flatten().tolist()
        if self.how == "band_list":
            self.last = y.sum(dim=(1, 3)).tolist()  # the band's rows: each rank its own
        if self.how == "allclose":
            assert torch.allclose(self.c.weight, self.c.weight.detach().clone())  # True in the dry run
        if self.how == "band_numpy" and torch.isnan(y).any(dim=-1).any(dim=1).any(dim=0).numpy().any():  # per row
            raise ValueError("nan")
        return y


@pytest.mark.mpi(min_size=1)
def test_a_value_read_in_the_forward_has_the_runs_verdict(make_manager):
    """Of a tensor every rank holds whole: exact, and a row of the plan saying the dry run did not see it; of the
    band: refused by both (ConversionError naming the module and the call)."""
    for d, manager in domain(make_manager):
        for h in heights(d):
            shape = (1, 2, h, 4)
            for how, kind in (("param", "__float__()"), ("buffer", "__int__()"), ("mean", "__bool__()"),
                              ("mean_list", "tolist()"), ("allclose", "allclose()")):
                with bounded(f"{how} {shape} on {d}"):
                    plan = verdict_is_the_run(how, lambda how=how: Reads(how), shape, manager)
                row = next(r for r in plan.rows if r.kind == kind)
                assert plan.exact and "not seen on the meta device" in row.note and row.path == "<root>", str(plan)
            for how, kind in (("band_list", "tolist()"), ("band_numpy", "numpy()")):
                with bounded(f"{how} {shape} on {d}"):
                    plan = verdict_is_the_run(how, lambda how=how: Reads(how), shape, manager)
                if d > 1:
                    assert plan.rows[-1].kind == kind and "reads the band's values" in plan.rows[-1].note, str(plan)


def test_describe_names_a_value_read_the_forward_failed_after():
    """A check that raises on the dry run's stand-in (False): a ConversionError naming the read and the failure."""
    with pytest.raises(ConversionError, match=r"raised ValueError: not finite after reading 1 value.*<root> \(__bool__\(\)\)"):
        describe(Reads("strict").double(), (1, 2, 6, 4), 2)


def test_describe_goes_on_after_a_value_read():
    """The stand-in values have the read's type and shape, and the layers after it are planned."""

    class After(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            table = self.a.weight[0, 0].tolist()
            assert len(table) == 3 and len(table[0]) == 3 and table[0][0] == 0.0
            n = int(self.a.weight.new_ones(()).long())
            return self.b(self.a(x)) * (n + 1)

    plan = describe(After().double(), (1, 2, 9, 4), 3)
    assert plan.exact and [r.kind for r in plan.rows] == ["tolist()", "__int__()", "Conv2d", "Conv2d"], str(plan)
    assert plan.traffic is not None, str(plan)


# -- 3. a band of no row ---------------------------------------------------------------------------------------

EMPTY = {
    "conv": lambda: nn.Conv2d(2, 2, 3, padding=1),
    "conv_transpose": lambda: nn.ConvTranspose2d(2, 2, 2, stride=2),
    "group_norm": lambda: nn.GroupNorm(1, 2),
    "batch_norm": lambda: nn.BatchNorm2d(2),
    "instance_norm": lambda: nn.InstanceNorm2d(2),
    "layer_norm": lambda: nn.LayerNorm((2, 2, 4)),
    "upsample": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "max_pool": lambda: nn.MaxPool2d(2),
    "global_mean": lambda: nn.AdaptiveAvgPool2d(1),
    "adaptive": lambda: nn.AdaptiveAvgPool2d((2, 2)),
    "model": lambda: nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1), nn.GroupNorm(1, 2)),
}


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("name", sorted(EMPTY))
def test_an_empty_band_is_one_conversion_error(name, make_manager):
    """2 rows on 3 or 4 ranks: the same ConversionError on every rank, naming the layer, the bands and what would
    run; describe() refuses the same layer."""
    for d, manager in domain(make_manager):
        if d < 3:
            continue
        model = convert_to_domain_parallel(EMPTY[name]().double(), manager)
        x = torch.randn(1, 2, 2, 4, dtype=torch.float64)
        start, stop = bands_of(2, manager)
        with bounded(f"{name} on {d}"):
            msg = same_error_everywhere(manager.domain_group, lambda m=model, b=x[:, :, start:stop]: m(b), ConversionError)
        layer = "1" if name == "model" else "<root>"
        assert msg.startswith(f"{layer}:") and "use at most" in msg and ("holds no row" in msg or "no output row" in msg), msg
        if "holds no row" in msg:
            assert f"{[1, 1] + [0] * (d - 2)}" in msg and "at most 2 domain rank(s)" in msg, msg
        plan = describe(EMPTY[name]().double(), (1, 2, 2, 4), d)
        assert not plan.exact and next(r for r in plan.rows if not r.exact).path == layer, str(plan)


# -- 4. an unbatched input -------------------------------------------------------------------------------------


def tall(kernel=3, stride=2):
    """A strided conv and a conv, both windows only along the rows: a row read on the wrong dim has no halo."""
    return lambda: nn.Sequential(nn.Conv2d(2, 2, (kernel, 1), stride=(stride, 1), padding=(kernel // 2, 0)),
                                 nn.Conv2d(2, 2, (3, 1), padding=(1, 0)))


@pytest.mark.parametrize("build, stride", [(tall(), 2), (lambda: nn.Sequential(nn.MaxPool2d((2, 1)), nn.ConvTranspose2d(2, 2, (2, 1), (2, 1))), 2)])
def test_an_unbatched_row_is_the_batched_one(build, stride):
    """describe() of a ``(C, H, W)`` input: the rows (halo, stride, bands, traffic) of the ``(1, C, H, W)`` one."""
    for shape in ((2, 12, 6), (2, 13, 6)):
        one, batched = describe(build().double(), shape, 3), describe(build().double(), (1, *shape), 3)
        assert one.rows == batched.rows and one.traffic == batched.traffic, f"{one}\n{batched}"
        assert one.rows[0].stride == stride, str(one)


@pytest.mark.mpi(min_size=1)
def test_an_unbatched_input_has_the_runs_verdict(make_manager):
    """Exact on even and uneven bands; a halo of 2 rows on bands of 1 row is refused by the run and by describe()
    (which read the kernel's column dim and said exact)."""
    for d, manager in domain(make_manager):
        for h in heights(d):
            with bounded(f"unbatched {h} on {d}"):
                assert verdict_is_the_run("unbatched", tall(), (2, h, 6), manager).exact
        if d > 1:
            with bounded(f"unbatched thin on {d}"):
                plan = verdict_is_the_run("thin", tall(5, 1), (2, d, 6), manager)
            assert not plan.exact and "halo" in plan.rows[0].note, str(plan)
