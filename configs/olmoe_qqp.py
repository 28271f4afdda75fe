"""RAPTOR on GLUE QQP with allenai/OLMoE-1B-7B-0924 (Tab. 2: E=64, top-8).

Public corpus: PAWS-Wiki sentence pairs. Paper scale (GPU, bf16 activations):

  python launch/main.py --config=configs/olmoe_qqp.py --workdir=/tmp/raptor_olmoe_qqp

Embedded offline default (a small random OLMoE, 8 experts, top-2):

  python launch/main.py --config=configs/olmoe_qqp.py:tiny --workdir=/tmp/raptor_olmoe_tiny

The classifier reads the last non-padding token (right padding). Every block is
sparse, so layer selection ranks all of them; owners are the gate-weighted
plurality of the top-k weights exactly as the model uses them.
"""

from raptor_jax.train.config import base_config, with_preset


def get_config(arg: str = ""):
  config = base_config()
  config.data.task = "qqp"
  config.data.public_corpus = "paws"
  return with_preset(config, arg, family="olmoe")
