"""DeepSeek-MoE decoder: config, routing, layouts, LoRA, owners, DeepSeek-VL2.

Parity with Hugging Face (MLA and the plain multi-head variant), a batch of
one, padding and the grouped dispatch: tests/test_backbones.py; the
references (and how the MHA one is built): tests/hf_references.py.
"""

import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from raptor_jax import models, ownership
from raptor_jax.models import deepseek
from raptor_jax.models import hf as hf_lib

import hf_references as refs
from helpers import assert_fused_and_base_layouts_load, vmapped_owner_grads, fast_jit, lora_from_pretrained, probe_loss, set_nonzero_lora_b

VOCAB, SEQ, LAYERS = refs.VOCAB, refs.SEQ, refs.DEEPSEEK_LAYERS
CONFIGS, MHA_CONFIGS = refs.DEEPSEEK_CONFIGS, refs.DEEPSEEK_MHA_CONFIGS
_batch, _hf_outputs, _rel_err = refs.batch, refs.deepseek_outputs, refs.rel_err


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  """name -> (checkpoint dir, the HF reference model in eval mode)."""
  root = tmp_path_factory.mktemp("deepseek")
  return {
      name: refs.save_deepseek(root / name, name)
      for name in list(CONFIGS) + list(MHA_CONFIGS)
  }


@pytest.fixture(scope="module")
def loaded(references):
  """name -> (module, params, jitted apply), loaded once so tests share compilations."""
  cache = {}

  def load(name, **options):
    key = (name, tuple(sorted(options.items())))
    if key not in cache:
      module, params = models.from_pretrained(references[name][0], **options)
      cache[key] = module, params, fast_jit(module.apply)
    return cache[key]

  return load


def test_config_from_checkpoint(loaded):
  cfg = loaded("group_qlora_dense0_s2_norm")[0].config
  assert (
      cfg.num_experts,
      cfg.top_k,
      cfg.routing_groups,
      cfg.routed_scaling_factor,
  ) == (8, 2, (2, 1), 2.5)
  assert (
      cfg.q_lora_rank,
      cfg.n_shared_experts,
      cfg.rope_theta,
      cfg.use_mla,
  ) == (12, 2, 500.0, True)
  assert cfg.sparse_layers == (0, 1, 2)  # first_k_dense_replace=0
  dense1 = loaded("greedy_q_dense1_s1")[0].config
  assert dense1.routing_groups is None and dense1.sparse_layers == (1, 2)
  mha = loaded("mha_gqa_dense0_s1")[0].config
  assert (mha.use_mla, mha.num_key_value_heads, mha.head_dim) == (False, 2, 8)
  # DeepSeek-VL2-Tiny's language config values (MHA, 64 routed + 2 shared, top-6).
  tiny = dict(
      refs.MHA_CONFIG,
      hidden_size=1280,
      intermediate_size=6848,
      moe_intermediate_size=896,
      num_hidden_layers=12,
      num_attention_heads=10,
      num_key_value_heads=10,
      n_routed_experts=64,
      n_shared_experts=2,
      num_experts_per_tok=6,
      first_k_dense_replace=1,
      n_group=1,
      topk_group=1,
      model_type="deepseek_v2",
      topk_method="greedy",
      q_lora_rank=None,
      vocab_size=129280,
  )
  cfg = deepseek.config_from_hf(tiny)
  assert (cfg.use_mla, cfg.head_dim, cfg.sparse_layers) == (
      False,
      128,
      tuple(range(1, 12)),
  )


def test_unsupported_configs_fail_clearly():
  with pytest.raises(ValueError, match="noaux_tc"):
    models.DeepseekConfig(topk_method="noaux_tc")
  with pytest.raises(ValueError, match="scoring_func"):
    deepseek.config_from_hf({"scoring_func": "sigmoid"})
  with pytest.raises(ValueError, match=r"\(n_group, topk_group\): must be"):
    models.DeepseekConfig(
        n_routed_experts=8,
        num_experts_per_tok=4,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=1,
    )
  with pytest.raises(ValueError, match="num_key_value_heads"):
    models.DeepseekConfig(num_key_value_heads=4)
  with pytest.raises(ValueError, match="are not sparse blocks"):
    models.DeepseekConfig(
        num_hidden_layers=3, first_k_dense_replace=1, expert_lora_layers=(0,)
    )


