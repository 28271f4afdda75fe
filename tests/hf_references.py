"""Tiny random Hugging Face checkpoints of every family and their PyTorch outputs.

The references of the backbone tests (tests/test_backbones.py) and of each
family's own tests (tests/test_<family>.py): one place for the configs, the
checkpoints `save_pretrained` writes and the transformers models' outputs.

DeepSeek: the reference for MLA is `transformers.DeepseekV2Model` (eager
attention). transformers has no plain multi-head attention variant of
DeepSeek-V2, so the reference for `use_mla: false` (DeepSeek-VL2-Tiny's
language model) is the same HF model with every attention replaced by
`transformers.LlamaAttention` and its rotary embedding by
`LlamaRotaryEmbedding`, exactly what DeepSeek's own code does for
`mha_eager`.
"""

import json

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers.models.llama import modeling_llama

from helpers import grid, row  # row: also test_grad_parity's (hf_references.row)

VOCAB, SEQ = 60, 11


def batch(seed=0, batch=4, low=1):
  """int64 (ids, mask) [batch, SEQ], rows 1 and 2 right-padded with id 0."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(low, VOCAB, (batch, SEQ))
  mask = np.ones((batch, SEQ), np.int64)
  mask[1, 7:] = 0
  mask[2, 3:] = 0
  ids[mask == 0] = 0
  return ids, mask


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def assert_close(a, b, tol=1e-4, floor=0.0):
  """max |a - b| <= tol * max(max |b|, floor) (float32 noise scales with the
  array, not the entry; `floor`: with the computation's scale where this
  array is nearly zero)."""
  b = np.asarray(b)
  assert np.max(np.abs(np.asarray(a) - b)) <= tol * max(
      np.max(np.abs(b)), floor, 1e-12
  )


# Every decoder reference's token ids and initialisation: id 0 pads, no
# end-of-sequence id, and initializer_range 0.2 (HF default 0.02) so that
# attention, experts and the router visibly move the hidden states and
# routing is decisive.
DECODER_BASE = dict(pad_token_id=0, eos_token_id=None, initializer_range=0.2)
THETA_500 = dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def _outputs(model, ids, mask, num_experts):
  """(last hidden state, router logits [B, S, E] per sparse layer) in eval mode."""
  with torch.no_grad():
    out = model(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        output_router_logits=True,
    )
  # OLMoE and DeepSeek return each layer's logits flattened to [B * S, E].
  return out.last_hidden_state.numpy(), [
      r.numpy().reshape(ids.shape + (num_experts,)) for r in out.router_logits
  ]


# ---------------------------------------------------------------------------
# Switch Transformers.

SWITCH_FIELDS = (
    "d_model d_kv num_heads d_ff num_layers num_experts expert_capacity"
    " num_sparse_encoder_layers"
)
SWITCH_CONFIGS = grid(
    SWITCH_FIELDS,
    e2_step2=(16, 4, 2, 24, 4, 2, 64, 2),
    e4_step1_drop=(24, 6, 3, 32, 3, 4, 2, 3),
    # 6 blocks, 1-4 two (sparse, dense) units in one scan
    e8_step2_drop=(32, 8, 4, 16, 6, 8, 1, 3),
)
# What every Switch reference shares: one decoder block (the encoder is
# what raptor_jax loads) and a short relative-position table.
SWITCH_BASE = dict(
    vocab_size=VOCAB,
    num_decoder_layers=1,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=20,
)


def save_switch(path, seed, **kwargs):
  torch.manual_seed(seed)
  config = transformers.SwitchTransformersConfig(**SWITCH_BASE, **kwargs)
  model = transformers.SwitchTransformersForConditionalGeneration(config)
  model.save_pretrained(path)
  return path


def switch_outputs(path, ids, mask):
  model = transformers.SwitchTransformersEncoderModel.from_pretrained(
      path
  ).eval()
  return _outputs(model, ids, mask, model.config.num_experts)


# ---------------------------------------------------------------------------
# OLMoE: tiny random configs, grouped kv heads everywhere (4 query heads, 2
# or 1 kv).

OLMOE_LAYERS = 2
OLMOE_CONFIGS = grid(
    "num_experts num_experts_per_tok norm_topk_prob num_key_value_heads",
    e8k2_norm_clip=(8, 2, True, 2, dict(clip_qkv=2.0)),
    e8k2_theta500=(8, 2, False, 2, THETA_500),
    e16k4_norm=(16, 4, True, 2),
    e16k4_mqa=(16, 4, False, 1),
)


OLMOE_BASE = dict(
    vocab_size=VOCAB,
    num_hidden_layers=OLMOE_LAYERS,
    **DECODER_BASE,
    # Widths: the model's, an expert's; 4 query heads.
    hidden_size=32,
    intermediate_size=16,
    num_attention_heads=4,
)


def olmoe_hf_config(**kwargs):
  return transformers.OlmoeConfig(**{**OLMOE_BASE, **kwargs})


def save_olmoe(path, seed, **kwargs):
  torch.manual_seed(seed)
  transformers.OlmoeForCausalLM(olmoe_hf_config(**kwargs)).save_pretrained(path)
  return path


def olmoe_model(path):
  return transformers.OlmoeModel.from_pretrained(
      path, attn_implementation="eager"
  ).eval()


def olmoe_outputs(path, ids, mask):
  model = olmoe_model(path)
  return _outputs(model, ids, mask, model.config.num_experts)


# ---------------------------------------------------------------------------
# DeepSeek-MoE.

DEEPSEEK_LAYERS = 3
# Multi-head latent attention's sizes.
MLA_SIZES = dict(
    kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
# What DeepSeek's code writes in config.json for plain attention
# (`mha_eager`): no MLA, every MLA size 0 and no kv LoRA rank.
MHA_CONFIG = dict(dict.fromkeys(MLA_SIZES, 0), use_mla=False, kv_lora_rank=None)
DEEPSEEK_BASE = dict(
    vocab_size=VOCAB,
    num_hidden_layers=DEEPSEEK_LAYERS,
    num_attention_heads=4,
    bos_token_id=None,
    **DECODER_BASE,
    # Widths: the model's, a dense block's MLP, an expert's, MLA's.
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    **MLA_SIZES,
)


def group_limited(n_group, topk_group, **kwargs):
  """DeepSeek's group-limited routing: the best `topk_group` of `n_group`."""
  return dict(
      topk_method="group_limited_greedy",
      n_group=n_group,
      topk_group=topk_group,
      **kwargs,
  )


