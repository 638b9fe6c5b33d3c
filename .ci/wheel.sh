# Sourced by .ci/run: the wheel that `make wheel` builds, installed into a
# fresh virtual environment (no checkout on the path, no torch), must import,
# answer `credit-mpi --version` and run `credit-mpi info` on 2 ranks of the
# PyPI mpich wheel, under a timeout.

CI_VENVS=${CI_VENVS:-build/ci}
PYTHON3=${PYTHON3:-python3}

ci_wheel() {
    local venv="$PWD/$CI_VENVS/wheel" whl version
    make wheel PYTHON3="$PYTHON3" || return 1
    whl=$(ls -t dist/credit_mpi-*-py3-none-any.whl | head -n 1)
    [ -n "$whl" ] || { echo "no wheel in dist/"; return 1; }
    whl=$(realpath "$whl")
    version=$("$PYTHON3" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])" 2>/dev/null \
              || sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
    echo "wheel: $whl (version $version)"
    # Only the package goes into the wheel: no tests, docs or tools.
    "$PYTHON3" - "$whl" <<'PY' || return 1
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if not (n.startswith("credit_mpi/") or ".dist-info/" in n)]
assert not bad, f"the wheel holds files outside the package: {bad}"
assert "credit_mpi/__init__.py" in names and any(n.endswith("entry_points.txt") for n in names), names
print(f"wheel holds {len(names)} files, all in credit_mpi/ or the dist-info")
PY
    rm -rf "$venv"
    "$PYTHON3" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q --upgrade pip || return 1
    "$venv/bin/python" -m pip install -q "$whl[mpich]" || return 1
    (
        cd "$(mktemp -d)" || exit 1   # nowhere near the checkout: the import must come from the wheel
        "$venv/bin/python" - "$version" <<'PY' || exit 1
import sys
import credit_mpi
assert "site-packages" in credit_mpi.__file__, credit_mpi.__file__
assert credit_mpi.__version__ == sys.argv[1], (credit_mpi.__version__, sys.argv[1])
assert "torch" not in sys.modules and "cupy" not in sys.modules
print("imported", credit_mpi.__file__, credit_mpi.__version__, "without torch")
PY
        out=$("$venv/bin/credit-mpi" --version) || exit 1
        echo "$out"
        [ "$out" = "credit_mpi $version" ] || { echo "credit-mpi --version printed '$out'"; exit 1; }
        MPIEXEC_TIMEOUT=120 timeout --kill-after=10 150 "$venv/bin/mpiexec" -n 2 "$venv/bin/credit-mpi" info -d 2 > info.txt || { cat info.txt; exit 1; }
        cat info.txt
        grep -q "2 rank(s) = 1 data-parallel replica(s) x domain size 2" info.txt || { echo "no 2-rank layout in the output"; exit 1; }
    )
}
