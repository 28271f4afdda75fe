"""Exports the trained model of a finished run: what a user may publish.

python launch/export.py --workdir=/tmp/raptor_tiny --out=/tmp/raptor_tiny_model

Writes the backbone (adapters merged) in `save_pretrained` format, the
tokenizer, the classification head and privacy_card.json; never the secret,
the noise keys, counts or wall time (see raptor_jax/release.py).
"""

import logging

from absl import app, flags, logging as absl_logging  # pylint: disable=g-multiple-import

from raptor_jax import _validate, release

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Workdir of a finished run (launch/main.py --workdir)."
)
_OUT = flags.DEFINE_string(
    "out", None, "New or empty directory to write the model to."
)
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax chatter
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  with _validate.errors_exit_in_one_line():
    out = release.export(_WORKDIR.value, _OUT.value)
  print(f"exported to {out}")


if __name__ == "__main__":
  app.run(main)
