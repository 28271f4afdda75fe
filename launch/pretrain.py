"""Pretrains a small MoE on public text and exports it in save_pretrained format.

  python launch/pretrain.py --config=configs/pretrain_switch.py:tiny --workdir=/tmp/pt_tiny

Rerunning with the same --workdir resumes; the model is written to
<workdir>/model and the held-out report to <workdir>/pretrain_report.json.
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from raptor_jax import process

# First of all, before any library starts a thread: kept host memory on CPU
# hosts (raptor_jax/process.py); one XLA device, as before.
process.setup(argv=sys.argv, cpu_devices=1)

import logging

from absl import app, flags, logging as absl_logging  # pylint: disable=g-multiple-import

from raptor_jax import _validate, entry_flags  # pylint: disable=g-multiple-import
from raptor_jax.pretrain import pretrain

_CONFIG, _WORKDIR = entry_flags.define_run_flags(
    "Pretraining configuration file.",
    "Directory for data, checkpoints and the "
    "model; rerunning with the same workdir resumes.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  with _validate.errors_exit_in_one_line():
    report = pretrain(_CONFIG.value, _WORKDIR.value)
  held, routing = report["heldout"], report["routing"]
  print(
      f"steps {report['steps']}/{report['planned_steps']}, tokens {report['tokens_seen']:,}, "
      f"{report['tokens_per_s']:,.0f} tokens/s, wall {report['wall_time_s']:.0f} s"
  )
  print(
      f"held-out LM loss {held['lm_loss']:.4f}, accuracy {held['accuracy']:.4f}"
  )
  for row in routing["layers"]:
    print(
        f"  layer {row['layer']}: token entropy {row['token_entropy_norm']:.3f}, owner "
        f"entropy {row['entropy_norm']:.3f}, min owner share {row['min_owner_share']:.3f}"
    )
  print(
      f"selected layer {routing['selected_layer']}: min owner share "
      f"{routing['selected_min_owner_share']:.3f} (required {routing['min_share_required']})"
      + ("  COLLAPSED" if routing["collapsed"] else "")
  )
  if report["model_dir"]:
    print(f"model: {report['model_dir']}")


if __name__ == "__main__":
  app.run(main)
