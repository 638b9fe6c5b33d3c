#!/usr/bin/env bash
# One rank per GPU: give each rank its own GPU, chosen from the node-local
# rank that the launcher sets, while every GPU stays visible; then exec the command.
#
#   srun ... slurm/bind-gpu.sh python train.py
#
# Why a wrapper instead of `srun --gpu-bind=...`/`--gpus-per-task=1`: those
# give every rank a *different* CUDA_VISIBLE_DEVICES through cgroups, so a
# rank cannot open its neighbours' GPUs. CUDA IPC (what CUDA-aware MPI uses to
# copy GPU-to-GPU inside a node) then fails or silently falls back to staging
# through host memory. With this wrapper every GPU stays visible to the
# process tree, and each rank picks its own by index (LOCAL_RANK below).
set -euo pipefail

# Node-local rank: Slurm sets SLURM_LOCALID; Cray PALS (PBS mpiexec on
# Derecho) sets PALS_LOCAL_RANKID; Open MPI sets OMPI_COMM_WORLD_LOCAL_RANK.
local_rank=${SLURM_LOCALID:-${PALS_LOCAL_RANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-0}}}}
gpus_per_node=${GPUS_PER_NODE:-4}   # EDIT if your nodes do not have 4 GPUs

# Tell the application which GPU is its own, but keep every GPU visible
# (CUDA IPC between the ranks of a node needs them). credit_mpi's
# credit_mpi.gpu.bind_device() finds the node-local rank by itself (MPI
# Split_type) and makes GPU local_rank % gpus current; this wrapper is for
# the rest of your code (torch users: torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % n)).
export LOCAL_RANK=$local_rank
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-${PALS_LOCAL_SIZE:-${OMPI_COMM_WORLD_LOCAL_SIZE:-$gpus_per_node}}}

exec "$@"
