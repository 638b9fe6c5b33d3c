# Two commands do everything on a fresh machine:
#   make demo   - install into .venv and run the end-to-end demo on 4 MPI ranks
#   make test   - install into .venv and run the whole test suite (serial + MPI on 1-4 ranks)
# The MPI is the PyPI `mpich` wheel (embedded, nothing to install system-wide).
#   make wheel  - build dist/credit_mpi-<version>-py3-none-any.whl (pip install it anywhere, with extras)

PYTHON3 ?= python3
VENV    ?= .venv
RANKS   ?= 4
# The CPU build of torch: a bare `torch` requirement pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
EXTRAS  ?= mpich,test,io,plot
PY      := $(VENV)/bin/python

.PHONY: install demo test docs lint wheel clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: install
	MPIEXEC_TIMEOUT=600 timeout 660 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m credit_mpi demo

test: install
	PYTHON=$(PY) tools/run-tests

# The documentation (Sphinx, autodoc API reference), warnings are errors: docs/_build/html/index.html
docs: install
	$(PY) -m pip install -q -e ".[docs]"
	$(PY) -m sphinx -W --keep-going -b html -q docs docs/_build/html

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
