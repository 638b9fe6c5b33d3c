# Two commands do everything on a fresh machine:
#   make demo   - install the package + the PyPI MPICH wheel into .venv, run the end-to-end demo on 4 MPI ranks
#   make test   - install the rest into .venv (torch, the test/io/plot/credit extras, miles-credit, timm and
#                 segmentation-models-pytorch), run the whole test suite: serial, then MPI on 1-4 ranks, the
#                 manager's layout tests on 8 ranks and the grid tests on 5 and 6 (about 20 minutes on 2 cores)
#   make docs   - the Sphinx docs from the docs extra alone (about a minute from nothing but the venv)
#   make slurm-test - a one-node Slurm (Debian's slurm-wlm + munge, installed if missing; needs root) runs the
#                 job scripts of slurm/ with sbatch and srun (tools/slurm-test)
# The MPI is the PyPI `mpich` wheel (embedded, nothing to install system-wide).
#   make wheel  - build dist/credit_mpi-<version>-py3-none-any.whl (pip install it anywhere, with extras)
# pip shows its own progress (downloads are the slow part on a fresh machine).

PYTHON3 ?= python3
VENV    ?= .venv
RANKS   ?= 4
# make test's torch. On PyPI a plain `torch==2.13.0` is the CUDA build on Linux x86_64 (a 527 MB wheel plus
# several GB of nvidia-* libraries); TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build
# (about 190 MB) from PyTorch's own index instead. Empty (the default): pip's configured indexes only, so a
# machine with a local mirror (CI) never waits on an index it cannot reach.
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
DEMO_EXTRAS ?= mpich
EXTRAS      ?= mpich,test,io,plot,credit
PY          := $(VENV)/bin/python

.PHONY: install demo test docs lint wheel clean slurm-test

# What the demo needs: the package (numpy, mpi4py) and the MPICH wheel; no torch.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[$(DEMO_EXTRAS)]"
	touch $@

# Everything else: torch (see TORCH / TORCH_INDEX above), the test, io, plot and credit extras, and NCAR
# CREDIT's models without their requirements (tests/test_credit_models.py; they would swap the torch build),
# with timm and segmentation-models-pytorch for FuXi and the smp UNet, also without theirs (torchvision:
# the tests stand in for the parts they import and never use). The credit extra also brings what CREDIT's
# gen-2 trainer imports (optuna) for `credit-mpi credit train`. The zoo extra (tests/test_zoo.py: other groups' models)
# goes in without its packages' requirements too (they would bring another torch and torchvision).
$(VENV)/.installed: $(VENV)/.demo-installed
	$(PY) -m pip install "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[$(EXTRAS)]"
	$(PY) -m pip install --no-deps "miles-credit==2026.2.0" "timm==1.0.31" "segmentation-models-pytorch==0.6.0"
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['zoo'])" \
	    | xargs $(PY) -m pip install --no-deps
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	MPIEXEC_TIMEOUT=600 timeout 660 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m credit_mpi demo

test: install
	PYTHON=$(PY) tools/run-tests

# The documentation (Sphinx, autodoc API reference), warnings are errors: docs/_build/html/index.html
# Needs the package and the docs extra only (sphinx, the MPICH wheel for mpi4py): docs/conf.py mocks torch and
# the io extra where they are missing, so a fresh venv builds them in about a minute (make docs VENV=.venv-docs
# keeps the docs in a venv of their own; in make test's .venv, the real torch is used).
$(VENV)/.docs-installed: pyproject.toml
	$(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(PY) -m sphinx -W --keep-going -b html -q docs docs/_build/html

# The job scripts of slurm/ under a real one-node Slurm (tools/slurm-test: installs slurm-wlm + munge when
# missing, which needs root; starts and stops its own daemons, touches nothing in /etc)
slurm-test: $(VENV)/.demo-installed
	PYTHON=$(PY) timeout 900 tools/slurm-test

# Lint (ruff, rules in pyproject.toml); the version is pinned so the rules do not move
lint: install
	$(PY) -m pip install -q -e ".[lint]"
	$(PY) -m ruff check .

# The wheel, built in a small venv of its own (no torch needed): dist/
wheel:
	$(PYTHON3) -m venv build/wheel-venv
	build/wheel-venv/bin/python -m pip install -q --upgrade pip
	rm -f dist/credit_mpi-*.whl
	build/wheel-venv/bin/python -m pip wheel -q --no-deps --wheel-dir dist .
	@ls dist/credit_mpi-*.whl

clean:
	rm -rf $(VENV) build dist *.egg-info docs/_build
