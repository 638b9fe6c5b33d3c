"""The ``credit-mpi`` command: ``info``, ``demo``, ``bench`` and ``credit`` (:mod:`credit_mpi.credit`).

Run it under your MPI launcher, e.g.::

    mpiexec -n 4 credit-mpi info -d 2
    mpiexec -n 4 credit-mpi demo
    mpiexec -n 2 credit-mpi bench --plot bench.png

(``python -m credit_mpi ...`` is the same.) Every subcommand is collective
over ``MPI.COMM_WORLD`` and prints from rank 0 only. Started without a
launcher, it runs as a single rank and says so.

Each subcommand is a function ``cmd_<name>(args, comm, say) -> int`` so that
tests can run it in-process on any communicator.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import __version__
from .. import credit as credit_mod
from . import demo as demo_mod
from .common import _mismatch_hint
from .parsing import parse_on_rank0

__all__ = ["build_parser", "cmd_bench", "cmd_demo", "cmd_info", "layout_table", "main", "parse_size"]

Say = Callable[..., None]

THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}

ERA5_SHAPE = (721, 1440)
DEFAULT_SWEEP = ("4x90x180", "4x180x360", "4x360x720", "4x720x1440")


# --------------------------------------------------------------------------- parsing


def parse_size(text: str) -> tuple[int, int, int]:
    """``"CxHxW"`` (e.g. ``16x720x1440``) as three positive ints; argparse type."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"size must be CxHxW with positive integers, e.g. 16x720x1440; got {text!r}")
    return values  # type: ignore[return-value]


