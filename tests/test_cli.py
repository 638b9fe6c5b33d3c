"""The ``credit-mpi`` command: argument parsing (serial) and the subcommands run in-process (MPI)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi import cli
from credit_mpi.cli import bench
from credit_mpi.cli.demo import conv3x3, synthetic_field

# ----------------------------------------------------------------------------- serial


def test_parse_size_accepts_cxhxw():
    assert cli.parse_size("16x720x1440") == (16, 720, 1440)
    assert cli.parse_size("2X3x4") == (2, 3, 4)


@pytest.mark.parametrize("text", ["16x720", "axbxc", "0x2x2", "1x2x3x4", ""])
def test_parse_size_rejects_bad_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="CxHxW"):
        cli.parse_size(text)


def test_parser_subcommands_and_defaults():
    p = cli.build_parser()
    args = p.parse_args(["info", "-d", "2"])
    assert args.command == "info" and args.domain_size == 2 and args.func is cli.cmd_info
    args = p.parse_args(["demo"])
    assert (args.lat, args.lon, args.channels, args.domain_size) == (721, 1440, 8, None)
    args = p.parse_args(["bench", "-s", "1x8x16", "-s", "2x4x4", "--json", "--plot", "x.png"])
    assert args.size == [(1, 8, 16), (2, 4, 4)] and args.json and args.plot == "x.png"
    assert p.parse_args(["bench"]).size is None


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["info", "-d", "0"], ["bench", "-r", "-1"], ["bench", "-s", "3x3"]])
def test_parser_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_layout_table_matches_the_spec_example():
    lines = cli.layout_table(8, 2, ["n0"] * 4 + ["n1"] * 4)
    assert lines[0] == "8 rank(s) = 4 data-parallel replica(s) x domain size 2"
    assert "[0, 1]" in lines[2] and "n0" in lines[2]
    assert "[6, 7]" in lines[5] and "n1" in lines[5]
    assert lines[-1].endswith("[0, 2, 4, 6] [1, 3, 5, 7]")


def test_domain_size_that_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match=r"domain size 3 does not divide the 1 rank\(s\).*valid domain sizes: 1"):
        cli._check_domain_size(MPI.COMM_SELF, 3)
    assert cli._check_domain_size(MPI.COMM_SELF, None) == 1


def test_conv3x3_on_bands_matches_the_whole_field():
    """The demo's check relies on this: a band padded with its neighbours' rows convolves like the whole."""
    field = synthetic_field(1, 2, 13, 16, seed=3)
    w = np.random.default_rng(0).standard_normal((2, 3, 3)).astype(np.float32)
    pad = np.zeros_like(field[..., :1, :])
    full = conv3x3(np.concatenate([pad, field, pad], axis=-2), w)
    padded = np.concatenate([pad, field, pad], axis=-2)
    parts = [conv3x3(padded[..., a : b + 2, :], w) for a, b in ((0, 7), (7, 13))]
    np.testing.assert_allclose(np.concatenate(parts, axis=-2), full, rtol=0, atol=1e-6)
    # and against a direct loop on one point, periodic in longitude
    i, j = 5, 0
    direct = sum(w[1, a, b] * padded[0, 1, i + a, (j + b - 1) % 16] for a in range(3) for b in range(3))
    assert abs(full[0, 1, i, j] - direct) < 1e-5


def test_timing_statistics():
    t = bench.Timing("x", 2_000_000_000, [2.0, 1.0, 4.0])
    assert t.median == 2.0 and t.best == 1.0 and t.gbps == pytest.approx(1.0)
    assert t.as_dict()["median_s"] == 2.0


# ----------------------------------------------------------------------------- MPI, in-process


def _run(capsys, argv):
    rc = cli.main(argv)
    rcs = MPI.COMM_WORLD.allgather(rc)
    return rcs, capsys.readouterr()


@pytest.mark.mpi(min_size=1)
def test_info_prints_library_layout_from_rank0_only(capsys):
    world = MPI.COMM_WORLD
    rcs, out = _run(capsys, ["info", "-d", "1"])
    assert rcs == [0] * world.Get_size()
    if world.Get_rank() == 0:
        assert "MPI library" in out.out and "mpi4py" in out.out and "CUDA-aware MPI" in out.out
        assert f"{world.Get_size()} rank(s) = {world.Get_size()} data-parallel replica(s) x domain size 1" in out.out
        assert out.out.count("\n  0 ") >= 1  # rank rows
        assert ("single MPI rank" in out.out) == (world.Get_size() == 1)
    else:
        assert out.out == ""


@pytest.mark.mpi(min_size=2)
def test_info_rejects_a_domain_size_that_does_not_divide(capsys):
    world = MPI.COMM_WORLD
    bad = world.Get_size() + 1
    rcs, out = _run(capsys, ["info", "-d", str(bad)])
    assert rcs == [2] * world.Get_size()
    if world.Get_rank() == 0:
        assert f"domain size {bad} does not divide" in out.err


@pytest.mark.mpi(min_size=1)
def test_tiny_demo_passes_its_checks(capsys):
    world = MPI.COMM_WORLD
    rcs, out = _run(capsys, ["demo", "--lat", str(4 * world.Get_size() + 1), "--lon", "16", "-c", "2", "--steps", "1"])
    assert rcs == [0] * world.Get_size()
    if world.Get_rank() == 0:
        assert "[1/3] shard" in out.out and "[3/3] gather" in out.out
        assert "check gather (bit for bit): ok" in out.out
        assert "all checks passed on every rank" in out.out
        assert "check halo + convolution: ok" in out.out and "max |error| vs one process" in out.out


@pytest.mark.mpi(min_size=1)
def test_tiny_bench_json(capsys):
    world = MPI.COMM_WORLD
    h = 4 * world.Get_size()
    # the default --ops: halo_grid is left out with a note on 1-3 ranks, and the note is not part of the JSON
    rcs, out = _run(capsys, ["bench", "-s", f"2x{h}x8", "-r", "1", "--no-torch", "--json"])
    assert rcs == [0] * world.Get_size()
    if world.Get_rank() == 0:
        result = json.loads(out.out)  # the whole stdout is one JSON document
        left_out = bench.halo_grid_unavailable(world.Get_size(), world.Get_size())
        assert ("note: halo_grid" in out.err) == (left_out is not None), out.err
        assert ("single MPI rank" in out.err) == (world.Get_size() == 1), out.err
        assert {r["op"] for r in result["rows"]} >= ({"halo_grid"} if left_out is None else set())
        assert result["ranks"] == world.Get_size()
        ops = {r["op"] for r in result["rows"]}
        assert {"gather", "gather out=", "shard_batch"} <= ops
        assert "halo" in ops
        gather = next(r for r in result["rows"] if r["op"] == "gather")
        assert gather["bytes"] == 2 * h * 8 * 4 and gather["credit"]["median_s"] > 0


@pytest.mark.mpi(min_size=1)
def test_bench_table_rejects_unknown_ops(capsys):
    world = MPI.COMM_WORLD
    rcs, out = _run(capsys, ["bench", "-s", "1x4x4", "--ops", "gather,warp", "--no-torch"])
    assert rcs == [2] * world.Get_size()
    if world.Get_rank() == 0:
        assert "unknown --ops ['warp']" in out.err


@pytest.mark.mpi(min_size=1)
def test_measurements_agree_with_credit_gather(make_manager):
    """raw Allgather and the reference's method (when torch is here) gather the same values."""
    world = MPI.COMM_WORLD
    manager = make_manager()
    # slices of >= 32 KiB: gathered straight into place (smaller ones use bounded scratch)
    x = bench.local_field((2, 4 * world.Get_size(), 4096), -2, manager.domain_group, seed=7)
    mine = bench.credit_gather(x, manager)()
    raw = bench.raw_allgather(manager.domain_group, x)
    raw()  # fills its own buffer; same bytes, dim-0 blocks
    parts = manager.domain_group.allgather(x)
    np.testing.assert_array_equal(mine, np.concatenate(parts, axis=-2))
    extra, out = bench.gather_extra_memory(x, manager)
    assert out == mine.nbytes and extra < out
    ref_extra, _ = bench.reference_extra_memory(x, manager.domain_group)
    if world.Get_size() > 1:
        assert ref_extra >= out, (ref_extra, out)  # the list of n shards is a second copy of the field
    torch = pytest.importorskip("torch")
    group = bench.gloo_group(manager)  # released by manager.free() (the fixture)
    ref = bench.gloo_all_gather_cat(torch.from_numpy(x), -2, group)()
    np.testing.assert_array_equal(ref.numpy(), mine)


