"""Tables of the controlled study, rebuilt from `results.csv` after every run.

`results.md` lists, per condition and epsilon, each method's mean accuracy
with its run count, and the paired differences RAPTOR - baseline_a and
RAPTOR - monolithic_lora (paired by seed: the same initialisation and the
same sample and noise secret) with 95% t intervals, plus the ablation cell.
A row with fewer runs than the protocol's seeds is marked PARTIAL: read the
counts before reading the numbers.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy import stats

SEEDS_PER_CELL = 10
PAIRS = ("baseline_a", "monolithic_lora")
METHOD_ORDER = (
    "nonprivate_lora",
    "monolithic_lora",
    "baseline_a",
    "baseline_b",
    "raptor",
    "raptor_de_b",
    "raptor_full_clip",
    "raptor_no_alternation",
    "raptor_no_residual",
)


def read_rows(path: Path) -> list[dict]:
  if not path.exists():
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def paired_interval(diffs) -> tuple[float, float, float]:
  """(mean, low, high) of the 95% t interval of paired differences."""
  d = np.asarray(diffs, np.float64)
  mean = float(d.mean())
  if len(d) < 2:
    return mean, math.nan, math.nan
  half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
  return mean, mean - half, mean + half


def paired(rows, condition: str, epsilon: str, other: str):
  """Per-seed RAPTOR - `other` accuracy differences (points) at one cell."""
  by = defaultdict(dict)
  for r in rows:
    if r["condition"] == condition and r["epsilon"] == epsilon:
      by[r["method"]][int(r["seed"])] = 100 * float(r["accuracy"])
  seeds = sorted(set(by["raptor"]) & set(by[other]))
  return [by["raptor"][s] - by[other][s] for s in seeds]


def markdown(rows) -> str:
  cells = defaultdict(lambda: defaultdict(list))
  for r in rows:
    cells[(r["condition"], r["epsilon"])][r["method"]].append(
        100 * float(r["accuracy"])
    )
  lines = [
      "# Controlled study: accuracy (%) per cell",
      "",
      "Rebuilt after every run from `results.csv`. `n` = runs done; the"
      f" protocol has {SEEDS_PER_CELL} seeds per cell, fewer is PARTIAL and"
      " no conclusion may be drawn from it.",
      "",
      "| condition | epsilon | method | n | mean ± std |",
      "|---|---|---|---|---|",
  ]
  for (cond, eps), methods in sorted(cells.items()):
    for m in sorted(methods, key=METHOD_ORDER.index):
      acc = np.asarray(methods[m])
      flag = "" if len(acc) >= SEEDS_PER_CELL else " (PARTIAL)"
      std = acc.std(ddof=1) if len(acc) > 1 else math.nan
      lines.append(
          f"| {cond} | {eps} | {m} | {len(acc)}{flag} |"
          f" {acc.mean():.2f} ± {std:.2f} |"
      )
  lines += [
      "",
      "## Paired differences (points), 95% t intervals",
      "",
      "| condition | epsilon | comparison | pairs | mean [95% CI] |",
      "|---|---|---|---|---|",
  ]
  for cond, eps in sorted(cells):
    if eps == "inf":
      continue
    for other in PAIRS:
      diffs = paired(rows, cond, eps, other)
      if not diffs:
        continue
      mean, low, high = paired_interval(diffs)
      flag = "" if len(diffs) >= SEEDS_PER_CELL else " (PARTIAL)"
      lines.append(
          f"| {cond} | {eps} | raptor - {other} | {len(diffs)}{flag} |"
          f" {mean:+.2f} [{low:+.2f}, {high:+.2f}] |"
      )
  return "\n".join(lines) + "\n"


def write(results_dir: Path) -> Path:
  """Rebuilds `results.md` from `results.csv`."""
  rows = read_rows(Path(results_dir) / "results.csv")
  path = Path(results_dir) / "results.md"
  path.write_text(markdown(rows))
  return path
