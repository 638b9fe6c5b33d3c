"""Internal: how array bytes reach MPI or torch.distributed (not part of the public API).

* :mod:`.arrays`: the one place that knows numpy, torch and CuPy (describe,
  allocate, byte views, streams, MPI datatypes);
* :mod:`.staging`: the bytes' path to MPI: straight, or staged through
  pinned host memory when MPI is not CUDA-aware;
* :mod:`.rowops`: row copies, sums and flips for the halo exchange;
* :mod:`.limits`: message tags and size thresholds both transports share;
* :mod:`.torch_moves`: the same data movements over torch.distributed groups.

Everything above this package speaks "an array with a shape, a dtype and a
buffer".
"""
