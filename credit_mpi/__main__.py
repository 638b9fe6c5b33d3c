"""``python -m credit_mpi``: the ``credit-mpi`` command (see :mod:`credit_mpi.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
