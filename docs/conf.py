"""Sphinx configuration: `make docs` (sphinx-build -W: warnings are errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "credit_mpi"
author = "credit_mpi contributors"
copyright = "2026, credit_mpi contributors"
release = "0.1.0"

extensions = [
    "autoapi.extension",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

# The API reference is generated from the source, as the spec's .rst files were.
autoapi_type = "python"
autoapi_dirs = ["../credit_mpi"]
autoapi_root = "api"
autoapi_add_toctree_entry = True  # "API Reference" at the end of the root toctree
autoapi_options = ["members", "undoc-members", "show-inheritance", "show-module-summary", "imported-members"]
autoapi_ignore = ["*/__main__.py"]
autoapi_keep_files = False
# The package re-exports its public names (imported-members), so a short name
# such as DomainParallelError has two targets; Sphinx picks the first either way.
suppress_warnings = ["autoapi.python_import_resolution", "ref.python"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline builds must not warn: intersphinx inventories are optional.
intersphinx_mapping = {}

html_theme = "alabaster"
html_static_path = []
exclude_patterns = ["_build"]
