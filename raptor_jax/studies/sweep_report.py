"""The results table (Tab. 1 layout) and plots of a sweep's cells.

Rows are variants grouped by epsilon (non-private rows first, as epsilon
infinity), columns are tasks, cells are dev accuracy in percent, mean +- std
over seeds (the sample std, ddof=1; a single seed shows no std). Everything
here reads public outputs only: results.json (dev metrics; wall time only
when the runs opted in with `config.log_wall_time`, else shown as '-') and
layer_selection.json (routing statistics of the PUBLIC corpus).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from raptor_jax import ownership
from raptor_jax.studies import sweep

METRIC = "accuracy"


def _order(variants) -> list[str]:
  known = [v for v in sweep.VARIANTS if v in variants]
  return known + sorted(set(variants) - set(known))


def _epsilon_key(eps: float | None) -> float:
  return math.inf if eps is None else eps


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One entry per (epsilon, variant, task): mean, std, seeds, mean wall time.

  Args:
    rows: `sweep.collect` output.

  Returns:
    Entries sorted by epsilon (non-private first), then table order.
  """
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    groups.setdefault(
        (row["target_epsilon"], row["variant"], row["task"]), []
    ).append(row)
  order = _order({variant for _, variant, _ in groups})
  entries = []
  for (eps, variant, task), members in groups.items():
    values = np.array([100.0 * m[METRIC] for m in members])
    entries.append(
        dict(
            epsilon=eps,
            variant=variant,
            label=sweep.LABELS.get(variant, variant),
            task=task,
            mean=float(values.mean()),
            std=float(values.std(ddof=1)) if len(values) > 1 else None,
            seeds=len(values),
            values=values.tolist(),
            wall_time_s=_mean_wall_time(members),
            finished=all(m.get("finished", True) for m in members),
        )
    )
  entries.sort(
      key=lambda e: (
          -math.inf if e["epsilon"] is None else e["epsilon"],
          order.index(e["variant"]),
          e["task"],
      )
  )
  return entries


def _row_keys(entries) -> list[tuple]:
  keys = []
  for e in entries:
    if (e["epsilon"], e["variant"]) not in keys:
      keys.append((e["epsilon"], e["variant"]))
  return keys


def _fmt(entry: dict | None) -> str:
  if entry is None:
    return "-"
  text = f"{entry['mean']:.2f}" + (
      "" if entry["std"] is None else f" ± {entry['std']:.2f}"
  )
  return text + ("" if entry["finished"] else " (unfinished)")


def markdown(entries: Sequence[dict[str, Any]]) -> str:
  """Tab. 1 layout: epsilon | method | one column per task; then wall times."""
  tasks = sorted({e["task"] for e in entries})
  cell = {(e["epsilon"], e["variant"], e["task"]): e for e in entries}
  seeds = sorted({e["seeds"] for e in entries})
  lines = [
      f"Dev {METRIC} (%), mean ± std over {'/'.join(map(str, seeds))} seed(s).",
      "",
      "| ε | Method | " + " | ".join(tasks) + " |",
      "|---|---|" + "---|" * len(tasks),
  ]
  times = [
      "",
      "Mean wall time per run (s; '-' unless the runs set log_wall_time).",
      "",
      "| ε | Method | " + " | ".join(tasks) + " |",
      "|---|---|" + "---|" * len(tasks),
  ]
  previous = object()
  for eps, variant in _row_keys(entries):
    shown = "" if eps == previous else ("∞" if eps is None else f"{eps:g}")
    previous = eps
    label = sweep.LABELS.get(variant, variant)
    lines.append(
        f"| {shown} | {label} | "
        + " | ".join(_fmt(cell.get((eps, variant, t))) for t in tasks)
        + " |"
    )
    times.append(
        f"| {shown} | {label} | "
        + " | ".join(
            "-"
            if (eps, variant, t) not in cell
            else _fmt_wall(cell[eps, variant, t]["wall_time_s"], ".0f")
            for t in tasks
        )
        + " |"
    )
  return "\n".join(lines + times) + "\n"


def _mean_wall_time(members: Sequence[dict]) -> float | None:
  """Mean wall time of the runs, or None unless every run logged it
  (`config.log_wall_time`: wall time is private by default)."""
  times = [m.get("wall_time_s") for m in members]
  return None if None in times else float(np.mean(times))


def _fmt_wall(value: float | None, spec: str, missing: str = "-") -> str:
  return missing if value is None else format(value, spec)


