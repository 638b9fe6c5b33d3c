"""A converted step against its floor: credit_mpi, the band alone, one process and CREDIT's converter, interleaved.

    mpiexec -n 2 python benchmarks/bench_step.py [--size 1x6x2x256x512] [--models smp_unet,example_unet,wxformer]
                                                 [--repeats 12] [--sample-seconds 0.25] [--profile-repeats 2]
                                                 [--json step.json]

Per model (float32, ``OMP_NUM_THREADS`` as set), every variant's training step
(forward, a loss that is this band's share of a global mean square,
backward, the gradient reduction) timed in one interleaved run, the order
rotated each round, ``--repeats`` rounds; a timed sample is as many steps in
a row as make the floor's last about ``--sample-seconds`` (a step of tens of
ms timed alone is mostly noise), its time per step:

* ``credit_mpi``: the model converted by :func:`credit_mpi.nn.convert_to_domain_parallel`
  on its band, then :func:`credit_mpi.reduce_gradients`;
* ``floor``: the unconverted model on the band alone (the same shapes, no
  communication, its own padding at the band's edges): what a step on the
  band costs in torch;
* ``one process``: the unconverted model on the whole field (rank 0; the
  other ranks sleep);
* ``CREDIT``: CREDIT's own ``credit.domain_parallel.convert_to_domain_parallel``
  over gloo (when ``miles-credit`` is installed and the field splits evenly),
  its gradients all-reduced over the domain in one call.

The step time is the slowest rank's; reported: the median, the spread
(min-max), the ratio to the floor of the same round (median and spread),
the saved activations per rank (the most of any rank; what autograd keeps
for backward, :func:`credit_mpi.cli.bench_model.saved_activation_bytes`), the
output's relative L2 error against one process, and the load average
before and after. Then a per-layer-type breakdown, credit_mpi against the
floor (the slower rank; median of ``--profile-repeats`` profiled steps):
forward ms (module hooks), backward ms (hooks on the autograd nodes each
layer made), saved activation MiB (attributed to the layer running when
autograd saved it); ``(outside layers)`` is what runs outside the timed
layers (the model's own interpolate, cat, pooling calls; the gradient
reduction is not in it). The models:

* ``smp_unet``: CREDIT's ``SegmentationModel`` (segmentation_models_pytorch
  UNet, depth 3, scSE decoder attention) on a resnet18 encoder (timm's, as
  smp's ``tu-resnet18``: smp's own resnet encoders need torchvision, whose
  wheels do not load beside this project's CPU torch; a stand-in takes its
  place as in tests/credit_stand_ins.py). Input ``--size`` (batch, channels,
  time, lat, lon);
* ``example_unet``: examples/train_unet.py's model, input (batch, 2, lat, lon);
* ``wxformer``: CREDIT's ``wxformer.crossformer.CrossFormer`` (dims 16-128,
  depth 1 per stage, strides 2, local window 2, global windows (2, 1, 1, 1)),
  input (batch, channels, 1, lat, lon).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import credit_mpi  # noqa: E402
from credit_mpi.cli.bench_model import _wait_idle, saved_activation_bytes  # noqa: E402
from credit_mpi.nn import convert_to_domain_parallel  # noqa: E402
from credit_mpi.partition import band_range  # noqa: E402

MiB = 2**20
OUTSIDE = "(outside layers)"


# -- the models ---------------------------------------------------------------------------------

def _credit_modules():
    from tests.credit_stand_ins import credit_models, timm_models

    crossformer, wxformer = credit_models()
    return wxformer, timm_models()


def smp_unet(size):
    """CREDIT's smp UNet: ``build(height)`` for a field of ``height`` rows, and the input shape."""
    b, c, t, h, w = size
    _, timm = _credit_modules()
    if timm is None:
        raise SystemExit("smp_unet needs timm and segmentation_models_pytorch")

    def build(height):
        return timm[1].SegmentationModel(
            image_height=height, image_width=w, frames=t, channels=1, surface_channels=c - 4, input_only_channels=0, levels=4,
            architecture={"name": "unet", "encoder_name": "tu-resnet18", "encoder_weights": None, "encoder_depth": 3,
                          "decoder_channels": (64, 32, 16), "decoder_attention_type": "scse"})

    return build, (b, c, t, h, w)


def example_unet(size):
    """examples/train_unet.py's model on a (batch, 2, lat, lon) field."""
    path = ROOT / "examples" / "train_unet.py"
    spec = importlib.util.spec_from_file_location("train_unet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return (lambda height: module.UNet()), (size[0], 2, size[-2], size[-1])


def wxformer(size):
    """CREDIT's WXFormer (crossformer) on a (batch, channels, 1, lat, lon) field."""
    b, c, _, h, w = size
    wx, _ = _credit_modules()

    def build(height):
        return wx.CrossFormer(
            image_height=height, image_width=w, interp=False, frames=1, channels=1, surface_channels=c - 4,
            input_only_channels=0, levels=4, dim=(16, 32, 64, 128), depth=(1, 1, 1, 1), dim_head=16,
            global_window_size=(2, 1, 1, 1), local_window_size=2, cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)),
            cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=False)

    return build, (b, c, 1, h, w)


