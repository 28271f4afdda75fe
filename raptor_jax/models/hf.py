"""Hugging Face checkpoints -> Flax modules and parameters, without torch.

Reads `config.json` and `*.safetensors` from a local directory or a Hub
snapshot, maps the tensor names onto the Flax parameter tree (Switch decoder,
decoder lm_head and DeepSeek-VL2 vision weights are ignored) and returns
`(module, params)`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import roles
from raptor_jax.models import common, deepseek, heads, olmoe, switch

Params = Mapping[str, Any]

_WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")


# ---------------------------------------------------------------------------
# Locating a checkpoint.


def resolve_model_dir(path_or_hub_id: str | os.PathLike) -> Path:
  """A local directory with config.json, downloading from the Hub if needed."""
  path = Path(path_or_hub_id).expanduser()
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise FileNotFoundError(
          f"{path} has no config.json; point at a directory written "
          "by save_pretrained (config.json + *.safetensors)"
      )
    return path
  name = str(path_or_hub_id)
  if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
    raise FileNotFoundError(f"model directory {name!r} does not exist")
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top

  try:
    return Path(snapshot_download(name, allow_patterns=list(_WEIGHT_PATTERNS)))
  except (
      Exception
  ) as e:  # Offline, not cached, gated or missing: one clear line.
    raise OSError(
        f"cannot load model {name!r} from the Hugging Face Hub ({type(e).__name__}); "
        f"the Hub is unreachable or the model is not cached (HF_HUB_OFFLINE="
        f"{os.environ.get('HF_HUB_OFFLINE', '0')}). Download it where you have internet "
        f"(`huggingface-cli download {name}`) or pass a local directory holding "
        "config.json and *.safetensors"
    ) from None


def read_config(model_dir: Path) -> dict[str, Any]:
  return json.loads((model_dir / "config.json").read_text())


def load_tensors(
    model_dir: Path, keep: Callable[[str], bool]
) -> dict[str, np.ndarray]:
  """Reads the float32 tensors whose names pass `keep` from `*.safetensors`."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  files = sorted(model_dir.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(
        f"{model_dir} holds no *.safetensors weights; re-save the model with "
        "save_pretrained(..., safe_serialization=True)"
    )
  tensors = {}
  for file in files:
    with safe_open(str(file), framework="flax") as f:
      for name in f.keys():
        if keep(name):
          tensors[name] = np.asarray(f.get_tensor(name).astype(jnp.float32))
  return tensors


# ---------------------------------------------------------------------------
# Parameter trees.


def merge_params(initialised: Params, pretrained: Params) -> dict:
  """Overlays `pretrained` leaves onto a freshly initialised tree.

  Leaves only in `initialised` (LoRA adapters, heads) keep their initial
  values; every pretrained leaf must exist with the same shape.
  """
  init_flat = flax.traverse_util.flatten_dict(
      flax.core.unfreeze(initialised), sep="/"
  )
  for path, value in flax.traverse_util.flatten_dict(
      flax.core.unfreeze(pretrained), sep="/"
  ).items():
    if path not in init_flat:
      raise ValueError(f"pretrained parameter {path} has no place in the model")
    if tuple(init_flat[path].shape) != tuple(value.shape):
      raise ValueError(
          f"pretrained parameter {path} has shape {tuple(value.shape)}, "
          f"the model expects {tuple(init_flat[path].shape)}"
      )
    init_flat[path] = jnp.asarray(value, init_flat[path].dtype)
  return flax.traverse_util.unflatten_dict(init_flat, sep="/")


is_adapter = roles.is_adapter  # a LoRA factor (the leaves `init_missing` adds)


