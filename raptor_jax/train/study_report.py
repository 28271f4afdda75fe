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


def write(results_dir: Path, plot: bool = True) -> Path:
  """Rebuilds `results.md` (and with `plot`, the phase diagram) from `results.csv`."""
  rows = read_rows(Path(results_dir) / "results.csv")
  path = Path(results_dir) / "results.md"
  path.write_text(markdown(rows))
  if rows and plot:
    plot_phase_diagram(rows, Path(results_dir) / "phase_diagram.png")
  return path


def plot_phase_diagram(rows, path: Path) -> Path:
  """RAPTOR - baseline_a and RAPTOR - monolithic_lora vs relevance.

  One panel per epsilon; one line per (comparison, imbalance level); error
  bars are the 95% paired t intervals. Cells with fewer than the protocol's
  seeds are drawn hollow (PARTIAL).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  relevance = {r["condition"]: float(r["relevance"]) for r in rows}
  epsilons = sorted({r["epsilon"] for r in rows} - {"inf"}, key=float)
  fig, axes = plt.subplots(
      1, max(len(epsilons), 1), figsize=(3.2 * max(len(epsilons), 1), 3.2)
  )
  axes = np.atleast_1d(axes)
  for ax, eps in zip(axes, epsilons):
    for other, color in zip(PAIRS, ("C0", "C1")):
      for imbalance, style in (("bal", "-"), ("skew", "--")):
        points = []
        for cond in sorted(relevance, key=relevance.get):
          if not cond.endswith(imbalance):
            continue
          diffs = paired(rows, cond, eps, other)
          if diffs:
            points.append(
                (relevance[cond], *paired_interval(diffs), len(diffs))
            )
        if not points:
          continue
        x, mean, low, high, n = map(np.asarray, zip(*points))
        ax.errorbar(
            x,
            mean,
            yerr=[mean - low, high - mean],
            fmt="o" + style,
            color=color,
            mfc=[color if k >= SEEDS_PER_CELL else "none" for k in n][0],
            label=f"- {other} ({imbalance})",
            capsize=3,
        )
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title(f"epsilon {eps}")
    ax.set_xlabel("expert relevance")
  axes[0].set_ylabel("RAPTOR gain (points)")
  axes[-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
