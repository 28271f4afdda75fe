"""A grid of runs (variant x epsilon x seed) through `train_and_evaluate`.

A *variant* is a table row: a method or a RAPTOR ablation, i.e. config
overrides (`VARIANTS`). Every cell of the grid runs the same config apart from
its overrides, its target epsilon and its seed, so all rows share Poisson
sampling, the budget, the step count and the training loop. Cells live in

  <workdir>/<task>/<variant>/eps<epsilon>/seed<seed>/   (eps'inf' if non-private)

next to a `cell.json` naming them. A cell whose `results.json` exists is
skipped, and an interrupted cell resumes from its checkpoint, so rerunning a
sweep finishes it.

A workdir holds checkpoints and is not meant to be committed; a study that
outlives its machine keeps an *archive* instead (`archive_cell`): each
finished cell's public records (`RECORD_FILES`, a few kB) mirrored under a
committed folder. `restore` copies them back into a fresh workdir, so a sweep
on a new clone skips what an earlier machine finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from raptor_jax import _validate
from raptor_jax.train import methods, secrecy, train_and_evaluate

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
    # One change: one clip C over a record's shared + expert gradient, each
    # alternating phase releasing its part (RAPTOR accounting, C_s = C_e = C).
    "raptor_full_clip": {"method": "raptor", "raptor.joint_clip": True},
    # Two changes (the variant `raptor_full_clip` named before): one sample
    # for both streams and one clip, one sigma.
    "raptor_full_clip_one_sample": {
        "method": "raptor",
        "raptor.joint_clip": True,
        "raptor.alternate": False,
    },
    "raptor_no_alternation": {"method": "raptor", "raptor.alternate": False},
    "raptor_no_residual": {"method": "raptor", "raptor.residual": "none"},
}
# Row labels of the tables, after the paper's.
LABELS = {
    "nonprivate_lora": "Non-priv. LoRA",
    "nonprivate_full": "Non-priv. full",
    "monolithic_lora": "Monolith. DP-Adam LoRA",
    "monolithic": "Monolith. DP-Adam",
    "baseline_a": "Baseline A (global)",
    "baseline_b": "Baseline B (shared-only)",
    "baseline_c": "Baseline C (expert-only)",
    "raptor_first": "Ours, first sparse",
    "raptor_last": "Ours, last sparse",
    "raptor": "Ours, entropy-sel.",
    "raptor_de_b": "Ours w/ D_e = B",
    "raptor_full_clip": "Ours w/ full-model clip",
    "raptor_full_clip_one_sample": "Ours w/ full-model clip, one sample",
    "raptor_no_alternation": "Ours w/o alternating",
    "raptor_no_residual": "Ours w/o residual",
}


# A finished cell's public records (`outputs.py`: no training loss, owner map
# or realised count), the ones the report, the diagnostics table and the
# phase placement read. Checkpoints and logs stay in the workdir.
RECORD_FILES = (
    "cell.json",
    "config.json",
    "results.json",
    "privacy_report.json",
    "layer_selection.json",
    "diagnostics.json",
)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of the grid.

  A tuning cell (`tune_clip` set) trains with that clip norm and is
  evaluated on the held-out train records, never on dev; it is not a row of
  the table.
  """

  task: str
  variant: str
  target_epsilon: float | None  # None: non-private (one cell per seed)
  seed: int
  tune_clip: float | None = None

  def directory(self, workdir: str | Path) -> Path:
    eps = "inf" if self.target_epsilon is None else f"{self.target_epsilon:g}"
    base = Path(workdir) / self.task / self.variant / f"eps{eps}"
    if self.tune_clip is not None:
      return base / "tune" / f"clip{self.tune_clip:g}"
    return base / f"seed{self.seed}"


