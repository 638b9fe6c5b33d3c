"""Sphinx configuration: `make docs` (sphinx-build -W: warnings are errors)."""

import importlib.util
import os
import re
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
# Importing the package needs mpi4py (and torch for the torch-only names);
# the optional extras a page documents but `pip install ".[docs]"` does not
# bring (torch, the io extra's xarray/zarr/dask/h5netcdf) are mocked when
# they are missing, so the docs extra builds the docs on its own.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
autodoc_mock_imports = [m for m in ("torch", "xarray", "zarr", "dask", "h5netcdf", "h5py")
                        if importlib.util.find_spec(m) is None]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline builds must not warn: intersphinx inventories are optional.
intersphinx_mapping = {}

html_theme = "alabaster"
html_theme_options = {"page_width": "1100px"}
html_static_path = ["_static"]  # custom.css: code in table cells wraps
exclude_patterns = ["_build"]

# A real colon that napoleon does not take for "type: description" (see _protect_property_colons).
rst_prolog = ".. |colon| unicode:: U+003A\n"

# --- what readers see, not what the tests need ---------------------------------

# tests/test_docs.py runs every python block; its markers (`# ranks: 2 4`,
# `# fragment: <why>`) stay in the sources and are dropped from the pages.
_TEST_MARKER = re.compile(r"^[ \t]*# (?:ranks|fragment):.*\n", re.M)

# Docstrings that point at their module's docstring, which the API pages do
# not render: they point at the guide page that explains the same thing.
_MODULE_PAGES = {
    "credit_mpi.halo": "halo",
    "credit_mpi.nn.conv": "models",
    "credit_mpi.nn.norm": "models",
    "credit_mpi.nn.resample": "models",
}


# Internal modules (README "Architecture") that public docstrings name: the pages say it in words.
_INTERNAL_WORDS = {
    ":mod:`credit_mpi.partition` layout": "band layout",
    ":mod:`credit_mpi.transport.staging` moves": "credit_mpi moves",
}


def _strip_test_markers(app, docname, source):
    source[0] = _TEST_MARKER.sub("", source[0])


def _point_at_pages(app, what, name, obj, options, lines):
    module = getattr(obj, "__module__", None) or name.rpartition(".")[0]
    page = _MODULE_PAGES.get(module)
    for i, line in enumerate(lines):
        for internal, words in _INTERNAL_WORDS.items():
            line = lines[i] = line.replace(internal, words)
        if "(see the module docstring)" in line:
            where = f"(see :doc:`{page}`)" if page else ""
            lines[i] = line.replace("(see the module docstring)", where).rstrip()


_UNPROTECTED = re.compile(r"``[^`]*``|:\w+:`[^`]*`|(?<!:)(:)(?!:)")


def _protect_property_colons(app, what, name, obj, options, lines):
    """Napoleon reads a property's first line ``type: text``; ours are sentences, whose colons stay colons."""
    if what == "property" and lines:
        lines[0] = _UNPROTECTED.sub(lambda m: "\\ |colon|" if m.group(1) else m.group(0), lines[0])


def _public_bases(app, name, obj, options, bases):
    """"Bases:" lists the public classes only (not the private mixins behind the layers)."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")]


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("source-read", _strip_test_markers)
    app.connect("autodoc-process-docstring", _point_at_pages)
    app.connect("autodoc-process-docstring", _protect_property_colons, priority=400)  # before napoleon (500)