MODELS = {"smp_unet": smp_unet, "example_unet": example_unet, "wxformer": wxformer}


# -- the variants -------------------------------------------------------------------------------

def _loss(out, count):
    return out.float().square().sum() / count


class Variant:
    """One way to run the step on this rank: ``step()`` runs it (forward, backward, gradient reduction)."""

    def __init__(self, name, model, x, count, reduce=None, alone=False):
        self.name, self.model, self.x, self.count, self.reduce, self.alone = name, model, x, count, reduce, alone

    def forward(self):
        return self.model(self.x.clone().requires_grad_())

    def step(self):
        out = self.forward()
        _loss(out, self.count).backward()
        if self.reduce is not None:
            self.reduce()
        self.model.zero_grad(set_to_none=True)
        return out


def _credit_converter(model, domain):
    """CREDIT's own converter over gloo (None when it is not installed); its gradient all-reduce over the domain."""
    try:
        from credit.domain_parallel import convert_to_domain_parallel as credit_convert
        from credit.domain_parallel import initialize_domain_parallel
    except ImportError:
        return None, None
    import torch.distributed as dist

    if not dist.is_initialized():
        from credit_mpi import torch_bridge

        torch_bridge.init_torch_distributed(domain, "gloo")
    manager = initialize_domain_parallel(dist.get_world_size(), dist.get_world_size())
    converted = credit_convert(model, manager)

    def reduce():
        grads = [p.grad for p in converted.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=manager.domain_group)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(r)

    return converted, reduce


def variants(build, shape, manager, with_credit):
    """The variants of one model on this rank, every parameter equal to the one-process model's."""
    world = manager.comm
    rank, n = world.Get_rank(), world.Get_size()
    h = shape[-2]
    torch.manual_seed(0)
    ref = build(h)
    xg = torch.randn(shape)
    count = xg.numel()
    a, b = band_range(h, n, rank, uneven=True)
    xb = xg.narrow(-2, a, b - a).contiguous()
    converted = convert_to_domain_parallel(build(h), manager)
    converted.load_state_dict(ref.state_dict())
    floor = build(b - a)
    floor.load_state_dict(ref.state_dict())
    out = [Variant("credit_mpi", converted, xb, count, lambda: credit_mpi.reduce_gradients(list(converted.parameters()), manager)),
           Variant("floor", floor, xb, count), Variant("one process", copy.deepcopy(ref), xg, count, alone=True)]
    if with_credit and h % n == 0:
        theirs, reduce = _credit_converter(copy.deepcopy(ref), manager)
        if theirs is not None:
            out.append(Variant("CREDIT", theirs, xb, count, reduce))
    return ref, xg, out


# -- timing -------------------------------------------------------------------------------------

def _minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _run_timed(v, world, steps=1):
    """Seconds a step and minor page faults a step, each the most of any rank: ``steps`` steps in a row, timed
    together (one process: rank 0's, the others sleep)."""
    world.Barrier()
    t = faults = 0.0
    if not v.alone or world.Get_rank() == 0:
        f0, t0 = _minor_faults(), time.perf_counter()
        for _ in range(steps):
            v.step()
        t, faults = (time.perf_counter() - t0) / steps, (_minor_faults() - f0) / steps
    if v.alone:
        _wait_idle(world)
    every = world.allgather((t, faults))
    return max(e[0] for e in every), max(e[1] for e in every)


def steps_per_sample(vs, world, seconds):
    """Steps in a row per timed sample, so that the floor's sample lasts about ``seconds`` (the same on every rank):
    a step of tens of ms timed alone is mostly the machine's noise and the barrier's."""
    floor = next(v for v in vs if v.name == "floor")
    once, _ = _run_timed(floor, world)
    return max(1, round(seconds / max(once, 1e-6)))


def _saved_mib(v, world):
    if v.alone and world.Get_rank() != 0:
        _wait_idle(world)
        return world.allreduce(0.0, op=MPI.MAX)
    nbytes, out = saved_activation_bytes(v.forward, v.model.parameters())
    del out
    if v.alone:
        _wait_idle(world)
    return world.allreduce(nbytes / MiB, op=MPI.MAX)


def _relative_error(v, ref_out, world, shard_dim=-2):
    """The gathered output's relative L2 error against one process's (None for one process itself)."""
    if v.alone:
        return None
    with torch.no_grad():
        mine = v.model(v.x).float()
    parts = world.gather(mine.numpy(), root=0)
    if world.Get_rank() != 0:
        return None
    whole = torch.cat([torch.from_numpy(p) for p in parts], dim=shard_dim)
    return float((whole - ref_out).norm() / ref_out.norm())


