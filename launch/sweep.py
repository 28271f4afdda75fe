r"""Trains a grid of variants x epsilons x seeds, then writes the results table.

Every cell is `train_and_evaluate` of the same config with the variant's
overrides (see `raptor_jax.studies.sweep.VARIANTS`), its epsilon and its seed,
in `<workdir>/<task>/<variant>/eps<epsilon>/seed<seed>`. Rerunning skips
finished cells and resumes interrupted ones. Run it once per task config with
the same --workdir; the table has one column per task.

  python launch/sweep.py --config=configs/switch_sst2.py:tiny --workdir=/tmp/sweep \
    --variants=raptor,monolithic_lora --epsilons=8 --seeds=0

  # Tab. 1 rows on SST-2 (GPU scale):
  ROWS=nonprivate_lora,nonprivate_full,monolithic_lora,monolithic,raptor_first,raptor_last,raptor
  python launch/sweep.py --config=configs/switch_sst2.py --workdir=/tmp/tab1 \
    --variants=$ROWS --epsilons=1,4,8 --seeds=0,1,2

Writes `<workdir>/results.csv`, `results.md`, `accuracy_vs_epsilon.png` and
`routing_entropy.png` (see `raptor_jax.studies.sweep_report`). With --diagnostics,
each new cell also gets `diagnostics.json` (App. G, on the dev split). With
--clip_grid, each private (variant, epsilon) first picks its clip norm on
held-out train records (`--config.data.holdout`), never on dev.
`environment.json` records the command lines and software versions. With
--archive, the finished cells' public records are also kept in a folder meant
to be committed, and a fresh workdir starts from them (`sweep.restore`).
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from raptor_jax import host_memory, process  # pylint: disable=g-multiple-import

# First of all, before any library starts a thread: kept host memory on CPU
# hosts (raptor_jax/process.py); one XLA device, as before.
process.setup(argv=sys.argv, cpu_devices=1)

import logging

from absl import app, flags, logging as absl_logging  # pylint: disable=g-multiple-import
from ml_collections import config_flags

from raptor_jax import diagnostics
from raptor_jax.studies import sweep, sweep_report

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Base training configuration file."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Root directory of the sweep.")
_VARIANTS = flags.DEFINE_list(
    "variants",
    "raptor,monolithic_lora,baseline_a",
    f"Table rows, from: {', '.join(sweep.VARIANTS)}.",
)
flags.DEFINE_bool("keep_host_memory", True, host_memory.FLAG_HELP)
_EPSILONS = flags.DEFINE_list(
    "epsilons", "1,8", "Target epsilons of the private variants."
)
_SEEDS = flags.DEFINE_list(
    "seeds", "0,1,2", "Seeds (adapters, Poisson samples, noise)."
)
_CLIP_GRID = flags.DEFINE_list(
    "clip_grid",
    [],
    "Tune each private (variant, epsilon)'s clip norm over these values on "
    "held-out train records (needs --config.data.holdout), e.g. 0.1,1,10.",
)
_TUNE_SEED = flags.DEFINE_integer(
    "tune_seed", 100, "Seed of the clip-tuning runs (not a " "table seed)."
)
_DIAGNOSTICS = flags.DEFINE_bool(
    "diagnostics",
    False,
    "Also write App. G diagnostics (on the dev split) per new cell.",
)
_TABLE_ONLY = flags.DEFINE_bool(
    "table_only", False, "Only rebuild the table and plots."
)
_RESULTS_DIR = flags.DEFINE_string(
    "results_dir",
    "",
    "Write the table and plots here "
    "(default: --workdir), e.g. a committed results/ folder.",
)
_ARCHIVE = flags.DEFINE_string(
    "archive",
    "",
    "Keep each finished cell's public records (a few kB; no checkpoints) "
    "here, e.g. results/<study>/cells, and restore them into a fresh "
    "--workdir first, so a sweep resumes on a new clone.",
)
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  if not _TABLE_ONLY.value:
    if _CONFIG.value is None:
      sys.exit("error: --config is required unless --table_only")

    def after(config, directory):
      if _DIAGNOSTICS.value:
        diagnostics.write_for_run(config, directory)
      sweep_report.write(
          _WORKDIR.value, _RESULTS_DIR.value or None
      )  # the table so far

    try:
      sweep.write_environment(_WORKDIR.value, sys.argv)
      sweep.run(
          _CONFIG.value,
          _WORKDIR.value,
          variants=_VARIANTS.value,
          epsilons=[float(e) for e in _EPSILONS.value],
          seeds=[int(s) for s in _SEEDS.value],
          clip_grid=[float(c) for c in _CLIP_GRID.value],
          tune_seed=_TUNE_SEED.value,
          after=after,
          archive=_ARCHIVE.value or None,
      )
    except (ValueError, FileNotFoundError, OSError) as e:
      sys.exit(f"error: {e}")
  for path in sweep_report.write(_WORKDIR.value, _RESULTS_DIR.value or None):
    print(path)


if __name__ == "__main__":
  app.run(main)
