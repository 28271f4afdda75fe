"""One enforced style: the repository is formatted with pyink (pyproject.toml)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_code_is_formatted_with_pyink():
  if shutil.which("pyink") is None and not _importable("pyink"):
    pytest.skip("pyink is not installed (pip install -r requirements-dev.txt)")
  result = subprocess.run(
      [sys.executable, "-m", "pyink", "--check", "--quiet", "."],
      cwd=ROOT,
      capture_output=True,
      text=True,
  )
  assert result.returncode == 0, (
      "unformatted files; run `pyink .` from the repository root:\n"
      + result.stderr
  )


def _importable(name: str) -> bool:
  try:
    __import__(name)
  except ImportError:
    return False
  return True