def parse_grid(text: str) -> tuple[int, int]:
    """``"2x3"`` -> ``(2, 3)`` (rows x cols of a domain grid)."""
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid is ROWSxCOLS such as 2x2, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"a grid needs at least one row and one column, got {text!r}")
    return rows, cols


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the valid values are in the message; --help has the rest)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``credit-mpi`` argument parser (no MPI calls)."""
    parser = _Parser(
        prog="credit-mpi",
        description="credit_mpi: MPI-native domain parallelism. Run under mpiexec/srun; output from rank 0.",
        epilog="example: mpiexec -n 4 credit-mpi info -d 2",
    )
    parser.add_argument("--version", action="version", version=f"credit_mpi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,bench,credit}", required=True)

    info = sub.add_parser("info", help="MPI library, threads, CUDA-awareness, GPUs per node, the rank layout")
    info.add_argument("-d", "--domain-size", type=_positive, default=None, help="show the layout for this domain size")
    info.add_argument("--grid", type=parse_grid, default=None, metavar="ROWSxCOLS",
                      help="show a latitude x longitude domain grid of the domain group (rows * cols = domain size)")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo", help="shard an ERA5-sized field, halo + convolve, gather back, check",
        description=demo_mod.__doc__.split("\n\n")[0],
    )
    demo_mod.add_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="time gather/shard_batch/halo against raw mpi4py and torch gloo")
    bench.add_argument(
        "-s", "--size", type=parse_size, action="append", default=None, metavar="CxHxW",
        help=f"global float32 field size, repeatable (default sweep: {' '.join(DEFAULT_SWEEP)})",
    )
    bench.add_argument("-d", "--domain-size", type=_positive, default=None, help="ranks per domain group (default: all)")
    bench.add_argument("-r", "--repeats", type=_positive, default=5, help="timed repetitions per row (default: 5)")
    bench.add_argument("--ops", default="gather,shard_batch,halo,halo_grid",
                       help="comma-separated subset of gather,shard_batch,halo,halo_grid (halo_grid: the same field's "
                            "halo on an (n x 1) and a square 2-D grid; needs a domain size with a 2-D grid, e.g. 4)")
    bench.add_argument("--no-torch", action="store_true", help="leave out the torch.distributed (gloo) column")
    bench.add_argument("--json", action="store_true", help="print JSON instead of the table")
    bench.add_argument("--plot", metavar="FILE.png", default=None,
                       help="draw each op's time as a ratio to raw, with its spread (needs matplotlib)")
    bench.set_defaults(func=cmd_bench)
    # `credit-mpi credit ...` is handed to credit_mpi.credit.main by main(); its parser here for --help and the docs
    credit = sub.add_parser("credit", help="run NCAR CREDIT's own trainer on credit_mpi (credit-mpi credit train -c "
                                           "config.yml)", description=credit_mod.DESCRIPTION, epilog=credit_mod.EPILOG)
    credit_mod.add_arguments(credit)
    return parser


def main(argv: Sequence[str] | None = None, comm: MPI.Comm | None = None) -> int:
    """Entry point of the ``credit-mpi`` console script; returns the exit status."""
    comm = MPI.COMM_WORLD if comm is None else comm
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["credit"]:
        from ..credit import main as credit_main

        return credit_main(argv[1:])
    args = parse_on_rank0(build_parser(), argv, comm)
    say = _rank0_printer(comm)
    try:
        return args.func(args, comm, say)
    except (ValueError, TypeError) as exc:
        # Library checks raise the same error on every rank; say it once.
        say(f"credit-mpi {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _rank0_printer(comm: MPI.Comm) -> Say:
    if comm.Get_rank() != 0:
        return lambda *a, **k: None

    def say(*a: Any, **k: Any) -> None:
        k.setdefault("flush", True)
        print(*a, **k)

    return say


def _check_domain_size(comm: MPI.Comm, d: int | None) -> int:
    size = comm.Get_size()
    d = size if d is None else d
    if d < 1 or size % d:
        divisors = [k for k in range(1, size + 1) if size % k == 0]
        raise ValueError(
            f"domain size {d} does not divide the {size} rank(s) of this job; "
            f"valid domain sizes: {', '.join(map(str, divisors))} (or change the number of ranks)"
            + _mismatch_hint(comm)
        )
    return d


def _single_rank_note(comm: MPI.Comm, say: Say, example: str) -> None:
    if comm.Get_size() == 1:
        hint = _mismatch_hint(comm)
        if hint:
            say("warning: a single MPI rank" + hint)
        else:
            say(f"note: this is a single MPI rank (started without mpiexec/srun?); try `{example}`")


# --------------------------------------------------------------------------- info


def layout_table(size: int, d: int, hosts: Sequence[str] | None = None) -> list[str]:
    """Lines of the domain x data-parallel table: which global ranks form which group."""
    groups = [list(range(g * d, (g + 1) * d)) for g in range(size // d)]
    lines = [f"{size} rank(s) = {size // d} data-parallel replica(s) x domain size {d}"]
    lines.append(f"  {'domain group':<14}{'global ranks (domain rank 0..' + str(d - 1) + ')':<40}hosts")
    for g, ranks in enumerate(groups):
        where = sorted({hosts[r] for r in ranks}) if hosts else []
        lines.append(f"  {g:<14}{ranks!s:<40}{', '.join(where)}")
    lines.append("  data-parallel groups (same band, different samples): " + " ".join(str(list(range(r, size, d))) for r in range(d)))
    return lines


def _gpu_facts(local_rank: int) -> dict:
    """What this rank can see of GPUs, without creating a CUDA context where avoidable."""
    facts: dict[str, Any] = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": 0, "names": [], "via": None}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        try:
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                facts.update(count=n, names=[torch.cuda.get_device_name(i) for i in range(n)], via="torch.cuda")
                return facts
            facts["via"] = "torch.cuda: no CUDA device"
        except Exception as exc:  # noqa: BLE001 - a broken driver is a finding, not a crash
            facts["via"] = f"torch.cuda error: {exc}"
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
            facts.update(count=n, names=names, via="cupy")
        except Exception as exc:  # noqa: BLE001
            facts["via"] = (facts["via"] or "") + f"; cupy: {exc}"
    elif torch is None:
        facts["via"] = "neither torch nor cupy installed"
    return facts


def _binding(local_rank: int, count: int) -> int | None:
    """The device this rank gets under credit_mpi.gpu.bind_device's rule: local rank mod GPUs on the node.

    (With ``CUDA_VISIBLE_DEVICES`` narrowed to one GPU per rank, that is 0.)
    Computed here rather than calling ``bind_device``, which would also make
    it the current device.
    """
    return local_rank % count if count else None


def format_cuda_report(report: dict) -> list[str]:
    """Lines for ``credit-mpi info`` from :func:`credit_mpi.gpu.cuda_awareness_report`'s dict."""
    lines = [f"verdict: {'CUDA-aware' if report.get('cuda_aware') else 'not CUDA-aware'} (all ranks agree)"
             if report.get("agreed", True) else
             f"verdict: {'CUDA-aware' if report.get('cuda_aware') else 'not CUDA-aware'} (ranks DISAGREE)"]
    lines.append(f"reason : {report.get('reason', '?')}")
    if not report.get("agreed", True):
        for r, item in enumerate(report.get("ranks", [])):
            lines.append(f"  rank {r}: {'yes' if item.get('cuda_aware') else 'no'} - {item.get('reason', '?')}")
    local = report.get("local") or {}
    lib = local.get("library") or {}
    if lib.get("symbol"):
        lines.append(f"rank 0 : {lib['symbol']}() = {lib.get('value')} in {lib.get('library')}")
    if local.get("memory_alloc_kinds"):
        lines.append(f"rank 0 : mpi_memory_alloc_kinds = {local['memory_alloc_kinds']}")
    for name, value in (local.get("env") or {}).items():
        lines.append(f"rank 0 : {name}={value}")
    if local.get("override") is not None:
        lines.append(f"rank 0 : override in effect: {local['override']}")
    return lines