def check_finished_cell(
    directory: Path, config: ml_collections.ConfigDict
) -> None:
  """A finished cell was trained as its variant is defined now.

  Variant definitions change between versions (`raptor_full_clip` was the
  one-sample variant before it kept alternation), and a finished cell is
  skipped, so a stale cell would enter the table under the new name. Every
  field some variant overrides must match the cell's `config.json`.
  """
  path = directory / "config.json"
  if not path.exists():
    return
  saved = json.loads(path.read_text())
  for key in sorted({k for o in VARIANTS.values() for k in o}):
    *sections, name = key.split(".")
    old, new = saved, config
    for section in sections:
      old, new = old.get(section, {}), new[section]
    if name in old and old[name] != new[name]:
      raise ValueError(
          f"{directory} was trained with {key}={old[name]!r}, but its variant "
          f"now sets {new[name]!r}; move the cell away (or use a new "
          "--workdir) to retrain it"
      )


def is_private_variant(variant: str) -> bool:
  return VARIANTS[variant]["method"] in methods.PRIVATE_METHODS


def grid(
    task: str,
    variants: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
) -> list[Cell]:
  """The cells of a sweep, seed by seed; a non-private variant gets one cell per seed."""
  for variant in variants:
    _validate.one_of("variant", variant, VARIANTS, "see --variants")
  if not epsilons or not seeds or not variants:
    raise ValueError(
        "a sweep needs at least one variant, one epsilon and one seed"
    )
  cells = []
  # Seeds outermost: a partial sweep already compares every variant.
  for seed in seeds:
    for eps in epsilons:
      cells.extend(
          Cell(task, v, float(eps), int(seed))
          for v in variants
          if is_private_variant(v)
      )
    cells.extend(
        Cell(task, v, None, int(seed))
        for v in variants
        if not is_private_variant(v)
    )
  return cells


def cell_config(
    base: ml_collections.ConfigDict, cell: Cell, clip: float | None = None
) -> ml_collections.ConfigDict:
  """`base` with the cell's variant overrides, epsilon and seed.

  A fixed `privacy.secret_seed` N becomes a KDF of (N, cell), so cells never
  share samples or noise (the secret itself stays OS entropy when N < 0).

  `clip` (or the tuning cell's own clip norm) sets every clip norm of the
  method (C_s and C_e; one-stream methods read C_s). A tuning cell evaluates
  on the held-out train records (`data.eval_split='holdout'`).
  """
  config = ml_collections.ConfigDict(base.to_dict())
  config.update_from_flattened_dict(VARIANTS[cell.variant])
  if cell.target_epsilon is not None:
    config.privacy.epsilon = cell.target_epsilon
  config.seed = cell.seed
  clip = cell.tune_clip if cell.tune_clip is not None else clip
  if clip is not None:
    config.privacy.clip_shared = config.privacy.clip_expert = float(clip)
  if cell.tune_clip is not None:
    # The holdout replaces dev; a dev field left set would be refused as
    # ignored (`setup.check_data_fields`).
    config.data.eval_split = "holdout"
    config.data.dev_path, config.data.dev_limit = "", 0
  if config.privacy.secret_seed >= 0:  # a fixed seed: one derived per cell
    config.privacy.secret_seed = secrecy.cell_secret_seed(
        base.privacy.secret_seed, str(cell.directory(""))
    )
  return config


def _train_cell(
    cell: Cell,
    config: ml_collections.ConfigDict,
    directory: Path,
    train,
    after,
    workdir: str | Path,
    archive: str | Path | None,
) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "cell.json").write_text(
      json.dumps(
          dict(
              dataclasses.asdict(cell),
              clip_shared=config.privacy.clip_shared,
              clip_expert=config.privacy.clip_expert,
          ),
          indent=2,
      )
  )
  train(config, str(directory))
  if after is not None and cell.tune_clip is None:
    after(config, directory)  # e.g. diagnostics.json, archived with the cell
  if archive is not None:
    archive_cell(workdir, directory, archive)


