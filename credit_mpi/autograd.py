"""torch autograd through credit_mpi's collectives.

Imported only when a torch tensor that requires grad reaches a collective
(or a :class:`credit_mpi.nn.HaloExchange` runs), so ``import credit_mpi`` never
imports torch. The routing itself is the engine's (:mod:`credit_mpi.engine`:
one ``torch.autograd.Function`` for every op, whose forward is the op's
kernel and whose backward is its adjoint, after the ranks have agreed on the
call, autograd's state included when the backward is a collective): with grad
mode on and ``x.requires_grad``, :func:`credit_mpi.gather_tensor` and
:func:`credit_mpi.halo_exchange` return a tensor with a ``grad_fn``. This
module holds what every backward that calls MPI checks first
(:func:`check_backward_thread`) and the semantics below. Backward passes that
communicate are collectives over the domain group: every rank of the group
must run the backward pass (as in any data- or model-parallel code).
Every backward is itself differentiable (double backward is exact).

Semantics follow torch DTensor's redistribution between ``Replicate()`` and
``Shard(dim)`` placements:

* ``gather_tensor`` (Shard -> Replicate): the gradient of the gathered
  tensor is taken to be replicated (the same on every rank, as when every
  rank computes the same loss from the gathered field); the backward returns
  this rank's slice of it, with no communication.
* ``shard_tensor`` / ``shard_batch`` are slices (as in the reference), so
  autograd differentiates them like any slice: the input's gradient is this
  rank's band's gradient, zeros elsewhere; no communication. (Summed over the
  domain group, as :func:`credit_mpi.reduce_gradients` does for parameters,
  these give the gradient of the whole input.)
* ``halo_exchange``: each halo row is a copy of a row of some band (or a
  constant at a ``"zero"`` edge); the backward sends the halo gradients back
  to the ranks that own those rows and adds them there (for ``"reflect"``
  and ``"earth"`` edges, into the band's own mirrored rows).
"""

from __future__ import annotations

import functools

from mpi4py import MPI

from .agreement import DomainParallelError

__all__ = ["check_backward_thread"]


_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "THREAD_MULTIPLE",
}


def check_backward_thread() -> None:
    """Raise unless this thread may call MPI.

    torch runs the backward of CUDA tensors on its own worker thread per
    device, not on the thread that called ``backward()``; MPI allows that
    from THREAD_SERIALIZED up (mpi4py asks for THREAD_MULTIPLE unless
    ``mpi4py.rc.thread_level`` says otherwise). Checked before each backward
    collective, so the error is a clear one instead of undefined behaviour.
    """
    level = _thread_level()
    if level >= MPI.THREAD_SERIALIZED or MPI.Is_thread_main():
        return
    raise DomainParallelError(
        f"a credit_mpi backward pass runs on a thread other than MPI's main thread (torch's autograd "
        f"worker thread for CUDA tensors), but MPI was initialised with {_THREAD_LEVELS.get(level, level)}; "
        f"it needs THREAD_SERIALIZED or THREAD_MULTIPLE (set mpi4py.rc.thread_level = 'multiple', "
        f"mpi4py's default, before importing mpi4py.MPI)"
    )


@functools.cache
def _thread_level() -> int:
    """MPI's thread level, asked once (it never changes after ``MPI_Init_thread``)."""
    return MPI.Query_thread()