def _cuda_awareness(comm: MPI.Comm) -> list[str]:
    """The verdict of credit_mpi.gpu and the reasons behind it."""
    from .. import gpu

    return format_cuda_report(gpu.cuda_awareness_report(comm))  # collective


def cmd_info(args: argparse.Namespace, comm: MPI.Comm, say: Say) -> int:
    """``credit-mpi info``: what a user runs first on a new cluster."""
    import mpi4py

    size = comm.Get_size()
    d = _check_domain_size(comm, args.domain_size)
    if args.grid is not None:
        from ..grid import check_grid
        from ..validation import allgather_or_raise

        allgather_or_raise(comm, lambda: check_grid(args.grid, d))  # the same ValueError on every rank
    say(f"credit_mpi {__version__}")
    _single_rank_note(comm, say, "mpiexec -n 4 credit-mpi info -d 2")
    lines = [" ".join(line.split()) for line in MPI.Get_library_version().splitlines() if line.strip()]
    library = " | ".join([lines[0]] + [line for line in lines[1:] if line.startswith("MPICH Device")]) if lines else "?"
    version = ".".join(map(str, MPI.Get_version()))
    vendor = " ".join(map(str, MPI.get_vendor())) if hasattr(MPI, "get_vendor") else "?"
    say(f"MPI library : {library[:160]}")
    say(f"MPI standard: {version}; mpi4py {mpi4py.__version__} (vendor: {vendor})")
    provided = MPI.Query_thread()
    say(f"threads     : {THREAD_LEVELS.get(provided, provided)} provided (mpi4py.rc.thread_level={mpi4py.rc.thread_level!r})")
    try:
        import torch

        say(f"torch       : {torch.__version__}")
    except ImportError:
        say("torch       : not installed (numpy only; install torch for tensors and the gloo baseline)")

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    facts = _gpu_facts(local_rank)
    me = {
        "host": MPI.Get_processor_name(),
        "local_rank": local_rank,
        "local_size": local_size,
        "slurm_localid": os.environ.get("SLURM_LOCALID"),
        "gpus": facts,
        "device": _binding(local_rank, facts["count"]),
    }
    everyone = comm.gather(me, root=0)
    awareness = _cuda_awareness(comm)

    say("CUDA-aware MPI:")
    for line in awareness:
        say(f"  {line}")
    if everyone is not None:
        hosts = [p["host"] for p in everyone]
        say(f"ranks       : {size} on {len(set(hosts))} node(s)")
        say(f"  {'rank':<6}{'host':<22}{'local':<7}{'SLURM_LOCALID':<15}{'CUDA_VISIBLE_DEVICES':<22}{'GPUs':<6}device")
        for r, p in enumerate(everyone):
            g = p["gpus"]
            device = f"cuda:{p['device']} ({g['names'][p['device']]})" if p["device"] is not None else f"- ({g['via']})"
            say(
                f"  {r:<6}{p['host'][:21]:<22}{p['local_rank']:<7}{p['slurm_localid'] or '-'!s:<15}"
                f"{g['visible'] if g['visible'] is not None else '(unset)'!s:<22}{g['count']:<6}{device}"
            )
        per_node: dict[str, list] = {}
        for p in everyone:
            per_node.setdefault(p["host"], []).append(p["device"])
        for host, devices in per_node.items():
            used = [x for x in devices if x is not None]
            if len(used) != len(set(used)):
                say(f"  warning: ranks on {host} share GPUs ({devices}); usually one rank per GPU is wanted")
        say("layout:")
        for line in layout_table(size, d, hosts):
            say(line)
    if args.grid is not None:
        from ..grid import format_grid

        say(f"grid for ERA5 0.25 degrees ({ERA5_SHAPE[0]} x {ERA5_SHAPE[1]}; rank: block rows x cols):")
        for line in format_grid(args.grid, ERA5_SHAPE):
            say(f"  {line}")
    return 0


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace, comm: MPI.Comm, say: Say) -> int:
    """``credit-mpi demo``: see :mod:`credit_mpi.demo`."""
    _check_domain_size(comm, args.domain_size)
    return demo_mod.run(args, comm, say)


