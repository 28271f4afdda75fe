"""RAPTOR on GLUE MNLI with google/switch-base-8; public corpus: ANLI R2 premises and hypotheses.

  python launch/main.py --config=configs/switch_mnli.py --workdir=/tmp/raptor_mnli

Local files: --config.data.train_path=... --config.data.dev_path=...
--config.data.public_path=... (see configs/switch_sst2.py). Presets:
`:tiny` (embedded offline task) and `:cpu` (tiny model on the real files).
"""

from raptor_jax.train.config import base_config, with_preset


def get_config(arg: str = ""):
  config = base_config()
  config.data.task = "mnli"
  config.data.public_corpus = "anli_r2"
  return with_preset(config, arg)
