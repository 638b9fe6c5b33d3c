"""credit_mpi.cli.bench: every measurement computes what it claims to (bit for bit); never its speed."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from credit_mpi import shard_tensor
from credit_mpi.cli import bench
from credit_mpi.partition import band_range

from .halo_reference import pad_numpy


def _field(rows: int, seed: int = 3) -> np.ndarray:
    """A small float32 global field (2, rows, 6), the same on every rank."""
    return np.random.default_rng(seed).standard_normal((2, rows, 6), dtype=np.float32)


def _expected_halo(full: np.ndarray, width: int, boundary: str, manager) -> np.ndarray:
    start, stop = band_range(full.shape[-2], manager.domain_parallel_size, manager.domain_rank, uneven=True)
    return pad_numpy(full, width, full.ndim - 2, boundary)[..., start : stop + 2 * width, :]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("width", [1, 2])
def test_halo_measurements_match_the_padded_field(make_manager, width):
    manager = make_manager()
    full = _field(3 * manager.domain_parallel_size + 1)  # uneven bands
    x = shard_tensor(full, -2, manager, uneven=True)
    expected = _expected_halo(full, width, "zero", manager)
    cases = {
        "credit": bench.halo_exchange_fn(x, width, manager),
        "credit check=False": bench.halo_exchange_fn(x, width, manager, check=False),
        "raw": bench.raw_halo(manager.domain_group, x, width),
    }
    for name, fn in cases.items():
        np.testing.assert_array_equal(fn(), expected, err_msg=name)
        np.testing.assert_array_equal(fn(), expected, err_msg=f"{name}, second call")
    bench.verify_identical(manager.domain_group, expected, {name: fn() for name, fn in cases.items()})


@pytest.mark.mpi(min_size=2)
def test_gloo_halo_matches_the_padded_field(make_manager):
    torch = pytest.importorskip("torch")
    manager = make_manager()
    full = _field(3 * manager.domain_parallel_size + 1)
    x = torch.from_numpy(shard_tensor(full, -2, manager, uneven=True))
    group = bench.gloo_group(manager)  # released by manager.free() (the fixture)
    for width in (1, 2):
        expected = _expected_halo(full, width, "zero", manager)
        np.testing.assert_array_equal(bench.gloo_halo_cat(x, width, group)().numpy(), expected)
        result = bench.halo_exchange_fn(x, width, manager, check=False)()
        assert isinstance(result, torch.Tensor)
        np.testing.assert_array_equal(result.numpy(), expected)


@pytest.mark.mpi(min_size=2)
def test_transport_measurements_match(make_manager):
    """gather and halo with transport 'mpi' and 'torch' (with and without out=), and the raw collectives."""
    torch = pytest.importorskip("torch")
    manager = make_manager()
    comm, n = manager.domain_group, manager.domain_parallel_size
    group = bench.gloo_group(manager)
    for rows in (2 * n, 2 * n + 1):  # even, uneven
        full = torch.from_numpy(_field(rows, seed=rows))
        band = shard_tensor(full, -2, manager, uneven=True)
        for transport in ("mpi", "torch"):
            for reuse in (False, True):
                fn = bench.credit_gather(band, manager, reuse=reuse, transport=transport)
                for _ in range(2):
                    assert torch.equal(fn(), full), (rows, transport, reuse)
        expected = _expected_halo(full.numpy(), 2, "periodic", manager)
        for transport in ("mpi", "torch"):
            fn = bench.halo_exchange_fn(band, 2, manager, boundary="periodic", transport=transport)
            np.testing.assert_array_equal(fn().numpy(), expected, err_msg=transport)

    band = shard_tensor(torch.from_numpy(_field(2 * n)), -2, manager)
    stacked = torch.stack(comm.allgather(band))
    for fn in (bench.raw_allgather(comm, band), bench.raw_torch_allgather(band, group),
               bench.raw_allgather(comm, band.numpy(), fresh=True)):
        result = fn()
        result = torch.from_numpy(result) if isinstance(result, np.ndarray) else result
        assert torch.equal(result, stacked)
    assert group is manager.torch_domain_group and bench.torch_group(manager) is group


@pytest.mark.mpi(min_size=2)
def test_verify_identical_fails_on_every_rank(make_manager):
    """One rank's wrong result stops all ranks, naming the method (no rank goes on to time alone)."""
    manager = make_manager()
    comm = manager.domain_group
    x = np.arange(6, dtype=np.float32)
    bench.verify_identical(comm, x, {"same": x.copy()})
    wrong = x.copy()
    if comm.Get_rank() == 1:
        wrong[0] = -0.0 if x[0] == 0 else -x[0]  # -0.0 == 0.0, but not the same bytes
    with pytest.raises(AssertionError, match=r"not bit-identical to the expected result: bad \(on rank\(s\) \[1\]\)"):
        bench.verify_identical(comm, x, {"good": x.copy(), "bad": wrong})
    with pytest.raises(AssertionError, match=r": float64 \(on rank"):
        bench.verify_identical(comm, x, {"float64": x.astype(np.float64)})


