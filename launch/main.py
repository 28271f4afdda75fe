"""Trains with RAPTOR (or a baseline) per an ml_collections config.

  python launch/main.py --config=configs/switch_sst2.py:tiny --workdir=/tmp/raptor_tiny
"""

import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging as absl_logging  # pylint: disable=g-import-not-at-top,g-multiple-import
from ml_collections import config_flags

from raptor_jax.train import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and reports; "
                               "rerunning with the same workdir resumes.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax chatter
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  try:
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError, OSError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
