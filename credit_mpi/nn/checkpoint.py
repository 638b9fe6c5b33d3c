"""Checkpoints of a domain-parallel training job: one atomic file, written once, resumed bit for bit.

:func:`save_checkpoint` writes one ``torch.save`` file in CREDIT's layout
(``model_state_dict``, ``optimizer_state_dict``, ``scheduler_state_dict``,
``scaler_state_dict``, ``epoch``) plus what an exact resume needs: the step,
the data sampler's epoch and every rank's RNG states (torch, CUDA when
initialised, numpy's global generator, Python's ``random``).

* **Once per replica set.** After :func:`credit_mpi.reduce_gradients` the
  parameters and the optimizer state are the same on every rank (replicated
  within a domain group and across data-parallel groups), so the first rank
  of ``manager.comm`` writes them; no two ranks write the same bytes. The
  RNG states, which may differ per rank, are gathered into that one file
  (a list indexed by rank) so the checkpoint is one file that either exists
  whole or not at all.
* **Through state_dict.** The model's ``state_dict`` keys are those of the
  unconverted model (the converted layers keep the original parameters
  under their names); the wrappers ``DistributedDataParallel`` (``module.``)
  and ``torch.compile`` (``_orig_mod.``) are looked through, so a checkpoint
  loads into the plain model, the converted one, DDP, a compiled model, and
  a CREDIT ``checkpoint.pt`` loads here. The module itself is never pickled
  (its communicators cannot be). FSDP2 (``fully_shard``) models and their
  optimizers are gathered into full, unsharded tensors with
  ``torch.distributed.checkpoint.state_dict`` (collective over the
  data-parallel group) and scattered back on load, so an FSDP2 checkpoint
  loads without FSDP2 and the other way round.
* **Atomic.** The file is written under a temporary name in the same
  directory, flushed and ``fsync``-ed, then ``os.replace``-d over the old
  one (and the directory ``fsync``-ed): a crash mid-save leaves the previous
  checkpoint whole (and a temporary file that the next save removes).
* **Agreed.** Every rank takes part (collective over ``manager.comm``) and
  a failure on any rank (a bad argument, a full disk on the writing rank, a
  missing file, keys that do not match) raises on every rank
  (:func:`credit_mpi.allgather_or_raise`), so no rank trains on while another
  one stopped.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..manager import DomainParallelManager, get_domain_parallel_manager
from ..printing import raised_alike
from ..validation import DomainParallelError, allgather_or_raise

__all__ = ["save_checkpoint", "load_checkpoint", "unwrap_model"]

_FORMAT = "credit_mpi.checkpoint/1"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` has the plain model's keys: DDP's ``module``, torch.compile's ``_orig_mod``."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_fsdp(model: torch.nn.Module) -> bool:
    """True when a parameter is a DTensor (FSDP2's ``fully_shard``): its state must be gathered collectively."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _comm(manager: DomainParallelManager | None) -> MPI.Comm:
    manager = manager if manager is not None else get_domain_parallel_manager()
    return MPI.COMM_WORLD if manager is None else manager.comm


# --------------------------------------------------------------------------- RNG states


def rng_state() -> dict:
    """This rank's RNG states as plain values and tensors (loadable with ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- state dicts


def _full_states(model: torch.nn.Module, optimizer: Any) -> tuple[dict, dict | None]:
    """The model's and optimizer's state dicts with the plain model's keys (full tensors under FSDP2, on CPU)."""
    model = unwrap_model(model)
    if not _is_fsdp(model):
        return model.state_dict(), (optimizer.state_dict() if optimizer is not None else None)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # collective over the FSDP mesh; rank 0 keeps it
    states = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return states, (_by_index(optim) if optim else optim)


def _by_index(optim: dict) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter names) keyed as ``Optimizer.state_dict``.

    ``Optimizer.state_dict`` numbers the parameters in the order of its
    param groups; so do the names here, so that the file loads into a plain
    optimizer (and CREDIT's files into a sharded one, :func:`_by_name`).
    """
    ids: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]})
    return {"state": {ids[name]: value for name, value in optim["state"].items()}, "param_groups": groups}


def _by_name(model: torch.nn.Module, optimizer: Any, optim: dict) -> dict:
    """The inverse of :func:`_by_index` for ``optimizer`` of ``model`` (index ``k``: its ``k``-th parameter)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in optim["param_groups"]]
    return {"state": {names[i]: value for i, value in optim["state"].items()}, "param_groups": groups}