def init_missing(
    module: nn.Module,
    pretrained: Params,
    example_args: tuple,
    key: jax.Array,
    is_new: Callable[[str], bool] = is_adapter,
) -> dict:
  """Initialises only the adapter parameters that `pretrained` lacks, then merges.

  The module's own initialisers define the new leaves (one source of truth);
  jit drops the work of initialising the leaves that the checkpoint replaces.
  Any other parameter missing from the checkpoint (`is_new(path)` False) is an
  error, never a silent random initialisation.
  """
  flatten = lambda tree: flax.traverse_util.flatten_dict(
      flax.core.unfreeze(tree), sep="/"
  )
  known = set(flatten(pretrained))
  init = lambda k: module.init(k, *example_args)["params"]
  shapes = flatten(jax.eval_shape(init, key))
  absent = [p for p in shapes if p not in known and not is_new(p)]
  if absent:
    raise ValueError(
        f"checkpoint lacks {len(absent)} model parameters, e.g. {absent[0]}"
    )
  fresh = jax.jit(
      lambda k: {p: v for p, v in flatten(init(k)).items() if p not in known}
  )(key)
  return merge_params(
      flax.traverse_util.unflatten_dict({**shapes, **fresh}, sep="/"),
      pretrained,
  )


def _map_tensors(
    named_tensors: Iterable[tuple[str, np.ndarray]],
    rules,
    expert_rule,
    num_experts: int,
    family: str,
) -> dict[str, np.ndarray]:
  """Flat Flax parameters from (HF name, tensor) pairs.

  Args:
    named_tensors: the checkpoint's tensors, names already normalised.
    rules: (regex, convert) pairs; convert(match, tensor) -> [(flat path, value)].
    expert_rule: regex matching one expert's weight, groups (block, expert,
      matrix); these are stacked along a leading expert axis.
    num_experts: E (every expert 0..E-1 must be present).
    family: model family name for error messages.

  Raises:
    ValueError: an unknown tensor, a missing expert, or both per-expert and
      fused expert weights.
  """
  flat: dict[str, np.ndarray] = {}
  experts: dict[str, dict[int, np.ndarray]] = {}
  for name, w in named_tensors:
    if m := expert_rule.fullmatch(name):
      path = f"block_{m[1]}/mlp/experts/{m[3]}/kernel"
      experts.setdefault(path, {})[int(m[2])] = _torch_linear(w)
      continue
    for pattern, convert in rules:
      if m := re.fullmatch(pattern, name):
        flat.update(convert(m, w))
        break
    else:
      raise ValueError(f"unexpected tensor {name} in the {family} checkpoint")
  for path, per_expert in experts.items():
    if path in flat:
      raise ValueError(
          f"{path}: the checkpoint holds both per-expert and fused weights"
      )
    if sorted(per_expert) != list(range(num_experts)):
      raise ValueError(
          f"{path}: found experts {sorted(per_expert)}, "
          f"expected 0..{num_experts - 1}"
      )
    flat[path] = np.stack([per_expert[e] for e in range(num_experts)])
  return flat


# ---------------------------------------------------------------------------
# Switch Transformers.

_SWITCH_ARCH_KEYS = (
    "vocab_size",
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_heads",
    "num_experts",
    "expert_capacity",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "layer_norm_epsilon",
    "dense_act_fn",
    "router_bias",
)


def switch_config_from_hf(
    hf: Mapping[str, Any], **options
) -> switch.SwitchConfig:
  """SwitchConfig from an HF config.json dict, plus fine-tuning options."""
  arch = {k: hf[k] for k in _SWITCH_ARCH_KEYS if k in hf}
  step = hf.get("encoder_sparse_step")
  if step is None:  # HF derives the step when config.json does not store it.
    num_sparse = hf.get("num_sparse_encoder_layers", 3)
    num_layers = hf.get("num_layers", 12)
    step = num_layers // num_sparse if num_sparse > 0 else num_layers
  return switch.SwitchConfig(**arch, sparse_step=step, **options)


