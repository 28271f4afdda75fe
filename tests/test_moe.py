"""Expert dispatch: the batched and ragged paths against the sorted-block scan.

`moe.batched_linear`, `moe.ragged_linear` (and their `*_trainable`) must
compute the same functions and gradients as `moe.grouped_linear` /
`grouped_linear_trainable`
(dropped rows included, per record under vmap); the every-expert autodiff
reference (`dense_linear` + `expert_lora`) pins both independently.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import models
from raptor_jax.models import lora as lora_lib
from raptor_jax.models import dispatch as dispatch_lib
from raptor_jax.models import kernels as kernels_lib
from raptor_jax.models import decoder, moe
from raptor_jax.models import ragged
from raptor_jax.models import olmoe
from raptor_jax.models import switch

from helpers import expert_inputs, fast_jit


def _inputs(num_experts, rows, records=2, seed=0):
  rng = np.random.RandomState(seed + rows + num_experts)
  return expert_inputs(rng, num_experts, rows, records)


KEY = jax.random.PRNGKey(0)

try:
  import tokamax  # pylint: disable=g-import-not-at-top,unused-import

  HAS_TOKAMAX = True
except ImportError:
  HAS_TOKAMAX = False
_needs_tokamax = pytest.mark.skipif(
    not HAS_TOKAMAX, reason="tokamax (the [gpu] extra) is not installed"
)
RAGGED_KINDS = ["ragged", pytest.param("tokamax", marks=_needs_tokamax)]
# The grouped scan's twins in whole layers: also the loop-free batched blocks
# (the GPU's 'auto'; tests/test_kernels.py checks it row by row).
DISPATCH_KINDS = ["batched"] + RAGGED_KINDS


def _close_to_scale(got, want, tol=1e-4):
  """max |got - want| <= tol * max |want| (float32 noise scales with the array)."""
  want = np.asarray(want)
  err = float(np.max(np.abs(np.asarray(got) - want)))
  assert err <= tol * max(float(np.max(np.abs(want))), 1e-12), err


def _close(got, want):
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", RAGGED_KINDS)
@pytest.mark.parametrize("num_experts,rows", [(3, 1), (8, 300)])
def test_ragged_lora_layer_equals_grouped_per_record(num_experts, rows, kind):
  """Values and per-record gradients (input, every expert's LoRA factors)."""
  x, experts, w, a, b = _inputs(num_experts, rows)
  ragged = getattr(moe, f"{kind}_linear")

  def loss(linear):
    return lambda x, e, a, b: jnp.sum(jnp.sin(linear(x, e, w, (a, b))))

  per_record = lambda f: fast_jit(
      jax.vmap(
          jax.value_and_grad(f, argnums=(0, 2, 3)), in_axes=(0, 0, None, None)
      )
  )
  got_value, got = per_record(loss(ragged))(x, experts, a, b)
  value, want = per_record(loss(moe.grouped_linear))(x, experts, a, b)
  _close(got_value, value)
  assert got[1].shape == (2, num_experts, 5, 3)  # per record, every expert
  jax.tree.map(_close, got, want)
  # Independent reference: autodiff of every expert on every row.
  ref = lambda x, e, a, b: jnp.sum(
      jnp.sin(moe.dense_linear(x, e, w) + moe.expert_lora(x, e, a, b, 1.0))
  )
  _, ref_grads = per_record(ref)(x, experts, a, b)
  jax.tree.map(_close, got, ref_grads)
  # Dropped rows get no output and no input gradient; base weights are frozen.
  y = fast_jit(jax.vmap(lambda x, e: ragged(x, e, w, (a, b))))(x, experts)
  dropped = np.asarray(experts) == num_experts
  assert not np.any(np.asarray(y)[dropped])
  assert not np.any(np.asarray(got[0])[dropped])
  dw = fast_jit(jax.grad(lambda w: jnp.sum(ragged(x[0], experts[0], w))))(w)
  assert not np.any(np.asarray(dw))


@pytest.mark.parametrize("kind", RAGGED_KINDS)
@pytest.mark.parametrize("num_experts,rows", [(3, 1), (8, 300)])
def test_ragged_trainable_equals_grouped_trainable(num_experts, rows, kind):
  """Pretraining (batch gradient) and per-record kernel gradients under vmap."""
  x, experts, w, _, _ = _inputs(num_experts, rows, records=3, seed=1)
  ragged = getattr(moe, f"{kind}_linear_trainable")
  loss = lambda linear: lambda x, e, w: jnp.sum(jnp.sin(linear(x, e, w)))
  grad = lambda f: fast_jit(jax.value_and_grad(f, argnums=(0, 2)))
  flat_x, flat_e = x.reshape(-1, 5), experts.reshape(-1)
  got_value, got = grad(loss(ragged))(flat_x, flat_e, w)
  value, want = grad(loss(moe.grouped_linear_trainable))(flat_x, flat_e, w)
  _, ref = grad(loss(moe.dense_linear))(flat_x, flat_e, w)
  _close(got_value, value)
  jax.tree.map(_close, got, want)
  jax.tree.map(_close, got, ref)
  per_record = lambda f: fast_jit(
      jax.vmap(jax.grad(f, argnums=(0, 2)), in_axes=(0, 0, None))
  )
  got = per_record(loss(ragged))(x, experts, w)
  want = per_record(loss(moe.dense_linear))(x, experts, w)
  assert got[1].shape == (3, num_experts, 5, 7)
  jax.tree.map(_close, got, want)


# Tiny sparse layers; Switch's capacity (2 of 10 tokens per expert) drops.
LAYERS = {
    "switch": lambda **o: switch.SwitchSparseMLP(
        switch.SwitchConfig(d_model=8, d_ff=12, num_experts=4, **o),
        rank=o["lora_rank"],
    ),
    "olmoe": lambda **o: decoder.SparseMLP(
        olmoe.OlmoeConfig(
            hidden_size=8,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=6,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **o,
        ),
        rank=o["lora_rank"],
    ),
}


@pytest.mark.parametrize("other", DISPATCH_KINDS)
@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("family", list(LAYERS))
def test_sparse_layer_ragged_equals_grouped_per_record(
    family, trainable, other
):
  """A whole Switch / OLMoE sparse layer (router, capacity, experts) under
  per-record vmap: values, router logits and the gradients of the input and
  of every parameter (LoRA factors, or trainable kernels) agree."""
  rng = np.random.RandomState(3)
  x = jnp.asarray(rng.normal(size=(3, 1, 10, 8)), jnp.float32)  # 3 records
  options = dict(lora_rank=0) if trainable else dict(lora_rank=2)
  if family == "switch":
    options["expert_capacity"] = 2
  got = {}
  for kind in ("grouped", other):
    dispatch = kind + "_train" if trainable else kind
    layer = LAYERS[family](dispatch=dispatch, **options)
    if kind == "grouped":
      shapes = jax.eval_shape(layer.init, KEY, x[0])
      params = jax.tree.map(
          lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype),
          shapes,
      )
    loss = lambda p, x: (lambda out: (jnp.sum(jnp.tanh(out[0])), out))(
        layer.apply(p, x)
    )
    got[kind] = fast_jit(
        jax.vmap(
            jax.value_and_grad(loss, argnums=(0, 1), has_aux=True),
            in_axes=(None, 0),
        )
    )(params, x)
  (_, (_, logits)), grads = got[other]
  if family == "switch":
    routing = moe.route_top1(logits, 2)
    assert np.any(np.asarray(routing.experts) == 4)  # capacity drops
  experts = grads[0]["params"]["experts"]
  leaf = "wi" if family == "switch" else "gate"
  name = "kernel" if trainable else "lora_a"
  assert experts[leaf][name].shape[:2] == (3, layer.config.num_experts)
  assert np.any(np.asarray(experts[leaf][name]))
  jax.tree.map(_close_to_scale, got[other], got["grouped"])


