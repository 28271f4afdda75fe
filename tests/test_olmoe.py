"""OLMoE decoder: clipping, RoPE, config and layouts, LoRA, owner slices.

Parity with Hugging Face, a batch of one, padding and the grouped dispatch:
tests/test_backbones.py (references: tests/hf_references.py).
"""

import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from raptor_jax import models
from raptor_jax.models import hf as hf_lib
from raptor_jax.models import olmoe

import hf_references as refs
from helpers import assert_fused_and_base_layouts_load, vmapped_owner_grads, fast_jit, lora_from_pretrained, probe_loss, set_nonzero_lora_b

CONFIGS = refs.OLMOE_CONFIGS
VOCAB, LAYERS = refs.VOCAB, refs.OLMOE_LAYERS
_hf_outputs, _rel_err, _assert_close = (
    refs.olmoe_outputs,
    refs.rel_err,
    refs.assert_close,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("olmoe")
  return {
      name: refs.save_olmoe(root / name, i, **kw)
      for i, (name, kw) in enumerate(CONFIGS.items())
  }


@pytest.fixture(scope="module")
def loaded(checkpoints):
  """name -> (module, params, jitted apply), loaded once so tests share compilations."""
  cache = {}

  def load(name, dispatch="auto"):
    if (name, dispatch) not in cache:
      module, params = models.from_pretrained(
          checkpoints[name], dispatch=dispatch
      )
      cache[name, dispatch] = module, params, fast_jit(module.apply)
    return cache[name, dispatch]

  return load


_batch = refs.batch


def test_clip_qkv_config_really_clips(checkpoints):
  """clip_qkv=2 changes HF's outputs on this config (else its parity proves little)."""
  ids, mask = _batch()
  path = checkpoints["e8k2_norm_clip"]
  clipped, _ = _hf_outputs(path, ids, mask)
  model = transformers.OlmoeModel.from_pretrained(
      path, attn_implementation="eager"
  ).eval()
  model.config.clip_qkv = None
  with torch.no_grad():
    unclipped = model(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)
    )
  assert _rel_err(unclipped.last_hidden_state.numpy(), clipped) > 1e-3


def test_config_from_checkpoint(loaded):
  cfg = loaded("e8k2_norm_clip")[0].config
  assert (cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, cfg.clip_qkv) == (
      8,
      2,
      True,
      2.0,
  )
  assert cfg.sparse_layers == tuple(range(LAYERS))
  assert cfg.num_key_value_heads == 2 and cfg.rope_theta == 10000.0
  assert loaded("e8k2_theta500")[0].config.rope_theta == 500.0
  # transformers v4 config.json: rope_theta at top level, rope_scaling null.
  v4 = dict(
      model_type="olmoe",
      hidden_size=32,
      num_attention_heads=4,
      rope_theta=321.0,
      rope_scaling=None,
      num_local_experts=4,
      num_experts_per_tok=1,
  )
  cfg = olmoe.config_from_hf(v4)
  assert (cfg.rope_theta, cfg.num_experts, cfg.num_key_value_heads) == (
      321.0,
      4,
      4,
  )


def test_unsupported_configs_and_options_fail_clearly(checkpoints):
  with pytest.raises(ValueError, match="unsupported RoPE type 'linear'"):
    olmoe.config_from_hf(
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    )
  with pytest.raises(ValueError, match="attention_bias"):
    olmoe.config_from_hf({"attention_bias": True})
  with pytest.raises(
      ValueError, match=r"unknown from_pretrained option\(s\) \['lora_rnak'\]"
  ):
    models.from_pretrained(checkpoints["e8k2_norm_clip"], lora_rnak=2)
  with pytest.raises(ValueError, match="not sparse blocks of this model"):
    models.OlmoeConfig(num_hidden_layers=2, expert_lora_layers=(2,))


def test_fused_and_base_model_layouts_load_the_same_params(
    checkpoints, loaded, tmp_path
):
  """v5's fused in-memory layout and OlmoeModel's prefix-free names both load."""
  path = checkpoints["e16k4_norm"]
  want = loaded("e16k4_norm")[1]
  hf_model = transformers.OlmoeForCausalLM.from_pretrained(path)
  assert_fused_and_base_layouts_load(
      hf_model,
      path,
      want,
      tmp_path,
      fused="model.layers.0.mlp.experts.gate_up_proj",
  )
  assert json.loads((path / "config.json").read_text())["model_type"] == "olmoe"
  assert not any(
      "lm_head" in p for p in flax.traverse_util.flatten_dict(want, sep="/")
  )


def _lora_model(path, **options):
  # seed=1: the owner-slice test compares two float32 paths of a loss with
  # cancellation at rtol 1e-5, and their gap depends on the random adapters
  # (1e-6 to 4e-5 over seeds 0-6, with `module.init` and `init_params`
  # alike); adapters are drawn by `models.init_params` since issue 43.
  return lora_from_pretrained(path, seed=1, **options)


@pytest.fixture(scope="module")
def lora_model(checkpoints):
  """LoRA rank 2 on q, k, v, o of every block and on block 1's experts (E=8, k=2).

  Returns (module, params, record_value_and_grad): the last is a jitted
  (params, ids [S], mask [S]) -> ((probe loss, hidden [S, D]), grads of all
  params) for one record; the tests share its one compilation.
  """
  module, params = _lora_model(checkpoints["e8k2_norm_clip"])

  @fast_jit
  def record_value_and_grad(p, x, m):
    def loss(p):
      hidden = module.apply({"params": p}, x[None], m[None]).hidden_states
      return probe_loss(hidden), hidden[0]

    return jax.value_and_grad(loss, has_aux=True)(p)

  return module, params, record_value_and_grad


