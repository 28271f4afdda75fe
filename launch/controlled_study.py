r"""The controlled study's grid, in one resumable process (results/controlled).

  python launch/controlled_study.py --config=configs/controlled.py \
    --results_dir=results/controlled

The grid (conditions, epsilons, methods, seeds, the ablation cell, the clip
grid and the tuning seed) is fixed in `results/controlled/PROTOCOL.md` and
mirrored by the constants below; it must not move after results are seen.
Every finished run is one row of `<results_dir>/results.csv` (tuning runs:
`tuning.csv`); a rerun skips the rows already there, so an interrupted
study resumes where it stopped. After every run the table
(`results.md`) is rebuilt from the CSV, the plot every 40 runs and at the end.

`--timing=N` runs the first N grid runs into a scratch directory and prints
only their wall times (no accuracy), to project the grid's cost.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags
import numpy as np

from raptor_jax.studies import controlled, controlled_report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/controlled.py")
_RESULTS = flags.DEFINE_string(
    "results_dir", "results/controlled", "where the CSVs and tables go"
)
_TIMING = flags.DEFINE_integer(
    "timing", 0, "time the first N grid runs (scratch output, no accuracy)"
)
_MAX_RUNS = flags.DEFINE_integer(
    "max_runs", 0, "stop after this many new runs (0 = the whole grid)"
)

# --- the grid of PROTOCOL.md -------------------------------------------------
CONDITIONS = controlled.CONDITIONS
EPSILONS = (0.5, 1.0, 2.0, 8.0)
PRIVATE = ("raptor", "baseline_a", "baseline_b", "monolithic_lora")
NONPRIVATE = "nonprivate_lora"
SEEDS = tuple(range(10))
TUNE_SEED = 100
CLIP_GRID = (0.1, 1.0, 10.0)
# Tab. 5 at one cell: highest relevance, balanced, epsilon 1 (RAPTOR's clip).
ABLATION_CONDITION, ABLATION_EPSILON = "r100_bal", 1.0
ABLATIONS = {
    "raptor_de_b": {"raptor.expert_denominator": "B"},
    "raptor_full_clip": {"raptor.joint_clip": True},
    "raptor_no_alternation": {"raptor.alternate": False},
    "raptor_no_residual": {"raptor.residual": "none"},
}
ROW_FIELDS = (
    "condition",
    "relevance",
    "domain_shares",
    "method",
    "epsilon",
    "seed",
    "clip",
    "accuracy",
    "epsilon_spent",
    "lambda_e",
    "lambda_s",
    "lambda_ratio",
    "M_role",
    "snr_per_expert",
    "snr_mean",
    "expert_layer",
    "seconds",
)
TUNE_FIELDS = ("condition", "method", "epsilon", "clip", "accuracy", "seconds")


def _cell_config(base, method, epsilon, seed, clip, overrides=None):
  config = base.copy_and_resolve_references()
  config.method = method
  config.seed = seed
  if epsilon is not None:
    config.privacy.epsilon = epsilon
  if clip is not None:
    config.privacy.clip_shared = clip
    config.privacy.clip_expert = clip
  for key, value in (overrides or {}).items():
    *sections, name = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[name] = value
  return config


def _read(path: Path) -> list[dict]:
  if not path.exists():
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def _append(path: Path, fields, row: dict) -> None:
  new = not path.exists()
  with open(path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    if new:
      writer.writeheader()
    writer.writerow({k: row.get(k, "") for k in fields})


def grid_runs():
  """Every run of the grid, in execution order: (condition, method, eps, seed)."""
  runs = []
  for cond in CONDITIONS:
    for eps in EPSILONS:
      for seed in SEEDS:
        for method in PRIVATE:
          runs.append((cond.name, method, eps, seed))
    for seed in SEEDS:
      runs.append((cond.name, NONPRIVATE, None, seed))
  for seed in SEEDS:
    for variant in ABLATIONS:
      runs.append((ABLATION_CONDITION, variant, ABLATION_EPSILON, seed))
  return runs


def _tuning_condition(name: str) -> str:
  """Clips are tuned per relevance level on its balanced condition."""
  return name.split("_")[0] + "_bal"


class Study:
  """The grid's state: data per condition, compiled steps, finished rows."""

  def __init__(self, config, results_dir: Path):
    self.config = config
    self.dir = results_dir
    self.dir.mkdir(parents=True, exist_ok=True)
    self.cache = controlled.StepCache()
    self.conditions = {c.name: c for c in CONDITIONS}
    _, _, self.tokenizer = controlled.pretrained(config.model.name)
    self._data: dict = {}
    self._owners: dict = {}
    self._eval_owners: dict = {}

  def data(self, name: str, split: str) -> controlled.ConditionData:
    if (name, split) not in self._data:
      self._data[(name, split)] = controlled.condition_data(
          self.config, self.conditions[name], self.tokenizer, eval_split=split
      )
    return self._data[(name, split)]

  def clip(self, name: str, method: str, epsilon: float) -> float:
    """The tuned clip of (relevance level, method, epsilon), tuning if needed."""
    tune_cond = _tuning_condition(name)
    path = self.dir / "tuning.csv"
    rows = [
        r
        for r in _read(path)
        if r["condition"] == tune_cond
        and r["method"] == method
        and float(r["epsilon"]) == epsilon
    ]
    done = {float(r["clip"]): float(r["accuracy"]) for r in rows}
    for clip in CLIP_GRID:
      if clip in done:
        continue
      config = _cell_config(self.config, method, epsilon, TUNE_SEED, clip)
      row = controlled.run_cell(
          config,
          self.data(tune_cond, "tune"),
          self.cache,
          secret_key=f"tune/{tune_cond}/{method}/{epsilon:g}/{clip:g}",
          memo=self._owners,
          with_diagnostics=False,
      )
      done[clip] = row["accuracy"]
      _append(
          path,
          TUNE_FIELDS,
          dict(
              condition=tune_cond,
              method=method,
              epsilon=epsilon,
              clip=clip,
              accuracy=row["accuracy"],
              seconds=round(row["seconds"], 2),
          ),
      )
    # The best held-out accuracy; ties go to the smaller clip.
    return max(CLIP_GRID, key=lambda c: (done[c], -c))

  def run(self, name, method, epsilon, seed) -> dict:
    overrides = ABLATIONS.get(method)
    base_method = "raptor" if overrides else method
    clip = None if epsilon is None else self.clip(name, base_method, epsilon)
    config = _cell_config(
        self.config, base_method, epsilon, seed, clip, overrides
    )
    cond = self.data(name, "dev")
    eps_key = "inf" if epsilon is None else f"{epsilon:g}"
    row = controlled.run_cell(
        config,
        cond,
        self.cache,
        # Common random numbers: every method of a (condition, eps, seed)
        # draws from the same sample and noise secret.
        secret_key=f"grid/{name}/{eps_key}/{seed}",
        memo=self._owners,
        eval_owners=self._dev_owners(config, cond),
    )
    condition = self.conditions[name]
    snr = row.get("snr")
    ratio = row["lambda_e"] / row["lambda_s"] if row["lambda_s"] > 0 else np.nan
    return dict(
        condition=name,
        relevance=condition.relevance,
        domain_shares=" ".join(f"{s:.4g}" for s in condition.domain_shares),
        method=method,
        epsilon=eps_key,
        seed=seed,
        clip="" if clip is None else clip,
        accuracy=row["accuracy"],
        epsilon_spent=""
        if row["epsilon_spent"] is None
        else row["epsilon_spent"],
        lambda_e=row["lambda_e"],
        lambda_s=row["lambda_s"],
        lambda_ratio=ratio,
        M_role=row["M_role"],
        snr_per_expert="" if snr is None else " ".join(f"{v:.4g}" for v in snr),
        snr_mean="" if snr is None else float(np.mean(snr)),
        expert_layer=row["expert_layer"],
        seconds=round(row["seconds"], 2),
    )

  def _dev_owners(self, config, cond):
    key = id(cond.run_data.dev)
    if key not in self._eval_owners:
      backbone, params, _ = controlled.pretrained(config.model.name)
      layer, _ = controlled.ownership.select_expert_layer(
          config, backbone, params, cond.run_data
      )
      self._eval_owners[key] = controlled.ownership.private_owner_map(
          config, backbone, params, cond.run_data.dev, layer
      )
    return self._eval_owners[key]


