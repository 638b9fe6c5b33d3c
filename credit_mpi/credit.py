"""Run NCAR CREDIT's own gen-2 trainer on credit_mpi: ``credit-mpi credit train -c config.yml``.

Under ``mpiexec``/``srun`` (``python -m credit_mpi.credit train -c config.yml`` is the same)::

    mpiexec -n 4 credit-mpi credit train -c config.yml

runs CREDIT's ``credit train`` (``credit.applications.train_gen2``), its code unchanged, with
``credit.domain_parallel`` answered by credit_mpi (:func:`credit_mpi.nn.compat.credit_alias` in
CREDIT's trainer mode): the config's ``trainer.parallelism: {data, tensor, domain}`` decides the
layout as it does in CREDIT; the model CREDIT converts is credit_mpi's (exact: one process's
forward and gradients), CREDIT's trainer shards the batch, averages the domain gradients and
gathers between rollout steps on torch groups with the same ranks as credit_mpi's MPI
communicators. What this adds to CREDIT's own launch:

* no torchrun and no ``MASTER_ADDR``/``MASTER_PORT``: rank 0 picks its address and a free port
  and sends them over MPI (``MASTER_ADDR``/``MASTER_PORT`` set on rank 0 are used as they are);
* ``--backend`` defaults to ``nccl`` where CUDA is available, else ``gloo`` (CREDIT's default is
  ``nccl``, which a CPU node lacks);
* a missing miles-credit, or a version this was not tested with, is a clear error
  (``--untested-credit`` runs an untested one anyway);
* where torchvision does not import (its wheels must match the torch build), CREDIT's gen-1 post
  block module, which the WXFormer module imports and the gen-2 trainer never builds (it drops
  ``model.post_conf``), is a stand-in that refuses to be built;
* an exception on one rank ends the whole job (:func:`credit_mpi.abort_on_exception`) rather
  than leaving the other ranks waiting.

CREDIT's rollout apps (``credit rollout``) take no domain path: each rank runs the whole model,
so they need nothing from credit_mpi.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import socket
import sys
import types
from collections.abc import Sequence

__all__ = ["TESTED_CREDIT_VERSIONS", "add_arguments", "build_parser", "check_credit", "main"]

#: The miles-credit versions whose trainer this was tested with (tests/test_credit_trainer.py).
TESTED_CREDIT_VERSIONS = ("2026.2.0",)

#: What CREDIT's own code takes as "started by a launcher" (train_gen2.py); else it runs one process.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID", "SLURM_PROCID")


class CreditUnavailable(RuntimeError):
    """miles-credit is missing, or of a version this was not tested with."""


DESCRIPTION = ("Run NCAR CREDIT's own trainer (miles-credit, its code unchanged) with its domain parallelism on "
               "credit_mpi: exact, one process's losses on any number of bands. Start it under mpiexec/srun; "
               "trainer.parallelism {data, tensor, domain} in the config sets the layout.")
EPILOG = ("example: mpiexec -n 4 credit-mpi credit train -c config.yml   (data 2 x domain 2 with "
          "trainer.parallelism: {data: fsdp2, tensor: 1, domain: 2}). CREDIT's `credit rollout` takes no "
          "domain path (each rank runs the whole model): run it as CREDIT documents.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``credit-mpi credit``'s options and its ``train`` subcommand, on ``parser``."""
    parser.add_argument("--untested-credit", action="store_true",
                        help=f"run a miles-credit version other than {', '.join(TESTED_CREDIT_VERSIONS)} "
                             f"(the ones this was tested with)")
    sub = parser.add_subparsers(dest="credit_command", metavar="{train}", required=True)
    train = sub.add_parser(
        "train", help="CREDIT's gen-2 trainer (`credit train`) on credit_mpi's domain parallelism",
        description="CREDIT's gen-2 trainer (credit.applications.train_gen2, `credit train`) with "
                    "credit.domain_parallel answered by credit_mpi; progress and checkpoints are CREDIT's.",
    )
    train.add_argument("-c", "--config", required=True, metavar="CONFIG", help="CREDIT gen-2 YAML config")
    train.add_argument("--backend", choices=["nccl", "gloo", "mpi"], default=None,
                       help="torch.distributed backend for CREDIT's own collectives (default: nccl where CUDA "
                            "is available, else gloo)")
    train.add_argument("--log-all-ranks", action="store_true", help="CREDIT's INFO logs from every rank")


