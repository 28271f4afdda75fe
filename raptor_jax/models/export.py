"""Flax parameters -> a Hugging Face `save_pretrained` directory.

The inverse of `hf.from_pretrained`: writes `config.json` (through the
transformers config class, so transformers reads it as its own) and
`model.safetensors` in the layout `save_pretrained` uses, so that both
`transformers` (`SwitchTransformersEncoderModel`, `OlmoeForCausalLM`,
`DeepseekV2ForCausalLM`, or `DeepseekV2ForSequenceClassification` with a
`score`) and `models.from_pretrained` load the directory.
Adapters are not exported: merge or drop them first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import flax
import numpy as np

from raptor_jax.models import deepseek, hf, olmoe, switch

_T = lambda w: np.ascontiguousarray(
    np.asarray(w, np.float32).T
)  # Flax [in, out] -> torch [out, in]
_ID = lambda w: np.ascontiguousarray(np.asarray(w, np.float32))

# (Flax path regex, HF name template, convert); experts are handled apart.
_SWITCH_RULES: list[tuple[str, str, Callable]] = [
    (r"embed_tokens/embedding", "shared.weight", _ID),
    (
        r"block_(\d+)/attention/([qkvo])/kernel",
        "encoder.block.{0}.layer.0.SelfAttention.{1}.weight",
        _T,
    ),
    (
        r"block_(\d+)/attention/relative_attention_bias/embedding",
        "encoder.block.{0}.layer.0.SelfAttention.relative_attention_bias.weight",
        _ID,
    ),
    (
        r"block_(\d+)/attention_norm/scale",
        "encoder.block.{0}.layer.0.layer_norm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/mlp_norm/scale",
        "encoder.block.{0}.layer.1.layer_norm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/mlp/(wi|wo)/kernel",
        "encoder.block.{0}.layer.1.mlp.{1}.weight",
        _T,
    ),
    (
        r"block_(\d+)/mlp/router/kernel",
        "encoder.block.{0}.layer.1.mlp.router.classifier.weight",
        _T,
    ),
    (
        r"block_(\d+)/mlp/router/bias",
        "encoder.block.{0}.layer.1.mlp.router.classifier.bias",
        _ID,
    ),
    (r"final_layer_norm/scale", "encoder.final_layer_norm.weight", _ID),
]
_SWITCH_EXPERT = (
    r"block_(\d+)/mlp/experts/(wi|wo)/kernel",
    "encoder.block.{0}.layer.1.mlp.experts.expert_{e}.{1}.weight",
)

_OLMOE_RULES: list[tuple[str, str, Callable]] = [
    (r"embed_tokens/embedding", "model.embed_tokens.weight", _ID),
    (
        r"block_(\d+)/attention/([qkvo])/kernel",
        "model.layers.{0}.self_attn.{1}_proj.weight",
        _T,
    ),
    (
        r"block_(\d+)/attention/([qk])_norm/scale",
        "model.layers.{0}.self_attn.{1}_norm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/attention_norm/scale",
        "model.layers.{0}.input_layernorm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/mlp_norm/scale",
        "model.layers.{0}.post_attention_layernorm.weight",
        _ID,
    ),
    (r"block_(\d+)/mlp/router/kernel", "model.layers.{0}.mlp.gate.weight", _T),
    (r"final_layer_norm/scale", "model.norm.weight", _ID),
]
_OLMOE_EXPERT = (
    r"block_(\d+)/mlp/experts/(gate|up|down)/kernel",
    "model.layers.{0}.mlp.experts.{e}.{1}_proj.weight",
)

_DEEPSEEK_RULES: list[tuple[str, str, Callable]] = [
    (r"embed_tokens/embedding", "model.embed_tokens.weight", _ID),
    *[
        (
            rf"block_(\d+)/attention/{flax_name}/kernel",
            f"model.layers.{{0}}.self_attn.{hf_name}.weight",
            _T,
        )
        for hf_name, flax_name in hf.DEEPSEEK_ATTENTION.items()
    ],
    (
        r"block_(\d+)/attention/(q_a|kv_a)_norm/scale",
        "model.layers.{0}.self_attn.{1}_layernorm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/attention_norm/scale",
        "model.layers.{0}.input_layernorm.weight",
        _ID,
    ),
    (
        r"block_(\d+)/mlp_norm/scale",
        "model.layers.{0}.post_attention_layernorm.weight",
        _ID,
    ),
    (r"block_(\d+)/mlp/router/kernel", "model.layers.{0}.mlp.gate.weight", _T),
    (
        r"block_(\d+)/mlp/shared_experts/(gate|up|down)/kernel",
        "model.layers.{0}.mlp.shared_experts.{1}_proj.weight",
        _T,
    ),
    (
        r"block_(\d+)/mlp/(gate|up|down)/kernel",
        "model.layers.{0}.mlp.{1}_proj.weight",
        _T,
    ),
    (r"final_layer_norm/scale", "model.norm.weight", _ID),
]
_DEEPSEEK_EXPERT = _OLMOE_EXPERT


def _hf_tensors(
    params: Mapping[str, Any], rules, expert_rule
) -> dict[str, np.ndarray]:
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  tensors = {}
  for path, value in flat.items():
    if path.rsplit("/", 1)[-1] in ("lora_a", "lora_b"):
      raise ValueError(
          f"{path}: adapters are not exported; export the backbone without them"
      )
    if m := re.fullmatch(expert_rule[0], path):
      for e, w in enumerate(np.asarray(value)):
        tensors[expert_rule[1].format(*m.groups(), e=e)] = _T(w)
      continue
    for pattern, template, convert in rules:
      if m := re.fullmatch(pattern, path):
        tensors[template.format(*m.groups())] = convert(value)
        break
    else:
      raise ValueError(f"parameter {path} has no Hugging Face name")
  return tensors


def switch_hf_config(config: switch.SwitchConfig, **extra):
  """A `transformers.SwitchTransformersConfig` of the encoder (decoder sized alike)."""
  import transformers  # pylint: disable=g-import-not-at-top

  num_sparse = len(config.sparse_layers)
  if num_sparse and config.num_layers // num_sparse != config.sparse_step:
    raise ValueError(
        f"sparse_step {config.sparse_step} with {config.num_layers} layers has no "
        "Hugging Face equivalent (it derives the step as layers // sparse layers)"
    )
  return transformers.SwitchTransformersConfig(
      vocab_size=config.vocab_size,
      d_model=config.d_model,
      d_kv=config.d_kv,
      d_ff=config.d_ff,
      num_layers=config.num_layers,
      num_decoder_layers=config.num_layers,
      num_heads=config.num_heads,
      num_experts=config.num_experts,
      num_sparse_encoder_layers=num_sparse,
      num_sparse_decoder_layers=num_sparse,
      expert_capacity=config.expert_capacity,
      router_bias=config.router_bias,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      layer_norm_epsilon=config.layer_norm_epsilon,
      dense_act_fn=config.dense_act_fn,
      **{"architectures": ["SwitchTransformersEncoderModel"], **extra},
  )


def olmoe_hf_config(config: olmoe.OlmoeConfig, **extra):
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


def deepseek_hf_config(config: deepseek.DeepseekConfig, **extra):
  """A `transformers.DeepseekV2Config` of the decoder (MLA: transformers has no MHA)."""
  import transformers  # pylint: disable=g-import-not-at-top

  if not config.use_mla:
    raise ValueError(
        "module: must be an MLA DeepseekDecoder (kv_lora_rank > 0), got plain"
        " multi-head attention; transformers' DeepseekV2 has no such variant,"
        " so export it with DeepSeek's own code instead"
    )
  return transformers.DeepseekV2Config(
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      moe_intermediate_size=config.moe_intermediate_size,
      num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads,
      q_lora_rank=config.q_lora_rank,
      kv_lora_rank=config.kv_lora_rank,
      qk_nope_head_dim=config.qk_nope_head_dim,
      qk_rope_head_dim=config.qk_rope_head_dim,
      v_head_dim=config.v_head_dim,
      n_routed_experts=config.n_routed_experts,
      n_shared_experts=config.n_shared_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      first_k_dense_replace=config.first_k_dense_replace,
      topk_method=config.topk_method,
      n_group=config.n_group,
      topk_group=config.topk_group,
      routed_scaling_factor=config.routed_scaling_factor,
      rms_norm_eps=config.rms_norm_eps,
      hidden_act=config.hidden_act,
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      tie_word_embeddings=False,
      **{"architectures": ["DeepseekV2ForCausalLM"], **extra},
  )


def save_pretrained(
    module,
    params: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    lm_head: np.ndarray | None = None,
    score: np.ndarray | None = None,
    tokenizer=None,
    hf_config_extra: Mapping[str, Any] | None = None,
) -> Path:
  """Writes a backbone (and optionally its LM head and tokenizer) in HF format.

  Args:
    module: a `SwitchEncoder`, `OlmoeDecoder` or (MLA) `DeepseekDecoder`
      (its config is written).
    params: the backbone's parameters, without adapters.
    directory: created if needed; existing files are overwritten.
    lm_head: decoders only: the output projection, Flax layout [D, V]
      (`lm_head.weight`). Switch's masked-LM head is tied to the embedding.
    score: DeepSeek only: a classifier's bias-free head, Flax layout [D, K]
      (`score.weight` of `DeepseekV2ForSequenceClassification`; name that
      class in `hf_config_extra['architectures']`).
    tokenizer: saved into the same directory when given.
    hf_config_extra: extra fields of the transformers config (token ids,
      router loss coefficients, ...).

  Returns:
    The directory.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  extra = dict(hf_config_extra or {})
  if isinstance(module, switch.SwitchEncoder):
    if lm_head is not None:
      raise ValueError(
          "Switch's masked-LM head is tied to the embedding; pass no lm_head"
      )
    hf_config = switch_hf_config(module.config, **extra)
    tensors = _hf_tensors(params, _SWITCH_RULES, _SWITCH_EXPERT)
  elif isinstance(module, (olmoe.OlmoeDecoder, deepseek.DeepseekDecoder)):
    if isinstance(module, olmoe.OlmoeDecoder):
      hf_config = olmoe_hf_config(module.config, **extra)
      tensors = _hf_tensors(params, _OLMOE_RULES, _OLMOE_EXPERT)
    else:
      hf_config = deepseek_hf_config(module.config, **extra)
      tensors = _hf_tensors(params, _DEEPSEEK_RULES, _DEEPSEEK_EXPERT)
    if lm_head is not None:
      tensors["lm_head.weight"] = _T(lm_head)
    if score is not None:
      if not isinstance(module, deepseek.DeepseekDecoder):
        raise ValueError(
            "score: only a DeepseekDecoder exports a sequence-classification"
            " head (transformers has no such class for OLMoE); pass none"
        )
      tensors["score.weight"] = _T(score)
  else:
    raise ValueError(
        f"cannot export {type(module).__name__}; export a SwitchEncoder, an "
        "OlmoeDecoder or a DeepseekDecoder"
    )
  hf_config.save_pretrained(directory)
  tmp = directory / "model.safetensors.tmp"
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  tmp.replace(directory / "model.safetensors")
  if tokenizer is not None:
    tokenizer.save_pretrained(directory)
  return directory
