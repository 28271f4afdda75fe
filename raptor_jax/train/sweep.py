"""A grid of runs (variant x epsilon x seed) through `train_and_evaluate`.

A *variant* is a table row: a method or a RAPTOR ablation, i.e. config
overrides (`VARIANTS`). Every cell of the grid runs the same config apart from
its overrides, its target epsilon and its seed, so all rows share Poisson
sampling, the budget, the step count and the training loop. Cells live in

  <workdir>/<task>/<variant>/eps<epsilon>/seed<seed>/   (eps'inf' if non-private)

next to a `cell.json` naming them. A cell whose `results.json` exists is
skipped, and an interrupted cell resumes from its checkpoint, so rerunning a
sweep finishes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from raptor_jax.train import loop, methods

log = logging.getLogger("raptor_jax")

# Table rows (Tab. 1, 5, 6): config overrides of each variant, in table order.
VARIANTS: dict[str, dict[str, Any]] = {
    "nonprivate_lora": {"method": "nonprivate_lora"},
    "nonprivate_full": {"method": "nonprivate_full"},
    "monolithic_lora": {"method": "monolithic_lora"},
    "monolithic": {"method": "monolithic"},
    "baseline_a": {"method": "baseline_a"},
    "baseline_b": {"method": "baseline_b"},
    "baseline_c": {"method": "baseline_c"},
    "raptor_first": {"method": "raptor", "raptor.layer": "first"},
    "raptor_last": {"method": "raptor", "raptor.layer": "last"},
    "raptor": {"method": "raptor", "raptor.layer": "entropy"},
    "raptor_de_b": {"method": "raptor", "raptor.expert_denominator": "B"},
    "raptor_full_clip": {"method": "raptor", "raptor.joint_clip": True,
                         "raptor.alternate": False},
    "raptor_no_alternation": {"method": "raptor", "raptor.alternate": False},
    "raptor_no_residual": {"method": "raptor", "raptor.residual": "none"},
}
# Row labels of the tables, after the paper's.
LABELS = {
    "nonprivate_lora": "Non-priv. LoRA", "nonprivate_full": "Non-priv. full",
    "monolithic_lora": "Monolith. DP-Adam LoRA", "monolithic": "Monolith. DP-Adam",
    "baseline_a": "Baseline A (global)", "baseline_b": "Baseline B (shared-only)",
    "baseline_c": "Baseline C (expert-only)", "raptor_first": "Ours, first sparse",
    "raptor_last": "Ours, last sparse", "raptor": "Ours, entropy-sel.",
    "raptor_de_b": "Ours w/ D_e = B", "raptor_full_clip": "Ours w/ full-model clip",
    "raptor_no_alternation": "Ours w/o alternating", "raptor_no_residual": "Ours w/o residual",
}


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of the grid."""

  task: str
  variant: str
  target_epsilon: float | None  # None: non-private (one cell per seed)
  seed: int

  def directory(self, workdir: str | Path) -> Path:
    eps = "inf" if self.target_epsilon is None else f"{self.target_epsilon:g}"
    return Path(workdir) / self.task / self.variant / f"eps{eps}" / f"seed{self.seed}"


def is_private_variant(variant: str) -> bool:
  return VARIANTS[variant]["method"] in methods.PRIVATE_METHODS


def grid(task: str, variants: Sequence[str], epsilons: Sequence[float],
         seeds: Sequence[int]) -> list[Cell]:
  """The cells of a sweep, seed by seed; a non-private variant gets one cell per seed."""
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
  if not epsilons or not seeds or not variants:
    raise ValueError("a sweep needs at least one variant, one epsilon and one seed")
  cells = []
  for seed in seeds:  # seeds outermost: a partial sweep already compares every variant
    for eps in epsilons:
      cells.extend(Cell(task, v, float(eps), int(seed)) for v in variants
                   if is_private_variant(v))
    cells.extend(Cell(task, v, None, int(seed)) for v in variants if not is_private_variant(v))
  return cells


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
  *path, last = key.split(".")
  target = config
  for name in path:
    target = target[name]
  target[last] = value


def cell_config(base: ml_collections.ConfigDict, cell: Cell) -> ml_collections.ConfigDict:
  """`base` with the cell's variant overrides, epsilon and seed."""
  config = ml_collections.ConfigDict(base.to_dict())
  for key, value in VARIANTS[cell.variant].items():
    _set(config, key, value)
  if cell.target_epsilon is not None:
    config.privacy.epsilon = cell.target_epsilon
  config.seed = cell.seed
  return config


def run(base: ml_collections.ConfigDict, workdir: str | Path, *, variants: Sequence[str],
        epsilons: Sequence[float], seeds: Sequence[int],
        train: Callable[[ml_collections.ConfigDict, str], Mapping] = loop.train_and_evaluate,
        after: Callable[[ml_collections.ConfigDict, Path], None] | None = None) -> list[Path]:
  """Runs every cell of the grid that has no `results.json` yet.

  Args:
    base: the config every cell starts from (task, model, data, steps).
    workdir: root of the sweep.
    variants, epsilons, seeds: the grid.
    train: the training function (`train_and_evaluate`).
    after: optional hook run on each freshly trained cell (config, directory),
      e.g. the diagnostics.

  Returns:
    The directories of all cells of the grid.
  """
  cells = grid(base.data.task, variants, epsilons, seeds)
  directories = []
  for i, cell in enumerate(cells):
    directory = cell.directory(workdir)
    directories.append(directory)
    if (directory / "results.json").exists():
      log.info("[%d/%d] %s: done, skipped", i + 1, len(cells), directory)
      continue
    log.info("[%d/%d] %s", i + 1, len(cells), directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cell.json").write_text(json.dumps(dataclasses.asdict(cell), indent=2))
    config = cell_config(base, cell)
    train(config, str(directory))
    if after is not None:
      after(config, directory)
  return directories


def collect(workdir: str | Path) -> list[dict[str, Any]]:
  """Every finished cell under `workdir`: its cell.json merged with results.json."""
  rows = []
  for results_path in sorted(Path(workdir).rglob("results.json")):
    cell_path = results_path.with_name("cell.json")
    if not cell_path.exists():
      continue
    row = {**json.loads(results_path.read_text()), **json.loads(cell_path.read_text())}
    row["directory"] = str(results_path.parent)
    rows.append(row)
  return rows
