"""Sphinx configuration of the raptor_jax docs site.

Sphinx + MyST (Markdown pages) + autodoc/autosummary with napoleon for the
Google-style docstrings, as jax, optax and jax_privacy build theirs. Build:

  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

# The checkout's raptor_jax, installed (pip install -e .) or not.
sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import raptor_jax  # pylint: disable=wrong-import-position

project = "raptor_jax"
author = "raptor_jax authors"
copyright = "raptor_jax authors"  # pylint: disable=redefined-builtin
release = raptor_jax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: `(label)=` targets and ::: fences; anchors for `#` links.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# autodoc: members in source order, no import side effects at build time.
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields of their class: NamedTuple and dataclass
# fields are documented once, by autodoc.
napoleon_use_ivar = True
# Our docstrings write `name` for code, as Markdown does.
default_role = "code"

html_theme = "sphinx_book_theme"
html_title = "raptor_jax"
html_theme_options = {
    "show_toc_level": 2,
}
html_static_path = []