def test_lora_with_zero_b_leaves_outputs_unchanged(loaded, lora_model):
  ids, mask = _batch()
  _, base_params, base = loaded("e8k2_norm_clip")
  _, lora_params, record_value_and_grad = lora_model
  flat = flax.traverse_util.flatten_dict(lora_params, sep="/")
  assert {p for p in flat if "lora" in p} == {
      f"block_{i}/attention/{m}/lora_{ab}"
      for i in range(LAYERS)
      for m in "qkvo"
      for ab in "ab"
  } | {
      f"block_1/mlp/experts/{m}/lora_{ab}"
      for m in ("gate", "up", "down")
      for ab in "ab"
  }
  assert flat["block_1/mlp/experts/gate/lora_a"].shape == (8, 32, 2)
  assert flat["block_1/mlp/experts/down/lora_b"].shape == (8, 2, 32)
  assert flat["block_0/attention/k/lora_b"].shape == (2, 16)
  assert flat["block_0/attention/q_norm/scale"].shape == (32,)
  assert flat["block_0/attention/k_norm/scale"].shape == (16,)
  for row in range(len(ids)):
    want = base(
        {"params": base_params},
        jnp.asarray(ids[row : row + 1]),
        jnp.asarray(mask[row : row + 1]),
    ).hidden_states[0]
    (_, got), _ = record_value_and_grad(
        lora_params, jnp.asarray(ids[row]), jnp.asarray(mask[row])
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_lora_params_get_gradients(lora_model):
  """Every adapter trains: B from its zero init, A once B is non-zero."""
  ids, mask = _batch()
  _, params, record_value_and_grad = lora_model
  grad = lambda p: flax.traverse_util.flatten_dict(
      record_value_and_grad(p, jnp.asarray(ids[2]), jnp.asarray(mask[2]))[1],
      sep="/",
  )
  adapters = [f"block_1/mlp/experts/{m}" for m in ("gate", "up", "down")] + [
      f"block_{i}/attention/{m}" for i in range(LAYERS) for m in "qkvo"
  ]
  at_init = grad(params)
  trained = grad(set_nonzero_lora_b(params, jax.random.PRNGKey(1)))
  for path in adapters:
    assert np.any(np.asarray(at_init[path + "/lora_b"]) != 0), path
    for leaf in ("lora_a", "lora_b"):
      assert np.any(np.asarray(trained[f"{path}/{leaf}"]) != 0), (path, leaf)


def test_vmapped_owner_slice_gradient_is_the_owner_part_of_the_full_gradient(
    lora_model,
):
  """Per-record owner gradients, vmapped over records as the trainer runs them.

  For every record and every candidate owner, the owner-override gradient
  (vmapped over (record, owner) pairs, which also exercises the grouped
  dispatch's custom_vmap rule) equals that record's full single-record
  gradient restricted to the owner's slice, and the loss value is unchanged.
  """
  ids, mask = _batch()
  module, params, record_value_and_grad = lora_model
  params = set_nonzero_lora_b(params, jax.random.PRNGKey(3))
  num_experts = module.config.num_experts
  values, grads = vmapped_owner_grads(module, params, ids, mask)
  for row in range(len(ids)):
    (value, _), full = record_value_and_grad(
        params, jnp.asarray(ids[row]), jnp.asarray(mask[row])
    )
    full = {
        m: {
            k: full["block_1"]["mlp"]["experts"][m][k]
            for k in ("lora_a", "lora_b")
        }
        for m in ("gate", "up", "down")
    }
    touched = 0
    for owner in range(num_experts):
      i = row * num_experts + owner
      np.testing.assert_allclose(values[i], value, rtol=1e-5)
      jax.tree.map(lambda g, f: _assert_close(g[i], f[owner]), grads, full)
      touched += bool(np.any(np.asarray(grads["gate"]["lora_b"][i]) != 0))
    assert touched >= 2  # the record's tokens reach several experts


def test_classifier_pools_the_last_real_token(loaded):
  ids, mask = _batch()
  backbone, backbone_params, _ = loaded("e8k2_theta500")
  classifier = models.SequenceClassifier(backbone, num_labels=3, pooling="last")
  keys = jax.random.split(jax.random.PRNGKey(0))
  head = {
      "kernel": jax.random.normal(keys[0], (32, 3)),
      "bias": jax.random.normal(keys[1], (3,)),
  }
  params = {"backbone": backbone_params, "head": head}
  apply = fast_jit(classifier.apply)
  logits, out = apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
  last = mask.sum(axis=1) - 1
  pooled = np.asarray(out.hidden_states)[np.arange(len(ids)), last]
  want = pooled @ np.asarray(params["head"]["kernel"]) + np.asarray(
      params["head"]["bias"]
  )
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  # Causal attention: tokens written into the padding cannot change the logits.
  noisy = np.where(mask == 1, ids, (ids + 7) % VOCAB)
  np.testing.assert_allclose(
      apply({"params": params}, jnp.asarray(noisy), jnp.asarray(mask))[0],
      logits,
      rtol=1e-6,
      atol=1e-6,
  )
