"""Internal: how array bytes reach MPI or torch.distributed (not part of the public API).

* :mod:`.moves`: the transport protocol (post receives and sends, wait;
  all-gather byte buffers) over MPI (:class:`~.moves.MpiMoves`), and the
  algorithms written once against it (the edge swap, the band/block gather);
* :mod:`.torch_moves`: the protocol over torch.distributed groups;
* :mod:`.arrays`: numpy, torch and CuPy arrays (describe, allocate, byte
  views, streams, MPI datatypes; :mod:`.rowops` and :mod:`.staging` also
  speak the libraries);
* :mod:`.staging`: the bytes' path to MPI: straight, or staged through
  pinned host memory when MPI is not CUDA-aware;
* :mod:`.rowops`: row copies, sums and flips for the halo exchange;
* :mod:`.limits`: message tags and size thresholds both transports share.

Everything above this package speaks "an array with a shape, a dtype and a
buffer".
"""
