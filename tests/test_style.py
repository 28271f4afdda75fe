"""One enforced style: the repository is formatted with pyink (pyproject.toml)."""

import ast
import pathlib
import re
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


# -- the layering rules of issue 45 -------------------------------------------


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules) -> set[str]:
  """The raptor_jax modules a module imports (also inside functions).

  `from p import name` imports `p.name` when that is a module, else `p`;
  importing `p.q` also runs every enclosing package's `__init__`.
  """
  targets = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        targets.add(name if name in modules else node.module)
    elif isinstance(node, ast.Import):
      targets.update(alias.name for alias in node.names)
  found = set()
  for name in targets:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
      prefix = ".".join(parts[:i])
      if prefix in modules:
        found.add(prefix)
  return found


def _import_graph() -> dict[str, set[str]]:
  paths = {_module_name(p): p for p in _library_modules()}
  graph = {}
  for name, path in paths.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    # A module's own enclosing packages are already importing it: not arrows.
    graph[name] = {
        t
        for t in _imports(tree, paths)
        if t != name and not name.startswith(t + ".")
    }
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_no_import_cycle_inside_raptor_jax():
  """Every module can be read bottom-up: no two modules import each other,
  directly or around a circle (imports inside functions count too)."""
  assert not _cycles(_import_graph())


def test_the_cycle_finder_finds_a_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]


def test_studies_stand_above_the_trainer_and_diagnostics():
  """Nothing in the library imports `raptor_jax.studies`, and the trainer does
  not import `diagnostics` (which builds on it)."""
  graph = _import_graph()

  def back_up(module: str, target: str) -> bool:
    if target.startswith("raptor_jax.studies"):
      return not module.startswith("raptor_jax.studies")
    return module.startswith("raptor_jax.train") and target == (
        "raptor_jax.diagnostics"
    )

  up = sorted(
      f"{m} -> {t}"
      for m, targets in graph.items()
      for t in targets
      if back_up(m, t)
  )
  assert not up, up


# (file, module) pairs whose private calls wait for a rewrite planned
# elsewhere: the dispatch kernels' shared scaffold (issue 45.4) is being built
# with the batched GPU dispatch; ragged.py then names its public form.
_PENDING_PRIVATE_CALLS = {("raptor_jax/models/ragged.py", "dispatch")}


def _private_uses(path: pathlib.Path, rel: str) -> list[tuple[str, str]]:
  """(rel, 'module._name') for each use of another module's private name."""
  tree = ast.parse(path.read_text(), filename=str(path))
  local = {}  # name bound by an import -> the raptor_jax module it names
  uses = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "raptor_jax"
    ):
      for alias in node.names:
        if alias.name.startswith("_") and alias.name != "_validate":
          uses.append((rel, f"{node.module}.{alias.name}"))
        local[alias.asname or alias.name] = alias.name
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("raptor_jax"):
          local[alias.asname or alias.name] = alias.name.split(".")[-1]
  for node in ast.walk(tree):
    if (
        isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and isinstance(node.value, ast.Name)
        and node.value.id in local
    ):
      uses.append((rel, f"{local[node.value.id]}.{node.attr}"))
  return uses


def _code_outside_tests():
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT)
    if rel.parts[0] not in (".venv", "third_party", "results", "runs", "tests"):
      yield path


def test_no_module_calls_another_modules_private_function():
  """A `_name` is its module's business: other modules (the library, launch
  scripts, examples) use public names. `_validate`, the shared validation
  module, is the one exemption."""
  uses = sorted(
      (rel, name)
      for p in _code_outside_tests()
      for rel, name in _private_uses(p, str(p.relative_to(ROOT)))
      if (rel, name.rsplit(".", 2)[-2]) not in _PENDING_PRIVATE_CALLS
  )
  assert not uses, uses


def test_the_private_call_finder_sees_one(tmp_path):
  path = tmp_path / "probe.py"
  path.write_text(
      "from raptor_jax import _validate, accounting\n"
      "from raptor_jax.grads import _sum_records\n"
      "x = accounting._mechanisms, accounting.epsilon, _validate.positive\n"
  )
  assert sorted(_private_uses(path, "probe.py")) == [
      ("probe.py", "accounting._mechanisms"),
      ("probe.py", "raptor_jax.grads._sum_records"),
  ]


# The dispatch kernels' custom VJPs (scan, ragged) share `reference_linear` /
# `dense_linear` as their twin; their naming follows with their scaffold.
_PENDING_TWINS = {
    "raptor_jax/models/dispatch.py",
    "raptor_jax/models/ragged.py",
}


def _custom_vjps(tree: ast.AST) -> list[str]:
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef):
      for d in node.decorator_list:
        text = ast.unparse(d)
        if "custom_vjp" in text:
          names.append(node.name)
  return names


def test_every_custom_vjp_in_models_has_a_reference_twin():
  """A hand-written backward `<name>_fast` sits next to `<name>_reference`,
  its definition, which the kernel tests compare it against."""
  missing = []
  for path in sorted((ROOT / "raptor_jax" / "models").rglob("*.py")):
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), filename=rel)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for name in _custom_vjps(tree):
      if rel in _PENDING_TWINS:
        continue
      base = name.removesuffix("_fast")
      if not name.endswith("_fast") or f"{base}_reference" not in defined:
        missing.append(f"{rel}: {name}")
  assert not missing, missing


def test_readme_is_a_front_page_of_at_most_300_lines():
  lines = (ROOT / "README.md").read_text().count("\n")
  assert lines <= 300, f"README.md has {lines} lines; move detail to docs/"


def test_no_spec_section_references():
  """Sections are cited as `docs/method.md §n.n`; the old SPEC numbering is gone."""
  pattern = re.compile(r"\bSPEC \d")
  hits = []
  for path in sorted(ROOT.rglob("*")):
    rel = path.relative_to(ROOT)
    if rel.parts[0] in (".venv", "third_party", "runs", ".git") or not (
        path.suffix in (".py", ".md", ".sh", ".toml", ".txt")
    ):
      continue
    for i, line in enumerate(path.read_text(errors="ignore").splitlines()):
      if pattern.search(line) and path != pathlib.Path(__file__):
        hits.append(f"{rel}:{i + 1}")
  assert not hits, hits
