"""Hugging Face checkpoints -> Flax modules and parameters, without torch.

The family-independent front door: reads `config.json` and `*.safetensors`
from a local directory or a Hub snapshot, picks the family by `model_type`
(`FAMILIES`) and maps the tensors through that family's name table (Switch
decoder and decoder lm_head weights are ignored), returning `(module,
params)`; a DeepSeek-VL2 checkpoint is the whole vision-language model
(`deepseek_vl2`), or its language model with `language_only=True`. The file
readers are `loading`'s. Each family's config reader, name table and
size builder live with its backbone (`switch`, `deepseek` and the decoder
kit's `olmoe`, `qwen3_moe`, `qwen2_moe`, `mixtral`); the
names below that carry a family's prefix are kept for their callers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax

from raptor_jax import roles
from raptor_jax.models import common, deepseek, deepseek_vl2, heads, mixtral, olmoe, qwen2_moe, qwen3_moe, stack, switch
from raptor_jax.models import family as family_lib
from raptor_jax.models.loading import init_missing, load_tensors, read_config, resolve_model_dir

Params = Mapping[str, Any]

# ---------------------------------------------------------------------------
# The families.

# Every family by its short name (the trainer's `model=`, the size configs'
# `family`). A new family adds its module here: its `HF_FAMILIES` entries
# join `FAMILIES`, its `from_sizes` serves `backbone_from_sizes`.
FAMILY_MODULES = {
    "switch": switch,
    "olmoe": olmoe,
    "deepseek": deepseek,
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
}
# HF `model_type` -> how `from_pretrained` reads it (and export writes it).
FAMILIES: dict[str, family_lib.Family] = {
    model_type: entry
    for module in FAMILY_MODULES.values()
    for model_type, entry in module.HF_FAMILIES.items()
}


def backbone_from_sizes(
    family: str, sizes: Any, vocab_size: int, **options: Any
) -> nn.Module:
  """A randomly initialisable backbone of `family` from a size config.

  One mapping for every model built from sizes rather than a checkpoint (the
  `:tiny` random model, pretraining): `sizes` has d_model, d_kv, d_ff,
  num_layers, num_heads, num_experts, and per family expert_capacity and
  sparse_step ('switch'), num_kv_heads, top_k and norm_topk_prob (the
  kit's families: 'olmoe', 'qwen3_moe', 'qwen2_moe', 'mixtral') or top_k, num_shared_experts, first_k_dense and kv_lora_rank ('deepseek',
  see `deepseek.sized_config`); each family's `from_sizes` reads them.
  `options` go to the family's config (e.g. `dispatch='grouped_train'`).
  """
  module = FAMILY_MODULES.get(family)
  if module is None:
    raise ValueError(
        f"family: must be one of {', '.join(map(repr, FAMILY_MODULES))}, got"
        f" {family!r}"
    )
  return module.from_sizes(sizes, vocab_size, **options)


def _check_options(
    options: Mapping[str, Any], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
  known = common.FINE_TUNING_OPTIONS + extra
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(
        f"unknown from_pretrained option(s) {unknown}; the options are "
        f"{list(known)} (architecture comes from config.json)"
    )
  options = dict(options)
  for name in ("expert_lora_layers", "unscanned_layers"):
    if name in options:
      options[name] = tuple(options[name])
  return options


def from_pretrained(
    path_or_hub_id: str | os.PathLike,
    *,
    seed: int = 0,
    num_labels: int | None = None,
    pooling: str = "",
    language_only: bool = False,
    **options,
) -> tuple[nn.Module, dict]:
  """Loads a Hugging Face MoE checkpoint as a Flax backbone.

  Args:
    path_or_hub_id: a directory written by `save_pretrained` (config.json +
      ``*.safetensors``) or a Hub id such as "google/switch-base-8" or
      "allenai/OLMoE-1B-7B-0924"; `model_type` in config.json selects the
      backbone (`FAMILIES`: SwitchEncoder, OlmoeDecoder, DeepseekDecoder, the
      kit's decoders). A "deepseek_vl_v2" checkpoint (e.g.
      "deepseek-ai/deepseek-vl2-tiny") is the whole vision-language model,
      `deepseek_vl2.DeepseekVL2` (vision tower, projector, language model),
      unless `language_only`.
    seed: PRNG seed for parameters the checkpoint lacks (LoRA adapters).
    num_labels: if set, return a `SequenceClassifier` with a linear head of
      this many labels instead of the bare backbone (see `with_head`).
    pooling: the classifier's pooling ('' = the family's default).
    language_only: for a "deepseek_vl_v2" checkpoint, only its language
      model (a DeepseekDecoder over text, as the trainer's text configs
      fine-tune it); every other checkpoint is a language model already.
    **options: fine-tuning options of the model config, any of
      `common.FINE_TUNING_OPTIONS` (e.g. lora_rank=8, attention_lora=True,
      expert_lora_layers=(5,), unscanned_layers=(5,), dtype='bfloat16',
      scan_layers=False) or of the family's
      `extra_options` (DeepSeek-MoE: shared_expert_lora); anything else is an
      error.

  Returns:
    (module, params): `module.apply({'params': params}, input_ids,
    attention_mask)` returns BackboneOutput(hidden_states, router_logits).
    The checkpoint's per-layer tensors are stacked into the module's scanned
    segments (`stack.stack_layers`; `scan_layers=False` keeps them per
    layer).
  """
  every_extra = (o for f in FAMILIES.values() for o in f.extra_options)
  _check_options(options, tuple(dict.fromkeys(every_extra)))  # before I/O
  model_dir = resolve_model_dir(path_or_hub_id)
  hf = read_config(model_dir)
  model_type = hf.get("model_type")
  family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
  if family is None:
    raise ValueError(
        f"unsupported model_type {model_type!r} in {model_dir}/config.json; "
        f"supported: {', '.join(map(repr, FAMILIES))}"
    )
  options = _check_options(options, family.extra_options)
  if model_type == "deepseek_vl_v2" and not language_only:
    if num_labels is not None or pooling:
      raise ValueError(
          f"{model_dir} is a DeepSeek-VL2 vision-language model; a text"
          " classifier head goes on its language model: pass"
          " language_only=True"
      )
    return deepseek_vl2.from_pretrained(model_dir, seed=seed, **options)
  config = family.config_from_hf(hf, **options)
  module = family.backbone(config)
  tensors = load_tensors(
      model_dir,
      keep=lambda n: n.startswith(family.prefix)
      and not n.startswith(family.ignored_prefix),
  )
  params = stack.stack_layers(family.params_from_hf(tensors, config), config)
  params = init_missing(module, params, jax.random.PRNGKey(seed))
  if num_labels is not None:
    return with_head(module, params, num_labels, pooling=pooling, seed=seed)
  return module, params


# Backbones whose classifier transformers has a class for: last-token
# pooling (the last token that is not `pad_token_id`) and a bias-free linear
# `score` over the final hidden states. Their heads have no bias either, so
# that the export is that class, computing the same logits.
SEQUENCE_CLASSIFICATION = {
    f.backbone: f.sequence_classification
    for f in FAMILIES.values()
    if f.sequence_classification
}


def sequence_classification_class(
    backbone: nn.Module, pooling: str
) -> str | None:
  """The transformers class of `backbone`'s classifier with `pooling`, or
  None (no such class: the export is the backbone plus a head file)."""
  name = SEQUENCE_CLASSIFICATION.get(type(backbone))
  return name if pooling == "last" else None


def with_head(
    backbone: nn.Module,
    backbone_params: Params,
    num_labels: int,
    *,
    pooling: str = "",
    seed: int = 0,
) -> tuple[nn.Module, dict]:
  """A `SequenceClassifier` of `backbone`: pooling and a linear head.

  The head is initialised from `PRNGKey(seed + 1)`, as the trainer does; only
  the head is new (anything else missing is an error). `pooling` '' picks
  mean pooling for encoders (Switch) and the last token for decoders (OLMoE).
  A head whose transformers class has no bias (DeepSeek with last-token
  pooling, `SEQUENCE_CLASSIFICATION`) has none (`head/kernel` only).

      model, params = models.from_pretrained("google/switch-base-8", num_labels=2)
      logits, aux = model.apply({"params": params}, input_ids, attention_mask)
  """
  entry = family_lib.find(FAMILIES.values(), backbone)
  pooling = pooling or (entry.pooling if entry else "last")
  clf = heads.SequenceClassifier(
      backbone,
      num_labels,
      pooling=pooling,
      head_bias=sequence_classification_class(backbone, pooling) is None,
  )
  params = init_missing(
      clf,
      {"backbone": backbone_params},
      jax.random.PRNGKey(seed + 1),
      is_new=lambda p: p.startswith("head/"),
  )
  return clf, params


def with_options(
    module: nn.Module, params: Params, *, seed: int = 0, **options
) -> tuple[nn.Module, dict]:
  """The same backbone with other fine-tuning options (adapters, dispatch).

  New adapter leaves are initialised (B factors at zero, so the function is
  unchanged); pretrained leaves are kept, moved into the new options' layout
  of scanned segments (`stack`) when that changes.
  """
  new = type(module)(dataclasses.replace(module.config, **options))
  per_layer = stack.unstack_layers(params, module.config)
  kept = {
      p: v
      for p, v in flax.traverse_util.flatten_dict(per_layer, sep="/").items()
      if not roles.is_adapter(p)
  }
  kept = flax.traverse_util.unflatten_dict(kept, sep="/")
  return new, init_missing(
      new, stack.stack_layers(kept, new.config), jax.random.PRNGKey(seed)
  )