def test_group_limited_routing_and_scaling_matter(references):
  """The group limit and routed_scaling_factor change HF's outputs on this config,
  and norm_topk_prob does not (transformers' DeepseekV2 ignores it, so does the port).
  """
  ids, mask = _batch()
  model = references["group_qlora_dense0_s2_norm"][1]
  want, _ = _hf_outputs(model, ids, mask)
  for layer in model.layers:
    layer.mlp.gate.topk_method = "greedy"
  greedy, _ = _hf_outputs(model, ids, mask)
  for layer in model.layers:
    layer.mlp.gate.topk_method = "group_limited_greedy"
    layer.mlp.gate.routed_scaling_factor = 1.0
  unscaled, _ = _hf_outputs(model, ids, mask)
  for layer in model.layers:
    layer.mlp.gate.routed_scaling_factor = 2.5
  assert _rel_err(greedy, want) > 1e-3 and _rel_err(unscaled, want) > 1e-3
  assert not hasattr(model.layers[0].mlp.gate, "norm_topk_prob")


def test_fused_and_base_model_layouts_load_the_same_params(
    references, loaded, tmp_path
):
  path = references["greedy_qlora_dense1_s2_norm"][0]
  module, want = loaded("greedy_qlora_dense1_s2_norm")[:2]
  hf_model = transformers.DeepseekV2ForCausalLM.from_pretrained(path)
  assert_fused_and_base_layouts_load(
      hf_model,
      path,
      want,
      tmp_path,
      fused="model.layers.1.mlp.experts.gate_up_proj",
  )
  flat = flax.traverse_util.flatten_dict(
      models.unstack_layers(want, module.config), sep="/"
  )
  assert flat["block_0/mlp/gate/kernel"].shape == (32, 48)  # the dense block
  assert flat["block_1/mlp/shared_experts/gate/kernel"].shape == (
      32,
      32,
  )  # 2 x 16
  assert flat["block_1/mlp/experts/gate/kernel"].shape == (16, 32, 16)
  assert not any("lm_head" in p for p in flat)


