"""Command-line parsing under MPI: every rank parses, rank 0 alone prints usage errors and ``--help``."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence

from mpi4py import MPI

__all__ = ["parse_on_rank0"]


def parse_on_rank0(parser: argparse.ArgumentParser, argv: Sequence[str] | None, comm: MPI.Comm) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a usage error (or ``--help``) is printed by rank 0 only.

    Every rank parses the same command line, so every rank exits with the
    same status; no MPI call is made.
    """
    if comm.Get_rank() == 0:
        return parser.parse_args(argv)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        return parser.parse_args(argv)