def build_parser() -> argparse.ArgumentParser:
    """``credit-mpi credit``'s argument parser (no MPI calls)."""
    parser = argparse.ArgumentParser(prog="credit-mpi credit", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(parser)
    return parser


def check_credit(untested: bool = False) -> str:
    """The installed miles-credit version; :class:`CreditUnavailable` if missing or untested (unless ``untested``)."""
    try:
        version = importlib.metadata.version("miles-credit")
        import credit  # noqa: F401
    except (importlib.metadata.PackageNotFoundError, ImportError) as exc:
        raise CreditUnavailable(
            f"NCAR CREDIT (miles-credit) is not installed ({exc}); install the tested version with "
            f"`pip install --no-deps miles-credit=={TESTED_CREDIT_VERSIONS[-1]}` and the `credit` extra "
            f"(`pip install 'credit-mpi[credit]'`; `make install` does both)") from None
    if version not in TESTED_CREDIT_VERSIONS and not untested:
        raise CreditUnavailable(
            f"miles-credit {version} is installed; credit-mpi credit was tested with "
            f"{', '.join(TESTED_CREDIT_VERSIONS)} only (CREDIT's trainer changes between releases): install "
            f"`miles-credit=={TESTED_CREDIT_VERSIONS[-1]}`, or pass --untested-credit to run {version} anyway")
    return version


def stand_in_gen1_post_block() -> bool:
    """Put a refusing stand-in for ``credit.postblock.gen1`` where it does not import (torchvision); True if so."""
    try:
        import credit.postblock.gen1  # noqa: F401
        return False
    except ImportError as exc:
        reason = str(exc)
    module = types.ModuleType("credit.postblock.gen1", "credit_mpi's stand-in: CREDIT's gen-2 trainer builds no gen-1 post block")

    class PostBlock:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"CREDIT's gen-1 post block does not import here ({reason}); the gen-2 "
                               f"trainer does not use it (remove model.post_conf)")

    module.PostBlock = PostBlock
    sys.modules[module.__name__] = module
    return True


def rendezvous_environment(comm) -> None:
    """``MASTER_ADDR``/``MASTER_PORT`` on every rank: rank 0's own, else its address and a free port (over MPI).

    CREDIT's ``get_rank_info`` reads them on rank 0 and broadcasts them; without them it takes a
    random port that may be taken. Also marks the process as launched (``RANK``) where the launcher
    sets none of the variables CREDIT looks for, so that CREDIT asks MPI for the ranks.
    """
    if comm.Get_size() == 1:
        return
    from .validation import allgather_or_raise

    hosts = allgather_or_raise(comm, socket.gethostname)

    def choose() -> tuple[str, str] | None:
        if comm.Get_rank() != 0:
            return None
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname())
        return addr, os.environ.get("MASTER_PORT") or str(_free_port(addr))

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = allgather_or_raise(comm, choose)[0]  # rank 0's, everywhere
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        os.environ["RANK"] = str(comm.Get_rank())


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("" if addr.startswith("127.") else addr, 0))
        return probe.getsockname()[1]


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def run_credit_train(config: str, backend: str, log_all_ranks: bool = False) -> None:
    """CREDIT's ``train_gen2.main_cli`` with its argv, under the alias in CREDIT's trainer mode (collective)."""
    from credit.applications import train_gen2

    from .manager import destroy_domain_parallel
    from .nn.compat import credit_alias

    argv = ["credit train", "-c", config, "--backend", backend] + (["--log-all-ranks"] if log_all_ranks else [])
    saved, sys.argv = sys.argv, argv
    try:
        with credit_alias(torch_groups=True):
            train_gen2.main_cli()
    finally:
        sys.argv = saved
    destroy_domain_parallel()


def main(argv: Sequence[str] | None = None) -> int:
    """``credit-mpi credit ...`` / ``python -m credit_mpi.credit ...``; the exit status."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    from .cli.parsing import parse_on_rank0

    args = parse_on_rank0(build_parser(), argv, comm)  # rank 0 prints --help / usage errors
    try:
        version = check_credit(args.untested_credit)
    except CreditUnavailable as exc:
        if comm.Get_rank() == 0:
            print(f"credit-mpi credit: error: {exc}", file=sys.stderr)
        return 2
    from .abort import abort_on_exception

    abort_on_exception()
    if comm.Get_rank() == 0:
        print(f"credit-mpi credit: CREDIT (miles-credit {version}) {args.credit_command} on {comm.Get_size()} rank(s), "
              f"credit.domain_parallel from credit_mpi", flush=True)
    if stand_in_gen1_post_block() and comm.Get_rank() == 0:
        print("credit-mpi credit: torchvision does not import here; CREDIT's gen-1 post block (unused by the "
              "gen-2 trainer) is a stand-in", flush=True)
    rendezvous_environment(comm)
    run_credit_train(args.config, args.backend or _default_backend(), args.log_all_ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
