"""credit_mpi: MPI-native domain parallelism for Earth-system machine learning.

CREDIT's ``credit.domain_parallel`` API (manager + sharding) on MPI through
mpi4py. Importing this package imports neither torch nor CuPy: the
torch-only names (``HaloExchange``, ``init_torch_distributed``,
``destroy_torch_distributed``, ``convert_to_domain_parallel``) load on first use and are left out of
``__all__``, so ``from credit_mpi import *`` works without torch.
"""

from .abort import abort_on_exception
from .grad_sync import reduce_gradients
from .halo import halo_exchange
from .manager import (
    DomainParallelManager,
    destroy_domain_parallel,
    get_domain_parallel_manager,
    initialize_domain_parallel,
)
from .sharding import gather_tensor, scatter_tensor, shard_batch, shard_tensor
from .transport.arrays import release_output_pool
from .validation import DomainParallelError, allgather_or_raise

__version__ = "0.1.0"

__all__ = [
    "DomainParallelManager",
    "DomainParallelError",
    "initialize_domain_parallel",
    "get_domain_parallel_manager",
    "destroy_domain_parallel",
    "shard_tensor",
    "gather_tensor",
    "shard_batch",
    "scatter_tensor",
    "halo_exchange",
    "release_output_pool",
    "reduce_gradients",
    "abort_on_exception",
    "allgather_or_raise",
    "__version__",
]


def __getattr__(name: str):
    # torch-only names load on first use, so `import credit_mpi` never imports torch
    if name == "HaloExchange":
        from .nn.exchange import HaloExchange

        return HaloExchange
    if name == "convert_to_domain_parallel":
        from .nn import convert_to_domain_parallel

        return convert_to_domain_parallel
    if name in ("init_torch_distributed", "destroy_torch_distributed"):
        from . import torch_bridge

        return getattr(torch_bridge, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
