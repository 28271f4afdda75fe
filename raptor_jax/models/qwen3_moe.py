"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) on the decoder kit.

A port of `transformers.Qwen3MoeModel` (eager attention, eval mode): the
kit (`models.decoder`) with an RMS norm per head on q and k (over
head_dim, before RoPE), an explicit head_dim, no attention bias, the top-k
softmax weights renormalised iff `norm_topk_prob`, SwiGLU experts of width
`moe_intermediate_size`, and dense SwiGLU blocks of width
`intermediate_size` where `mlp_only_layers` or `decoder_sparse_step` put
them. This file holds its defaults, config reader, name table and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raptor_jax.models import decoder, family


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(decoder.DecoderConfig):
  """The kit's config with Qwen3-30B-A3B's defaults."""

  vocab_size: int = 151936
  hidden_size: int = 2048
  intermediate_size: int = 6144
  moe_intermediate_size: int = 768
  num_hidden_layers: int = 48
  num_attention_heads: int = 32
  num_key_value_heads: int = 4
  head_dim: int = 128
  num_experts: int = 128
  num_experts_per_tok: int = 8
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1000000.0
  qk_norm: str = "head"


class Qwen3MoeDecoder(decoder.Decoder):
  """The Qwen3-MoE decoder stack (`decoder.Decoder`)."""

  config: Qwen3MoeConfig


def config_from_hf(hf: Mapping[str, Any], **options) -> Qwen3MoeConfig:
  """Qwen3MoeConfig from an HF config.json dict, plus fine-tuning options."""
  decoder.refuse_attention_bias(
      hf,
      "Qwen3-MoE",
      "the port's q, k, v carry a bias only as in Qwen2's qkv_bias",
  )
  return Qwen3MoeConfig(**decoder.arch_from_hf(hf), **options)


HF_NAMES = family.NameTable(
    "Qwen3-MoE",
    decoder.hf_rules(qk_norm=True, dense_mlp=True)
    + family.gated_moe_rules(decoder.BLOCK, decoder.LAYER),
    prefix="model.",
)


params_from_hf = HF_NAMES.params_from_hf


def hf_config(config: Qwen3MoeConfig, **extra):
  """A `transformers.Qwen3MoeConfig` of the decoder."""
  return decoder.transformers_config(
      "Qwen3Moe",
      config,
      extra,
      **decoder.qwen_kwargs(config),
      head_dim=config.head_dim,
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> Qwen3MoeDecoder:
  """A random Qwen3-MoE from generic sizes (`hf.backbone_from_sizes`)."""
  arch = decoder.sized(sizes, vocab_size)
  arch["moe_intermediate_size"] = arch["intermediate_size"]
  return Qwen3MoeDecoder(Qwen3MoeConfig(**arch, head_dim=sizes.d_kv, **options))


HF_FAMILIES = {
    "qwen3_moe": family.causal_lm_family(
        "Qwen3Moe", Qwen3MoeDecoder, config_from_hf, HF_NAMES, hf_config
    ),
}