def test_format_cuda_report_says_verdict_reason_and_disagreement():
    agreed = {
        "cuda_aware": True, "reason": "CUDA-aware: MPIX_Query_cuda_support() reports CUDA support", "agreed": True,
        "ranks": [{"cuda_aware": True, "reason": "x"}],
        "local": {"override": None, "library": {"value": 1, "symbol": "MPIX_Query_cuda_support", "library": "libmpi.so"},
                  "memory_alloc_kinds": None, "env": {"MPICH_GPU_SUPPORT_ENABLED": "1"}, "mpi": "MPICH"},
    }
    lines = cli.format_cuda_report(agreed)
    assert lines[0] == "verdict: CUDA-aware (all ranks agree)"
    assert any("MPIX_Query_cuda_support() = 1 in libmpi.so" in x for x in lines)
    assert any("MPICH_GPU_SUPPORT_ENABLED=1" in x for x in lines)
    split = dict(agreed, cuda_aware=False, agreed=False, reason="ranks disagree",
                 ranks=[{"cuda_aware": True, "reason": "a"}, {"cuda_aware": False, "reason": "b"}])
    lines = cli.format_cuda_report(split)
    assert lines[0] == "verdict: not CUDA-aware (ranks DISAGREE)"
    assert "  rank 1: no - b" in lines


