"""DeepSeek-MoE and Hugging Face: config.json, the name table, sizes.

`HF_NAMES` is the one table between transformers' DeepSeek-V2 tensor names
and the Flax tree: loading (`params_from_hf`) and export
(`export.save_pretrained`) both read it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

import numpy as np

from raptor_jax.models import decoder, family
from raptor_jax.models.deepseek.backbone import DeepseekConfig, DeepseekDecoder
from raptor_jax.models.family import COPY, Rule

_ARCH_KEYS = decoder.LLAMA_HF_KEYS + (
    "use_mla",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)
_MLA_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def config_from_hf(hf: Mapping[str, Any], **options) -> DeepseekConfig:
  """DeepseekConfig from an HF config.json dict (DeepSeek-V2 keys), plus options.

  `use_mla: false` (DeepSeek's own config key, e.g. DeepSeek-VL2-Tiny's
  language model) selects plain multi-head attention; the MLA fields are
  then ignored.
  """
  unsupported = {
      "attention_bias": hf.get("attention_bias", False),
      "mlp_bias": hf.get("mlp_bias", False),
      "scoring_func": hf.get("scoring_func", "softmax") != "softmax",
      "moe_layer_freq": hf.get("moe_layer_freq", 1) != 1,
  }
  bad = sorted(k for k, v in unsupported.items() if v)
  if bad:
    raise ValueError(
        f"config.json: DeepSeek checkpoints with {bad} set are not supported;"
        " the port has bias-free projections, softmax routing and every block"
        " after first_k_dense_replace sparse"
    )
  arch = {k: hf[k] for k in _ARCH_KEYS if hf.get(k) is not None}
  if not arch.get("use_mla", True):
    for key in _MLA_KEYS:
      arch.pop(key, None)
  arch.setdefault(
      "num_key_value_heads",
      arch.get("num_attention_heads", DeepseekConfig.num_attention_heads),
  )
  if hf.get("norm_topk_prob") and hf.get("num_experts_per_tok", 1) > 1:
    logging.getLogger("raptor_jax").warning(
        "norm_topk_prob=true is ignored, as transformers' DeepseekV2 ignores"
        " it; DeepSeek's original code renormalises the top-k weights, so a"
        " model trained with that code mixes its experts differently here"
    )
  return DeepseekConfig(**arch, rope_theta=family.rope_theta(hf), **options)


def vl2_config_from_hf(hf: Mapping[str, Any], **options) -> DeepseekConfig:
  """The DeepseekConfig of a DeepSeek-VL2 checkpoint's language model.

  DeepSeek's own code is this checkpoint's reference, and it renormalises
  the top-k gate weights when `norm_topk_prob` is set (MoEGate.forward,
  deepseek_vl2/models/modeling_deepseek.py): so does the port.
  """
  language = dict(hf["language_config"])
  norm = bool(language.pop("norm_topk_prob", False))
  return config_from_hf(language, norm_topk_prob=norm, **options)


# HF attention projection name -> Flax module name (MLA and the MHA variant).
DEEPSEEK_ATTENTION = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "q_a_proj": "q_a",
    "q_b_proj": "q_b",
    "kv_a_proj_with_mqa": "kv_a",
    "kv_b_proj": "kv_b",
}
_BLOCK, _LAYER = "block_{i}/", "layers.{i}."
_GATED = "{p:gate|up|down}"
# Names with or without `model.`; routed experts per expert (save_pretrained,
# the Hub) or fused (transformers v5 in memory, load only); shared experts
# under `mlp/shared_experts`, the dense blocks' MLPs under `mlp`.
HF_NAMES = family.NameTable(
    "DeepSeek",
    (
        Rule("embed_tokens/embedding", "embed_tokens.weight", COPY),
        *(
            Rule(
                _BLOCK + f"attention/{ours}/kernel",
                _LAYER + f"self_attn.{theirs}.weight",
            )
            for theirs, ours in DEEPSEEK_ATTENTION.items()
        ),
        Rule(
            _BLOCK + "attention/{p:q_a|kv_a}_norm/scale",
            _LAYER + "self_attn.{p}_layernorm.weight",
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
        Rule(_BLOCK + f"mlp/{_GATED}/kernel", _LAYER + "mlp.{p}_proj.weight"),
        Rule(
            _BLOCK + f"mlp/shared_experts/{_GATED}/kernel",
            _LAYER + "mlp.shared_experts.{p}_proj.weight",
        ),
        *family.gated_moe_rules(_BLOCK, _LAYER),
        Rule("final_layer_norm/scale", "norm.weight", COPY),
    ),
    prefix="model.",
    ignore=("rotary_emb.inv_freq",),
)


params_from_hf = HF_NAMES.params_from_hf


def vl2_params_from_hf(
    tensors: Mapping[str, np.ndarray], config: DeepseekConfig
) -> dict:
  """The language model's parameters of a DeepSeek-VL2 checkpoint."""
  return params_from_hf(
      {n.removeprefix("language."): w for n, w in tensors.items()}, config
  )