# --------------------------------------------------------------------------- bench


def run_bench(args: argparse.Namespace, comm: MPI.Comm, say: Say) -> list[dict]:
    """The sweep behind ``credit-mpi bench``; returns one row per (operation, size), same on every rank.

    ``say`` prints its notes (``cmd_bench`` sends them to stderr).
    """
    from ..manager import DomainParallelManager
    from . import bench

    d = _check_domain_size(comm, args.domain_size)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - {"gather", "shard_batch", "halo", "halo_grid"}
    if unknown:
        raise ValueError(f"unknown --ops {sorted(unknown)}; choose from gather, shard_batch, halo, halo_grid")
    use_torch = not args.no_torch and comm.allreduce(bench.torch_available(), op=MPI.LAND)
    if not args.no_torch and not use_torch:
        say("note: torch is not installed on every rank; the torch.distributed (gloo) column is left out")
    sizes = args.size or [parse_size(s) for s in DEFAULT_SWEEP]
    rows: list[dict] = []
    with DomainParallelManager(None, d, comm=comm) as manager:
        dom = manager.domain_group
        group = bench.gloo_group(manager) if use_torch and {"gather", "halo"} & set(ops) else None
        rep = {"repeats": args.repeats, "warmup": 1}
        for c, h, w in sizes:
            total = c * h * w * 4
            x = bench.local_field((c, h, w), -2, dom, seed=manager.dp_rank)
            if "gather" in ops:
                # the same allocation policy on both sides: a new output per call, then one reused output
                row = {"op": "gather", "size": f"{c}x{h}x{w}", "bytes": total}
                row["credit"] = bench.time_collective(dom, bench.credit_gather(x, manager), "credit_mpi", total, **rep)
                row["raw"] = bench.time_collective(dom, bench.raw_allgather(dom, x, fresh=True), "raw mpi4py", x.nbytes * d, **rep)
                if use_torch and h % d == 0:
                    row["torch"] = bench.time_collective(dom, bench.gloo_all_gather_cat(x, -2, group), "gloo", total, **rep)
                rows.append(row)
                row = {"op": "gather out=", "size": f"{c}x{h}x{w}", "bytes": total}
                row["credit"] = bench.time_collective(dom, bench.credit_gather(x, manager, reuse=True), "credit_mpi", total, **rep)
                row["raw"] = bench.time_collective(dom, bench.raw_allgather(dom, x), "raw mpi4py", x.nbytes * d, **rep)
                rows.append(row)
            if "shard_batch" in ops:
                batch = {"x": np.random.default_rng(0).standard_normal((1, c, h, w), dtype=np.float32)}
                mine = x.nbytes
                row = {"op": "shard_batch", "size": f"{c}x{h}x{w}", "bytes": mine}
                row["credit"] = bench.time_collective(dom, bench.credit_shard_batch(batch, manager), "credit_mpi", mine, **rep)
                row["raw"] = bench.time_collective(dom, bench.raw_slice_copy(batch, dom), "slice copy", mine, **rep)
                rows.append(row)
            if "halo" in ops:
                fn = bench.halo_exchange_fn(x, 1, manager)
                padded = x.nbytes + 2 * c * w * 4  # the result: the band and its two halo rows
                row = {"op": "halo", "size": f"{c}x{h}x{w}", "bytes": padded}
                row["credit"] = bench.time_collective(dom, fn, "credit_mpi", padded, **rep)
                row["raw"] = bench.time_collective(dom, bench.raw_halo(dom, x, 1), "copy + Sendrecv", padded, **rep)
                if use_torch:
                    row["torch"] = bench.time_collective(dom, bench.gloo_halo_cat(x, 1, group), "gloo", padded, **rep)
                rows.append(row)
    why = bench.halo_grid_unavailable(d, comm.Get_size()) if "halo_grid" in ops else None
    if "halo_grid" in ops and why is None:
        for c, h, w in sizes:
            if h >= 2 * d and w % 2 == 0:
                rows.append(bench.halo_grid_comparison(comm, (c, h, w), 1, repeats=args.repeats, seed=1))
    if why is not None:  # said, not silently an empty table (an error when nothing else was measured)
        if not rows:
            raise ValueError(why)
        say(f"note: {why}")
    return rows


