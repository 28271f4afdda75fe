"""RAPTOR on GLUE QQP with DeepSeek-VL2-Tiny's language model (DeepSeekMoE).

The same as `configs/glue.py:task=qqp,model=deepseek,preset=<arg>`; see
configs/glue.py for the presets (`:tiny`, `:cpu`, `:small`; none = paper scale).
Shared experts see every token, so their adapters train in the shared stream
with the attention adapters and the head (clip C_s); only the routed experts
of l* form the expert stream, and only the routed gates decide owners.
"""

from raptor_jax.train.config import glue_config


def get_config(arg: str = ""):
  return glue_config(task="qqp", model="deepseek", preset=arg)