def write_environment(results_dir: Path, argv) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  path = results_dir / "environment.json"
  env = json.loads(path.read_text()) if path.exists() else {"invocations": []}
  env.update(
      python=platform.python_version(),
      jax=jax.__version__,
      flax=flax.__version__,
      optax=optax.__version__,
      numpy=np.__version__,
      platform=platform.platform(),
      cpus=os.cpu_count(),
  )
  env["invocations"].append(
      dict(
          argv=list(argv),
          started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      )
  )
  path.write_text(json.dumps(env, indent=2))


def main(argv):
  del argv
  logging.getLogger("raptor_jax").setLevel(logging.WARNING)
  config = _CONFIG.value
  if _TIMING.value:
    results = Path(_RESULTS.value) / "timing_scratch"
    study = Study(config, results)
    for key in grid_runs()[: _TIMING.value]:
      start = time.perf_counter()
      study.run(*key)
      print(f"{key}: {time.perf_counter() - start:.1f} s", flush=True)
    return
  results = Path(_RESULTS.value)
  study = Study(config, results)
  write_environment(results, sys.argv)
  path = results / "results.csv"
  done = {
      (r["condition"], r["method"], r["epsilon"], int(r["seed"]))
      for r in _read(path)
  }
  new = 0
  for name, method, eps, seed in grid_runs():
    eps_key = "inf" if eps is None else f"{eps:g}"
    if (name, method, eps_key, seed) in done:
      continue
    row = study.run(name, method, eps, seed)
    _append(path, ROW_FIELDS, row)
    new += 1
    # The plot costs more than a cached run; redraw it every 40 runs.
    controlled_report.write(results, plot=new % 40 == 0)
    print(
        f"{name} {method} eps={eps_key} seed={seed}: {row['seconds']:.1f} s",
        flush=True,
    )
    if _MAX_RUNS.value and new >= _MAX_RUNS.value:
      break
  controlled_report.write(results)


if __name__ == "__main__":
  app.run(main)
