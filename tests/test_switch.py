"""Switch encoder: capacity, LoRA, owner slices, loading (parity, batch of one,
padding and dispatch: tests/test_backbones.py)."""

import dataclasses
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from raptor_jax import models
from raptor_jax.models import moe

import hf_references as refs
from helpers import lora_from_pretrained, probe_loss, set_nonzero_lora_b

_assert_close = refs.assert_close


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("switch")
  return {
      name: refs.save_switch(root / name, i, **kw)
      for i, (name, kw) in enumerate(refs.SWITCH_CONFIGS.items())
  }


def _batch(seed=0, batch=4):
  return refs.batch(seed, batch, low=2)


def test_small_capacity_really_drops_tokens(checkpoints):
  """The capacity configs exercise HF's drop rule (else parity proves little)."""
  ids, mask = _batch()
  module, params = models.from_pretrained(checkpoints["e8_step2_drop"])
  out = module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
  routing = moe.route_top1(out.router_logits[0], module.config.expert_capacity)
  assert int(jnp.sum(routing.experts == module.config.num_experts)) > 0


def test_sparse_layer_positions():
  assert models.SwitchConfig(num_layers=12, sparse_step=2).sparse_layers == (
      1,
      3,
      5,
      7,
      9,
      11,
  )
  assert models.SwitchConfig(num_layers=3, sparse_step=1).sparse_layers == (
      0,
      1,
      2,
  )
  assert models.SwitchConfig(num_layers=4, sparse_step=4).sparse_layers == (1,)


def test_route_top1_capacity_by_hand():
  # Tokens 0..4 all prefer expert 1; capacity 2 keeps tokens 0 and 1 only.
  logits = jnp.array(
      [[0.0, 3.0], [0.0, 2.0], [0.0, 1.0], [0.0, 4.0], [2.0, 0.0]]
  )
  routing = moe.route_top1(logits[None], expert_capacity=2)
  np.testing.assert_array_equal(routing.experts[0, :, 0], [1, 1, 2, 2, 0])
  assert float(routing.weights[0, 2, 0]) == 0.0
  np.testing.assert_allclose(
      routing.weights[0, 0, 0], jax.nn.softmax(logits[0])[1], rtol=1e-6
  )


@pytest.mark.parametrize("num_experts,rows", [(3, 1), (4, 37), (8, 300)])
def test_grouped_linear_matches_dense_values_and_input_grads(num_experts, rows):
  keys = jax.random.split(jax.random.PRNGKey(num_experts), 3)
  x = jax.random.normal(keys[0], (rows, 5))
  w = jax.random.normal(keys[1], (num_experts, 5, 7))
  experts = jax.random.randint(
      keys[2], (rows,), 0, num_experts + 1
  )  # E = dropped
  np.testing.assert_allclose(
      moe.grouped_linear(x, experts, w),
      moe.dense_linear(x, experts, w),
      rtol=1e-5,
      atol=1e-5,
  )
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x, experts, w)))
  np.testing.assert_allclose(
      jax.grad(loss(moe.grouped_linear))(x),
      jax.grad(loss(moe.dense_linear))(x),
      rtol=1e-5,
      atol=1e-5,
  )
  # The base weights are constants of the grouped dispatch.
  dw = jax.grad(lambda w: jnp.sum(moe.grouped_linear(x, experts, w)))(w)
  assert not np.any(np.asarray(dw))