def time_variants(vs, world, repeats, sample_seconds):
    """Interleaved rounds, the order rotated each round: every variant's times (a sample: as many steps in a row as
    make the warm floor's last about ``sample_seconds``), its ratio to the floor's, its minor page faults a step,
    and those steps per sample."""
    for v in vs:  # warm-up: the plans, the caches, the allocator
        _run_timed(v, world)
    steps = steps_per_sample(vs, world, sample_seconds)
    times, faults = {v.name: [] for v in vs}, {v.name: [] for v in vs}
    for r in range(repeats):
        order = vs[r % len(vs):] + vs[: r % len(vs)]
        for v in order:
            t, f = _run_timed(v, world, steps)
            times[v.name].append(t)
            faults[v.name].append(f)
    ratios = {k: [t / f for t, f in zip(ts, times["floor"], strict=True)] for k, ts in times.items()}
    return times, ratios, faults, steps


# -- the per-layer-type breakdown ---------------------------------------------------------------

_LAYER_BASES = (torch.nn.modules.conv._ConvNd, torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)


def _kind(m):
    """The torch.nn class a layer is (a converted layer is a subclass of its original; timm's BatchNormAct2d a BatchNorm2d)."""
    for c in type(m).__mro__:
        if c.__module__.startswith("torch.nn.modules") and c is not torch.nn.Module:
            return c.__name__
    return type(m).__name__  # a model's own leaf module (CREDIT's channel LayerNorm)


def _timed_layers(model):
    """The outermost layers to time: leaf modules, and torch layers with children of their own (timm's BatchNormAct2d)."""
    out = []

    def visit(m):
        children = list(m.children())
        if not children or isinstance(m, _LAYER_BASES):
            out.append(m)
            return
        for c in children:
            visit(c)

    visit(model)
    return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _tag(nodes, roots, stop, kind):
    """Every autograd node reachable from ``roots`` short of ``stop`` and of nodes tagged already: ``kind``."""
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in nodes or node in stop:
            continue
        nodes[node] = kind
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def profile_step(v):
    """This rank's forward ms, backward ms and saved MiB per layer type for one step of ``v``."""
    fwd, bwd, saved = defaultdict(float), defaultdict(float), defaultdict(float)
    nodes, stack, handles, storages = {}, [], [], {}

    def pre(m, args):
        stop = {t.grad_fn for t in _tensors(args) if t.grad_fn is not None}
        stack.append((_kind(m), time.perf_counter(), stop))

    def post(m, args, out):
        kind, t0, stop = stack.pop()
        fwd[kind] += time.perf_counter() - t0
        _tag(nodes, [t.grad_fn for t in _tensors(out)], stop, kind)

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in storages:
            storages[key] = (stack[-1][0] if stack else OUTSIDE, t.untyped_storage().nbytes())
        return t

    skip = {p.untyped_storage().data_ptr() for p in v.model.parameters()}
    for m in _timed_layers(v.model):
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        x = v.x.clone().requires_grad_()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = v.model(x)
        total = time.perf_counter() - t0
    finally:
        for hd in handles:
            hd.remove()
    fwd[OUTSIDE] += total - sum(fwd.values())
    loss = _loss(out, v.count)
    _tag(nodes, [loss.grad_fn], set(), OUTSIDE)
    starts = {}

    def timer(node, kind):
        def start(grad_outputs):
            starts[node] = time.perf_counter()

        def stop(grad_inputs, grad_outputs):
            bwd[kind] += time.perf_counter() - starts.pop(node)

        node.register_prehook(start)
        node.register_hook(stop)

    for node, kind in nodes.items():
        timer(node, kind)
    loss.backward()
    v.model.zero_grad(set_to_none=True)
    for kind, nbytes in storages.values():
        saved[kind] += nbytes / MiB
    return {k: {"fwd_ms": 1e3 * fwd.get(k, 0.0), "bwd_ms": 1e3 * bwd.get(k, 0.0), "saved_mib": saved.get(k, 0.0)}
            for k in set(fwd) | set(bwd) | set(saved)}


def breakdown(vs, world, repeats):
    """credit_mpi against the floor per layer type: the slower rank's figures, the median over ``repeats`` profiled steps."""
    runs = {v.name: [] for v in vs}
    for _ in range(repeats):
        for v in vs:
            world.Barrier()
            mine = profile_step(v)
            every = world.allgather(mine)
            kinds = set().union(*every)
            runs[v.name].append({k: {f: max(r.get(k, {}).get(f, 0.0) for r in every) for f in ("fwd_ms", "bwd_ms", "saved_mib")}
                                 for k in kinds})
    out = {}
    for name, rs in runs.items():
        kinds = set().union(*rs)
        out[name] = {k: {f: statistics.median(r.get(k, {}).get(f, 0.0) for r in rs) for f in ("fwd_ms", "bwd_ms", "saved_mib")}
                     for k in kinds}
    return out