def write_csv(entries: Sequence[dict[str, Any]], path: Path) -> None:
  """Tab. 1 layout as CSV: epsilon, method, then mean/std/seeds/wall time per task."""
  tasks = sorted({e["task"] for e in entries})
  cell = {(e["epsilon"], e["variant"], e["task"]): e for e in entries}
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(
        ["epsilon", "variant", "method"]
        + [
            f"{t}_{k}"
            for t in tasks
            for k in ("mean", "std", "seeds", "wall_time_s")
        ]
    )
    for eps, variant in _row_keys(entries):
      row = [
          "inf" if eps is None else f"{eps:g}",
          variant,
          sweep.LABELS.get(variant, variant),
      ]
      for t in tasks:
        e = cell.get((eps, variant, t))
        row += (
            ["", "", "", ""]
            if e is None
            else [
                f"{e['mean']:.4f}",
                "" if e["std"] is None else f"{e['std']:.4f}",
                e["seeds"],
                _fmt_wall(e["wall_time_s"], ".1f", ""),
            ]
        )
      writer.writerow(row)


def write_cells_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
  """cells.csv: one line per finished cell (task, variant, epsilon, seed).

  Public quantities only: the dev accuracy, the accounted epsilon and the
  wall time where the run logged it.
  """
  order = _order({row["variant"] for row in rows})
  rows = sorted(
      rows,
      key=lambda r: (
          r["task"],
          _epsilon_key(r["target_epsilon"]),
          order.index(r["variant"]),
          r["seed"],
      ),
  )
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(
        ["task", "variant", "target_epsilon", "seed", METRIC, "epsilon"]
        + ["wall_time_s"]
    )
    for r in rows:
      eps = r["target_epsilon"]
      writer.writerow(
          [
              r["task"],
              r["variant"],
              "inf" if eps is None else f"{eps:g}",
              r["seed"],
              f"{r[METRIC]:.6f}",
              "" if r.get("epsilon") is None else f"{r['epsilon']:.4f}",
              _fmt_wall(r.get("wall_time_s"), ".1f", ""),
          ]
      )


