"""credit_mpi: MPI-native domain parallelism for Earth-system machine learning.

CREDIT's ``credit.domain_parallel`` API (manager + sharding) on MPI through
mpi4py. Importing this package imports neither torch nor CuPy.
"""

from .abort import abort_on_exception
from .manager import (
    DomainParallelManager,
    destroy_domain_parallel,
    get_domain_parallel_manager,
    initialize_domain_parallel,
)
from .sharding import gather_tensor, scatter_tensor, shard_batch, shard_tensor
from .validation import DomainParallelError

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
    "abort_on_exception",
    "__version__",
]