def _table(rows: list[dict]) -> list[str]:
    header = (
        f"{'op':<12}{'size':<13}{'MB':>8}{'credit_mpi ms':>15}{'GB/s':>8}{'raw ms':>10}{'GB/s':>8}{'x raw':>7}"
        f"{'gloo ms':>10}{'x credit':>10}"
    )
    lines = [header]
    grid_rows = [r for r in rows if r["op"] == "halo_grid"]
    rows = [r for r in rows if r["op"] != "halo_grid"]
    for r in rows:
        c, raw, t = r["credit"], r["raw"], r.get("torch")
        line = (
            f"{r['op']:<12}{r['size']:<13}{r['bytes'] / 1e6:>8.2f}{c.median * 1e3:>15.3f}{c.gbps:>8.2f}"
            f"{raw.median * 1e3:>10.3f}{raw.gbps:>8.2f}{c.median / raw.median:>7.2f}"
        )
        if t is not None:
            line += f"{t.median * 1e3:>10.3f}{t.median / c.median:>10.2f}"
        else:
            line += f"{'-':>10}{'-':>10}"
        lines.append(line)
    if grid_rows:
        lines.append("")
        lines.append("halo of the same field on latitude bands (n x 1) and on a 2-D grid: width (1, 1), earth x periodic; "
                     "bytes = received from other ranks, all ranks / the busiest rank")
        lines.append(f"{'size':<13}{'grid':<6}{'MB all':>9}{'MB max':>9}{'ms':>9}{'grid':>6}{'MB all':>9}{'MB max':>9}"
                     f"{'ms':>9}{'bytes 2d/1d':>13}{'time 2d/1d':>12}")
        for r in grid_rows:
            t1, t2 = r["time_1d"], r["time_2d"]
            lines.append(
                f"{r['size']:<13}{r['grid_1d']:<6}{r['bytes_1d'] / 1e6:>9.3f}{r['max_bytes_1d'] / 1e6:>9.3f}{t1.median * 1e3:>9.3f}"
                f"{r['grid_2d']:>6}{r['bytes_2d'] / 1e6:>9.3f}{r['max_bytes_2d'] / 1e6:>9.3f}{t2.median * 1e3:>9.3f}"
                f"{r['bytes_2d'] / r['bytes_1d']:>13.2f}{t2.median / t1.median:>12.2f}"
            )
    return lines


def ratio_spread(num: Any, den: Any) -> tuple[float, float, float]:
    """``num``'s time over ``den``'s (two :class:`~credit_mpi.cli.bench.Timing`): the ratio of the medians, and
    the 25th and 75th percentiles of the ratios over every pair of repetitions (their spread)."""
    pairs = np.divide.outer(np.asarray(num.times, dtype=float), np.asarray(den.times, dtype=float)).ravel()
    low, high = np.percentile(pairs, [25, 75])
    return num.median / den.median, float(low), float(high)


def _field_mb(size: str) -> float:
    """The global float32 field ``CxHxW`` in MB (the x axis of every panel)."""
    return float(np.prod([int(v) for v in size.split("x")])) * 4 / 1e6


