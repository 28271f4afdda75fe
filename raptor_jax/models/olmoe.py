"""OLMoE (Muennighoff et al., 2024) on the decoder kit (`models.decoder`).

A faithful port of `transformers.OlmoeModel` (eager attention, eval mode):
the kit with q and k RMS norms over the full projection width (all heads
together, not per head) and optional clipping of q, k and v to
[-clip_qkv, clip_qkv]; every block sparse, SwiGLU experts of width
`intermediate_size`, the top-k weights renormalised iff `norm_topk_prob`.
This file holds OLMoE's defaults, config reader, name table and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raptor_jax.models import decoder, family


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(decoder.DecoderConfig):
  """The kit's config with OLMoE-1B-7B's defaults: q/k norms over all heads,
  every block sparse, `intermediate_size` each expert's width."""

  vocab_size: int = 50304
  hidden_size: int = 2048
  intermediate_size: int = 2048  # per expert
  num_hidden_layers: int = 16
  num_attention_heads: int = 16
  num_key_value_heads: int = 16
  num_experts: int = 64
  num_experts_per_tok: int = 8
  qk_norm: str = "full"


class OlmoeDecoder(decoder.Decoder):
  """The OLMoE decoder stack (`decoder.Decoder`; token embedding to final
  norm, no lm_head)."""

  config: OlmoeConfig


# ---------------------------------------------------------------------------
# Hugging Face: config.json, the name table, sizes.


def config_from_hf(hf: Mapping[str, Any], **options) -> OlmoeConfig:
  """OlmoeConfig from an HF config.json dict, plus fine-tuning options."""
  decoder.refuse_attention_bias(
      hf, "OLMoE", "the port's attention projections are bias-free, as in OLMoE"
  )
  return OlmoeConfig(**decoder.arch_from_hf(hf), **options)


# Names with or without `model.` (OlmoeForCausalLM or OlmoeModel); routed
# experts per expert as `save_pretrained` and the Hub store them, or fused as
# transformers v5 holds them in memory (load only).
HF_NAMES = family.NameTable(
    "OLMoE",
    decoder.hf_rules(qk_norm=True)
    + family.gated_moe_rules(decoder.BLOCK, decoder.LAYER),
    prefix="model.",
    ignore=("rotary_emb.inv_freq",),  # a buffer old checkpoints stored
)


params_from_hf = HF_NAMES.params_from_hf


def hf_config(config: OlmoeConfig, **extra):
  """A `transformers.OlmoeConfig` of the decoder."""
  return decoder.transformers_config(
      "Olmoe",
      config,
      extra,
      num_experts=config.num_experts,
      norm_topk_prob=config.norm_topk_prob,
      clip_qkv=config.clip_qkv,
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> OlmoeDecoder:
  """A random OLMoE from generic sizes (`hf.backbone_from_sizes`)."""
  return OlmoeDecoder(
      OlmoeConfig(**decoder.sized(sizes, vocab_size), **options)
  )


# This family's entries in `hf.FAMILIES`, by the checkpoint's `model_type`.
HF_FAMILIES = {
    "olmoe": family.causal_lm_family(
        "Olmoe",
        OlmoeDecoder,
        config_from_hf,
        HF_NAMES,
        hf_config,
        ignored_prefix="lm_head.",
        heads=("lm_head",),
        head_note="transformers has no sequence-classification class for"
        " OLMoE",
        sequence_classification=None,
    ),
}
