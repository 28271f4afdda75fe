"""RAPTOR on GLUE QNLI with DeepSeek-VL2-Tiny's language model (DeepSeekMoE).

The same as `configs/glue.py:task=qnli,model=deepseek,preset=<arg>`; see
configs/glue.py for the presets and for where the shared experts train.
"""

from raptor_jax.train.config import glue_config


def get_config(arg: str = ""):
  return glue_config(task="qnli", model="deepseek", preset=arg)