def tune_clip(
    base: ml_collections.ConfigDict,
    workdir: str | Path,
    variant: str,
    epsilon: float,
    clip_grid: Sequence[float],
    tune_seed: int,
    train: Callable[[ml_collections.ConfigDict, str], Mapping] | None = None,
    archive: str | Path | None = None,
) -> float:
  """The clip norm of (variant, epsilon): best held-out accuracy over `clip_grid`.

  Each candidate trains once with seed `tune_seed` (kept apart from the
  table's seeds) and is scored on `data.holdout` train records that no cell
  trains on, so the dev accuracies of the table are not selected on. Ties go
  to the first candidate of the grid. Finished candidates are reused; the
  choice is written to `<variant>/eps<epsilon>/tuning.json`.

  Tuning reads private data outside the privacy accounting, as the paper's
  hyperparameter search does (App. C): report it as such.
  """
  train = train or train_and_evaluate
  if not base.data.holdout:
    raise ValueError(
        "clip tuning scores candidates on held-out train records; set "
        "--config.data.holdout=N (and --config.data.train_limit)"
    )
  scores = {}
  for clip in clip_grid:
    cell = Cell(
        base.data.task,
        variant,
        float(epsilon),
        tune_seed,
        tune_clip=float(clip),
    )
    directory = cell.directory(workdir)
    if not (directory / "results.json").exists():
      log.info("tuning %s eps %g: clip %g", variant, epsilon, clip)
      config = cell_config(base, cell)
      _train_cell(cell, config, directory, train, None, workdir, archive)
    scores[float(clip)] = float(
        json.loads((directory / "results.json").read_text())["accuracy"]
    )
  chosen = max(scores, key=lambda c: (scores[c], -list(scores).index(c)))
  path = (
      Cell(base.data.task, variant, float(epsilon), tune_seed)
      .directory(workdir)
      .parent
  )
  (path / "tuning.json").write_text(
      json.dumps(
          dict(
              variant=variant,
              epsilon=epsilon,
              tune_seed=tune_seed,
              metric="holdout accuracy",
              holdout_accuracy={f"{c:g}": v for c, v in scores.items()},
              chosen_clip=chosen,
          ),
          indent=2,
      )
  )
  if archive is not None:
    target = Path(archive) / path.relative_to(workdir)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path / "tuning.json", target / "tuning.json")
  return chosen


def run(
    base: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    variants: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
    clip_grid: Sequence[float] = (),
    tune_seed: int = 100,
    train: Callable[
        [ml_collections.ConfigDict, str], Mapping
    ] = train_and_evaluate,
    after: Callable[[ml_collections.ConfigDict, Path], None] | None = None,
    archive: str | Path | None = None,
) -> list[Path]:
  """Runs every cell of the grid that has no `results.json` yet.

  Args:
    base: the config every cell starts from (task, model, data, steps).
    workdir: root of the sweep.
    variants, epsilons, seeds: the grid.
    clip_grid: if given, each private (variant, epsilon) first tunes its clip
      norm over these values (`tune_clip`) and its cells use the choice.
    tune_seed: the seed of the tuning runs.
    train: the training function (`train_and_evaluate`).
    after: optional hook run on each freshly trained cell (config, directory),
      e.g. the diagnostics.
    archive: if given, first `restore` its finished cells into `workdir`, then
      `archive_cell` each cell (and tuning run) as it finishes.

  Returns:
    The directories of all cells of the grid.
  """
  cells = grid(base.data.task, variants, epsilons, seeds)
  if clip_grid and tune_seed in seeds:
    raise ValueError(
        f"tune_seed {tune_seed} is also a table seed; use a seed outside {seeds}"
    )
  if archive is not None:
    for directory in restore(archive, workdir):
      log.info("restored %s from %s", directory, archive)
  directories = []
  for i, cell in enumerate(cells):
    directory = cell.directory(workdir)
    directories.append(directory)
    if (directory / "results.json").exists():
      check_finished_cell(directory, cell_config(base, cell))
      log.info("[%d/%d] %s: done, skipped", i + 1, len(cells), directory)
      continue
    clip = None
    if clip_grid and cell.target_epsilon is not None:
      clip = tune_clip(
          base,
          workdir,
          cell.variant,
          cell.target_epsilon,
          clip_grid,
          tune_seed,
          train,
          archive,
      )
    log.info("[%d/%d] %s", i + 1, len(cells), directory)
    _train_cell(
        cell,
        cell_config(base, cell, clip),
        directory,
        train,
        after,
        workdir,
        archive,
    )
  return directories