def plot_accuracy(entries: Sequence[dict[str, Any]], path: Path) -> None:
  """Dev accuracy vs epsilon per variant (one panel per task); non-private as lines.

  Each private variant is drawn as its mean +- std and every seed's own
  accuracy as a small point beside it, so that the spread is visible.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = sorted({e["task"] for e in entries})
  fig, axes = plt.subplots(
      1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False
  )
  for ax, task in zip(axes[0], tasks):
    mine = [e for e in entries if e["task"] == task]
    for variant in _order({e["variant"] for e in mine}):
      points = sorted(
          (e for e in mine if e["variant"] == variant),
          key=lambda e: _epsilon_key(e["epsilon"]),
      )
      label = variant  # the config's method name, as the tables and CLI
      if points[0]["epsilon"] is None:
        ax.axhline(
            points[0]["mean"],
            linestyle="--",
            linewidth=1,
            label=label,
            color="gray",
        )
        continue
      line = ax.errorbar(
          [e["epsilon"] for e in points],
          [e["mean"] for e in points],
          yerr=[e["std"] or 0.0 for e in points],
          marker="o",
          capsize=3,
          label=label,
      )
      for e in points:
        ax.scatter(
            [e["epsilon"]] * len(e.get("values", ())),
            e.get("values", ()),
            s=8,
            alpha=0.5,
            color=line[0].get_color(),
        )
    ax.set_xscale("log")
    ticks = sorted({e["epsilon"] for e in mine if e["epsilon"] is not None})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ε")
    ax.set_ylabel(f"dev {METRIC} (%)")
    ax.set_title(task)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def routing_tables(workdir: str | Path) -> dict[str, dict[str, Any]]:
  """Per task, the public-corpus layer table of its first cell that has one."""
  tables = {}
  for path in sorted(Path(workdir).rglob("layer_selection.json")):
    cell_path = path.with_name("cell.json")
    if not cell_path.exists():
      continue
    task = json.loads(cell_path.read_text())["task"]
    selection = json.loads(path.read_text())
    if task not in tables and selection.get("public_corpus"):
      tables[task] = dict(selection, source=str(path.parent))
  return tables


def plot_routing_entropy(tables: dict[str, dict[str, Any]], path: Path) -> None:
  """H(q)/log E per sparse layer on the public corpus; the entropy-selected layer marked."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = sorted(tables)
  fig, axes = plt.subplots(
      1,
      max(len(tasks), 1),
      figsize=(4 * max(len(tasks), 1), 3.5),
      squeeze=False,
  )
  for ax, task in zip(axes[0], tasks):
    rows = tables[task]["public_corpus"]
    layers = [r["layer"] for r in rows]
    best = ownership.select_layer("entropy", layers, rows)
    ax.bar(
        [str(l) for l in layers],
        [r["entropy_norm"] for r in rows],
        color=["tab:orange" if l == best else "tab:blue" for l in layers],
    )
    ax.set_ylim(0, 1)
    ax.set_xlabel("sparse block")
    ax.set_ylabel("H(q) / log E (public corpus)")
    ax.set_title(f"{task}: l* = {best}")
  if not tasks:
    axes[0][0].set_axis_off()
    axes[0][0].text(0.5, 0.5, "no public-corpus layer table", ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def diagnostics_markdown(rows: Sequence[dict[str, Any]]) -> str | None:
  """Tab. 8 / Tab. 10 layout of the cells' diagnostics.json (means over seeds), or None."""
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    path = Path(row["directory"]) / "diagnostics.json"
    if path.exists():
      key = (row["task"], _epsilon_key(row["target_epsilon"]), row["variant"])
      groups.setdefault(key, []).append(json.loads(path.read_text()))
  if not groups:
    return None
  order = _order({variant for _, _, variant in groups})

  def mean(values) -> str:
    values = [v for v in values if v is not None]
    return f"{np.mean(values):.3g}" if values else "-"

  lines = [
      "App. G diagnostics on each cell's dev split (means over seeds); λ+ per role (Eq. 40).",
      "",
      "| Task | ε | Method | M_role | mean SNR | SNR-CV | λ+ shared | λ+ head "
      "| λ+ experts |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for task, eps, variant in sorted(
      groups, key=lambda k: (k[0], k[1], order.index(k[2]))
  ):
    diags = groups[task, eps, variant]
    snr = [d["expert_snr"] for d in diags]
    lam = {
        role: mean(
            [
                d["noise_sensitivity"]["roles"].get(role, {}).get("lambda_plus")
                for d in diags
            ]
        )
        for role in ("shared", "head", "experts")
    }
    lines.append(
        f"| {task} | {'∞' if eps == math.inf else f'{eps:g}'} | "
        f"{sweep.LABELS.get(variant, variant)} | "
        f"{mean([d['role_mismatch']['M_role'] for d in diags])} | "
        f"{mean([s and s['mean'] for s in snr])} | {mean([s and s['cv'] for s in snr])} | "
        f"{lam['shared']} | {lam['head']} | {lam['experts']} |"
    )
  return "\n".join(lines) + "\n"


def paired_interval(diffs: Sequence[float]) -> tuple[float, tuple | None]:
  """Mean and two-sided 95% Student t interval of paired differences."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  diffs = np.asarray(diffs, dtype=float)
  mean = float(diffs.mean())
  if len(diffs) < 2:
    return mean, None
  half = float(
      stats.t.ppf(0.975, len(diffs) - 1)
      * diffs.std(ddof=1)
      / math.sqrt(len(diffs))
  )
  return mean, (mean - half, mean + half)


# RAPTOR is compared, seed by seed, with each of these that the sweep ran.
PAIRED_BASELINES = ("monolithic_lora", "baseline_a", "baseline_b")


def paired_differences(
    rows: Sequence[dict[str, Any]],
    a: str = "raptor",
    b: str = "monolithic_lora",
) -> list[dict[str, Any]]:
  """Per (task, epsilon): the seed-paired accuracy difference a - b, in points.

  Cells of the same seed share the initialisation (`config.seed`), so the
  difference is paired; the interval is the two-sided 95% Student t interval
  of the mean difference over the seeds both variants finished.
  """

  by_key: dict[tuple, dict[int, float]] = {}
  for row in rows:
    if row["variant"] in (a, b) and row["target_epsilon"] is not None:
      by_key.setdefault(
          (row["task"], row["target_epsilon"], row["variant"]), {}
      )[row["seed"]] = (100.0 * row[METRIC])
  out = []
  for task, eps in sorted({(t, e) for t, e, _ in by_key}):
    first, second = by_key.get((task, eps, a), {}), by_key.get(
        (task, eps, b), {}
    )
    seeds = sorted(set(first) & set(second))
    if not seeds:
      continue
    diffs = np.array([first[s] - second[s] for s in seeds])
    entry = dict(
        task=task,
        epsilon=eps,
        a=a,
        b=b,
        seeds=seeds,
        differences=diffs.tolist(),
        mean=float(diffs.mean()),
        std=None,
        ci95=None,
    )
    if len(diffs) > 1:
      entry.update(std=float(diffs.std(ddof=1)), ci95=paired_interval(diffs)[1])
    out.append(entry)
  return out


def paired_markdown(pairs: Sequence[dict[str, Any]]) -> str | None:
  if not pairs:
    return None
  a, b = pairs[0]["a"], pairs[0]["b"]
  lines = [
      f"Paired difference {sweep.LABELS.get(a, a)} − {sweep.LABELS.get(b, b)} "
      "(points, same seed = same initialisation; 95% Student t interval).",
      "",
      "| Task | ε | seeds | per-seed differences | mean | 95% interval |",
      "|---|---|---|---|---|---|",
  ]
  for p in pairs:
    interval = (
        "-"
        if p["ci95"] is None
        else f"[{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}]"
    )
    lines.append(
        f"| {p['task']} | {p['epsilon']:g} | {len(p['seeds'])} | "
        + ", ".join(f"{d:+.2f}" for d in p["differences"])
        + f" | {p['mean']:+.2f} | {interval} |"
    )
  return "\n".join(lines) + "\n"


def tuning_markdown(workdir: str | Path) -> str | None:
  """The clip-norm search of each (task, variant, epsilon): held-out accuracy per candidate.

  The task is read from the path (`<task>/<variant>/eps<e>/tuning.json`, the
  layout of `Cell.directory`), so a sweep over several tasks gets one row per
  task rather than rows that cannot be told apart.
  """
  found = [
      dict(json.loads(p.read_text()), task=p.parents[2].name)
      for p in sorted(Path(workdir).rglob("tuning.json"))
  ]
  if not found:
    return None
  order = _order({t["variant"] for t in found})
  found.sort(key=lambda t: (t["task"], t["epsilon"], order.index(t["variant"])))
  clips = sorted({c for t in found for c in t["holdout_accuracy"]}, key=float)
  lines = [
      "Clip-norm tuning: held-out train-record accuracy (%) per candidate C "
      f"(seed {found[0]['tune_seed']}, never the dev set); the chosen C is used for every "
      "seed of the table.",
      "",
      "| Task | ε | Method | "
      + " | ".join(f"C={c}" for c in clips)
      + " | chosen |",
      "|---|---|---|" + "---|" * (len(clips) + 1),
  ]
  for t in found:
    accs = t["holdout_accuracy"]
    lines.append(
        f"| {t['task']} | {t['epsilon']:g} | "
        f"{sweep.LABELS.get(t['variant'], t['variant'])} | "
        + " | ".join(
            "-" if c not in accs else f"{100 * accs[c]:.2f}" for c in clips
        )
        + f" | {t['chosen_clip']:g} |"
    )
  return "\n".join(lines) + "\n"


def write(workdir: str | Path, out: str | Path | None = None) -> list[Path]:
  """Writes the table, the plots and any diagnostics table under `out` (default `workdir`).

  Returns:
    Paths of results.csv, results.md, accuracy_vs_epsilon.png,
    routing_entropy.png, cells.csv (every seed) and, if a cell has diagnostics.json, diagnostics.md.
  """
  workdir = Path(workdir)
  rows = sweep.collect(workdir)
  entries = summarize(rows)
  if not entries:
    raise ValueError(
        f"no finished cells (cell.json + results.json) under {workdir}"
    )
  out = Path(out) if out is not None else workdir
  out.mkdir(parents=True, exist_ok=True)
  paths = [
      out / name
      for name in (
          "results.csv",
          "results.md",
          "accuracy_vs_epsilon.png",
          "routing_entropy.png",
      )
  ]
  write_csv(entries, paths[0])
  paths.append(out / "cells.csv")
  write_cells_csv(rows, paths[-1])
  extra = [
      paired_markdown(paired_differences(rows, b=baseline))
      for baseline in PAIRED_BASELINES
  ] + [tuning_markdown(workdir)]
  paths[1].write_text(
      "\n".join([markdown(entries)] + [e for e in extra if e]), encoding="utf-8"
  )
  plot_accuracy(entries, paths[2])
  plot_routing_entropy(routing_tables(workdir), paths[3])
  environment = workdir / "environment.json"
  if environment.exists() and out != workdir:
    paths.append(out / "environment.json")
    paths[-1].write_text(environment.read_text(), encoding="utf-8")
  diagnostics = diagnostics_markdown(rows)
  if diagnostics is not None:
    paths.append(out / "diagnostics.md")
    paths[-1].write_text(diagnostics, encoding="utf-8")
  return paths
