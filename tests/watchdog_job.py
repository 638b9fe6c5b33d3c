"""An MPI job for the watchdog (credit_mpi.watchdog) and the communicator leak: run by tests/test_watchdog.py.

    CREDIT_MPI_TIMEOUT=3 mpiexec -n N python tests/watchdog_job.py MODE

Modes (the last rank is the odd one):

* ``alone-sleep``: the odd rank calls gather_tensor, the others sleep (not in MPI);
* ``alone-sleep-funneled``: the same with MPI_THREAD_FUNNELED (no queries: the odd rank's own state);
* ``alone-barrier``: the odd rank calls gather_tensor, the others wait in ``MPI_Barrier`` of COMM_WORLD
  (a non-credit_mpi call: their watchdog threads must still answer);
* ``raise``: the odd rank dies of an exception without abort_on_exception(), the others go on to a gather;
* ``backward-raise``: the odd rank raises in backward before a HaloExchange's adjoint (a gradient hook),
  without abort_on_exception(); the others wait in the adjoint's exchange (the engine's backward phase);
* ``clean``: a healthy job with a 3 s deadline and ranks that arrive up to 1 s apart: must end with 0;
* ``leak``: managers made and dropped without free() until the MPI library runs out of communicators.
"""

from __future__ import annotations

import sys
import time
import warnings

import mpi4py
import numpy as np

if sys.argv[1:] and sys.argv[1].endswith("-funneled"):
    mpi4py.rc.thread_level = "funneled"  # below MPI_THREAD_MULTIPLE: the watchdog reports its own state only
from mpi4py import MPI  # noqa: E402

import credit_mpi  # noqa: E402


def main(mode: str) -> None:
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    odd = rank == n - 1
    if mode == "leak":
        leak(world)
        return
    manager = credit_mpi.initialize_domain_parallel(None, n)
    g = np.arange(2 * 3 * n * 4, dtype=np.float64).reshape(2, 3 * n, 4)
    band = credit_mpi.shard_tensor(g, -2, manager)
    credit_mpi.halo_exchange(band, 1, -2, manager)  # the last collective every rank finished
    print(f"rank {rank}: ready", flush=True)
    if mode == "clean":
        for step in range(6):
            if rank == step % n:
                time.sleep(0.6)  # a straggler, well within the deadline
            assert np.array_equal(credit_mpi.gather_tensor(band, -2, manager), g)
            credit_mpi.halo_exchange(band, 1, -2, manager)
        credit_mpi.destroy_domain_parallel()
        print(f"rank {rank}: done", flush=True)
        return
    if mode == "backward-raise":
        import torch

        x = torch.from_numpy(band.copy()).requires_grad_(True)
        y = credit_mpi.HaloExchange(1, manager=manager)(x)
        if odd:
            y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError(f"injected failure in backward on rank {rank}")))
        try:
            (y * y).sum().backward()  # the others: in the halo's backward exchange, which the odd rank never enters
        except RuntimeError as exc:  # the odd rank lives on elsewhere (an exiting rank would race the launcher's kill)
            print(f"rank {rank}: {exc}", flush=True)
            time.sleep(60)
        print(f"rank {rank}: done", flush=True)  # never reached
        return
    if mode == "raise" and odd:
        raise RuntimeError(f"injected failure on rank {rank}")
    if odd or mode == "raise":
        credit_mpi.gather_tensor(band, -2, manager)  # the others never come: the watchdog ends the job
    elif mode in ("alone-sleep", "alone-sleep-funneled"):
        time.sleep(120)
    else:
        world.Barrier()
    print(f"rank {rank}: done", flush=True)  # never reached


def leak(world: MPI.Comm) -> None:
    """Managers dropped without free(): the error must name them and free()."""
    warnings.simplefilter("ignore")  # one ResourceLeakWarning per manager
    kept = credit_mpi.DomainParallelManager(None, world.Get_size())  # one live manager too
    for made in range(6000):
        try:
            credit_mpi.DomainParallelManager(None, world.Get_size())  # dropped at once, never freed
        except credit_mpi.DomainParallelError as exc:
            print(f"rank {world.Get_rank()}: after {made} managers: {exc}", flush=True)
            break
    else:
        print(f"rank {world.Get_rank()}: no communicator limit within 6000 managers", flush=True)
    kept.free()
    print(f"rank {world.Get_rank()}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