def _expert_inputs(seed, num_experts, rows):
  """Two records' x [2, rows, 5], w, LoRA a and b, experts (E = dropped)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = jax.random.normal(keys[0], (2, rows, 5))  # two records
  w = jax.random.normal(keys[1], (num_experts, 5, 7))
  a = jax.random.normal(keys[2], (num_experts, 5, 3))
  b = jax.random.normal(keys[3], (num_experts, 3, 7))
  experts = jax.random.randint(
      keys[4], (2, rows), 0, num_experts + 1
  )  # E = dropped
  return x, w, a, b, experts


@pytest.mark.parametrize("num_experts,rows", [(3, 1), (8, 300)])
def test_grouped_linear_with_frozen_lora_matches_a_brute_force_loop_under_vmap(
    num_experts, rows
):
  """x @ (W[e] + A[e] B[e]) in one dispatch (the owner path's frozen layer), per
  record: values and input gradients against a per-row NumPy loop."""
  x, w, a, b, experts = _expert_inputs(rows, num_experts, rows)
  layer = jax.vmap(lambda x, e: moe.grouped_linear(x, e, w, (a, b)))
  expected = np.zeros((2, rows, 7), np.float32)
  dx = np.zeros(
      (2, rows, 5), np.float32
  )  # gradient of sum(sin(y)) with respect to x
  for i, t in np.ndindex(2, rows):
    e = int(experts[i, t])
    if e < num_experts:
      m = np.asarray(w[e]) + np.asarray(a[e]) @ np.asarray(b[e])
      expected[i, t] = np.asarray(x[i, t]) @ m
      dx[i, t] = m @ np.cos(expected[i, t])
  np.testing.assert_allclose(layer(x, experts), expected, rtol=1e-4, atol=1e-4)
  got = jax.grad(lambda x: jnp.sum(jnp.sin(layer(x, experts))))(x)
  np.testing.assert_allclose(got, dx, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("owner", [0, 2])
def test_owner_lora_delta_gives_the_owner_slice_and_the_input_their_full_gradients(
    owner,
):
  """Frozen grouped layer + owner delta vs the differentiable dense reference:
  same value, same input gradient (the owner's adapter counted once), and the
  owner factors get the owner slice of the stacked factors' gradient."""
  keys = jax.random.split(jax.random.PRNGKey(owner), 5)
  num_experts, rows, scale = 3, 40, 0.5
  x = jax.random.normal(keys[0], (rows, 5))
  w = jax.random.normal(keys[1], (num_experts, 5, 7))
  a = jax.random.normal(keys[2], (num_experts, 5, 3))
  b = jax.random.normal(keys[3], (num_experts, 3, 7))
  experts = jax.random.randint(keys[4], (rows,), 0, num_experts + 1)

  def owner_loss(x, oa, ob):
    y = moe.grouped_linear(x, experts, w, (a, scale * b))
    y = y + moe.owner_lora_delta(x, experts, scale, jnp.int32(owner), oa, ob)
    return jnp.sum(jnp.sin(y))

  def reference_loss(x, a, b):
    y = moe.dense_linear(x, experts, w) + moe.expert_lora(
        x, experts, a, b, scale
    )
    return jnp.sum(jnp.sin(y))

  value, (dx, da, db) = jax.value_and_grad(owner_loss, argnums=(0, 1, 2))(
      x, a[owner], b[owner]
  )
  ref_value, (ref_dx, ref_da, ref_db) = jax.value_and_grad(
      reference_loss, argnums=(0, 1, 2)
  )(x, a, b)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(da, ref_da[owner], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(db, ref_db[owner], rtol=1e-4, atol=1e-4)
  assert np.any(np.asarray(db) != 0)


def test_lora_with_zero_b_leaves_outputs_unchanged(checkpoints):
  ids, mask = _batch()
  base, base_params = models.from_pretrained(checkpoints["e8_step2_drop"])
  lora, lora_params = lora_from_pretrained(checkpoints["e8_step2_drop"])
  flat = flax.traverse_util.flatten_dict(lora_params, sep="/")
  assert {p for p in flat if "lora" in p} >= {
      "block_0/attention/q/lora_a",
      "block_3/attention/o/lora_b",
      "block_1/mlp/experts/wi/lora_a",
      "block_1/mlp/experts/wo/lora_b",
  }
  assert flat["block_1/mlp/experts/wi/lora_a"].shape == (8, 32, 2)
  assert not any("lora" in p for p in flat if p.startswith("block_3/mlp"))
  a = base.apply({"params": base_params}, jnp.asarray(ids), jnp.asarray(mask))
  b = lora.apply({"params": lora_params}, jnp.asarray(ids), jnp.asarray(mask))
  np.testing.assert_allclose(
      a.hidden_states, b.hidden_states, rtol=1e-6, atol=1e-6
  )


def _lora_grads(module, params, ids, mask):
  def loss(p):
    return probe_loss(module.apply({"params": p}, ids, mask).hidden_states)

  return flax.traverse_util.flatten_dict(
      jax.jit(jax.grad(loss))(params), sep="/"
  )


def test_lora_params_get_gradients(checkpoints):
  ids, mask = _batch()
  module, params = lora_from_pretrained(checkpoints["e8_step2_drop"])
  grads = _lora_grads(module, params, jnp.asarray(ids), jnp.asarray(mask))
  for path in (
      "block_0/attention/q/lora_b",
      "block_2/attention/v/lora_b",
      "block_1/mlp/experts/wi/lora_b",
      "block_1/mlp/experts/wo/lora_b",
  ):
    assert np.any(np.asarray(grads[path]) != 0), path


@pytest.mark.parametrize(
    "name,layer,scan",
    [
        ("e8_step2_drop", 1, True),
        # Blocks 1-4 one scanned segment, the owner block 5 out of it.
        ("e8_step2_drop", 5, True),
        ("e8_step2_drop", 5, False),
    ],
)
def test_owner_slice_gradient_is_the_owner_part_of_the_full_gradient(
    checkpoints, name, layer, scan
):
  """Native owner override == full gradient restricted to the owner's slice."""
  ids, mask = _batch()
  module, params = lora_from_pretrained(
      checkpoints[name], expert_lora_layers=(layer,), unscanned_layers=(layer,)
  )
  assert ("blocks_1_4" in params) == (layer == 5)
  params = set_nonzero_lora_b(params, jax.random.PRNGKey(3))
  if not scan:  # the unrolled twin, on the same values
    params = models.unstack_layers(params, module.config)
    module = type(module)(dataclasses.replace(module.config, scan_layers=False))
  experts = params[f"block_{layer}"]["mlp"]["experts"]
  lora = {
      m: {k: experts[m][k] for k in ("lora_a", "lora_b")} for m in ("wi", "wo")
  }

  @jax.jit
  def full_grad(lo, x, m):
    return jax.grad(
        lambda lo: probe_loss(
            module.apply(
                {"params": _with_lora(params, lo, layer)}, x[None], m[None]
            ).hidden_states
        )
    )(lo)

  @jax.jit
  def owner_value_and_grad(s, owner, x, m):
    def loss(s):
      override = models.OwnerOverride(layer, owner, s)
      return probe_loss(
          module.apply(
              {"params": params}, x[None], m[None], owner_override=override
          ).hidden_states
      )

    return jax.value_and_grad(loss)(s)

  for row in (0, 2):
    x, m = jnp.asarray(ids[row]), jnp.asarray(mask[row])
    full = full_grad(lora, x, m)
    plain = probe_loss(
        module.apply({"params": params}, x[None], m[None]).hidden_states
    )
    touched = 0
    for owner in range(module.config.num_experts):
      slice_ = jax.tree.map(lambda p: p[owner], lora)
      value, got = owner_value_and_grad(slice_, jnp.int32(owner), x, m)
      np.testing.assert_allclose(
          value, plain, rtol=1e-4
      )  # float32, another op order
      jax.tree.map(lambda g, f: _assert_close(g, f[owner]), got, full)
      touched += bool(np.any(np.asarray(got["wi"]["lora_b"]) != 0))
    assert touched >= 2  # the record's tokens reach several experts


def _with_lora(params, lora, layer):
  params = jax.tree.map(lambda x: x, params)
  experts = params[f"block_{layer}"]["mlp"]["experts"]
  for m in ("wi", "wo"):
    experts[m] = {**experts[m], **lora[m]}
  return params


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_vmap_per_record_grads_equal_loop(checkpoints, scan):
  """Grouped dispatch under vmap (flattened by its custom_vmap rule) is per
  record; with the scan, blocks 1-2 (adapters included) are one segment."""
  ids, mask = _batch()
  module, params = lora_from_pretrained(
      checkpoints["e4_step1_drop"],
      expert_lora_layers=(0, 1, 2),
      scan_layers=scan,
  )
  assert scan == ("blocks_1_2" in params)
  params = set_nonzero_lora_b(params, jax.random.PRNGKey(0))

  def loss(p, x, m):
    return probe_loss(
        module.apply({"params": p}, x[None], m[None]).hidden_states[0]
    )

  batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(
      params, jnp.asarray(ids), jnp.asarray(mask)
  )
  single_grad = jax.jit(jax.grad(loss))
  for row in range(ids.shape[0]):
    single = single_grad(params, jnp.asarray(ids[row]), jnp.asarray(mask[row]))
    # Float32 noise scales with the record's gradient, not with a leaf whose
    # gradient is nearly zero: on an AVX2-only AMD EPYC, the unrolled twin's
    # last router kernel (3.5e-3 in a 3-token record whose other leaves are
    # of order 1-8) differed by 4.8e-7 between the vmapped and the one-record
    # programs, 1.4e-4 of its own size. A record mixing into another would
    # be off by the leaf's own size.
    scale = max(float(jnp.max(jnp.abs(s))) for s in jax.tree.leaves(single))
    jax.tree.map(
        lambda b, s: _assert_close(b[row], s, floor=1e-2 * scale),
        batched,
        single,
    )


def test_offline_hub_id_gives_one_clear_error(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(OSError, match=r"google/switch-base-8.*local directory"):
    models.from_pretrained("google/switch-base-8")


def test_missing_directory_and_bad_model_type(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    models.from_pretrained(str(tmp_path / "nowhere"))
  (tmp_path / "config.json").write_text('{"model_type": "bert"}')
  with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
    models.from_pretrained(tmp_path)


def test_encoder_only_checkpoint_loads(tmp_path, checkpoints):
  model = transformers.SwitchTransformersEncoderModel.from_pretrained(
      checkpoints["e2_step2"]
  )
  model.save_pretrained(tmp_path)
  ids, mask = _batch()
  a_mod, a = models.from_pretrained(checkpoints["e2_step2"])
  b_mod, b = models.from_pretrained(tmp_path)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_expert_lora_on_dense_block_is_rejected():
  with pytest.raises(ValueError, match="not sparse blocks"):
    models.SwitchConfig(num_layers=4, sparse_step=2, expert_lora_layers=(2,))


@pytest.mark.parametrize("num_experts,rows", [(3, 1), (8, 300)])
def test_grouped_lora_gradients_equal_plain_autodiff_per_record(
    num_experts, rows
):
  """The grouped dispatch's hand-written adapter gradients (every expert's factors,
  per record under vmap) and input gradients equal autodiff of the every-expert
  reference (dense_linear + expert_lora)."""
  x, w, a, b, experts = _expert_inputs(rows + num_experts, num_experts, rows)
  scale = 0.5

  def grouped(x, e, a, b):
    return jnp.sum(jnp.sin(moe.grouped_linear(x, e, w, (a, scale * b))))

  def reference(x, e, a, b):
    y = moe.dense_linear(x, e, w) + moe.expert_lora(x, e, a, b, scale)
    return jnp.sum(jnp.sin(y))

  per_record = lambda f: jax.vmap(
      jax.value_and_grad(f, argnums=(0, 2, 3)), in_axes=(0, 0, None, None)
  )
  value, grads = per_record(grouped)(x, experts, a, b)
  ref_value, ref_grads = per_record(reference)(x, experts, a, b)
  np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-4)
  for got, want in zip(
      grads, ref_grads
  ):  # dx [2, T, 5], da [2, E, 5, 3], db [2, E, 3, 7]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_families_share_one_set_of_fine_tuning_options():
  """Options are declared once (models.common); every family config has them."""
  from raptor_jax.models import common, hf  # pylint: disable=g-import-not-at-top

  names = common.FINE_TUNING_OPTIONS
  assert names == (
      "lora_rank",
      "lora_alpha",
      "attention_lora",
      "expert_lora_layers",
      "dispatch",
      "dtype",
      "kernels",
      "scan_layers",
      "unscanned_layers",
  )
  for config in (
      models.SwitchConfig(),
      models.OlmoeConfig(),
      models.DeepseekConfig(),
      models.Qwen3MoeConfig(),
      models.Qwen2MoeConfig(),
      models.MixtralConfig(),
  ):
    assert isinstance(config, common.FineTuningOptions)
  assert set(hf.FAMILIES) == {
      "switch_transformers",
      "olmoe",
      "deepseek_v2",
      "deepseek_vl_v2",
      "qwen3_moe",
      "qwen2_moe",
      "mixtral",
  }
