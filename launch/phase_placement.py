r"""Places a sweep's tasks on the controlled study's phase diagram.

The rule is fixed in `results/glue_small/PROTOCOL.md` (section 5), before any
result of that study:

* A (task, epsilon)'s imbalance class is 'skewed' if the public corpus's
  owner entropy H/log E at RAPTOR's selected layer is below 0.8, 'balanced'
  otherwise. The controlled conditions had 0.999 ('_bal') and 0.59-0.63
  ('_skew').
* Its relevance level is the one of that class whose median
  lambda_e / lambda_s is nearest the task's RAPTOR seed-0 value. The median
  is taken over the grid runs of the five main methods where lambda_s > 0,
  as in `results/controlled/results.md`.
* The prediction is the sign of that controlled cell's mean
  RAPTOR - baseline_a at the same epsilon, and whether its paired 95%
  interval excluded 0. It is right if the signs agree. It is confirmed only
  if both intervals exclude 0 with the same sign.

Reads only public outputs: `layer_selection.json` (public corpus),
`diagnostics.json` (dev split), the cells' dev accuracies.

  python launch/phase_placement.py --workdir=runs/glue_small \
    --controlled=results/controlled --out=results/glue_small/phase_placement.md
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence

from absl import app, flags  # pylint: disable=g-multiple-import
import numpy as np

from raptor_jax.studies import sweep, sweep_report

SKEWED_BELOW = 0.8  # H / log E of the public corpus at the selected layer
MAIN_METHODS = (
    "nonprivate_lora",
    "monolithic_lora",
    "baseline_a",
    "baseline_b",
    "raptor",
)


def controlled_cells(controlled: str | Path) -> dict[str, dict[str, Any]]:
  """Per controlled condition: class, relevance, median ratio, gains by epsilon."""
  controlled = Path(controlled)
  owners = json.loads((controlled / "owners.json").read_text())
  with open(controlled / "results.csv", encoding="utf-8") as f:
    rows = [r for r in csv.DictReader(f) if r["method"] in MAIN_METHODS]
  out = {}
  for name, info in owners.items():
    mine = [r for r in rows if r["condition"] == name]
    ratios = [
        float(r["lambda_e"]) / float(r["lambda_s"])
        for r in mine
        if r["lambda_s"] and float(r["lambda_s"]) > 0
    ]
    accuracy = {
        (r["method"], r["epsilon"], r["seed"]): float(r["accuracy"])
        for r in mine
    }
    gains = {}
    for eps in sorted({r["epsilon"] for r in mine if r["epsilon"] != "inf"}):
      seeds = sorted(
          s
          for m, e, s in accuracy
          if m == "raptor" and e == eps and ("baseline_a", e, s) in accuracy
      )
      diffs = [
          100.0 * (accuracy["raptor", eps, s] - accuracy["baseline_a", eps, s])
          for s in seeds
      ]
      if diffs:
        gains[float(eps)] = sweep_report.paired_interval(diffs)
    out[name] = dict(
        skewed=info["public_owner_entropy"] < SKEWED_BELOW,
        relevance=info["relevance"],
        public_owner_entropy=info["public_owner_entropy"],
        median_ratio=float(np.median(ratios)) if ratios else None,
        gains=gains,
    )
  return out


def task_statistics(cell_directory: str | Path) -> dict[str, float | None]:
  """H/log E of the public corpus at l* and lambda_e / lambda_s of one run."""
  directory = Path(cell_directory)
  selection = json.loads((directory / "layer_selection.json").read_text())
  (row,) = [
      r
      for r in selection["public_corpus"]
      if r["layer"] == selection["selected_layer"]
  ]
  roles = json.loads((directory / "diagnostics.json").read_text())[
      "noise_sensitivity"
  ]["roles"]
  lam_s = roles.get("shared", {}).get("lambda_plus", 0.0)
  lam_e = roles.get("experts", {}).get("lambda_plus", 0.0)
  return dict(
      public_owner_entropy=float(row["entropy_norm"]),
      lambda_e=lam_e,
      lambda_s=lam_s,
      ratio=lam_e / lam_s if lam_s > 0 else None,
  )


def nearest_condition(
    cells: dict[str, dict[str, Any]], skewed: bool, ratio: float | None
) -> str | None:
  """The condition of that class whose median ratio is nearest `ratio`.

  None when the ratio is undefined (the task's lambda_s measured 0): the
  protocol's rule places a task by its ratio alone and says nothing for that
  case, so no condition is picked and no prediction is made, rather than
  reading an undefined ratio as infinite after the fact.
  """
  if ratio is None:
    return None
  candidates = [
      (abs(c["median_ratio"] - ratio), name)
      for name, c in cells.items()
      if c["skewed"] == skewed and c["median_ratio"] is not None
  ]
  return min(candidates)[1] if candidates else None


def _sign(interval_or_mean) -> int:
  return int(np.sign(interval_or_mean))


def _excludes_zero(ci) -> bool:
  return ci is not None and (ci[0] > 0 or ci[1] < 0)


def place(workdir: str | Path, controlled: str | Path) -> list[dict[str, Any]]:
  """One entry per (task, epsilon) with a RAPTOR seed-0 diagnostics run."""
  cells = controlled_cells(controlled)
  rows = sweep.collect(workdir)
  observed = {
      (p["task"], p["epsilon"]): p
      for p in sweep_report.paired_differences(rows, b="baseline_a")
  }
  out = []
  for row in rows:
    directory = Path(row["directory"])
    if not (
        row["variant"] == "raptor"
        and row["seed"] == 0
        and (directory / "diagnostics.json").exists()
    ):
      continue
    task, eps = row["task"], row["target_epsilon"]
    stats_ = task_statistics(directory)
    skewed = stats_["public_owner_entropy"] < SKEWED_BELOW
    name = nearest_condition(cells, skewed, stats_["ratio"])
    predicted = cells[name]["gains"].get(eps) if name else None
    seen = observed.get((task, eps))
    entry = dict(
        task=task,
        epsilon=eps,
        **stats_,
        skewed=skewed,
        condition=name,
        predicted=predicted,
        observed=None if seen is None else (seen["mean"], seen["ci95"]),
        observed_seeds=None if seen is None else len(seen["seeds"]),
    )
    if predicted is not None and seen is not None:
      entry["right"] = _sign(predicted[0]) == _sign(seen["mean"])
      entry["confirmed"] = (
          entry["right"]
          and _excludes_zero(predicted[1])
          and _excludes_zero(seen["ci95"])
      )
    out.append(entry)
  return sorted(out, key=lambda e: (e["task"], e["epsilon"]))


def _fmt_gain(gain) -> str:
  if gain is None:
    return "-"
  mean, ci = gain
  return f"{mean:+.2f}" + (
      "" if ci is None else f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
  )


def markdown(entries: Sequence[dict[str, Any]]) -> str:
  lines = [
      "Each task on the controlled study's phase diagram (rule fixed in "
      "PROTOCOL.md section 5): gain = RAPTOR − Baseline A in points, paired "
      "95% interval.",
      "",
      "| task | ε | H/log E (public) | class | λe/λs (seed 0) | nearest "
      "condition | controlled gain | observed gain (seeds) | sign right | "
      "confirmed |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for e in entries:
    ratio = "undefined (λs = 0)" if e["ratio"] is None else f"{e['ratio']:.3g}"
    seeds = "" if e["observed_seeds"] is None else f" ({e['observed_seeds']})"
    lines.append(
        f"| {e['task']} | {e['epsilon']:g} | {e['public_owner_entropy']:.3f} |"
        f" {'skewed' if e['skewed'] else 'balanced'} | {ratio} |"
        f" {e['condition'] or '-'} | {_fmt_gain(e['predicted'])} |"
        f" {_fmt_gain(e['observed'])}{seeds} |"
        f" {_yes_no(e.get('right'))} | {_yes_no(e.get('confirmed'))} |"
    )
  return "\n".join(lines) + "\n"


def _yes_no(value) -> str:
  return "-" if value is None else ("yes" if value else "no")


_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's --workdir.")
_CONTROLLED = flags.DEFINE_string(
    "controlled", "results/controlled", "The controlled study's results."
)
_OUT = flags.DEFINE_string("out", "", "Write the table here (default: print).")


def main(argv) -> None:
  del argv
  text = markdown(place(_WORKDIR.value, _CONTROLLED.value))
  if _OUT.value:
    Path(_OUT.value).write_text(text, encoding="utf-8")
  print(text)


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
