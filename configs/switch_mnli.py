"""RAPTOR on GLUE MNLI with google/switch-base-8.

The same as `configs/glue.py:task=mnli,model=switch,preset=<arg>`; see
configs/glue.py for the presets (`:tiny`, `:cpu`, `:small`; none = paper scale).
"""

from raptor_jax.train.config import glue_config


def get_config(arg: str = ""):
  return glue_config(task="mnli", model="switch", preset=arg)
