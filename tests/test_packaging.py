"""Packaging: the DP core imports with the core dependencies only; no path hacks."""

import tomllib

from helpers import ROOT, run_python

_CORE = ("transforms", "grads", "sampling", "accounting", "ledger")
# Imports that fail in the child process: the `[train]` extra's packages.
_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in {blocked!r}:
      raise ImportError(f'{{name}} is not a core dependency')
sys.meta_path.insert(0, Block())
"""


def test_core_dependencies_are_declared():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  names = [d.split(">")[0].split("=")[0] for d in project["dependencies"]]
  assert names == ["jax", "optax", "numpy", "dp-accounting"]
  assert "flax" in str(project["optional-dependencies"]["train"])


def test_core_floors_are_pinned_for_ci():
  """requirements-floors.txt (which .ci/run tests) pins pyproject's floors."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  floors = dict(d.split(">=") for d in project["dependencies"])
  lines = (ROOT / "requirements-floors.txt").read_text().splitlines()
  pins = dict(l.split("==") for l in lines if l and not l.startswith("#"))
  assert pins == {**floors, "jaxlib": floors["jax"]}


def test_dp_core_and_example_import_without_the_train_extra():
  blocked = {
      "flax",
      "orbax",
      "ml_collections",
      "transformers",
      "datasets",
      "pyarrow",
      "tokenizers",
      "safetensors",
      "huggingface_hub",
      "tensorboardX",
      "tqdm",
      "matplotlib",
      "torch",
  }
  code = _BLOCK.format(blocked=blocked) + "\n".join(
      [f"import raptor_jax.{m}" for m in _CORE]
      + ["import runpy", "runpy.run_path('examples/dp_linear_regression.py')"]
  )
  proc = run_python(
      "-c",
      code,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_sys_path_edits():
  """Scripts and tests import the installed (`pip install -e .`) package."""
  needle = "sys.path." + "insert"
  for folder in ("launch", "tests", "examples", "configs", "raptor_jax"):
    for path in (ROOT / folder).rglob("*.py"):
      assert needle not in path.read_text(), path