# -- the report ---------------------------------------------------------------------------------

def _spread(ts):
    return f"{statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})"


def step_table(times, ratios, saved, errors, faults):
    lines = ["| | step s, median (min-max) | / floor, median (min-max) | saved activations per rank MiB | output rel. error "
             "| page faults a step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k, ts in times.items():
        r = ratios[k]
        err = "-" if errors.get(k) is None else f"{errors[k]:.1e}"
        lines.append(f"| {k} | {_spread(ts)} | {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | {saved[k]:.1f} | {err} "
                     f"| {statistics.median(faults[k]):.0f} |")
    return "\n".join(lines)


def layer_table(rows):
    ours, floor = rows["credit_mpi"], rows["floor"]
    kinds = sorted(set(ours) | set(floor), key=lambda k: -(ours.get(k, {}).get("fwd_ms", 0) + ours.get(k, {}).get("bwd_ms", 0)))
    lines = ["| layer type | forward ms credit_mpi / floor | backward ms credit_mpi / floor | saved MiB credit_mpi / floor |",
             "| --- | --- | --- | --- |"]
    zero = {"fwd_ms": 0.0, "bwd_ms": 0.0, "saved_mib": 0.0}
    for k in kinds:
        a, b = ours.get(k, zero), floor.get(k, zero)
        lines.append(f"| {k} | {a['fwd_ms']:.1f} / {b['fwd_ms']:.1f} | {a['bwd_ms']:.1f} / {b['bwd_ms']:.1f} | "
                     f"{a['saved_mib']:.1f} / {b['saved_mib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1x6x2x256x512", help="batch x channels x time x lat x lon (the UNets read what they need)")
    parser.add_argument("--models", default="smp_unet,example_unet,wxformer")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved timed rounds")
    parser.add_argument("--sample-seconds", type=float, default=0.25,
                        help="each timed sample runs as many steps in a row as make the floor's about this long")
    parser.add_argument("--profile-repeats", type=int, default=2, help="profiled steps per variant for the per-layer breakdown")
    parser.add_argument("--no-credit", action="store_true", help="leave CREDIT's converter out")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    size = tuple(int(s) for s in args.size.split("x"))
    if len(size) != 5:
        raise SystemExit(f"--size: batch x channels x time x lat x lon, got {args.size!r}")
    world = MPI.COMM_WORLD
    manager = credit_mpi.DomainParallelManager(None, world.Get_size())
    say = print if world.Get_rank() == 0 else (lambda *a, **k: None)
    report = {"ranks": world.Get_size(), "threads": torch.get_num_threads(), "size": size, "models": {}}
    say(f"{world.Get_size()} ranks, {torch.get_num_threads()} thread(s) each, float32, {args.repeats} interleaved rounds")
    for name in args.models.split(","):
        build, shape = MODELS[name](size)
        load_before = os.getloadavg()
        ref, xg, vs = variants(build, shape, manager, not args.no_credit)
        ref_out = None
        if world.Get_rank() == 0:
            with torch.no_grad():
                ref_out = ref(xg).float()
        errors = {v.name: _relative_error(v, ref_out, world) for v in vs}
        saved = {v.name: _saved_mib(v, world) for v in vs}
        times, ratios, faults, steps = time_variants(vs, world, args.repeats, args.sample_seconds)
        layers = breakdown([v for v in vs if v.name in ("credit_mpi", "floor")], world, args.profile_repeats)
        load_after = os.getloadavg()
        say(f"\n## {name}, input {shape}; load average {load_before[0]:.1f} / {load_before[1]:.1f} before, "
            f"{load_after[0]:.1f} / {load_after[1]:.1f} after (1 / 5 min); {steps} step(s) in a row per sample\n")
        say(step_table(times, ratios, saved, errors, faults))
        say(f"\nper layer type, the slower rank, median of {args.profile_repeats} profiled steps:\n")
        say(layer_table(layers))
        report["models"][name] = {"shape": shape, "load": [load_before, load_after], "steps_per_sample": steps,
                                  "times": times, "ratios": ratios, "page_faults": faults,
                                  "saved_mib": saved, "errors": errors, "layers": layers}
    if args.json and world.Get_rank() == 0:
        Path(args.json).write_text(json.dumps(report, indent=1))
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="c10d::")  # CREDIT's halo exchange backpropagates through dist.all_reduce
    try:
        raise SystemExit(main())
    except Exception:  # noqa: BLE001 - one rank's failure ends every rank (the others wait in a collective)
        traceback.print_exc()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)
