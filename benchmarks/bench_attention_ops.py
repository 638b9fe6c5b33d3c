"""Per-call cost of the attention layouts' collectives against raw mpi4py and gloo, in one run.

    mpiexec -n 2 python benchmarks/bench_attention_ops.py [--repeats 9] [--json FILE]

Each rank holds the queries, keys and values of its band's tokens, float32
``(1, heads, n, 32)`` (8 heads: they divide among 2 and 4 ranks), and the
script times, interleaved (see ``bench_percall.time_cases``):

* ``alltoall``: ``credit_mpi.ops.alltoall`` from token bands to a head-sharded
  layout (Ulysses) against the least raw mpi4py code with the same result
  (one ``Alltoall`` of the contiguous head groups, the received token parts
  joined) and gloo's ``all_to_all_single`` plus the same join;
* ``allgather_along``: the key gather of hand-written attention against one
  raw ``Allgather`` into a reused buffer plus the join along the tokens, and
  gloo's ``all_gather`` + ``torch.cat``;
* ``ring``: ``ring_attention`` (a ring of K/V bands, online softmax) against
  the same attention done by gathering K and V (``allgather_along`` twice,
  then ``scaled_dot_product_attention``) and by raw ``Allgather`` + sdpa:
  what the ring costs for holding two bands instead of ``P``.

Every method's result is checked against the others before timing; the
slowest rank's mean per call, median over ``--repeats`` blocks, ratios of
medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_percall import parse_args, time_row, write_json  # noqa: E402

from credit_mpi.cli import bench  # noqa: E402

HEADS, DIM = 8, 32
TOKENS = {"0.37 MB": 360, "2.1 MB": 2070, "8.3 MB": 8100}  # a band of 8x45, 23x90, 45x180 (lat x lon) tokens; MB: q of a rank


def raw_alltoall(comm, q):
    """Head group ``s`` of every rank's tokens to rank ``s``: one Alltoall into a reused buffer, the token parts joined."""
    import torch

    size = comm.Get_size()
    send = q.numpy()  # (1, H, n, E): the head groups are contiguous blocks
    recv = np.empty((size, 1, HEADS // size, *send.shape[2:]), send.dtype)

    def run():
        comm.Alltoall(send, recv)
        return torch.from_numpy(np.concatenate(list(recv), axis=2))

    return run


def gloo_alltoall(q, group):
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    send = q.contiguous()
    recv = torch.empty_like(send)

    def run():
        dist.all_to_all_single(recv, send, group=group)
        return torch.cat(list(recv.reshape(size, 1, HEADS // size, *send.shape[2:])), dim=2)

    return run


def raw_allgather_join(comm, k):
    """Every rank's keys: one Allgather into a reused buffer, joined along the tokens."""
    import torch

    send = k.numpy()
    recv = np.empty((comm.Get_size(), *send.shape), send.dtype)

    def run():
        comm.Allgather(send, recv)
        return torch.from_numpy(np.concatenate(list(recv), axis=2))

    return run


def gloo_allgather_cat(k, group):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(k) for _ in range(dist.get_world_size(group))]

    def run():
        dist.all_gather(parts, k, group=group)
        return torch.cat(parts, dim=2)

    return run


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import credit_mpi
    from credit_mpi import DomainParallelManager
    from credit_mpi.ops.allgather_along import allgather_along
    from credit_mpi.ops.alltoall import alltoall
    from credit_mpi.ops.ring import ring_attention

    args = parse_args(argv, __doc__, 9, TOKENS, "alltoall,allgather_along,ring")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if HEADS % size:
        raise SystemExit(f"{HEADS} heads do not divide among {size} ranks: run on 1, 2, 4 or 8")
    ops = args.ops.split(",")
    report = {"ranks": size, "credit_mpi": credit_mpi.__file__, "rows": []}
    with DomainParallelManager(None, size) as manager:
        comm = manager.domain_group
        group = bench.gloo_group(manager)
        for label in args.sizes.split(","):
            n = TOKENS[label]
            gen = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn((1, HEADS, n, DIM), generator=gen) for _ in range(3))
            number = args.number or max(3, min(200, int(3e7 // q.numpy().nbytes)))
            rows = {}
            if "alltoall" in ops:
                rows["alltoall"] = {
                    "credit": lambda q=q: alltoall(q, 1, 2, comm),
                    "raw": raw_alltoall(comm, q),
                    "gloo": gloo_alltoall(q, group),
                }
            if "allgather_along" in ops:
                rows["allgather_along"] = {
                    "credit": lambda k=k: allgather_along(k, 2, comm),
                    "raw": raw_allgather_join(comm, k),
                    "gloo": gloo_allgather_cat(k, group),
                }
            if "ring" in ops:
                gk, gv = raw_allgather_join(comm, k), raw_allgather_join(comm, v)
                rows["ring"] = {
                    "credit": lambda q=q, k=k, v=v: ring_attention(q, k, v, comm),
                    "credit gather": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                        q, allgather_along(k, 2, comm), allgather_along(v, 2, comm)),
                    "raw": lambda q=q, gk=gk, gv=gv: F.scaled_dot_product_attention(q, gk(), gv()),
                }
            for op, cases in rows.items():
                _verify(op, cases, comm)
                times, med = time_row(comm, cases, args.repeats, number)
                report["rows"].append({"op": op, "size": label, "tokens": n, "times": times, "median": med})
                if rank == 0:
                    cells = "  ".join(f"{m} {t * 1e6:8.1f} us" for m, t in med.items())
                    ratios = "  ".join(f"credit/{m} {med['credit'] / t:.2f}" for m, t in med.items() if m != "credit")
                    print(f"{op:16s} {label:8s} {cells}   {ratios}", flush=True)
        dist.barrier(group)
    write_json(report, args.json, rank)
    return 0


def _verify(op, cases, comm):
    import torch

    results = {name: fn() for name, fn in cases.items()}
    first = results["credit"]
    for name, r in results.items():
        same = torch.equal(r, first) if op != "ring" else torch.allclose(r, first, rtol=1e-4, atol=1e-5)
        if not same:
            raise AssertionError(f"{op}: {name} differs from credit on rank {comm.Get_rank()}")


if __name__ == "__main__":
    raise SystemExit(main())