@pytest.mark.mpi(min_size=1)
def test_raw_halo_floor_matches_halo_exchange(make_manager):
    """The bench's raw halo baseline computes what credit_mpi.halo_exchange (zero boundary) computes."""
    from credit_mpi import halo
    manager = make_manager()
    x = bench.local_field((2, 3 * manager.domain_world_size + 1, 5), -2, manager.domain_group, seed=4)
    expected = halo.halo_exchange(x, 1, dim=-2, manager=manager, boundary="zero")
    np.testing.assert_array_equal(bench.raw_halo(manager.domain_group, x, 1)(), expected)


def test_single_rank_under_a_foreign_launcher_is_explained(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(ValueError, match="launcher started 4 processes but MPI sees 1 rank"):
        cli._check_domain_size(MPI.COMM_SELF, 2)
    lines = []
    cli._single_rank_note(MPI.COMM_SELF, lambda *a, **k: lines.append(" ".join(a)), "x")
    assert "different MPI" in lines[0]
    monkeypatch.delenv("PMI_SIZE")
    for var in ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "PALS_SIZE"):
        monkeypatch.delenv(var, raising=False)
    lines.clear()
    cli._single_rank_note(MPI.COMM_SELF, lambda *a, **k: lines.append(" ".join(a)), "mpiexec -n 4 x")
    assert "single MPI rank (started without mpiexec/srun?)" in lines[0]


