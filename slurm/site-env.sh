# Sourced by the job scripts of slurm/: the site's environment, from variables rather than text edits.
#   CREDIT_MPI_MODULES  modules to `module load` (space-separated); empty: load none. Each script sets
#                       its own default (what it was written for) when the variable is unset.
#   CREDIT_MPI_CONDA    a conda environment to `conda activate` (unset or empty: none; derecho.pbs: credit-mpi)
#   CREDIT_MPI_VENV     the virtual environment with credit_mpi installed (default $HOME/venvs/credit-mpi);
#                       empty: use the python and credit-mpi already on PATH.
# The variables reach the job from the submitting shell (sbatch's and qsub -V's default export), e.g.
#   CREDIT_MPI_MODULES="python/3.11" CREDIT_MPI_VENV=$PWD/.venv sbatch --account=abc123 slurm/cpu.sbatch
if [ -n "${CREDIT_MPI_MODULES:-}" ]; then
    if ! command -v module >/dev/null 2>&1; then
        echo "slurm/site-env.sh: CREDIT_MPI_MODULES='$CREDIT_MPI_MODULES' but this node has no 'module' command;" \
             "set CREDIT_MPI_MODULES= (empty) to load none" >&2
        exit 1
    fi
    # shellcheck disable=SC2086 - a list of modules
    module load $CREDIT_MPI_MODULES
fi
if [ -n "${CREDIT_MPI_CONDA:-}" ]; then
    conda activate "$CREDIT_MPI_CONDA"
fi
CREDIT_MPI_VENV=${CREDIT_MPI_VENV-$HOME/venvs/credit-mpi}
if [ -n "$CREDIT_MPI_VENV" ]; then
    if [ ! -f "$CREDIT_MPI_VENV/bin/activate" ]; then
        echo "slurm/site-env.sh: no virtual environment at CREDIT_MPI_VENV=$CREDIT_MPI_VENV" \
             "(set it to yours, or to empty to use the PATH)" >&2
        exit 1
    fi
    # shellcheck disable=SC1091
    source "$CREDIT_MPI_VENV/bin/activate"
fi
