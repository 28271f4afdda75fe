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

import numpy as np

from raptor_jax.models import decoder, family
from raptor_jax.models.family import COPY, Rule


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

_ARCH_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "rms_norm_eps",
    "clip_qkv",
    "hidden_act",
)


def config_from_hf(hf: Mapping[str, Any], **options) -> OlmoeConfig:
  """OlmoeConfig from an HF config.json dict, plus fine-tuning options."""
  if hf.get("attention_bias"):
    raise ValueError(
        "OLMoE checkpoints with attention_bias=true are not supported "
        "(the port's attention projections are bias-free, as in OLMoE)"
    )
  arch = {k: hf[k] for k in _ARCH_KEYS if hf.get(k) is not None}
  if "num_experts" not in arch and "num_local_experts" in hf:
    arch["num_experts"] = hf["num_local_experts"]
  arch.setdefault(
      "num_key_value_heads",
      arch.get("num_attention_heads", OlmoeConfig.num_attention_heads),
  )
  if "clip_qkv" in arch:
    arch["clip_qkv"] = float(arch["clip_qkv"])
  return OlmoeConfig(**arch, rope_theta=family.rope_theta(hf), **options)


_BLOCK, _LAYER = "block_{i}/", "layers.{i}."
# Names with or without `model.` (OlmoeForCausalLM or OlmoeModel); routed
# experts per expert as `save_pretrained` and the Hub store them, or fused as
# transformers v5 holds them in memory (load only).
HF_NAMES = family.NameTable(
    "OLMoE",
    (
        Rule("embed_tokens/embedding", "embed_tokens.weight", COPY),
        Rule(
            _BLOCK + "attention/{p:q|k|v|o}/kernel",
            _LAYER + "self_attn.{p}_proj.weight",
        ),
        Rule(
            _BLOCK + "attention/{p:q|k}_norm/scale",
            _LAYER + "self_attn.{p}_norm.weight",
            COPY,
        ),
        Rule(
            _BLOCK + "attention_norm/scale",
            _LAYER + "input_layernorm.weight",
            COPY,
        ),
        Rule(
            _BLOCK + "mlp_norm/scale",
            _LAYER + "post_attention_layernorm.weight",
            COPY,
        ),
        *family.gated_moe_rules(_BLOCK, _LAYER),
        Rule("final_layer_norm/scale", "norm.weight", COPY),
    ),
    prefix="model.",
    ignore=("rotary_emb.inv_freq",),  # a buffer old checkpoints stored
)


def params_from_hf(
    tensors: Mapping[str, np.ndarray], config: OlmoeConfig
) -> dict:
  """Maps HF OLMoE decoder tensor names onto the Flax tree (`HF_NAMES`).

  `lm_head` must already be filtered out.
  """
  return HF_NAMES.to_flax(tensors, config.num_experts)


def hf_config(config: OlmoeConfig, **extra):
  """A `transformers.OlmoeConfig` of the decoder."""
  import transformers  # pylint: disable=g-import-not-at-top

  return transformers.OlmoeConfig(
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads,
      num_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      norm_topk_prob=config.norm_topk_prob,
      rms_norm_eps=config.rms_norm_eps,
      clip_qkv=config.clip_qkv,
      hidden_act=config.hidden_act,
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      tie_word_embeddings=False,
      **{"architectures": ["OlmoeForCausalLM"], **extra},
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> OlmoeDecoder:
  """A random OLMoE from generic sizes (`hf.backbone_from_sizes`)."""
  return OlmoeDecoder(
      OlmoeConfig(
          vocab_size=vocab_size,
          hidden_size=sizes.d_model,
          intermediate_size=sizes.d_ff,
          num_hidden_layers=sizes.num_layers,
          num_attention_heads=sizes.num_heads,
          num_key_value_heads=sizes.num_kv_heads,
          num_experts=sizes.num_experts,
          num_experts_per_tok=sizes.top_k,
          norm_topk_prob=sizes.norm_topk_prob,
          **options,
      )
  )


# This family's entries in `hf.FAMILIES`, by the checkpoint's `model_type`.
HF_FAMILIES = {
    "olmoe": family.Family(
        OlmoeDecoder,
        config_from_hf,
        params_from_hf,
        ignored_prefix="lm_head.",
        names=HF_NAMES,
        hf_config=hf_config,
        hf_backbone_class="OlmoeModel",
        heads=("lm_head",),
        head_note="transformers has no sequence-classification class for"
        " OLMoE",
    ),
}
