"""`<workdir>/curves.png`: a picture of a run, drawn from its metrics.jsonl.

The evaluation metrics and the epsilon spent against the cycle. Public
only: the rows of metrics.jsonl (dev metrics, epsilon spent, the cycle),
never the private training loss a user may have opted in to log. Drawn with
matplotlib (`raptor_jax[train]`); without it, nothing is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

CURVES = "curves.png"


def _rows(path: Path) -> dict[int, dict]:
  """{cycle: its public scalars}, the last value of each (a resumed run
  appends to the file)."""
  rows: dict[int, dict] = {}
  for line in path.read_text(encoding="utf-8").splitlines():
    if not line.strip():
      continue
    row = json.loads(line)
    scalars = {
        k: v
        for k, v in row.items()
        if k == "epsilon_spent" or k.startswith("dev/")
    }
    rows.setdefault(int(row["step"]), {}).update(scalars)
  return rows


def write(workdir: str | Path, title: str, split: str = "dev") -> Path | None:
  """Draws `<workdir>/curves.png` from `<workdir>/metrics.jsonl`, titled
  `title` (method and task), `split` naming the evaluation split.

  Returns:
    The file, or None without matplotlib or without an evaluation row.
  """
  workdir = Path(workdir)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError:
    return None
  rows = _rows(workdir / "metrics.jsonl")
  metrics = sorted({k for row in rows.values() for k in row if "/" in k})
  if not metrics:
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  for key in metrics:
    points = sorted((c, r[key]) for c, r in rows.items() if key in r)
    ax.plot(*zip(*points), marker="o", markersize=3, label=key)
  ax.set_xlabel("cycle")
  ax.set_ylabel(f"{split} metric")
  handles, labels = ax.get_legend_handles_labels()
  spent = sorted(
      (c, r["epsilon_spent"]) for c, r in rows.items() if "epsilon_spent" in r
  )
  if spent:
    eps_ax = ax.twinx()
    eps_ax.plot(
        *zip(*spent), color="gray", linestyle="--", label="epsilon spent"
    )
    eps_ax.set_ylabel("epsilon spent")
    eps_ax.set_ylim(bottom=0)
    more, more_labels = eps_ax.get_legend_handles_labels()
    handles, labels = handles + more, labels + more_labels
  ax.legend(handles, labels, fontsize=8, loc="lower right")
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  path = workdir / CURVES
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