def _set_full_states(model: torch.nn.Module, optimizer: Any, states: dict, optim: dict | None) -> None:
    model = unwrap_model(model)
    if not _is_fsdp(model):
        model.load_state_dict(states)
        if optimizer is not None:
            optimizer.load_state_dict(optim)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)  # every rank holds the full state: each keeps its shard
    set_model_state_dict(model, states, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, optim), options=options)


def _fingerprint(model: torch.nn.Module) -> bytes:
    """Two float64 sums (plain and absolute) of every state tensor: equal tensors give equal bytes on any rank."""
    sums = [
        torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]).cpu()
        for t in model.state_dict().values()
        if isinstance(t, torch.Tensor) and t.numel()
    ]
    return torch.cat(sums).numpy().tobytes() if sums else b""


# --------------------------------------------------------------------------- the file


def _write_atomically(path: str, payload: dict) -> None:
    """``torch.save(payload, file)`` under a temporary name next to ``path``, fsync, then ``os.replace``: all or nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:  # the rename itself reaches the disk
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)
    for stale in glob.glob(os.path.join(directory, glob.escape(f".{os.path.basename(path)}.tmp-") + "*")):
        with contextlib.suppress(OSError):  # a killed save's leftover (this path has one writer: rank 0)
            os.remove(stale)


def _read(path: str) -> dict:
    """The file's contents on CPU, memory-mapped: the ranks of a node share the page cache, not one copy each.

    Files in torch's legacy (pre-zip) format cannot be mapped: read whole.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    manager: DomainParallelManager | None = None,
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    step: int = 0,
    epoch: int | None = None,
    extra: dict | None = None,
    check: bool = True,
) -> None:
    """Write a checkpoint to ``path`` (collective over ``manager.comm``; the first rank writes the file).

    Args:
        path: the file (the same on every rank, on a filesystem rank 0 can write and every rank can read).
        model: the converted model (or the plain one, DDP, torch.compile or FSDP2 around it).
        manager: the job's manager (default: the global one; without any, ``MPI.COMM_WORLD``).
        optimizer, scheduler, scaler: saved through their ``state_dict()`` when given.
        sampler: its ``epoch`` attribute is saved (a ``DistributedSampler`` or BandDataset's sampler).
        step: the number of optimizer steps taken so far.
        epoch: CREDIT's ``epoch`` field (default: the sampler's epoch, else 0).
        extra: more picklable values (plain types and tensors) to keep, returned by :func:`load_checkpoint`.
        check: first compare a fingerprint of the model's state across the ranks (two float64 sums per
            tensor, on its device): rank 0 writes for all of them, so they must hold the same model.
            Not for FSDP2 models (their shards differ by design).

    Raises:
        ValueError: the ranks pass different paths or steps (on every rank).
        DomainParallelError: the ranks hold different models (``check``; on every rank).
        DomainParallelError: writing failed on the writing rank (an ``OSError`` there, named in the
            message; raised on every rank, the previous checkpoint at ``path`` untouched).
    """
    comm = _comm(manager)
    path = os.fspath(path)

    fsdp = _is_fsdp(unwrap_model(model))

    def mine() -> tuple:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"save_checkpoint: step must be a non-negative int, got {step!r}")
        return path, int(step), _fingerprint(unwrap_model(model)) if check and not fsdp else None

    everyone = allgather_or_raise(comm, mine)
    if any(e[:2] != (path, int(step)) for e in everyone):
        raise ValueError(
            "save_checkpoint: every rank must save the same path at the same step, got "
            + "; ".join(f"rank {r}: {p!r} step {s}" for r, (p, s, _) in enumerate(everyone))
        )
    drifted = [r for r, e in enumerate(everyone) if e[2] != everyone[0][2]]
    if drifted:
        raise DomainParallelError(
            f"save_checkpoint: the model's parameters or buffers on rank(s) {drifted} differ from rank 0's, "
            f"which alone writes them: the replicas drifted apart (reduce the gradients on every rank, "
            f"credit_mpi.reduce_gradients, before optimizer.step()); check=False saves rank 0's anyway"
        )
    rngs = comm.gather(rng_state(), root=0)  # agreed above: every rank is here; only the writer holds them all
    states, optim = _full_states(model, optimizer)  # collective under FSDP2: every rank, in the same order
    sampler_epoch = getattr(sampler, "epoch", None) if sampler is not None else None

    def write() -> None:
        if comm.Get_rank() != 0:
            return
        payload = {
            "format": _FORMAT,
            "model_state_dict": states,
            "optimizer_state_dict": optim,
            "scheduler_state_dict": scheduler.state_dict() if scheduler is not None else None,
            "scaler_state_dict": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch if epoch is not None else (sampler_epoch if sampler_epoch is not None else 0),
            "sampler_epoch": sampler_epoch,
            "step": int(step),
            "world_size": comm.Get_size(),
            "rng_states": rngs,
            "extra": extra or {},
        }
        _write_atomically(path, payload)

    allgather_or_raise(comm, write)  # the writer's failure is every rank's; also the barrier: the file is complete


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    manager: DomainParallelManager | None = None,
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    rng: bool = True,
) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (or CREDIT's ``checkpoint.pt``) into the given objects.

    Collective over ``manager.comm``: every rank reads the file (shared
    filesystem) and loads the same state; the RNG states are each rank's
    own. A failure on any rank is raised on every rank.

    Args:
        rng: restore every rank's RNG states (needs the world size the checkpoint was saved with;
            ``False`` skips them, e.g. to resume on another layout).

    Returns:
        ``{"step", "epoch", "sampler_epoch", "extra"}`` of the checkpoint (``step`` 0 and ``extra`` {} for
        a file without them).

    Raises:
        ValueError: the file's world size differs and ``rng`` is true (on every rank).
        DomainParallelError: the file is missing or unreadable, or its keys or shapes do not fit the
            model or optimizer (torch's error named in the message; on every rank).
    """
    comm = _comm(manager)
    path = os.fspath(path)
    box: list[dict] = []

    def read() -> int | None:
        box.append(_read(path))
        return box[0].get("world_size")

    sizes = allgather_or_raise(comm, read)
    ckpt = box[0]
    if rng and "rng_states" in ckpt and sizes[0] != comm.Get_size():
        raise raised_alike(ValueError(  # every rank read the same file: printed once
            f"load_checkpoint: {path} holds the RNG states of {sizes[0]} ranks, this job has {comm.Get_size()}; "
            f"pass rng=False to resume without them (not bit for bit)"
        ), comm)

    def restore() -> None:
        if optimizer is not None and ckpt.get("optimizer_state_dict") is None:
            raise ValueError(f"load_checkpoint: {path} holds no optimizer state")
        if not _is_fsdp(unwrap_model(model)):
            _set_full_states(model, optimizer, ckpt["model_state_dict"], ckpt.get("optimizer_state_dict"))
        for what, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                state = ckpt.get(f"{what}_state_dict")
                if state is None:
                    raise ValueError(f"load_checkpoint: {path} holds no {what} state")
                obj.load_state_dict(state)
        if sampler is not None and ckpt.get("sampler_epoch") is not None:
            sampler.set_epoch(ckpt["sampler_epoch"])

    allgather_or_raise(comm, restore)
    if _is_fsdp(unwrap_model(model)):  # collective over the FSDP mesh: outside the agreement, every rank alike
        _set_full_states(model, optimizer, ckpt["model_state_dict"], ckpt.get("optimizer_state_dict"))
    if rng and "rng_states" in ckpt:
        set_rng_state(ckpt["rng_states"][comm.Get_rank()])
    return {
        "step": int(ckpt.get("step", 0)),
        "epoch": ckpt.get("epoch"),
        "sampler_epoch": ckpt.get("sampler_epoch"),
        "extra": ckpt.get("extra", {}),
    }
