"""Mixtral (Mixtral-8x7B, Mixtral-8x22B) on the decoder kit.

A port of `transformers.MixtralModel` (eager attention, eval mode): the
kit (`models.decoder`) with plain grouped-query attention (no q/k norms,
no bias), an optional sliding window on every block, a softmax over all
experts whose top-k weights are always renormalised, and SwiGLU experts of
width `intermediate_size` in every block. Checkpoints name the experts
`block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down); transformers
v5's fused in-memory layout loads too. This file holds its defaults,
config reader, name table and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raptor_jax.models import decoder, family
from raptor_jax.models.family import EXPERTS, Rule

_MOE = decoder.LAYER + "block_sparse_moe."


@dataclasses.dataclass(frozen=True)
class MixtralConfig(decoder.DecoderConfig):
  """The kit's config with Mixtral-8x7B's defaults."""

  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 14336  # per expert
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int = 8
  num_experts: int = 8
  num_experts_per_tok: int = 2
  norm_topk_prob: bool = True  # Mixtral always renormalises
  rope_theta: float = 1000000.0


class MixtralDecoder(decoder.Decoder):
  """The Mixtral decoder stack (`decoder.Decoder`)."""

  config: MixtralConfig


def config_from_hf(hf: Mapping[str, Any], **options) -> MixtralConfig:
  """MixtralConfig from an HF config.json dict, plus fine-tuning options."""
  arch = decoder.arch_from_hf(hf)
  arch.pop("norm_topk_prob", None)
  return MixtralConfig(**arch, norm_topk_prob=True, **options)


HF_NAMES = family.NameTable(
    "Mixtral",
    decoder.hf_rules()
    + (
        Rule(decoder.BLOCK + "mlp/router/kernel", _MOE + "gate.weight"),
        *(
            Rule(
                decoder.BLOCK + f"mlp/experts/{ours}/kernel",
                _MOE + f"experts.{{e}}.{theirs}.weight",
                EXPERTS,
            )
            for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
        ),
    )
    + tuple(
        dataclasses.replace(rule, load_only=True)
        for rule in family.gated_moe_rules(decoder.BLOCK, decoder.LAYER)
    ),
    prefix="model.",
)


params_from_hf = HF_NAMES.params_from_hf


def hf_config(config: MixtralConfig, **extra):
  """A `transformers.MixtralConfig` of the decoder."""
  return decoder.transformers_config(
      "Mixtral",
      config,
      extra,
      num_local_experts=config.num_experts,
      head_dim=config.head_dim,
      sliding_window=config.sliding_window,
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> MixtralDecoder:
  """A random Mixtral from generic sizes (`hf.backbone_from_sizes`)."""
  arch = decoder.sized(sizes, vocab_size)
  arch["norm_topk_prob"] = True
  return MixtralDecoder(MixtralConfig(**arch, **options))


HF_FAMILIES = {
    "mixtral": family.causal_lm_family(
        "Mixtral", MixtralDecoder, config_from_hf, HF_NAMES, hf_config
    ),
}