# The grid of the issue: greedy / group-limited routing, q_lora_rank None / set,
# first_k_dense_replace 0 / 1, n_shared_experts 1 / 2, norm_topk_prob on / off.
_ROUTED = "n_routed_experts num_experts_per_tok"
DEEPSEEK_FIELDS = (
    _ROUTED
    + " q_lora_rank first_k_dense_replace n_shared_experts norm_topk_prob"
)
_SCALED_GROUPS = group_limited(
    2, 1, routed_scaling_factor=2.5, rms_norm_eps=1e-5, **THETA_500
)
DEEPSEEK_CONFIGS = grid(
    DEEPSEEK_FIELDS,
    greedy_q_dense1_s1=(8, 2, None, 1, 1, False),
    group_qlora_dense0_s2_norm=(8, 2, 12, 0, 2, True, _SCALED_GROUPS),
    greedy_qlora_dense1_s2_norm=(16, 4, 12, 1, 2, True),
    group_q_dense0_s1=(16, 4, None, 0, 1, False, group_limited(4, 2)),
)
DEEPSEEK_MHA_CONFIGS = grid(
    _ROUTED + " first_k_dense_replace n_shared_experts num_key_value_heads",
    mha_dense1_s2=(8, 2, 1, 2, 4),
    mha_gqa_dense0_s1=(8, 2, 0, 1, 2, dict(rms_norm_eps=1e-5)),
)


def save_deepseek_mla(path, seed, **kwargs):
  """Saves a DeepseekV2ForCausalLM; returns the reference DeepseekV2Model."""
  torch.manual_seed(seed)
  model = transformers.DeepseekV2ForCausalLM(
      transformers.DeepseekV2Config(**DEEPSEEK_BASE, **kwargs)
  )
  model.save_pretrained(path)
  return transformers.DeepseekV2Model.from_pretrained(
      path, attn_implementation="eager"
  ).eval()


def deepseek_with_llama_attention(config, num_key_value_heads):
  """`DeepseekV2Model(config)` with every attention a `LlamaAttention` and its
  rotary embedding Llama's, as DeepSeek's code builds `mha_eager`."""
  model = transformers.DeepseekV2Model(config)
  llama = transformers.LlamaConfig(
      hidden_size=config.hidden_size,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=num_key_value_heads,
      rope_parameters=config.rope_parameters,
      max_position_embeddings=config.max_position_embeddings,
  )
  llama._attn_implementation = "eager"  # pylint: disable=protected-access
  for i, layer in enumerate(model.layers):
    layer.self_attn = modeling_llama.LlamaAttention(llama, i)
  model.rotary_emb = modeling_llama.LlamaRotaryEmbedding(llama)
  return model


