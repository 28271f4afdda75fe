"""One enforced style: the repository is formatted with pyink (pyproject.toml)."""

import ast
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


def _library_modules():
  return sorted((ROOT / "raptor_jax").rglob("*.py"))


def test_no_library_function_is_longer_than_80_lines():
  """Small functions: every def in raptor_jax/ spans <= 80 lines."""
  long = []
  for path in _library_modules():
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if node.end_lineno - first + 1 > 80:
          long.append(
              f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
              f"({node.end_lineno - first + 1} lines)"
          )
  assert not long, long


def test_only_the_train_package_imports_the_training_loop():
  """`train/loop.py` is the trainer's top: nothing builds on it but the
  package's `train_and_evaluate` export.

  Tests are exempt: the unit tests of loop.py itself (test_interrupt.py,
  test_secrecy.py) import it to reach its internals.
  """
  importers = []
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT)
    if rel.parts[0] in (".venv", "third_party", "results", "runs", "tests"):
      continue
    if rel == pathlib.Path("raptor_jax/train/__init__.py"):
      continue
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = {a.name for a in node.names}
        if node.module == "raptor_jax.train.loop" or (
            node.module == "raptor_jax.train" and "loop" in names
        ):
          importers.append(str(rel))
      elif isinstance(node, ast.Import):
        if any(a.name == "raptor_jax.train.loop" for a in node.names):
          importers.append(str(rel))
  assert not importers, importers