def test_owner_linear_with_the_ragged_frozen_dispatch():
  x, experts, w, _, _ = _inputs(4, 40, seed=2)
  owner_w = w[1] + 0.5

  def value_and_grad(frozen_linear):
    return fast_jit(
        jax.vmap(
            jax.value_and_grad(
                lambda x, e, ow: jnp.sum(
                    jnp.sin(moe.owner_linear(x, e, w, 1, ow, frozen_linear))
                ),
                argnums=(0, 2),
            ),
            in_axes=(0, 0, None),
        )
    )(x, experts, owner_w)

  jax.tree.map(
      _close,
      value_and_grad(moe.ragged_linear),
      value_and_grad(moe.grouped_linear),
  )


def test_auto_resolves_by_backend():
  assert jax.default_backend() == "cpu"
  assert moe.resolve_dispatch("auto") == "grouped"
  assert moe.resolve_dispatch("auto_train") == "grouped_train"
  for backend in ("gpu", "tpu"):  # no host-driven loop off CPU
    assert moe.resolve_dispatch("auto", backend) == "batched"
    assert moe.resolve_dispatch("auto_train", backend) == "batched_train"
  with kernels_lib.defaults_of("gpu"):
    assert moe.resolve_dispatch("auto") == "batched"
    assert kernels_lib.resolve("auto") == "reference"
  assert moe.resolve_dispatch("auto") == "grouped"
  for forced in ("grouped", "ragged", "dense", "ragged_train"):
    assert moe.resolve_dispatch(forced, "gpu") == forced
  assert models.SwitchConfig().dispatch == "auto"


