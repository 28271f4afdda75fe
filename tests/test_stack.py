"""Scanned blocks (`models.stack`): the plan, the converters, the twin, refusals.

Parity with Hugging Face under both settings is in tests/test_backbones.py
and tests/test_grad_parity.py; here the scanned model is checked against its
unrolled twin (`scan_layers=False`) on the same parameters, and the per-layer
layout on disk against the checkpoint it came from.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from raptor_jax import models, roles
from raptor_jax.models import export, initializers, lora, stack

import hf_references as refs

SWITCH = models.SwitchConfig(
    vocab_size=50,
    d_model=16,
    d_kv=4,
    d_ff=24,
    num_layers=8,
    num_heads=4,
    num_experts=4,
    expert_capacity=4,
    sparse_step=2,
    lora_rank=2,
    attention_lora=True,
)
OLMOE = models.OlmoeConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    lora_rank=2,
    attention_lora=True,
)
DEEPSEEK = models.DeepseekConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=2,
    v_head_dim=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    lora_rank=2,
    attention_lora=True,
    shared_expert_lora=True,
)
BACKBONES = {
    "switch": (models.SwitchEncoder, SWITCH),
    "olmoe": (models.OlmoeDecoder, OLMOE),
    "deepseek": (models.DeepseekDecoder, DEEPSEEK),
}


def _names(config, **options):
  return [
      s.name for s in stack.segments(dataclasses.replace(config, **options))
  ]


def test_segments_follow_the_repeated_units():
  # Switch: block 0 owns the position table; then (sparse, dense) pairs, and
  # the last block (sparse) alone.
  assert _names(SWITCH) == ["block_0", "blocks_1_6", "block_7"]
  assert _names(SWITCH, num_layers=12, unscanned_layers=(11,)) == [
      "block_0",
      "blocks_1_10",
      "block_11",
  ]
  # The owner layer l* = 5 out, with its pair's dense block.
  assert _names(
      SWITCH, num_layers=12, expert_lora_layers=(5,), unscanned_layers=(5,)
  ) == [
      "block_0",
      "blocks_1_4",
      "block_5",
      "block_6",
      "blocks_7_10",
      "block_11",
  ]
  # Monolithic LoRA (adapters on every sparse block) scans them together.
  assert _names(SWITCH, expert_lora_layers=(1, 3, 5, 7)) == [
      "block_0",
      "blocks_1_6",
      "block_7",
  ]
  assert _names(SWITCH, sparse_step=1) == ["block_0", "blocks_1_7"]
  # Adapters on one block among blocks without: it stays out.
  assert _names(OLMOE, expert_lora_layers=(1,)) == [
      "block_0",
      "block_1",
      "blocks_2_3",
  ]
  # DeepSeek: the dense blocks form their own segment.
  assert _names(DEEPSEEK) == ["blocks_0_1", "blocks_2_4"]
  assert _names(DEEPSEEK, scan_layers=False) == [f"block_{i}" for i in range(5)]
  for layers in range(1, 14):
    segments = stack.segments(dataclasses.replace(SWITCH, num_layers=layers))
    assert [b for s in segments for b in s.blocks] == list(range(layers))


def test_unscanned_layers_must_be_blocks():
  with pytest.raises(
      ValueError, match=r"unscanned_layers \[9\] are not blocks"
  ):
    dataclasses.replace(OLMOE, unscanned_layers=(9,))


@pytest.fixture(scope="module", params=sorted(BACKBONES))
def twins(request):
  """(scanned module, its params, unrolled twin, per-layer params, batch)."""
  backbone, config = BACKBONES[request.param]
  scanned = backbone(config)
  params = initializers.init_params(scanned, jax.random.key(0))
  flat = roles.flatten(params)  # non-zero B factors: adapters matter
  for i, path in enumerate(sorted(p for p in flat if p.endswith("lora_b"))):
    flat[path] = 0.3 * jax.random.normal(jax.random.key(i), flat[path].shape)
  params = roles.unflatten(flat)
  unrolled = backbone(dataclasses.replace(config, scan_layers=False))
  ids = jax.random.randint(jax.random.key(1), (3, 7), 0, config.vocab_size)
  mask = jnp.ones_like(ids).at[1, 4:].set(0).at[2, 1:].set(0)
  return (
      scanned,
      params,
      unrolled,
      stack.unstack_layers(params, config),
      (
          ids,
          mask,
      ),
  )


def test_stack_and_unstack_round_trip(twins):
  scanned, params, unrolled, per_layer, _ = twins
  assert any(k.startswith("blocks_") for k in params)
  shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  # Per layer: exactly the unrolled twin's tree.
  want = roles.unflatten(initializers.abstract_params(unrolled))
  assert shapes(per_layer) == shapes(want)
  again = stack.stack_layers(per_layer, scanned.config)
  assert shapes(again) == shapes(params)
  jax.tree.map(np.testing.assert_array_equal, again, params)
  # With scan_layers=False both are the identity.
  config = unrolled.config
  jax.tree.map(
      np.testing.assert_array_equal,
      stack.stack_layers(per_layer, config),
      stack.unstack_layers(per_layer, config),
  )


def test_scanned_outputs_equal_the_unrolled_twin(twins):
  scanned, params, unrolled, per_layer, (ids, mask) = twins
  got = jax.jit(scanned.apply)({"params": params}, ids, mask)
  want = jax.jit(unrolled.apply)({"params": per_layer}, ids, mask)
  num_sparse = len(scanned.config.sparse_layers)
  assert len(got.router_logits) == len(want.router_logits) == num_sparse
  scale = float(jnp.max(jnp.abs(want.hidden_states)))
  np.testing.assert_allclose(
      got.hidden_states, want.hidden_states, rtol=0, atol=1e-6 * scale
  )
  for a, b in zip(got.router_logits, want.router_logits):  # layer order
    np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b)))
    )


def test_owner_layer_stays_out_of_the_scan_with_todays_paths():
  config = dataclasses.replace(
      SWITCH, num_layers=12, expert_lora_layers=(11,), unscanned_layers=(11,)
  )
  module = models.SwitchEncoder(config)
  flat = initializers.abstract_params(module)
  owner = [p for p in flat if p.startswith(roles.expert_prefix(11, root=""))]
  assert sorted(p.rsplit("/", 2)[-2] for p in owner if "lora" in p) == [
      "wi",
      "wi",
      "wo",
      "wo",
  ]
  assert flat["block_11/mlp/experts/wi/lora_a"].shape == (4, 16, 2)
  assert flat["blocks_1_10/offset_0/mlp/experts/wi/kernel"].shape == (
      5,
      4,
      16,
      24,
  )
  assert flat["blocks_1_10/offset_1/mlp/wi/kernel"].shape == (5, 16, 24)
  # Selection by block takes l*'s leaves, whole.
  assert roles.select(
      roles.unflatten(flat), roles.EXPERT_ROLES, (11,)
  ) == sorted(p for p in owner if roles.is_adapter(p))


def test_an_owner_override_inside_a_scan_is_refused():
  module = models.OlmoeDecoder(OLMOE)
  params = initializers.init_params(module, jax.random.key(0))
  ids, mask = initializers.example_inputs()
  slice_ = {m: {"kernel": jnp.zeros((16, 8))} for m in ("gate", "up")}
  override = models.OwnerOverride(2, jnp.int32(0), slice_)
  with pytest.raises(
      ValueError,
      match=r"owner layer 2 is inside the scanned segment blocks_0_3; keep it"
      r" out of the scan with unscanned_layers=\(2,\)",
  ):
    module.apply({"params": params}, ids, mask, owner_override=override)


def test_selection_by_block_never_cuts_a_stacked_leaf():
  params = roles.unflatten(
      initializers.abstract_params(models.OlmoeDecoder(OLMOE))
  )
  assert list(roles.blocks_of("blocks_0_3/attention/q/kernel")) == [0, 1, 2, 3]
  assert len(roles.select(params, ("attention_adapter",), range(4))) == 8
  assert roles.select(params, ("attention_adapter",), (7,)) == []
  with pytest.raises(ValueError, match="stacks blocks 0..3, and selecting"):
    roles.select(params, ("attention_adapter",), (2,))


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_from_pretrained_then_export_keeps_hugging_face_names_and_values(
    tmp_path, scan
):
  """A Switch checkpoint (blocks 1-4 scanned) exports byte for byte per layer."""
  path = refs.save_switch(
      tmp_path / "hf", 0, **refs.SWITCH_CONFIGS["e8_step2_drop"]
  )
  module, params = models.from_pretrained(path, scan_layers=scan)
  assert scan == ("blocks_1_4" in params)
  out = export.save_pretrained(module, params, tmp_path / f"out_{scan}")
  original = load_file(str(path / "model.safetensors"))
  written = load_file(str(out / "model.safetensors"))
  encoder = {n for n in original if n.startswith("encoder.")} - {
      "encoder.embed_tokens.weight"  # tied to shared.weight
  }
  assert set(written) == encoder | {"shared.weight"}
  for name, value in written.items():
    np.testing.assert_array_equal(value, original[name], err_msg=name)
  _, again = models.from_pretrained(out, scan_layers=scan)
  jax.tree.map(np.testing.assert_array_equal, again, params)


def test_scanned_and_unrolled_exports_are_the_same_bytes(tmp_path):
  path = refs.save_switch(
      tmp_path / "hf", 0, **refs.SWITCH_CONFIGS["e8_step2_drop"]
  )
  files = []
  for scan in (True, False):
    module, params = models.from_pretrained(path, scan_layers=scan)
    out = export.save_pretrained(module, params, tmp_path / str(scan))
    files.append((out / "model.safetensors").read_bytes())
  assert files[0] == files[1]


def test_with_options_moves_leaves_between_layouts():
  module = models.OlmoeDecoder(dataclasses.replace(OLMOE, lora_rank=0))
  params = initializers.init_params(module, jax.random.key(0))
  assert list(params) == ["blocks_0_3", "embed_tokens", "final_layer_norm"]
  new, moved = models.with_options(
      module,
      params,
      lora_rank=2,
      expert_lora_layers=(2,),
      unscanned_layers=(2,),
  )
  assert sorted(moved) == [
      "block_2",
      "block_3",
      "blocks_0_1",
      "embed_tokens",
      "final_layer_norm",
  ]
  kernel = "mlp/experts/up/kernel"
  np.testing.assert_array_equal(
      moved["block_2"]["mlp"]["experts"]["up"]["kernel"],
      params["blocks_0_3"]["mlp"]["experts"]["up"]["kernel"][2],
      err_msg=kernel,
  )
  assert "lora_a" in moved["block_2"]["mlp"]["experts"]["up"]
  _, again = models.with_options(new, moved, scan_layers=False)
  assert sorted(k for k in again if k.startswith("block")) == [
      f"block_{i}" for i in range(4)
  ]


def test_merging_stacked_adapters_keeps_the_outputs(twins):
  """`lora.merge` folds each stacked adapter into its stacked kernel."""
  scanned, params, _, _, (ids, mask) = twins
  config = scanned.config
  plain = dataclasses.replace(
      config, lora_rank=0, attention_lora=False, expert_lora_layers=()
  )
  if isinstance(config, models.DeepseekConfig):
    plain = dataclasses.replace(plain, shared_expert_lora=False)
  assert stack.segments(plain) == stack.segments(config)
  merged = lora.merge(params, config.lora_alpha, config.lora_rank)
  got = type(scanned)(plain).apply({"params": merged}, ids, mask)
  want = scanned.apply({"params": params}, ids, mask)
  # float32: the merged kernel rounds W + s B A once, the adapter path its
  # two products, and attention spreads one token's rounding over its
  # record. Against the outputs' scale (about 2): Switch's records moved by
  # 6e-7 to 6e-5 of it over four draws of the parameters (one record of
  # one draw at the top), where folding with a tenth too much scale moves
  # them by 0.75 of it.
  scale = float(np.max(np.abs(want.hidden_states)))
  np.testing.assert_allclose(
      got.hidden_states, want.hidden_states, rtol=0, atol=2e-4 * scale
  )
