"""Internal: how array bytes reach MPI or torch.distributed (not part of the public API).

* :mod:`.moves`: the transport protocol (post receives and sends, wait;
  all-gather and all-to-all byte buffers) over MPI (:class:`~.moves.MpiMoves`),
  and the algorithms written once against it (the edge swap, the band/block
  gather);
* :mod:`.torch_moves`: the protocol over torch.distributed groups;
* :mod:`.adapters`: one class per array library (numpy, torch, CuPy) that
  answers every per-library question, found by the array's type;
* :mod:`.arrays`: the helpers the rest of the package calls (describe,
  allocate, byte views, streams, MPI datatypes), each asking the array's
  adapter (``adapter=``: one looked up once per call); :mod:`.pool`: the
  reuse pool of host outputs;
* :mod:`.staging`: the bytes' path to MPI: straight, or staged through
  pinned host memory when MPI is not CUDA-aware;
* :mod:`.rowops`: row copies, sums and flips for the halo exchange;
* :mod:`.limits`: message tags and size thresholds both transports share.

Everything above this package speaks "an array with a shape, a dtype and a
buffer".
"""