def write_deepseek_mha(path, model, config, num_key_value_heads):
  """Saves `deepseek_with_llama_attention`'s model as DeepSeek's code would:
  q/k/v/o_proj tensors and `use_mla: false` in config.json."""
  path.mkdir(parents=True)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  safetensors.torch.save_file(state, str(path / "model.safetensors"))
  hf_config = dict(
      config.to_dict(), num_key_value_heads=num_key_value_heads, **MHA_CONFIG
  )
  (path / "config.json").write_text(json.dumps(hf_config))


def save_deepseek_mha(path, seed, num_key_value_heads, **kwargs):
  """A DeepSeek-MoE with LlamaAttention (DeepSeek's `use_mla: false`), saved as DeepSeek's
  code would: q/k/v/o_proj tensors and `use_mla: false` in config.json."""
  torch.manual_seed(seed)
  config = transformers.DeepseekV2Config(
      **DEEPSEEK_BASE, q_lora_rank=None, **kwargs
  )
  config._attn_implementation = "eager"
  model = deepseek_with_llama_attention(config, num_key_value_heads)
  model.eval()
  write_deepseek_mha(path, model, config, num_key_value_heads)
  return model


def save_deepseek(path, name):
  """(checkpoint dir, reference model) of DeepSeek config `name`."""
  if name in DEEPSEEK_CONFIGS:
    seed = list(DEEPSEEK_CONFIGS).index(name)
    return path, save_deepseek_mla(path, seed, **DEEPSEEK_CONFIGS[name])
  seed = 10 + list(DEEPSEEK_MHA_CONFIGS).index(name)
  return path, save_deepseek_mha(path, seed, **DEEPSEEK_MHA_CONFIGS[name])


def deepseek_outputs(model, ids, mask):
  return _outputs(model, ids, mask, model.config.n_routed_experts)


# ---------------------------------------------------------------------------
# The decoder kit's families (Qwen3-MoE, Qwen2-MoE, Mixtral): 3 blocks,
# grouped kv heads, a dense block or a sliding window where the family has
# them.

KIT_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    **DECODER_BASE,
)
_KIT_SIZES = (
    "intermediate_size moe_intermediate_size num_experts num_experts_per_tok"
)
# head_dim 12 (not hidden / heads); 4 blocks: 0-1 scanned, 2 dense
_QWEN3_DENSE2 = dict(head_dim=12, num_hidden_layers=4, mlp_only_layers=[2])
# block 1 sparse, 0 and 2 dense
_QWEN3_STEP2 = dict(decoder_sparse_step=2, **THETA_500)
# 4 blocks: 0 dense, 1-2 scanned
_QWEN2_DENSE0 = dict(num_hidden_layers=4, mlp_only_layers=[0])
KIT_CONFIGS = {
    "qwen3_moe": (
        "Qwen3Moe",
        grid(
            _KIT_SIZES + " norm_topk_prob",
            e8k2_norm_dense2=(24, 16, 8, 2, True, _QWEN3_DENSE2),
            e4k1_step2_theta500=(24, 16, 4, 1, False, _QWEN3_STEP2),
        ),
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        grid(
            _KIT_SIZES + " shared_expert_intermediate_size norm_topk_prob",
            e8k2_shared=(24, 16, 8, 2, 20, False),
            e4k2_norm_dense0=(24, 8, 4, 2, 16, True, _QWEN2_DENSE0),
        ),
    ),
    "mixtral": (
        "Mixtral",
        grid(
            "intermediate_size num_local_experts num_experts_per_tok",
            e4k2=(16, 4, 2),
            # sliding window 4, shorter than SEQ: the window matters
            e8k2_window4=(16, 8, 2, dict(sliding_window=4)),
        ),
    ),
}


def kit_hf_config(family, **kwargs):
  prefix, _ = KIT_CONFIGS[family]
  return getattr(transformers, prefix + "Config")(**{**KIT_BASE, **kwargs})


def save_kit(family):
  """`Spec.save` of a kit family: (dir, name) -> (dir, dir)."""
  prefix, configs = KIT_CONFIGS[family]

  def save(path, name):
    torch.manual_seed(list(configs).index(name))
    config = kit_hf_config(family, **configs[name])
    getattr(transformers, prefix + "ForCausalLM")(config).save_pretrained(path)
    return path, path

  return save


def kit_outputs(family):
  prefix, _ = KIT_CONFIGS[family]

  def outputs(path, ids, mask):
    model = getattr(transformers, prefix + "Model").from_pretrained(
        path, attn_implementation="eager"
    )
    num_experts = getattr(
        model.config,
        "num_experts",
        getattr(model.config, "num_local_experts", 0),
    )
    return _outputs(model.eval(), ids, mask, num_experts)

  return outputs