def plot_series(rows: list[dict]) -> dict[str, list[tuple[str, list[tuple[float, float, float, float]]]]]:
    """What ``--plot`` draws: per operation, ``(label, [(field MB, ratio, low, high), ...])`` per curve.

    Every curve is a time ratio to the operation's floor (raw mpi4py, a
    slice copy, copy + Sendrecv), with its spread (:func:`ratio_spread`);
    ``halo_grid`` is the 2-D grid's time over latitude bands'.
    """
    panels: dict[str, list] = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        if op == "halo_grid":
            pairs = [(f"{mine[0]['grid_2d']} grid / {mine[0]['grid_1d']} bands", "time_2d", "time_1d")]
        else:
            floor = mine[0]["raw"].name
            pairs = [(f"{mine[0][key].name} / {floor}", key, "raw") for key in ("credit", "torch") if any(key in r for r in mine)]
        panels[op] = [
            (label, [(_field_mb(r["size"]), *ratio_spread(r[num], r[den])) for r in mine if num in r])
            for label, num, den in pairs
        ]
    return panels


def _plot(rows: list[dict], path: str, ranks: int) -> None:
    """One panel per operation: time ratio to its floor (1 = as fast as raw) against the field size, with spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = plot_series(rows)
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows + 0.9), squeeze=False, layout="constrained")
    for ax, (op, curves) in zip(axes.flat, panels.items(), strict=False):  # the grid may have a spare panel
        for i, (label, pts) in enumerate(curves):
            mb, ratio, low, high = (np.array(v) for v in zip(*pts, strict=True))
            ax.errorbar(mb, ratio, yerr=[ratio - low, high - ratio], fmt="-o", ms=4, capsize=3, color=f"C{i}", label=label)
        ax.axhline(1.0, color="0.3", lw=1, ls="--", label="1 = the floor" if op == next(iter(panels)) else None)
        ax.set_xscale("log")
        ax.set_yscale("log")  # 2x slower and 2x faster are as far from 1
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_title(op)
        ax.set_xlabel("field size, MB (float32, global)")
        ax.set_ylabel("time / floor's time" if op != "halo_grid" else "time / bands' time")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(len(handles), 3), fontsize=8)
    fig.suptitle(f"credit-mpi bench, {ranks} rank(s): time ratio to raw (median; bars: middle half over pairs of "
                 "repetitions)", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_plot_possible(comm: MPI.Comm) -> None:
    """``--plot`` needs matplotlib on rank 0 (which draws); a ValueError on every rank if it is missing."""
    from ..validation import allgather_or_raise

    def check() -> None:
        if comm.Get_rank() == 0 and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(
                "--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or the package's `plot` extra: pip install \".[plot]\" from a checkout), or leave out --plot"
            )

    allgather_or_raise(comm, check)


def _to_stderr(say: Say) -> Say:
    """``say`` to stderr: notes beside the results, so that stdout is the table or the JSON alone."""
    return lambda *a, **k: say(*a, **{**k, "file": sys.stderr})


def cmd_bench(args: argparse.Namespace, comm: MPI.Comm, say: Say) -> int:
    """``credit-mpi bench``: a table (or JSON, or a plot) of credit_mpi against its floors.

    stdout is the table, or with ``--json`` one JSON document; notes (a single
    rank, an operation left out) go to stderr.
    """
    note = _to_stderr(say)
    _single_rank_note(comm, note, "mpiexec -n 2 credit-mpi bench")
    if args.plot:
        _check_plot_possible(comm)  # before the sweep, not after it
    if not args.json:
        say(f"{comm.Get_size()} rank(s); median of {args.repeats} repetitions, slowest rank; GB/s = result bytes per rank / time", flush=True)
    rows = run_bench(args, comm, note)
    if comm.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps({"ranks": comm.Get_size(), "rows": [
            {k: (v.as_dict() if hasattr(v, "as_dict") else v) for k, v in r.items()} for r in rows
        ]}, indent=1))
    else:
        for line in _table(rows):
            say(line)
        say("raw: gather = mpi4py Allgather of the same bytes (contiguous, reused buffer); "
            "shard_batch = numpy slice copy of the band; halo = a padded copy of the band + two Sendrecv of one row (zero at the edges). "
            "gloo = the reference's methods over torch.distributed: gather = all_gather into a list + torch.cat, "
            "halo = batch_isend_irecv of the edge rows + torch.cat")
    if args.plot:
        _plot(rows, args.plot, comm.Get_size())
        note(f"wrote {args.plot}")
    return 0
