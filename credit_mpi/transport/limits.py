"""Constants both transports (MPI and torch.distributed) share: message tags and size thresholds."""

from __future__ import annotations

__all__ = ["TAG_UP", "TAG_DOWN", "TAG_N", "TAG_S", "TAG_W", "TAG_E", "TAG_POLE_N", "TAG_POLE_S", "SLICE_BYTES", "PACK_BYTES", "TAG_GATHER", "TAG_RING", "P2P_RANKS"]

# Message tags of the halo exchange (MPI and torch): rows travelling to the
# previous / next rank of the domain group.
TAG_UP, TAG_DOWN = 17, 18
# Tag of the point-to-point gather: a band travelling straight into its place.
TAG_GATHER = 19
# Tag of the ring attention's shift: a K/V band travelling to the next rank.
TAG_RING = 20
# Tags of the 2-D grid's halo exchange: rows going north / south, columns
# going west / east, pole pieces across the opposite longitudes.
TAG_N, TAG_S, TAG_W, TAG_E, TAG_POLE_N, TAG_POLE_S = 41, 42, 43, 44, 45, 46

# Above this many bytes per outer slice of the output, a gather moves each
# slice with its own contiguous (I)allgather, straight into place, all in
# flight at once; below it, slices are gathered in packed groups of at most
# PACK_BYTES and copied into place. Measured on 2 ranks (float32
# bands gathered along dim -2): 64 slices of 65 KB took 2.2 x the raw
# Allgather of the same bytes as slices and 1.5 x packed; 64 slices of 1 MB
# 1.25 x as slices and 2.0 x packed.
SLICE_BYTES = 1 << 18
PACK_BYTES = 1 << 23

# A gather of host memory on a domain of at most this many ranks moves
# point to point: each band is sent to every other rank, which receives it
# straight into its place (one vector datatype, or one contiguous message
# per outer slice when a band's block in a slice reaches SLICE_BYTES); a rank
# copies its own band. Measured on 2 ranks (float32 bands gathered along dim
# -2, 32-64 outer slices, 0.5 / 4 / 16 / 66 MB outputs), time over the raw
# contiguous Allgather of the same bytes: MPICH 5 wheel 0.69 / 1.04-1.13 /
# 1.0 / 1.04-1.06 x, against 1.9 / 1.7-2.0 / - / 2.0 x for packed groups and
# 4.5 / 2.1 / 1.5 / 1.15 x for per-slice Iallgather; Open MPI 5 wheel
# 2.7 / 1.4 / 1.16 (contiguous blocks) / 1.02 x, against 2.7 / 1.8 / - / 2.0
# x packed and 7.3 / 1.8 / 1.24 / 1.09 x per slice. Above this many ranks
# (messages grow as n**2), and for device memory, the collective
# strategies above.
P2P_RANKS = 8