def test_owners_follow_the_routed_gates_hf_uses(references, loaded):
  """Owners (Eq. 5) from the port's router logits = the gate-weighted plurality of the top-k
  experts and weights that HF's router returns (group limit included); shared experts,
  which every token uses, never vote."""
  ids, mask = _batch(seed=3, batch=6)
  mask[4, 2:] = 0
  name = "group_qlora_dense0_s2_norm"
  module, params, apply = loaded(name)
  model = references[name][1]
  routed = []
  hooks = [
      layer.mlp.gate.register_forward_hook(lambda m, i, o: routed.append(o))
      for layer in model.layers
  ]
  _hf_outputs(model, ids, mask)
  for hook in hooks:
    hook.remove()
  cfg = module.config
  logits = apply(
      {"params": params}, jnp.asarray(ids), jnp.asarray(mask)
  ).router_logits
  for layer_logits, (_, weights, experts) in zip(logits, routed):
    votes = np.zeros((len(ids), cfg.num_experts))
    rows = np.repeat(np.arange(len(ids)), SEQ)
    for slot in range(cfg.top_k):
      np.add.at(
          votes,
          (rows, experts[:, slot].numpy()),
          weights[:, slot].numpy() * mask.reshape(-1),
      )
    got = ownership.owners(
        layer_logits, mask, cfg.top_k, "prob", groups=cfg.routing_groups
    )
    np.testing.assert_array_equal(np.asarray(got), np.argmax(votes, axis=1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["greedy_qlora_dense1_s2_norm", "mha_dense1_s2"]
)
def test_lora_adapters_start_neutral_and_all_train(references, loaded, name):
  """Adapters on every attention projection, the shared experts of every sparse block and the
  routed experts of block 1: zero B leaves the outputs unchanged, and every factor gets a
  gradient once B is non-zero."""
  ids, mask = _batch()
  module, params = lora_from_pretrained(
      references[name][0], shared_expert_lora=True
  )
  _, base_params, base = loaded(name)
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  projections = (
      ("q_a", "q_b", "kv_a", "kv_b", "o") if module.config.use_mla else "qkvo"
  )
  sparse = module.config.sparse_layers
  assert {p.rsplit("/", 1)[0] for p in flat if "lora" in p} == (
      {f"block_{i}/attention/{m}" for i in range(LAYERS) for m in projections}
      | {
          f"block_{i}/mlp/shared_experts/{m}"
          for i in sparse
          for m in ("gate", "up", "down")
      }
      | {f"block_1/mlp/experts/{m}" for m in ("gate", "up", "down")}
  )
  apply = fast_jit(module.apply)
  np.testing.assert_allclose(
      apply(
          {"params": params}, jnp.asarray(ids), jnp.asarray(mask)
      ).hidden_states,
      base(
          {"params": base_params}, jnp.asarray(ids), jnp.asarray(mask)
      ).hidden_states,
      # B = 0 makes every delta exactly zero; what is left is float32 rounding
      # of the same products run as differently shaped GEMMs (the adapted
      # experts go through the owner dispatch), up to ~1e-6 on O(1) outputs.
      rtol=1e-5,
      atol=1e-5,
  )
  probe_grad = fast_jit(
      jax.grad(
          lambda p: probe_loss(
              module.apply(
                  {"params": p}, jnp.asarray(ids[:1]), jnp.asarray(mask[:1])
              ).hidden_states
          )
      )
  )
  grads = probe_grad(set_nonzero_lora_b(params, jax.random.PRNGKey(1)))
  for path, g in flax.traverse_util.flatten_dict(grads, sep="/").items():
    if "lora" in path:
      assert np.any(np.asarray(g) != 0), path


@pytest.mark.slow
def test_vmapped_owner_slice_gradient_is_the_owner_part_of_the_full_gradient(
    references,
):
  """As for OLMoE: under vmap over (record, owner) pairs, the owner-override gradient equals
  the record's full gradient restricted to that routed expert's slice (value unchanged).
  """
  ids, mask = _batch()
  module, params = lora_from_pretrained(
      references["group_qlora_dense0_s2_norm"][0], shared_expert_lora=True
  )
  params = set_nonzero_lora_b(params, jax.random.PRNGKey(3))
  num_experts = module.config.num_experts

  def full_value_and_grad(x, m):
    return jax.value_and_grad(
        lambda p: probe_loss(
            module.apply({"params": p}, x[None], m[None]).hidden_states
        )
    )(params)

  values, grads = vmapped_owner_grads(module, params, ids, mask)
  full_fn = fast_jit(full_value_and_grad)
  for row in range(len(ids)):
    value, full = full_fn(jnp.asarray(ids[row]), jnp.asarray(mask[row]))
    full = full["block_1"]["mlp"]["experts"]
    touched = 0
    for owner in range(num_experts):
      i = row * num_experts + owner
      np.testing.assert_allclose(values[i], value, rtol=1e-5)
      for m in ("gate", "up", "down"):
        for k in ("lora_a", "lora_b"):
          want = np.asarray(full[m][k][owner])
          assert np.max(np.abs(grads[m][k][i] - want)) <= 1e-4 * max(
              np.max(np.abs(want)), 1e-12
          )
      touched += bool(np.any(np.asarray(grads["gate"]["lora_b"][i]) != 0))
    assert touched >= 2


def test_deepseek_vl2_checkpoint_loads_its_language_model(
    references, loaded, tmp_path
):
  """A DeepSeek-VL2 directory (model_type deepseek_vl_v2, language model under `language.`,
  vision tower and projector beside it) loads the language model's decoder."""
  path = references["mha_dense1_s2"][0]
  tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
  vl2 = {f"language.model.{name}": w for name, w in tensors.items()}
  vl2.update(
      {
          "language.lm_head.weight": torch.zeros(VOCAB, 32),
          "vision.blocks.0.attn.qkv.weight": torch.zeros(6, 2),
          "projector.layers.weight": torch.zeros(32, 2),
          "image_newline": torch.zeros(32),
      }
  )
  (tmp_path / "vl2").mkdir()
  safetensors.torch.save_file(vl2, str(tmp_path / "vl2" / "model.safetensors"))
  language = json.loads((path / "config.json").read_text())
  (tmp_path / "vl2" / "config.json").write_text(
      json.dumps(
          dict(
              model_type="deepseek_vl_v2",
              language_config=language,
              vision_config={"layers": 1},
          )
      )
  )
  module, params = models.from_pretrained(tmp_path / "vl2", language_only=True)
  assert module.config == loaded("mha_dense1_s2")[0].config
  jax.tree.map(
      np.testing.assert_array_equal, params, loaded("mha_dense1_s2")[1]
  )
