"""gather_tensor on an ERA5-sized field against its floors and the reference.

    mpiexec -n 2 python benchmarks/gather_era5.py [--repeats 10] [--json]

A float32 field of 16 x 720 x 1440 (66 MB) split by latitude over the ranks
(2 in the target setting). Printed, with the targets in brackets:

* gather_tensor(dim=-2) time over raw mpi4py ``Allgather`` of the same bytes,
  for numpy arrays and for torch CPU tensors                    [<= 1.25x];
  the raw call into a reused buffer (the floor) and into a new buffer per
  call (what any gather that returns a new array pays: first touch of the
  output's pages)
* the reference's method (torch.distributed gloo ``all_gather`` into a list
  of n tensors + ``torch.cat``) over gather_tensor (torch)      [>= 5x]
* extra memory of gather_tensor beyond its output, tracemalloc peak during
  the call minus the output's bytes, numpy (numpy reports its buffers to
  tracemalloc); the reference's list + concatenate measured the same way
  for comparison                                                [<= 0.25x output]
* the same with ``gather_tensor(..., out=buffer)`` reusing one output, as
  the raw ``Allgather`` does (no fresh allocation + first touch per call)
* a 721-row uneven gather (Allgatherv) over the 720-row even one [<= 1.15x]

Times are medians over ``--repeats`` of the slowest rank (credit_mpi.cli.bench).
All measurements live in credit_mpi/cli/bench.py; this script only arranges them.
"""

from __future__ import annotations

import argparse
import json
import sys

from mpi4py import MPI

