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

# Tell the application which device to use, but keep every GPU visible
# (CUDA IPC between ranks of a node needs them). credit_mpi and most codes
# read LOCAL_RANK; torch users call torch.cuda.set_device(LOCAL_RANK % n).
export LOCAL_RANK=$local_rank
export CREDIT_MPI_DEVICE=$(( local_rank % gpus_per_node ))

exec "$@"
