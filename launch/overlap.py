"""Reports how much of a run's public corpus its private train split quotes.

python launch/overlap.py --config=configs/glue.py:task=sst2,preset=cpu \
  --config.data.train_path=glue/sst2/train.tsv \
  --config.data.public_path=calib/imdb/unsup_sample5000.tsv

An operator's opt-in check of a corpus choice, run apart from training. It
prints one line to stdout and writes no file: the count is a function of the
private data that no epsilon covers, so keep it to yourself. It changes
nothing a run computes: training always uses the public corpus as loaded
(`raptor_jax.train.setup.public_texts`), overlap or not, which is DP-safe
because the corpus is the same for every neighbouring dataset.
"""

import logging

from absl import app, logging as absl_logging  # pylint: disable=g-multiple-import
from ml_collections import config_flags

from raptor_jax import _validate
from raptor_jax.train import setup

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training configuration file.", lock_config=True
)


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("raptor_jax").setLevel(logging.WARNING)
  with _validate.errors_exit_in_one_line():
    report = setup.overlap_report(_CONFIG.value)
  print(
      f"{report['overlapping']} of {report['public_texts']} public texts"
      " overlap the private train split verbatim (private: do not publish)"
  )


if __name__ == "__main__":
  app.run(main)