def _torch_linear(w: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(
      w.T
  )  # torch Linear [out, in] -> Flax kernel [in, out]


def switch_params_from_hf(
    tensors: Mapping[str, np.ndarray], config: switch.SwitchConfig
) -> dict:
  """Maps HF Switch encoder tensor names onto the Flax parameter tree."""
  flat: dict[str, np.ndarray] = {}
  embedding = tensors.get(
      "shared.weight", tensors.get("encoder.embed_tokens.weight")
  )
  if embedding is None:
    raise ValueError(
        "checkpoint has neither shared.weight nor encoder.embed_tokens.weight"
    )
  flat["embed_tokens/embedding"] = embedding
  rules = [
      (
          r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.weight",
          lambda m, w: [
              (f"block_{m[1]}/attention/{m[2]}/kernel", _torch_linear(w))
          ],
      ),
      (
          r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
          lambda m, w: [
              (f"block_{m[1]}/attention/relative_attention_bias/embedding", w)
          ],
      ),
      (
          r"encoder\.block\.(\d+)\.layer\.0\.layer_norm\.weight",
          lambda m, w: [(f"block_{m[1]}/attention_norm/scale", w)],
      ),
      (
          r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight",
          lambda m, w: [(f"block_{m[1]}/mlp_norm/scale", w)],
      ),
      (
          r"encoder\.block\.(\d+)\.layer\.1\.mlp\.(wi|wo)\.weight",
          lambda m, w: [(f"block_{m[1]}/mlp/{m[2]}/kernel", _torch_linear(w))],
      ),
      (
          r"encoder\.block\.(\d+)\.layer\.1\.mlp\.router\.classifier\.(weight|bias)",
          lambda m, w: [
              (
                  f"block_{m[1]}/mlp/router/"
                  + ("kernel" if m[2] == "weight" else "bias"),
                  _torch_linear(w) if m[2] == "weight" else w,
              )
          ],
      ),
      (
          r"encoder\.final_layer_norm\.weight",
          lambda m, w: [("final_layer_norm/scale", w)],
      ),
  ]
  expert_rule = re.compile(
      r"encoder\.block\.(\d+)\.layer\.1\.mlp\.experts\.expert_(\d+)\.(wi|wo)\.weight"
  )
  encoder = (
      (name, w)
      for name, w in tensors.items()
      if name.startswith("encoder.") and name != "encoder.embed_tokens.weight"
  )
  flat.update(
      _map_tensors(encoder, rules, expert_rule, config.num_experts, "Switch")
  )
  return flax.traverse_util.unflatten_dict(flat, sep="/")


# ---------------------------------------------------------------------------
# OLMoE.

_OLMOE_ARCH_KEYS = (
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


def _rope_theta(hf: Mapping[str, Any]) -> float:
  """RoPE base from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(
        f"unsupported RoPE type {rope_type!r} in config.json; only default "
        "RoPE (no scaling) is ported"
    )
  return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def olmoe_config_from_hf(hf: Mapping[str, Any], **options) -> olmoe.OlmoeConfig:
  """OlmoeConfig from an HF config.json dict, plus fine-tuning options."""
  if hf.get("attention_bias"):
    raise ValueError(
        "OLMoE checkpoints with attention_bias=true are not supported "
        "(the port's attention projections are bias-free, as in OLMoE)"
    )
  arch = {k: hf[k] for k in _OLMOE_ARCH_KEYS if hf.get(k) is not None}
  if "num_experts" not in arch and "num_local_experts" in hf:
    arch["num_experts"] = hf["num_local_experts"]
  arch.setdefault(
      "num_key_value_heads",
      arch.get("num_attention_heads", olmoe.OlmoeConfig.num_attention_heads),
  )
  if "clip_qkv" in arch:
    arch["clip_qkv"] = float(arch["clip_qkv"])
  return olmoe.OlmoeConfig(**arch, rope_theta=_rope_theta(hf), **options)


def _split_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Fused torch [E, 2I, D] (gate rows first) -> Flax kernels [E, D, I] each."""
  gate, up = np.split(gate_up, 2, axis=1)
  return (
      np.ascontiguousarray(gate.transpose(0, 2, 1)),
      np.ascontiguousarray(up.transpose(0, 2, 1)),
  )


def olmoe_params_from_hf(
    tensors: Mapping[str, np.ndarray], config: olmoe.OlmoeConfig
) -> dict:
  """Maps HF OLMoE decoder tensor names onto the Flax parameter tree.

  Accepts the per-expert layout that `save_pretrained` and the Hub use
  (`mlp.experts.{j}.{gate,up,down}_proj.weight`) and the fused in-memory
  layout of transformers v5 (`mlp.experts.gate_up_proj` [E, 2I, D],
  `mlp.experts.down_proj` [E, D, I]); names with or without the `model.`
  prefix (OlmoeForCausalLM or OlmoeModel). `lm_head` must already be
  filtered out.
  """
  layer = r"layers\.(\d+)\."
  rules = [
      (r"embed_tokens\.weight", lambda m, w: [("embed_tokens/embedding", w)]),
      (
          layer + r"self_attn\.([qkvo])_proj\.weight",
          lambda m, w: [
              (f"block_{m[1]}/attention/{m[2]}/kernel", _torch_linear(w))
          ],
      ),
      (
          layer + r"self_attn\.([qk])_norm\.weight",
          lambda m, w: [(f"block_{m[1]}/attention/{m[2]}_norm/scale", w)],
      ),
      (
          layer + r"input_layernorm\.weight",
          lambda m, w: [(f"block_{m[1]}/attention_norm/scale", w)],
      ),
      (
          layer + r"post_attention_layernorm\.weight",
          lambda m, w: [(f"block_{m[1]}/mlp_norm/scale", w)],
      ),
      (
          layer + r"mlp\.gate\.weight",
          lambda m, w: [(f"block_{m[1]}/mlp/router/kernel", _torch_linear(w))],
      ),
      (
          layer + r"mlp\.experts\.gate_up_proj",
          lambda m, w: list(
              zip(
                  (
                      f"block_{m[1]}/mlp/experts/gate/kernel",
                      f"block_{m[1]}/mlp/experts/up/kernel",
                  ),
                  _split_gate_up(w),
              )
          ),
      ),
      (
          layer + r"mlp\.experts\.down_proj",
          lambda m, w: [
              (
                  f"block_{m[1]}/mlp/experts/down/kernel",
                  np.ascontiguousarray(w.transpose(0, 2, 1)),
              )
          ],
      ),
      (r"norm\.weight", lambda m, w: [("final_layer_norm/scale", w)]),
  ]
  expert_rule = re.compile(
      layer + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"
  )
  named = (
      (name.removeprefix("model."), w)
      for name, w in tensors.items()
      if not name.endswith("rotary_emb.inv_freq")
  )  # a buffer old checkpoints stored
  flat = _map_tensors(named, rules, expert_rule, config.num_experts, "OLMoE")
  return flax.traverse_util.unflatten_dict(flat, sep="/")


# ---------------------------------------------------------------------------
# DeepSeek-MoE (DeepSeek-V2 layout).

_DEEPSEEK_ARCH_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "use_mla",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "rms_norm_eps",
    "hidden_act",
)
_MLA_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def deepseek_config_from_hf(
    hf: Mapping[str, Any], **options
) -> deepseek.DeepseekConfig:
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
  arch = {k: hf[k] for k in _DEEPSEEK_ARCH_KEYS if hf.get(k) is not None}
  if not arch.get("use_mla", True):
    for key in _MLA_KEYS:
      arch.pop(key, None)
  arch.setdefault(
      "num_key_value_heads",
      arch.get(
          "num_attention_heads", deepseek.DeepseekConfig.num_attention_heads
      ),
  )
  if hf.get("norm_topk_prob") and hf.get("num_experts_per_tok", 1) > 1:
    logging.getLogger("raptor_jax").warning(
        "norm_topk_prob=true is ignored, as transformers' DeepseekV2 ignores"
        " it; DeepSeek's original code renormalises the top-k weights, so a"
        " model trained with that code mixes its experts differently here"
    )
  return deepseek.DeepseekConfig(**arch, rope_theta=_rope_theta(hf), **options)


def deepseek_vl2_config_from_hf(
    hf: Mapping[str, Any], **options
) -> deepseek.DeepseekConfig:
  """The DeepseekConfig of a DeepSeek-VL2 checkpoint's language model."""
  return deepseek_config_from_hf(hf["language_config"], **options)


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


def _deepseek_rules() -> list:
  """(regex, convert) of every non-routed-expert DeepSeek-V2 tensor."""
  layer = r"layers\.(\d+)\."
  attention = "|".join(DEEPSEEK_ATTENTION)
  block = lambda m: f"block_{m[1]}"
  linear = lambda path: lambda m, w: [(path(m), _torch_linear(w))]
  scale = lambda path: lambda m, w: [(path(m), w)]
  return [
      (r"embed_tokens\.weight", scale(lambda m: "embed_tokens/embedding")),
      (
          layer + rf"self_attn\.({attention})\.weight",
          linear(
              lambda m: f"{block(m)}/attention/{DEEPSEEK_ATTENTION[m[2]]}/kernel"
          ),
      ),
      (
          layer + r"self_attn\.(q_a|kv_a)_layernorm\.weight",
          scale(lambda m: f"{block(m)}/attention/{m[2]}_norm/scale"),
      ),
      (
          layer + r"input_layernorm\.weight",
          scale(lambda m: f"{block(m)}/attention_norm/scale"),
      ),
      (
          layer + r"post_attention_layernorm\.weight",
          scale(lambda m: f"{block(m)}/mlp_norm/scale"),
      ),
      (
          layer + r"mlp\.(gate|up|down)_proj\.weight",
          linear(lambda m: f"{block(m)}/mlp/{m[2]}/kernel"),
      ),
      (
          layer + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight",
          linear(lambda m: f"{block(m)}/mlp/shared_experts/{m[2]}/kernel"),
      ),
      (
          layer + r"mlp\.gate\.weight",
          linear(lambda m: f"{block(m)}/mlp/router/kernel"),
      ),
      (
          layer + r"mlp\.experts\.gate_up_proj",
          lambda m, w: list(
              zip(
                  (
                      f"{block(m)}/mlp/experts/gate/kernel",
                      f"{block(m)}/mlp/experts/up/kernel",
                  ),
                  _split_gate_up(w),
              )
          ),
      ),
      (
          layer + r"mlp\.experts\.down_proj",
          lambda m, w: [
              (
                  f"{block(m)}/mlp/experts/down/kernel",
                  np.ascontiguousarray(w.transpose(0, 2, 1)),
              )
          ],
      ),
      (r"norm\.weight", scale(lambda m: "final_layer_norm/scale")),
  ]


def deepseek_params_from_hf(
    tensors: Mapping[str, np.ndarray], config: deepseek.DeepseekConfig
) -> dict:
  """Maps HF DeepSeek-V2 decoder tensor names onto the Flax parameter tree.

  Accepts the per-expert layout of `save_pretrained` and the Hub
  (`mlp.experts.{j}.{gate,up,down}_proj.weight`) and transformers v5's fused
  in-memory layout (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`);
  names with or without the `model.` prefix. `lm_head` must already be
  filtered out. Shared experts map to `block_i/mlp/shared_experts/...`,
  dense blocks' MLPs to `block_i/mlp/{gate,up,down}`.
  """
  expert_rule = re.compile(
      r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight"
  )
  named = (
      (name.removeprefix("model."), w)
      for name, w in tensors.items()
      if not name.endswith("rotary_emb.inv_freq")
  )
  flat = _map_tensors(
      named, _deepseek_rules(), expert_rule, config.num_experts, "DeepSeek"
  )
  return flax.traverse_util.unflatten_dict(flat, sep="/")


def deepseek_vl2_params_from_hf(
    tensors: Mapping[str, np.ndarray], config: deepseek.DeepseekConfig
) -> dict:
  """The language model's parameters of a DeepSeek-VL2 checkpoint."""
  return deepseek_params_from_hf(
      {n.removeprefix("language."): w for n, w in tensors.items()}, config
  )


# ---------------------------------------------------------------------------
# Entry point.

FINE_TUNING_OPTIONS = common.FINE_TUNING_OPTIONS


@dataclasses.dataclass(frozen=True)
class Family:
  """How `from_pretrained` reads one HF `model_type`."""

  backbone: type[nn.Module]  # built from the config: Backbone(config)
  config_from_hf: Callable[
      ..., common.FineTuningOptions
  ]  # (hf dict, **options)
  params_from_hf: Callable[
      [Mapping[str, np.ndarray], Any], dict
  ]  # (tensors, config)
  ignored_prefix: str | tuple[str, ...]  # tensors the backbone does not use
  prefix: str = ""  # where the backbone's tensors sit ('' = everywhere)
  extra_options: tuple[str, ...] = ()  # family-only fine-tuning options


# A new family adds its entry here, next to its name table above.
FAMILIES = {
    "switch_transformers": Family(
        switch.SwitchEncoder,
        switch_config_from_hf,
        switch_params_from_hf,
        ignored_prefix="decoder.",
    ),
    "olmoe": Family(
        olmoe.OlmoeDecoder,
        olmoe_config_from_hf,
        olmoe_params_from_hf,
        ignored_prefix="lm_head.",
    ),
    "deepseek_v2": Family(
        deepseek.DeepseekDecoder,
        deepseek_config_from_hf,
        deepseek_params_from_hf,
        # lm_head: a causal LM's; score: an exported classifier's head
        ignored_prefix=("lm_head.", "score."),
        extra_options=("shared_expert_lora",),
    ),
    # DeepSeek-VL2 holds its DeepSeekMoE language model under `language.`;
    # the vision tower and projector are not loaded (text-only fine-tuning).
    "deepseek_vl_v2": Family(
        deepseek.DeepseekDecoder,
        deepseek_vl2_config_from_hf,
        deepseek_vl2_params_from_hf,
        ignored_prefix="language.lm_head.",
        prefix="language.",
        extra_options=("shared_expert_lora",),
    ),
}


def backbone_from_sizes(
    family: str, sizes: Any, vocab_size: int, **options: Any
) -> nn.Module:
  """A randomly initialisable backbone of `family` from a size config.

  One mapping for every model built from sizes rather than a checkpoint (the
  `:tiny` random model, pretraining): `sizes` has d_model, d_kv, d_ff,
  num_layers, num_heads, num_experts, and per family expert_capacity and
  sparse_step ('switch'), num_kv_heads, top_k and norm_topk_prob ('olmoe')
  or top_k, num_shared_experts, first_k_dense and kv_lora_rank ('deepseek',
  see `deepseek.sized_config`). `options` go to the family's config (e.g. `dispatch='grouped_train'`).
  """
  if family == "switch":
    return switch.SwitchEncoder(
        switch.SwitchConfig(
            vocab_size=vocab_size,
            d_model=sizes.d_model,
            d_kv=sizes.d_kv,
            d_ff=sizes.d_ff,
            num_layers=sizes.num_layers,
            num_heads=sizes.num_heads,
            num_experts=sizes.num_experts,
            expert_capacity=sizes.expert_capacity,
            sparse_step=sizes.sparse_step,
            **options,
        )
    )
  if family == "olmoe":
    return olmoe.OlmoeDecoder(
        olmoe.OlmoeConfig(
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
  if family == "deepseek":
    return deepseek.DeepseekDecoder(
        deepseek.sized_config(
            vocab_size=vocab_size,
            d_model=sizes.d_model,
            d_ff=sizes.d_ff,
            num_layers=sizes.num_layers,
            num_heads=sizes.num_heads,
            d_kv=sizes.d_kv,
            num_experts=sizes.num_experts,
            top_k=sizes.top_k,
            num_shared_experts=sizes.num_shared_experts,
            first_k_dense=sizes.first_k_dense,
            kv_lora_rank=sizes.kv_lora_rank,
            **options,
        )
    )
  raise ValueError(
      f"family: must be one of 'switch', 'olmoe', 'deepseek', got {family!r}"
  )


def _check_options(
    options: Mapping[str, Any], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
  known = FINE_TUNING_OPTIONS + extra
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(
        f"unknown from_pretrained option(s) {unknown}; the options are "
        f"{list(known)} (architecture comes from config.json)"
    )
  options = dict(options)
  if "expert_lora_layers" in options:
    options["expert_lora_layers"] = tuple(options["expert_lora_layers"])
  return options


def from_pretrained(
    path_or_hub_id: str | os.PathLike,
    *,
    seed: int = 0,
    num_labels: int | None = None,
    pooling: str = "",
    **options,
) -> tuple[nn.Module, dict]:
  """Loads a Hugging Face MoE checkpoint as a Flax backbone.

  Args:
    path_or_hub_id: a directory written by `save_pretrained` (config.json +
      ``*.safetensors``) or a Hub id such as "google/switch-base-8" or
      "allenai/OLMoE-1B-7B-0924"; `model_type` in config.json selects the
      backbone (SwitchEncoder, OlmoeDecoder or DeepseekDecoder; for
      "deepseek_vl_v2", e.g. "deepseek-ai/deepseek-vl2-tiny", the
      DeepseekDecoder of its language model).
    seed: PRNG seed for parameters the checkpoint lacks (LoRA adapters).
    num_labels: if set, return a `SequenceClassifier` with a linear head of
      this many labels instead of the bare backbone (see `with_head`).
    pooling: the classifier's pooling ('' = the family's default).
    **options: fine-tuning options of the model config, any of
      `FINE_TUNING_OPTIONS` (e.g. lora_rank=8, attention_lora=True,
      expert_lora_layers=(5,), dtype='bfloat16') or of the family's
      `extra_options` (DeepSeek-MoE: shared_expert_lora); anything else is an
      error.

  Returns:
    (module, params): `module.apply({'params': params}, input_ids,
    attention_mask)` returns BackboneOutput(hidden_states, router_logits).
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
  config = family.config_from_hf(hf, **options)
  module = family.backbone(config)
  tensors = load_tensors(
      model_dir,
      keep=lambda n: n.startswith(family.prefix)
      and not n.startswith(family.ignored_prefix),
  )
  params = family.params_from_hf(tensors, config)
  params = init_missing(
      module, params, example_inputs(), jax.random.PRNGKey(seed)
  )
  if num_labels is not None:
    return with_head(module, params, num_labels, pooling=pooling, seed=seed)
  return module, params


# Backbones whose classifier transformers has a class for: last-token
# pooling (the last token that is not `pad_token_id`) and a bias-free linear
# `score` over the final hidden states. Their heads have no bias either, so
# that the export is that class, computing the same logits.
SEQUENCE_CLASSIFICATION = {
    deepseek.DeepseekDecoder: "DeepseekV2ForSequenceClassification",
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
  pooling = pooling or (
      "mean" if isinstance(backbone, switch.SwitchEncoder) else "last"
  )
  clf = heads.SequenceClassifier(
      backbone,
      num_labels,
      pooling=pooling,
      head_bias=sequence_classification_class(backbone, pooling) is None,
  )
  params = init_missing(
      clf,
      {"backbone": backbone_params},
      example_inputs(),
      jax.random.PRNGKey(seed + 1),
      is_new=lambda p: p.startswith("head/"),
  )
  return clf, params


def example_inputs() -> tuple[jax.Array, jax.Array]:
  """A tiny (input_ids, attention_mask) batch for initialisation."""
  return jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)


def with_options(
    module: nn.Module, params: Params, *, seed: int = 0, **options
) -> tuple[nn.Module, dict]:
  """The same backbone with other fine-tuning options (adapters, dispatch).

  New adapter leaves are initialised (B factors at zero, so the function is
  unchanged); pretrained leaves are kept.
  """
  new = type(module)(dataclasses.replace(module.config, **options))
  kept = {
      p: v
      for p, v in flax.traverse_util.flatten_dict(
          flax.core.unfreeze(params), sep="/"
      ).items()
      if not is_adapter(p)
  }
  return new, init_missing(
      new,
      flax.traverse_util.unflatten_dict(kept, sep="/"),
      example_inputs(),
      jax.random.PRNGKey(seed),
  )