@pytest.mark.parametrize(
    "dispatch,present,absent",
    [
        ("auto", "scan", "ragged_dot"),
        ("grouped", "scan", "ragged_dot"),
        ("ragged", "ragged_dot", "scan"),
        ("batched", "dot_general", "scan"),
    ],
)
def test_expert_layer_runs_the_dispatch_it_resolves_to(
    dispatch, present, absent
):
  """On CPU 'auto' traces the scan path; 'ragged' traces only ragged GEMMs."""
  layer = lora_lib.ExpertLinear(4, 7, rank=2, dispatch=dispatch)
  x, experts = jnp.ones((6, 5)), jnp.arange(6, dtype=jnp.int32) % 5
  params = jax.eval_shape(layer.init, jax.random.PRNGKey(0), x, experts)
  grad = jax.grad(lambda p: jnp.sum(layer.apply(p, x, experts)))
  text = str(jax.make_jaxpr(grad)(params))
  assert present in text and absent not in text


def test_bad_dispatch_gives_one_clear_error():
  want = (
      r"^dispatch: must be one of 'auto', 'grouped', 'batched', 'ragged', "
      r"'tokamax', 'dense', 'auto_train', 'grouped_train', 'batched_train', "
      r"'ragged_train', 'tokamax_train', got 'scan'; pass "
      r"dispatch= .*--config\.model\.dispatch"
  )
  with pytest.raises(ValueError, match=want):
    models.SwitchConfig(dispatch="scan")
  with pytest.raises(ValueError, match=want):
    models.OlmoeConfig(dispatch="scan")
  layer = lora_lib.ExpertLinear(4, 7, dispatch="scan")
  with pytest.raises(ValueError, match=want):
    jax.eval_shape(layer.init, KEY, jnp.ones((3, 5)), jnp.zeros(3, jnp.int32))
  layer = lora_lib.ExpertLinear(4, 7, rank=2, dispatch="ragged_train")
  with pytest.raises(
      ValueError, match="'ragged_train' trains the base kernels"
  ):
    jax.eval_shape(layer.init, KEY, jnp.ones((3, 5)), jnp.zeros(3, jnp.int32))


def test_ragged_kernel_gradient_flows_through_an_expert_layer():
  """'ragged_train' trains the stacked kernel; 'ragged' keeps it frozen."""
  x, experts, w, _, _ = _inputs(4, 6, records=1)
  x, experts = x[0], experts[0]
  grads = {}
  for dispatch in ("ragged", "ragged_train", "dense"):
    layer = lora_lib.ExpertLinear(4, 7, dispatch=dispatch)
    loss = lambda w: jnp.sum(
        jnp.sin(layer.apply({"params": {"kernel": w}}, x, experts))
    )
    grads[dispatch] = fast_jit(jax.grad(loss))(w)
  assert not np.any(np.asarray(grads["ragged"]))
  _close(grads["ragged_train"], grads["dense"])
  assert np.any(np.asarray(grads["dense"]))


