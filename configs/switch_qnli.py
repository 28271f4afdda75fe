"""RAPTOR on GLUE QNLI with google/switch-base-8; public corpus: SQuAD contexts.

  python launch/main.py --config=configs/switch_qnli.py --workdir=/tmp/raptor_qnli

Local files: --config.data.train_path=... --config.data.dev_path=...
--config.data.public_path=... (see configs/switch_sst2.py). Presets:
`:tiny` (embedded offline task) and `:cpu` (tiny model on the real files).
"""

from raptor_jax.train.config import base_config, with_preset


def get_config(arg: str = ""):
  config = base_config()
  config.data.task = "qnli"
  config.data.public_corpus = "squad"
  return with_preset(config, arg)