def archive_cell(
    workdir: str | Path, directory: str | Path, archive: str | Path
) -> Path:
  """Mirrors a finished cell's `RECORD_FILES` (and its `tuning.json`) into `archive`.

  The copy sits at the cell's path relative to `workdir`, so `restore` can put
  it back. A cell without `results.json` is refused: an archive holds only
  finished cells.
  """
  workdir, directory = Path(workdir), Path(directory)
  if not (directory / "results.json").exists():
    raise ValueError(f"{directory} has no results.json: not a finished cell")
  target = Path(archive) / directory.relative_to(workdir)
  target.mkdir(parents=True, exist_ok=True)
  for name in RECORD_FILES:
    if (directory / name).exists():
      shutil.copy2(directory / name, target / name)
  # The (variant, epsilon)'s clip choice, `<variant>/eps<e>/tuning.json`,
  # once its tuning has finished.
  eps_dir = directory.parent
  if eps_dir.name == "tune":
    eps_dir = eps_dir.parent
  if (eps_dir / "tuning.json").exists():
    shutil.copy2(
        eps_dir / "tuning.json",
        Path(archive) / eps_dir.relative_to(workdir) / "tuning.json",
    )
  return target


def restore(archive: str | Path, workdir: str | Path) -> list[Path]:
  """Copies every archived finished cell missing from `workdir` back into it.

  A cell the workdir already has (finished or interrupted) is left alone.
  Returns the restored cell directories.
  """
  archive, workdir = Path(archive), Path(workdir)
  restored = []
  for results_path in sorted(archive.rglob("results.json")):
    source = results_path.parent
    target = workdir / source.relative_to(archive)
    if target.exists():
      continue
    target.mkdir(parents=True)
    for name in RECORD_FILES:
      if (source / name).exists():
        shutil.copy2(source / name, target / name)
    restored.append(target)
  for tuning_path in sorted(archive.rglob("tuning.json")):
    target = workdir / tuning_path.relative_to(archive)
    if not target.exists():
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(tuning_path, target)
  return restored


def write_environment(workdir: str | Path, argv: Sequence[str]) -> Path:
  """Appends this invocation and the software versions to `<workdir>/environment.json`.

  A `--config.privacy.secret_seed=N` flag is written as `=<redacted>`.
  """
  import platform  # pylint: disable=g-import-not-at-top
  from importlib import metadata  # pylint: disable=g-import-not-at-top

  path = Path(workdir) / "environment.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  env = json.loads(path.read_text()) if path.exists() else {"invocations": []}
  packages = (
      "jax",
      "jaxlib",
      "flax",
      "optax",
      "dp-accounting",
      "orbax-checkpoint",
      "transformers",
      "tokenizers",
      "numpy",
  )
  env["python"] = platform.python_version()
  env["platform"] = platform.platform()
  env["packages"] = {p: metadata.version(p) for p in packages}
  env["invocations"].append(" ".join(_redacted(argv)))
  path.write_text(json.dumps(env, indent=2))
  return path


def _redacted(argv: Sequence[str]) -> list[str]:
  """`argv` with the value of a `secret_seed` flag hidden (never written)."""
  out = []
  for arg in argv:
    if out and out[-1].endswith("secret_seed"):  # --flag value
      arg = "<redacted>"
    elif "secret_seed=" in arg:
      arg = arg.split("=", 1)[0] + "=<redacted>"
    out.append(arg)
  return out


def collect(workdir: str | Path, tuning: bool = False) -> list[dict[str, Any]]:
  """Every finished cell under `workdir`: its cell.json merged with results.json.

  Args:
    workdir: root of the sweep.
    tuning: return the clip-tuning cells instead of the table's cells.
  """
  rows = []
  for results_path in sorted(Path(workdir).rglob("results.json")):
    cell_path = results_path.with_name("cell.json")
    if not cell_path.exists():
      continue
    row = {
        **json.loads(results_path.read_text()),
        **json.loads(cell_path.read_text()),
    }
    if (row.get("tune_clip") is not None) != tuning:
      continue
    row["directory"] = str(results_path.parent)
    rows.append(row)
  return rows
