"""The docs site builds with warnings as errors (docs/, Sphinx + MyST).

A docstring that autodoc cannot render, a broken cross-reference or a page
missing from the toctree fails here, as it fails `.ci/run`'s docs build.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
  for module in ("sphinx", "myst_parser", "sphinx_book_theme"):
    pytest.importorskip(module, reason="pip install -r requirements-dev.txt")
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "sphinx",
          "-W",
          "--keep-going",
          "-q",
          "-b",
          "html",
          "-d",
          str(tmp_path / "doctrees"),
          str(ROOT / "docs"),
          str(tmp_path / "html"),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
  )
  assert result.returncode == 0, (
      "the docs build has warnings (run `python -m sphinx -W --keep-going"
      " -b html docs docs/_build/html`):\n" + result.stderr[-5000:]
  )
  assert (tmp_path / "html" / "api" / "dp_core.html").is_file()