def hf_config(config: DeepseekConfig, **extra):
  """A `transformers.DeepseekV2Config` of the decoder (MLA: transformers has no MHA)."""
  import transformers  # pylint: disable=g-import-not-at-top

  if not config.use_mla:
    raise ValueError(
        "module: must be an MLA DeepseekDecoder (kv_lora_rank > 0), got plain"
        " multi-head attention; transformers' DeepseekV2 has no such variant,"
        " so export it with DeepSeek's own code instead"
    )
  return transformers.DeepseekV2Config(
      **{k: getattr(config, k) for k in _ARCH_KEYS if k != "use_mla"},
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      tie_word_embeddings=False,
      **{"architectures": ["DeepseekV2ForCausalLM"], **extra},
  )


def sized_config(
    *,
    vocab_size: int,
    d_model: int,
    d_ff: int,
    num_layers: int,
    num_heads: int,
    d_kv: int,
    num_experts: int,
    top_k: int,
    num_shared_experts: int,
    first_k_dense: int,
    kv_lora_rank: int,
    **options,
) -> DeepseekConfig:
  """A small DeepSeek-MoE from generic sizes (random and pretraining models).

  Routed experts have width d_ff, the dense blocks 2 d_ff. MLA heads split
  d_kv into a position-free part of d_kv and a rotary part of d_kv / 2
  (DeepSeek-V2's 128 / 64), values of d_kv, latent rank `kv_lora_rank`;
  `kv_lora_rank=0` gives plain multi-head attention (as DeepSeek-VL2-Tiny).
  """
  mla = dict(
      qk_nope_head_dim=d_kv,
      qk_rope_head_dim=d_kv // 2,
      v_head_dim=d_kv,
      kv_lora_rank=kv_lora_rank,
      q_lora_rank=None,
  )
  return DeepseekConfig(
      vocab_size=vocab_size,
      hidden_size=d_model,
      intermediate_size=2 * d_ff,
      moe_intermediate_size=d_ff,
      num_hidden_layers=num_layers,
      num_attention_heads=num_heads,
      num_key_value_heads=num_heads,
      n_routed_experts=num_experts,
      n_shared_experts=num_shared_experts,
      num_experts_per_tok=top_k,
      first_k_dense_replace=first_k_dense,
      use_mla=kv_lora_rank > 0,
      **(mla if kv_lora_rank > 0 else {}),
      **options,
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> DeepseekDecoder:
  """A random DeepSeek-MoE from generic sizes (`hf.backbone_from_sizes`).

  `sizes` names its fields as `sized_config`'s arguments.
  """
  arch = {
      key: getattr(sizes, key)
      for key in inspect.signature(sized_config).parameters
      if key not in ("vocab_size", "options")
  }
  return DeepseekDecoder(sized_config(vocab_size=vocab_size, **arch, **options))


_OPTIONS = ("shared_expert_lora",)
# This family's entries in `hf.FAMILIES`, by the checkpoint's `model_type`.
HF_FAMILIES = {
    "deepseek_v2": family.causal_lm_family(
        "DeepseekV2",
        DeepseekDecoder,
        config_from_hf,
        HF_NAMES,
        hf_config,
        extra_options=_OPTIONS,
    ),
    # DeepSeek-VL2 holds its DeepSeekMoE language model under `language.`;
    # the vision tower and projector are not loaded (text-only fine-tuning).
    "deepseek_vl_v2": family.Family(
        DeepseekDecoder,
        vl2_config_from_hf,
        vl2_params_from_hf,
        ignored_prefix="language.lm_head.",
        prefix="language.",
        extra_options=_OPTIONS,
        sequence_classification="DeepseekV2ForSequenceClassification",
    ),
}