@pytest.mark.mpi(min_size=1)
def test_time_collective_number_runs_every_call(make_manager):
    manager = make_manager()
    calls = []
    t = bench.time_collective(manager.domain_group, lambda: calls.append(1), "count", 8, repeats=3, warmup=2, number=4)
    assert len(calls) == 2 + 3 * 4 and len(t.times) == 3
    with pytest.raises(ValueError, match="number"):
        bench.time_collective(MPI.COMM_SELF, lambda: None, "x", 1, number=0)


def _script(name: str):
    """A benchmark script of benchmarks/ as a module (its folder on sys.path: profile_halo imports bench_percall)."""
    import importlib.util
    import sys

    from .conftest import ROOT

    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=2)
def test_per_call_benchmark_scripts_run(capsys):
    """bench_percall (every method's result checked against the others) and profile_halo run, briefly.

    docs/performance.rst's per-call tables come from these scripts: a rename inside
    credit_mpi must not leave them broken (bench_percall once was, unnoticed).
    """
    pytest.importorskip("torch")
    from .conftest import reset_torch_distributed

    try:
        assert _script("bench_percall").main(["--repeats", "1", "--number", "2", "--sizes", "0.26 MB"]) == 0
    finally:
        reset_torch_distributed()
    assert _script("profile_halo").main(["--repeats", "1", "--number", "2"]) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        out = capsys.readouterr().out
        assert "halo fwd+bwd" in out and "gather" in out and "agreement of a repeated call" in out


@pytest.mark.mpi(min_size=2)
def test_attention_ops_benchmark_runs(capsys):
    """bench_attention_ops (every method's result checked against the others) runs, briefly, where the heads divide."""
    pytest.importorskip("torch")
    from .conftest import reset_torch_distributed

    module = _script("bench_attention_ops")
    if module.HEADS % MPI.COMM_WORLD.Get_size():
        pytest.skip(f"{module.HEADS} heads do not divide among {MPI.COMM_WORLD.Get_size()} ranks")
    try:
        assert module.main(["--repeats", "1", "--number", "2", "--sizes", "0.37 MB"]) == 0
    finally:
        reset_torch_distributed()
    if MPI.COMM_WORLD.Get_rank() == 0:
        out = capsys.readouterr().out
        assert all(op in out for op in ("alltoall", "allgather_along", "ring")), out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rows", ["uneven", "zero-row band"])
def test_raw_allgather_of_uneven_bands(world, rows):
    """Bands of different sizes: the raw baseline is one Allgatherv (an Allgather with different counts hangs)."""
    n = world.Get_size()
    h = 3 * n + 1 if rows == "uneven" else n - 1  # n - 1 rows: the last rank holds none
    x = bench.local_field((2, h, 5), -2, world)
    for fresh in (False, True):
        got = bench.raw_allgather(world, x, fresh=fresh)()
        parts = world.allgather(np.ascontiguousarray(x).tobytes())
        assert got.tobytes() == b"".join(parts) and got.nbytes == sum(len(p) for p in parts)


@pytest.mark.mpi(min_size=2)
def test_bench_gather_on_a_zero_row_band_and_halo_grid_says_why(world):
    """``credit-mpi bench`` with a band of no rows ends (it hung), and --ops halo_grid without a 2-D grid says why."""
    import argparse

    from credit_mpi.cli import run_bench

    n = world.Get_size()
    args = argparse.Namespace(domain_size=None, ops="gather", no_torch=True, size=[(2, n - 1, 4)], repeats=1)
    rows = run_bench(args, world, lambda *a, **k: None)
    assert [r["op"] for r in rows] == ["gather", "gather out="]
    said = []
    args.ops, args.size = "halo_grid", [(2, 4 * n, 8)]
    if bench.halo_grid_unavailable(n, n) is None:  # 4 ranks: a 2x2 grid, measured
        assert [r["op"] for r in run_bench(args, world, said.append)] == ["halo_grid"]
        return
    with pytest.raises(ValueError, match="halo_grid compares latitude bands with a 2-D grid.*run it on 4"):
        run_bench(args, world, said.append)
    args.ops = "gather,halo_grid"
    run_bench(args, world, said.append)
    assert any("note: halo_grid compares" in line for line in said), said
