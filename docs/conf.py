"""Sphinx configuration: `make docs` (sphinx-build -W: warnings are errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "credit_mpi"
author = "credit_mpi contributors"
copyright = "2026, credit_mpi contributors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

# The API reference (api.rst) is written by hand over autodoc: the public
# names only, each once, under the name users import (credit_mpi.X).
# Importing the package needs mpi4py (and torch for the torch-only names):
# `make docs` builds in the project's .venv, which has both.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}

napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline builds must not warn: intersphinx inventories are optional.
intersphinx_mapping = {}

html_theme = "alabaster"
html_static_path = []
exclude_patterns = ["_build"]
