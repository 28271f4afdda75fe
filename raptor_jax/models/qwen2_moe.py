"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) on the decoder kit.

A port of `transformers.Qwen2MoeModel` (eager attention, eval mode): the
kit (`models.decoder`) with a bias on q, k and v (`qkv_bias`), no q/k
norms, the top-k softmax weights renormalised iff `norm_topk_prob`, SwiGLU
experts of width `moe_intermediate_size`, and one always-active shared
expert per sparse block (width `shared_expert_intermediate_size`) whose
output is scaled by sigmoid(x @ shared_expert_gate). The shared expert sees
every token, so it trains in RAPTOR's shared stream, as DeepSeek's shared
experts do (`roles`: shared_expert_*). This file holds its defaults,
config reader, name table and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raptor_jax.models import decoder, family
from raptor_jax.models.family import Rule

_MLP = decoder.BLOCK + "mlp/shared_experts/"


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig(decoder.DecoderConfig):
  """The kit's config with Qwen1.5-MoE-A2.7B's defaults."""

  vocab_size: int = 151936
  hidden_size: int = 2048
  intermediate_size: int = 5632
  moe_intermediate_size: int = 1408
  num_hidden_layers: int = 24
  num_attention_heads: int = 16
  num_key_value_heads: int = 16
  num_experts: int = 60
  num_experts_per_tok: int = 4
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1000000.0
  attention_bias: bool = True
  shared_expert_intermediate_size: int = 5632
  shared_expert_gate: bool = True


class Qwen2MoeDecoder(decoder.Decoder):
  """The Qwen2-MoE decoder stack (`decoder.Decoder`)."""

  config: Qwen2MoeConfig


def config_from_hf(hf: Mapping[str, Any], **options) -> Qwen2MoeConfig:
  """Qwen2MoeConfig from an HF config.json dict, plus fine-tuning options."""
  return Qwen2MoeConfig(
      **decoder.arch_from_hf(hf),
      attention_bias=bool(hf.get("qkv_bias", True)),
      **options,
  )


HF_NAMES = family.NameTable(
    "Qwen2-MoE",
    decoder.hf_rules(qkv_bias=True, dense_mlp=True)
    + (
        Rule(
            _MLP + "{p:gate|up|down}/kernel",
            decoder.LAYER + "mlp.shared_expert.{p}_proj.weight",
        ),
        Rule(
            _MLP + "output_gate/kernel",
            decoder.LAYER + "mlp.shared_expert_gate.weight",
        ),
    )
    + family.gated_moe_rules(decoder.BLOCK, decoder.LAYER),
    prefix="model.",
)


params_from_hf = HF_NAMES.params_from_hf


def hf_config(config: Qwen2MoeConfig, **extra):
  """A `transformers.Qwen2MoeConfig` of the decoder."""
  return decoder.transformers_config(
      "Qwen2Moe",
      config,
      extra,
      **decoder.qwen_kwargs(config),
      shared_expert_intermediate_size=config.shared_expert_width,
      qkv_bias=config.attention_bias,
      max_window_layers=config.num_hidden_layers,
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> Qwen2MoeDecoder:
  """A random Qwen2-MoE from generic sizes (`hf.backbone_from_sizes`): one
  shared expert as wide as a routed one."""
  arch = decoder.sized(sizes, vocab_size)
  arch["moe_intermediate_size"] = arch["intermediate_size"]
  arch["shared_expert_intermediate_size"] = arch["intermediate_size"]
  return Qwen2MoeDecoder(Qwen2MoeConfig(**arch, **options))


HF_FAMILIES = {
    "qwen2_moe": family.causal_lm_family(
        "Qwen2Moe",
        Qwen2MoeDecoder,
        config_from_hf,
        HF_NAMES,
        hf_config,
        extra_options=("shared_expert_lora",),
    ),
}