from credit_mpi import DomainParallelManager
from credit_mpi.cli import bench


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16x720x1440", help="global C x H x W (default 16x720x1440)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    world = MPI.COMM_WORLD
    c, h, w = (int(v) for v in args.shape.lower().split("x"))
    have_torch = bench.torch_available()
    results: dict = {"ranks": world.Get_size(), "shape": [c, h, w], "dtype": "float32"}
    with DomainParallelManager(None, world.Get_size()) as manager:
        comm = manager.domain_group
        rep = {"repeats": args.repeats, "warmup": 2}
        nbytes = c * h * w * 4

        def gather_timings(kind: str, x) -> dict:
            """The four gather measurements of one array kind (each set up just before it is timed)."""
            return {
                f"raw_{kind}": bench.time_collective(comm, bench.raw_allgather(comm, x), f"raw Allgather {kind}", nbytes, **rep),
                f"raw_{kind}_fresh": bench.time_collective(
                    comm, bench.raw_allgather(comm, x, fresh=True), f"raw Allgather {kind}, new buf", nbytes, **rep
                ),
                f"credit_{kind}": bench.time_collective(comm, bench.credit_gather(x, manager), f"gather_tensor {kind}", nbytes, **rep),
                f"credit_{kind}_out": bench.time_collective(
                    comm, bench.credit_gather(x, manager, reuse=True), f"gather_tensor {kind} out=", nbytes, **rep
                ),
            }

        x = bench.local_field((c, h, w), -2, comm)
        t = gather_timings("numpy", x)
        # the uneven gather right after the even one, before torch and gloo start threads of their own
        xu = bench.local_field((c, h + 1, w), -2, comm)
        t["credit_uneven"] = bench.time_collective(
            comm, bench.credit_gather(xu, manager), f"gather_tensor numpy {h + 1} rows", c * (h + 1) * w * 4, **rep
        )
        t["credit_uneven_out"] = bench.time_collective(
            comm, bench.credit_gather(xu, manager, reuse=True), f"gather_tensor numpy {h + 1} out=", c * (h + 1) * w * 4, **rep
        )
        if have_torch:
            xt = bench.local_field((c, h, w), -2, comm, kind="torch")
            t.update(gather_timings("torch", xt))
            group = bench.gloo_group(manager)
            t["reference_gloo"] = bench.time_collective(
                comm, bench.gloo_all_gather_cat(xt, -2, group), "gloo all_gather+cat", nbytes, **rep
            )
        extra, out = bench.gather_extra_memory(x, manager)
        ref_extra, _ = bench.reference_extra_memory(x, comm)

    ratios = {
        "credit_over_raw_numpy": t["credit_numpy"].median / t["raw_numpy"].median,
        "credit_over_raw_fresh_numpy": t["credit_numpy"].median / t["raw_numpy_fresh"].median,
        "credit_out_over_raw_numpy": t["credit_numpy_out"].median / t["raw_numpy"].median,
        # per row, so the one extra row (0.14%) does not count against the uneven gather
        "uneven_over_even": (t["credit_uneven"].median / (h + 1)) / (t["credit_numpy"].median / h),
        "uneven_over_even_out": (t["credit_uneven_out"].median / (h + 1)) / (t["credit_numpy_out"].median / h),
        "extra_memory_over_output": extra / out,
        "reference_extra_memory_over_output": ref_extra / out,
    }
    if have_torch:
        ratios["credit_over_raw_torch"] = t["credit_torch"].median / t["raw_torch"].median
        ratios["credit_over_raw_fresh_torch"] = t["credit_torch"].median / t["raw_torch_fresh"].median
        ratios["credit_out_over_raw_torch"] = t["credit_torch_out"].median / t["raw_torch"].median
        ratios["reference_over_credit_torch"] = t["reference_gloo"].median / t["credit_torch"].median
    results.update(timings={k: v.as_dict() for k, v in t.items()}, ratios=ratios,
                   extra_memory_bytes=extra, output_bytes=out, reference_extra_memory_bytes=ref_extra)
    if world.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{world.Get_size()} ranks, float32 {c}x{h}x{w} ({out / 1e6:.1f} MB), medians of {args.repeats}, slowest rank")
    for v in t.values():
        print(f"  {v.name:<28} {v.median * 1e3:9.2f} ms  {v.gbps:7.2f} GB/s")
    targets = {
        "credit_over_raw_numpy": ("gather_tensor / raw Allgather (numpy)", "<= 1.25", lambda r: r <= 1.25),
        "credit_out_over_raw_numpy": ("gather_tensor(out=) / raw Allgather (numpy)", "<= 1.25", lambda r: r <= 1.25),
        "credit_over_raw_fresh_numpy": ("gather_tensor / raw Allgather new buf (numpy)", "<= 1.25", lambda r: r <= 1.25),
        "credit_over_raw_torch": ("gather_tensor / raw Allgather (torch)", "<= 1.25", lambda r: r <= 1.25),
        "credit_out_over_raw_torch": ("gather_tensor(out=) / raw Allgather (torch)", "<= 1.25", lambda r: r <= 1.25),
        "credit_over_raw_fresh_torch": ("gather_tensor / raw Allgather new buf (torch)", "<= 1.25", lambda r: r <= 1.25),
        "reference_over_credit_torch": ("reference gloo list+cat / gather_tensor", ">= 5", lambda r: r >= 5),
        "extra_memory_over_output": ("extra memory / output (tracemalloc)", "<= 0.25", lambda r: r <= 0.25),
        "reference_extra_memory_over_output": ("reference extra memory / output", "(info)", lambda r: True),
        "uneven_over_even": (f"{h + 1}-row uneven / {h}-row even, per row", "<= 1.15", lambda r: r <= 1.15),
        "uneven_over_even_out": ("same with out=", "<= 1.15", lambda r: r <= 1.15),
    }
    for key, (label, target, ok) in targets.items():
        if key in ratios:
            print(f"  {label:<48} {ratios[key]:7.3f}  target {target:<8} {'met' if ok(ratios[key]) else 'not met'}")
    print(f"  extra memory: {extra} bytes (gather_tensor), {ref_extra} bytes (reference method), output {out} bytes")
    if not have_torch:
        print("  torch is not installed: the torch and reference (gloo) rows are left out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
