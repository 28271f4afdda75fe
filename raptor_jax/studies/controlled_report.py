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
import json
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
  lines += _ablations(rows) + _corollary1(rows) + _lambda_table(rows)
  return "\n".join(lines) + "\n"


ABLATION_CELL = ("r100_bal", "1")


def _flag(count: int) -> str:
  return "" if count >= SEEDS_PER_CELL else " (PARTIAL)"


def _ablations(rows) -> list[str]:
  """Tab. 5 at the ablation cell: RAPTOR - each variant, paired by seed."""
  cond, eps = ABLATION_CELL
  lines = [
      "",
      f"## Ablations at {cond}, epsilon {eps} (Tab. 5): RAPTOR - variant",
      "",
      "| variant | pairs | RAPTOR - variant, points [95% CI] |",
      "|---|---|---|",
  ]
  for variant in METHOD_ORDER[5:]:
    diffs = paired(rows, cond, eps, variant)
    if diffs:
      mean, low, high = paired_interval(diffs)
      lines.append(
          f"| {variant} | {len(diffs)}{_flag(len(diffs))} |"
          f" {mean:+.2f} [{low:+.2f}, {high:+.2f}] |"
      )
  return lines


def _corollary1(rows) -> list[str]:
  """Corollary 1: is the gain over baseline_a larger at epsilon 0.5 than 8?

  Per condition and seed, (RAPTOR - baseline_a at 0.5) - (the same at 8);
  the seeds pair both epsilons (same initialisation).
  """
  lines = [
      "",
      "## Corollary 1: gain at epsilon 0.5 minus gain at epsilon 8",
      "",
      "Gain = RAPTOR - baseline_a (points), per seed; the difference of the"
      " two gains is paired over seeds.",
      "",
      "| condition | pairs | gain(0.5) - gain(8) [95% CI] |",
      "|---|---|---|",
  ]

  def gains(cond, eps):
    by = defaultdict(dict)
    for r in rows:
      if r["condition"] == cond and r["epsilon"] == eps:
        by[r["method"]][int(r["seed"])] = 100 * float(r["accuracy"])
    seeds = set(by["raptor"]) & set(by["baseline_a"])
    return {s: by["raptor"][s] - by["baseline_a"][s] for s in seeds}

  for cond in sorted({r["condition"] for r in rows}):
    tight, loose = gains(cond, "0.5"), gains(cond, "8")
    seeds = sorted(set(tight) & set(loose))
    if not seeds:
      continue
    mean, low, high = paired_interval([tight[s] - loose[s] for s in seeds])
    lines.append(
        f"| {cond} | {len(seeds)}{_flag(len(seeds))} |"
        f" {mean:+.2f} [{low:+.2f}, {high:+.2f}] |"
    )
  return lines


def _lambda_table(rows) -> list[str]:
  """App. G's noise-injection sensitivities as measured by the grid's runs."""
  lines = [
      "",
      "## Noise-injection sensitivity measured in the grid (App. G)",
      "",
      "Per condition, over every private and non-private run: the share of"
      " runs with a positive lambda_s and lambda_e, their medians, and the"
      " median lambda_e / lambda_s over the runs where lambda_s > 0.",
      "",
      "| condition | runs | lambda_s > 0 | lambda_e > 0 | median lambda_s |"
      " median lambda_e | median ratio |",
      "|---|---|---|---|---|---|---|",
  ]
  by = defaultdict(list)
  for r in rows:
    if r["method"] in METHOD_ORDER[:5]:
      by[r["condition"]].append((float(r["lambda_s"]), float(r["lambda_e"])))
  for cond in sorted(by):
    ls, le = np.asarray(by[cond]).T
    ratio = le[ls > 0] / ls[ls > 0]
    median = f"{np.median(ratio):.3g}" if ratio.size else "undefined"
    lines.append(
        f"| {cond} | {len(ls)} | {np.mean(ls > 0):.2f} | {np.mean(le > 0):.2f}"
        f" | {np.median(ls):.3g} | {np.median(le):.3g} | {median} |"
    )
  return lines


def predictors(rows, owners: dict, scan: list) -> list[str]:
  """Spearman rho over the (condition, epsilon) cells of the mean gain
  (RAPTOR - baseline_a) with quantities measurable without private data:
  the public corpus's owner entropy and the relevance scan's lambda ratio.
  """
  lines = [
      "",
      "## Predictors without private data (Spearman over cells)",
      "",
  ]
  cells = sorted(
      {(r["condition"], r["epsilon"]) for r in rows if r["epsilon"] != "inf"}
  )
  gain, entropy, ratio = [], [], []
  scan_ratio = {float(s["relevance"]): s["lambda_ratio"] for s in scan}
  for cond, eps in cells:
    diffs = paired(rows, cond, eps, "baseline_a")
    if len(diffs) < SEEDS_PER_CELL or cond not in owners:
      continue
    gain.append(float(np.mean(diffs)))
    entropy.append(owners[cond]["public_owner_entropy"])
    ratio.append(scan_ratio.get(owners[cond]["relevance"]))
  lines.append(f"Complete cells: {len(gain)}.")
  lines.append("")
  if len(gain) >= 3:
    if len(set(entropy)) < 2:
      lines.append(
          "* public owner entropy H/log E: not computable (one value over"
          " the complete cells)"
      )
    else:
      rho, p = stats.spearmanr(entropy, gain)
      lines.append(
          f"* public owner entropy H/log E: rho = {rho:+.2f} (p = {p:.2g})"
      )
    defined = [(g, x) for g, x in zip(gain, ratio) if x is not None]
    if len({x for _, x in defined}) >= 3:
      rho, p = stats.spearmanr([x for _, x in defined], [g for g, _ in defined])
      lines.append(
          f"* relevance-scan lambda_e / lambda_s: rho = {rho:+.2f} (p = {p:.2g})"
      )
    else:
      lines.append(
          "* relevance-scan lambda_e / lambda_s: not computable (the ratio is"
          f" defined, with distinct values, at {len({x for _, x in defined})}"
          " relevance level(s) of the grid)"
      )
  return lines


def write(results_dir: Path, plot: bool = True) -> Path:
  """Rebuilds `results.md` (and with `plot`, the phase diagram) from `results.csv`."""
  rows = read_rows(Path(results_dir) / "results.csv")
  path = Path(results_dir) / "results.md"
  text = markdown(rows)
  owners, scan = (
      Path(results_dir) / f for f in ("owners.json", "relevance_scan.json")
  )
  if owners.exists() and scan.exists():
    text += (
        "\n".join(
            predictors(
                rows,
                json.loads(owners.read_text()),
                json.loads(scan.read_text()),
            )
        )
        + "\n"
    )
  path.write_text(text)
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