def test_plot_writes_a_png(tmp_path):
    import matplotlib  # noqa: F401 - the plot extra is part of `make test` (EXTRAS): this test must not skip
    rows = [
        {"op": "gather", "size": f"1x{h}x8", "bytes": h * 32,
         "credit": bench.Timing("credit_mpi", h * 32, [1e-4 * h]), "raw": bench.Timing("raw mpi4py", h * 32, [5e-5 * h])}
        for h in (8, 16, 32)
    ]
    rows.append({"op": "halo_grid", "size": "1x8x8", "grid_1d": "4x1", "grid_2d": "2x2",
                 "time_1d": bench.Timing("4x1 halo", 8, [2.0, 4.0]), "time_2d": bench.Timing("2x2 halo", 8, [1.0, 1.0])})
    path = tmp_path / "bench.png"
    cli._plot(rows, str(path), 2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_shows_each_op_as_a_ratio_to_its_floor_with_its_spread():
    """One panel per op; each curve a time ratio to the floor (the ratio of the medians, the middle half of the pairs)."""
    rows = [
        {"op": "halo", "size": "1x100x100", "bytes": 1, "credit": bench.Timing("credit_mpi", 1, [2.0, 3.0, 4.0]),
         "raw": bench.Timing("copy + Sendrecv", 1, [1.0, 2.0]), "torch": bench.Timing("gloo", 1, [6.0])},
        {"op": "gather", "size": "1x250x100", "bytes": 1, "credit": bench.Timing("credit_mpi", 1, [1.0]),
         "raw": bench.Timing("raw mpi4py", 1, [0.5])},
        {"op": "halo_grid", "size": "1x8x8", "grid_1d": "4x1", "grid_2d": "2x2",
         "time_1d": bench.Timing("4x1 halo", 8, [2.0]), "time_2d": bench.Timing("2x2 halo", 8, [1.0])},
    ]
    panels = cli.plot_series(rows)
    assert list(panels) == ["halo", "gather", "halo_grid"]
    (label, pts), (gloo_label, gloo_pts) = panels["halo"]
    assert label == "credit_mpi / copy + Sendrecv" and gloo_label == "gloo / copy + Sendrecv"
    # pairs: 2/1 3/1 4/1 2/2 3/2 4/2 = 1 1.5 2 2 3 4; quartiles 1.625 and 2.75; medians 3 / 1.5 = 2
    assert pts == [(0.04, 2.0, 1.625, 2.75)]
    assert gloo_pts == [(0.04, 4.0, 3.75, 5.25)]  # 6/2, 6/1: quartiles 3.75, 5.25
    assert panels["gather"] == [("credit_mpi / raw mpi4py", [(0.1, 2.0, 2.0, 2.0)])]
    assert panels["halo_grid"] == [("2x2 grid / 4x1 bands", [(pytest.approx(256e-6), 0.5, 0.5, 0.5)])]


@pytest.mark.mpi(min_size=1)
def test_plot_without_matplotlib_fails_before_the_sweep(capsys, monkeypatch, tmp_path):
    """--plot checks for matplotlib first: exit 2 on every rank, without running the sweep."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))

    def sweep(*args, **kwargs):
        raise AssertionError("the sweep ran although --plot cannot work")

    monkeypatch.setattr(cli, "run_bench", sweep)
    rcs, out = _run(capsys, ["bench", "-s", "1x8x16", "--plot", str(tmp_path / "x.png")])
    assert rcs == [2] * MPI.COMM_WORLD.Get_size()
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "--plot needs matplotlib" in out.err and "[plot]" in out.err


# ----------------------------------------------------------------------------- every documented option, run


def _grid_for(size: int) -> str:
    rows = max(r for r in range(1, size + 1) if size % r == 0 and r * r <= size)
    return f"{rows}x{size // rows}"


def documented_runs(size: int, plot: str) -> list[list[str]]:
    """Command lines that between them use every option of docs/cli.rst (small fields, one repetition)."""
    h = 4 * size
    return [
        ["info", "--domain-size", str(size), "--grid", _grid_for(size)],
        ["info", "-d", "1", "--grid", "1x1"],
        ["demo", "-d", "1", "-c", "2", "--lat", str(size + 3), "--lon", "16", "--steps", "1"],
        ["demo", "--domain-size", str(size), "--channels", "1", "--lat", str(size), "--lon", "8", "--steps", "1"],
        ["bench", "-s", f"1x{h}x8", "-d", "1", "-r", "1", "--ops", "gather,halo", "--no-torch", "--json"],
        ["bench", "--size", f"1x{h}x8", "--domain-size", str(size), "--repeats", "1", "--ops", "shard_batch",
         "--no-torch", "--plot", plot],
    ]


def test_documented_runs_use_every_option():
    """When the command gains an option, the runs below must use it (docs/cli.rst must name it: test_docs).

    ``credit`` (CREDIT's trainer, a subprocess job of its own) is run by tests/test_credit_trainer.py.
    """
    used = {w for argv in documented_runs(4, "x.png") for w in argv if w.startswith("-")}
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = {s for name, p in sub.choices.items() if name != "credit"
               for a in p._actions for s in a.option_strings} - {"-h", "--help"}
    assert options == used, (sorted(options - used), sorted(used - options))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("k", range(6))
def test_every_documented_option_runs(k, capsys, tmp_path):
    world = MPI.COMM_WORLD
    argv = documented_runs(world.Get_size(), str(tmp_path / "bench.png"))[k]
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    rcs, out = _run(capsys, argv)
    assert rcs == [0] * world.Get_size(), (argv, out.err)
    if world.Get_rank() != 0:
        assert out.out == "" and out.err == ""
    elif argv[0] == "info" and "--grid" in argv:
        grid = argv[argv.index("--grid") + 1]
        assert f"domain grid {grid}" in out.out and "r0 " in out.out
    elif argv[0] == "demo":
        assert "all checks passed on every rank" in out.out and "bytes moved:" in out.out
    elif "--plot" in argv:
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("argv", "says"), [
    (["demo", "-c", "0"], "the channel count must be an integer >= 1, got '0'"),
    (["demo", "--lat", "0"], "the latitude count must be an integer >= 1, got '0'"),
    (["demo", "--steps", "x"], "the step count must be an integer >= 1, got 'x'"),
    (["info", "--grid", "2"], "a grid is ROWSxCOLS such as 2x2"),
])
def test_usage_errors_are_one_line_naming_valid_values(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv, comm=MPI.COMM_SELF)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


@pytest.mark.mpi(min_size=2)
def test_usage_errors_come_from_rank0_only(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "-c", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("the channel count" in err) == (MPI.COMM_WORLD.Get_rank() == 0), err


@pytest.mark.mpi(min_size=2)
def test_demo_lat_below_the_domain_size_is_one_clear_error(capsys):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    rcs, out = _run(capsys, ["demo", "--lat", str(n - 1), "--lon", "8", "--steps", "1"])
    assert rcs == [2] * n
    if world.Get_rank() == 0:
        assert f"use --lat {n} or more" in out.err and "halo_width" not in out.err, out.err
        assert out.err.count("\n") == 1
    else:
        assert out.err == ""


@pytest.mark.mpi(min_size=2)
def test_info_grid_that_does_not_fit_names_the_grids_that_do(capsys):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    rcs, out = _run(capsys, ["info", "--grid", f"{n + 1}x1"])
    assert rcs == [2] * n
    if world.Get_rank() == 0:
        assert "grids that fit" in out.err and f"1x{n}" in out.err, out.err