@pytest.mark.parametrize("k", [1, 3])
def test_combine_matches_a_loop_and_its_gradient_under_vmap(k):
  rng = np.random.RandomState(k)
  records, batch, seq, d = 2, 1, 4, 5
  out = jnp.asarray(rng.normal(size=(records, batch * seq * k, d)), jnp.float32)
  w = jnp.asarray(rng.uniform(size=(records, batch, seq, k)), jnp.float32)

  def loop(out, w):
    rows = np.asarray(out).reshape(batch, seq, k, d)
    res = np.zeros((batch, seq, d), np.float32)
    for b in range(batch):
      for s in range(seq):
        for j in range(k):
          res[b, s] += float(w[b, s, j]) * rows[b, s, j]
    return res

  got = jax.vmap(moe.combine)(out, w)
  for r in range(records):
    np.testing.assert_allclose(got[r], loop(out[r], w[r]), rtol=1e-6)
  # Gradients against the einsum of the [B, S, k, D] layout it replaces.
  ref = lambda o, w: jnp.einsum("bskd,bsk->bsd", o.reshape(batch, seq, k, d), w)
  loss = lambda f: lambda o, w: jnp.sum(jnp.sin(f(o, w)))
  grads = jax.vmap(jax.grad(loss(moe.combine), argnums=(0, 1)))(out, w)
  want = jax.vmap(jax.grad(loss(ref), argnums=(0, 1)))(out, w)
  for g, h in zip(grads, want):
    np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


def test_block_size_bounds_padding_and_keeps_blocks_of_16_rows():
  """Worst-case padding E * (block - 1) below rows / 8, except for the 16-row
  floor (at >= 32 rows per expert), where it stays below rows / 2."""
  for num_experts in (1, 2, 8, 60, 64, 128):
    for rows in (1, 7, 128, 512, 1000, 4096, 8192, 65536, 10**6):
      block = moe.block_size(rows, num_experts)
      assert 1 <= block <= 256
      padding = num_experts * (block - 1)
      if rows >= 32 * num_experts:
        assert block >= 16
        assert padding < rows / 8 or (block == 16 and padding < rows / 2)
      else:
        assert padding < rows / 8 or block == 1
  assert moe.block_size(4096, 64) == 16  # not 4096 // 513 = 7
  assert moe.block_size(4096, 8) == 63
  assert moe.block_size(512, 64) == 1


@pytest.mark.parametrize(
    "routing",
    ["uniform", "one expert", "some empty", "all dropped", "tail of one"],
)
def test_dispatch_plan_gives_every_expert_a_block_and_fixed_work(routing):
  """Whatever the routing: num_blocks blocks, E - 1 expert changes, rows in
  blocks of their own expert, no two rows in one slot, dropped rows nowhere.

  The block loop loads an expert's weights at its first block, so this is
  what keeps its work (products and weight copies) independent of the data.
  """
  num_experts, rows = 4, 37
  block = moe.block_size(rows, num_experts)
  rng = np.random.RandomState(3)
  experts = {
      "uniform": rng.randint(0, num_experts, rows),
      "one expert": np.full(rows, 2),
      "some empty": rng.choice([0, 3], rows),
      "all dropped": np.full(rows, num_experts),
      "tail of one": np.r_[np.zeros(rows - 1, int), [num_experts - 1]],
  }[routing]
  experts = np.where(rng.rand(rows) < 0.1, num_experts, experts)
  dest, block_expert, num_blocks = jax.tree.map(
      np.asarray,
      jax.jit(dispatch_lib._dispatch_plan, static_argnums=(1, 2))(  # pylint: disable=protected-access
          jnp.asarray(experts, jnp.int32), num_experts, block
      ),
  )
  assert num_blocks == moe.static_num_blocks(rows, num_experts, block)
  assert block_expert.shape == (num_blocks,)
  assert np.all(np.diff(block_expert) >= 0)
  every_expert = set(range(num_experts))
  assert set(block_expert) == every_expert  # each in one run (non-decreasing)
  kept = experts < num_experts
  assert np.all(dest[~kept] >= num_blocks * block)
  assert len(set(dest[kept])) == kept.sum()
  np.testing.assert_array_equal(
      block_expert[dest[kept] // block], experts[kept]
  )


def test_tokamax_without_the_package_gives_one_line_with_the_install(
    monkeypatch,
):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import fails
  monkeypatch.setattr(
      ragged, "_tokamax_dispatch", ragged._tokamax_dispatch.__wrapped__
  )
  x, experts, w, a, b = _inputs(3, 4)
  with pytest.raises(ImportError, match=r"raptor_jax\[gpu\]") as err:
    moe.tokamax_linear(x[0], experts[0], w, (a, b))
  assert "\n" not in str(err.value)
