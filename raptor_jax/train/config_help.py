"""The config reference of `launch/main.py --help` and `--help_config`.

Built from the code, so it cannot drift: the fields and defaults of
`config.base_config()`, the comment each field carries in
`raptor_jax/train/config.py`, the presets each file under `configs/`
accepts (tried, not listed by hand) and `methods.METHODS`.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
from pathlib import Path
import tokenize

import ml_collections

from raptor_jax.train import config as config_lib
from raptor_jax.train import methods

# The function of raptor_jax/train/config.py that builds each section.
_SECTIONS = {
    "base_config": "",
    "_model_config": "model",
    "_random_model_config": "model.random",
    "_data_config": "data",
    "_privacy_config": "privacy",
    "_raptor_config": "raptor",
}
# Fields only configs/custom.py declares (setup.CUSTOM_TASK_ONLY): not in
# the base config, so listed here with their defaults and meaning.
CUSTOM_ONLY = (
    (
        "data.label_names",
        "''",
        "your task's class names, comma-separated; position = class id"
        " (configs/custom.py only)",
    ),
    (
        "data.hub_dataset",
        "''",
        "a Hub dataset id with train and validation splits instead of files"
        " (configs/custom.py only)",
    ),
)
# What a task of your own sets (configs/custom.py; docs/data.md).
YOUR_OWN_DATA = (
    (
        "data.train_path",
        "your train file: .tsv .csv .jsonl .parquet, or a"
        " datasets.save_to_disk directory",
    ),
    (
        "data.dev_path",
        "your evaluation file (or data.eval_split=holdout with"
        " data.train_limit and data.holdout)",
    ),
    ("data.text_fields", "the text column, or two for a sentence pair: q,s"),
    ("data.label_field", "the label column: class names or ids 0..K-1"),
    ("data.label_names", "the K class names, comma-separated"),
    (
        "data.public_path",
        "public text of your language and domain (never"
        " the private file), with data.public_corpus= (empty)",
    ),
    (
        "batch_size, epochs",
        "0 in configs/custom.py: chosen from n (n / 10,"
        " at least 200 noisy steps); set a number to override",
    ),
    ("privacy.delta", "0 in configs/custom.py: 1/(10 n)"),
)
# Presets tried on each config file, as `file:<p>` and `file:preset=<p>`.
_PRESETS = ("tiny", "cpu", "small")


def _comments() -> dict[str, str]:
  """{dotted field: its comment in config.py} (the comment of its lines)."""
  source = inspect.getsource(config_lib)
  by_line, alone = {}, set()  # comments by line; lines holding only one
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      by_line[token.start[0]] = token.string.lstrip("#").strip()
      if token.line.strip().startswith("#"):
        alone.add(token.start[0])
  found = {}
  for function in ast.parse(source).body:
    prefix = _SECTIONS.get(getattr(function, "name", None))
    if prefix is None:
      continue
    for node in ast.walk(function):
      if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        continue
      names, target = [], node.targets[0]
      while isinstance(target, ast.Attribute):
        names.insert(0, target.attr)
        target = target.value
      if not names or not isinstance(target, ast.Name):
        continue
      key = ".".join(filter(None, (prefix, *names)))
      lines = [i for i in range(node.lineno, node.end_lineno + 1)]
      if not any(i in by_line for i in lines):  # the comment lines above it
        above = node.lineno - 1
        while above in alone:
          above -= 1
        lines = range(above + 1, node.lineno)
      text = " ".join(by_line[i] for i in lines if i in by_line)
      if text:
        found[key] = text
  return found


def fields(
    config: ml_collections.ConfigDict | None = None,
) -> list[tuple[str, str, str]]:
  """(dotted field, default, comment) of every leaf of `config` (default: the base)."""
  config = config_lib.base_config() if config is None else config
  comments = _comments()
  rows = []

  def walk(node, prefix):
    for key, value in node.items():
      dotted = f"{prefix}{key}"
      if isinstance(value, ml_collections.ConfigDict):
        walk(value, dotted + ".")
      else:
        rows.append((dotted, repr(value), comments.get(dotted, "")))

  walk(config, "")
  if "label_names" not in config.data:  # the base: add the custom fields
    rows += [row for row in CUSTOM_ONLY]
  return rows


def _load(path: Path):
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def config_files(directory: str | Path) -> list[tuple[str, list[str], str]]:
  """(file, the arguments it accepts, its docstring's first line) per
  training config under `directory` (pretraining configs left out)."""
  rows = []
  for path in sorted(Path(directory).glob("*.py")):
    try:
      module = _load(path)
      if "method" not in module.get_config(""):
        continue  # a launch/pretrain.py config
    except Exception:  # pylint: disable=broad-except
      continue  # not a training config file
    presets = [""]
    for preset in _PRESETS:
      for arg in (preset, f"preset={preset}"):
        try:
          module.get_config(arg)
        except Exception:  # pylint: disable=broad-except
          continue
        presets.append(arg)
        break
    doc = (module.__doc__ or "").strip().splitlines()
    rows.append((f"configs/{path.name}", presets, doc[0] if doc else ""))
  return rows


def _sections(rows) -> dict[str, list[tuple[str, str, str]]]:
  sections: dict[str, list] = {}
  for dotted, default, comment in rows:
    section, _, key = dotted.rpartition(".")
    sections.setdefault(section, []).append((key, default, comment))
  return sections


def _presets_line(presets: list[str]) -> str:
  return " | ".join(f":{p}" if p else "(none)" for p in presets)


def summary(directory: str | Path) -> str:
  """The short reference `--help` shows: methods, config files, fields."""
  lines = [
      "",
      "Methods (--config.method=...): " + ", ".join(methods.METHODS) + ".",
      "",
      "Config files and their presets (--config=<file>:<preset>):",
  ]
  for name, presets, _ in config_files(directory):
    lines.append(f"  {name}  {_presets_line(presets)}")
  lines += [
      "",
      "Config fields (--config.<section>.<key>=...), with defaults; "
      "--help_config explains each:",
  ]
  for section, keys in _sections(fields()).items():
    shown = " ".join(f"{key}={default}" for key, default, _ in keys)
    lines.append(f"  {section or '(top level)'}: {shown}")
  return "\n".join(lines) + "\n"


def reference(directory: str | Path) -> str:
  """`--help_config`: every field with its default and meaning, the config
  files with their presets, the methods."""
  lines = ["Methods (--config.method=...):"]
  lines += [f"  {m}" for m in methods.METHODS]
  lines += ["", "Config files (--config=<file>:<preset>):"]
  for name, presets, doc in config_files(directory):
    lines.append(f"  {name}  presets: {_presets_line(presets)}")
    if doc:
      lines.append(f"      {doc}")
  lines += [
      "",
      "Your own data (--config=configs/custom.py:small; docs/data.md):",
  ]
  width = max(len(name) for name, _ in YOUR_OWN_DATA)
  lines += [f"  {name:<{width}}  {meaning}" for name, meaning in YOUR_OWN_DATA]
  lines += ["", "Config fields (--config.<field>=<value>), default, meaning:"]
  for section, keys in _sections(fields()).items():
    lines.append(f"  [{section or 'top level'}]")
    width = max(len(f"{k} = {d}") for k, d, _ in keys)
    for key, default, comment in keys:
      entry = f"{key} = {default}"
      lines.append(f"    {entry:<{width}}  {comment}".rstrip())
  return "\n".join(lines) + "\n"
