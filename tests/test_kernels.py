"""Each fast kernel against its plain twin: values, gradients, per record.

`kernels='fast'` (custom VJPs, `custom_vmap` record folding, layout
barriers) must compute the same function and gradients as
`kernels='reference'` (plain `jnp` differentiated by autodiff, batched by
JAX's own vmap rules), for every input that can be differentiated,
including trainable attention biases. The reference is in turn pinned
against PyTorch's gradients in `test_grad_parity.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax.models import attention, kernels, lora, low_rank, moe

from helpers import attention_inputs, expert_inputs, fast_jit


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _assert_trees_close(got, want, tol=1e-5):
  for (path, g), h in zip(
      jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
  ):
    assert g.shape == h.shape, path
    assert _rel(g, h) < tol, (jax.tree_util.keystr(path), _rel(g, h))


def test_auto_is_fast_on_cpu_only_and_bad_values_get_one_line():
  assert kernels.resolve("auto", "cpu") == "fast"
  assert kernels.resolve("auto", "gpu") == "reference"
  assert kernels.resolve("auto", "tpu") == "reference"
  assert kernels.resolve("reference", "cpu") == "reference"
  assert kernels.resolve("fast", "gpu") == "fast"
  # The expert dispatch's twin is dense (E x the FLOPs): 'auto' keeps it fast.
  assert kernels.resolve_expert("auto") == "fast"
  assert kernels.resolve_expert("reference") == "reference"
  with pytest.raises(ValueError, match="kernels") as err:
    kernels.resolve("fastest")
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["fast", "reference"])
def test_attention_bias_gradient_is_the_score_gradient_summed(kind):
  """A position bias shared by the batch gets d(loss)/d(scores) summed over
  the batch, checked against autodiff of an explicitly broadcast bias."""
  q, k, v, position, padding, probe = attention_inputs()

  def loss(position):
    out = attention.attend(q, k, v, position, padding, kernels=kind)
    return jnp.sum(probe * out)

  def broadcast_loss(full):  # the bias as its own [B, H, Q, K] array
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) + full + padding
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, -1), v)
    return jnp.sum(probe * out)

  got = jax.grad(loss)(position)
  full = jnp.broadcast_to(position, (q.shape[0],) + position.shape[1:])
  want = jnp.sum(jax.grad(broadcast_loss)(full), axis=0, keepdims=True)
  assert float(jnp.linalg.norm(want)) > 0.1
  assert _rel(got, want) < 1e-5


def test_fast_attention_matches_reference_in_every_input():
  q, k, v, position, padding, probe = attention_inputs()

  def loss(kind):
    return lambda *args: jnp.sum(probe * attention.attend(*args, kernels=kind))

  args = (q, k, v, position, padding)
  np.testing.assert_allclose(
      attention.attend(*args, kernels="fast"),
      attention.attend(*args, kernels="reference"),
      rtol=1e-5,
      atol=1e-6,
  )
  fast = jax.grad(loss("fast"), argnums=(0, 1, 2, 3))(*args)
  reference = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(*args)
  _assert_trees_close(fast, reference)


def test_fast_attention_per_record_bias_gradients_under_vmap():
  """Records folded into one batch by `custom_vmap` still get their own
  gradient of the shared position bias (and of q), equal to the reference
  and to a loop over single records; padded records included."""
  q, k, v, position, padding, _ = attention_inputs()

  def per_record(kind):
    def loss(q, k, v, pad, position):
      out = attention.attend(
          q[None], k[None], v[None], position, pad[None], kernels=kind
      )
      return jnp.sum(jnp.sin(out))

    grad = jax.grad(loss, argnums=(0, 4))
    return fast_jit(jax.vmap(grad, in_axes=(0, 0, 0, 0, None)))(
        q, k, v, padding, position
    )

  fast, reference = per_record("fast"), per_record("reference")
  assert fast[1].shape == (3,) + position.shape
  _assert_trees_close(fast, reference)
  for i in range(q.shape[0]):
    one = jax.grad(
        lambda p: jnp.sum(
            jnp.sin(
                attention.attend_reference(
                    q[i : i + 1],
                    k[i : i + 1],
                    v[i : i + 1],
                    p,
                    padding[i : i + 1],
                )
            )
        )
    )(position)
    assert _rel(fast[1][i], one) < 1e-5


def _count_reductions(fn, *args):
  hlo = fast_jit(fn).lower(*args).compile().as_text()
  return hlo.count(" reduce(")


def test_a_constant_bias_costs_no_reduction():
  """The bias gradient is only computed where it is used: with the padding
  bias a constant, the compiled q/k/v gradient has exactly the reductions
  of the same gradient without any bias."""
  q, k, v, _, padding, probe = attention_inputs()

  def grads(*biases):
    return lambda q, k, v: jax.grad(
        lambda q, k, v: jnp.sum(
            probe * attention.attend_fast(q, k, v, *biases)
        ),
        argnums=(0, 1, 2),
    )(q, k, v)

  without = _count_reductions(grads(), q, k, v)
  with_padding = _count_reductions(grads(padding), q, k, v)
  assert with_padding == without
  # ...and the count does see the reduction when the bias gradient is used.
  bias_grad = lambda q, k, v: jax.grad(
      lambda b: jnp.sum(probe * attention.attend_fast(q, k, v, b))
  )(padding)
  assert _count_reductions(bias_grad, q, k, v) > without


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lora_dense_fast_and_reference_agree(dtype):
  x = jax.random.normal(jax.random.key(2), (2, 4, 8))
  layers = {
      kind: lora.LoRADense(5, rank=2, alpha=4.0, dtype=dtype, kernels=kind)
      for kind in ("fast", "reference")
  }
  params = layers["fast"].init(jax.random.key(3), x)["params"]
  params = dict(params, lora_b=jax.random.normal(jax.random.key(4), (2, 5)))

  def loss(kind):
    return lambda params, x: jnp.sum(
        jnp.tanh(layers[kind].apply({"params": params}, x).astype(jnp.float32))
    )

  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  grads = {
      kind: jax.grad(loss(kind), argnums=(0, 1))(params, x) for kind in layers
  }
  _assert_trees_close(grads["fast"], grads["reference"], tol)


def test_low_rank_update_fast_and_reference_agree_per_record():
  keys = jax.random.split(jax.random.key(9), 4)
  x = jax.random.normal(keys[0], (5, 6, 8))
  a = jax.random.normal(keys[1], (8, 3)) / 3
  b = jax.random.normal(keys[2], (3, 4)) / 3
  probe = jax.random.normal(keys[3], (5, 6, 4))

  def per_record(kind):
    loss = lambda x, a, b, p: jnp.sum(
        p * jnp.tanh(low_rank.low_rank_update(x, a, b, 2.0, kind))
    )
    return jax.vmap(jax.grad(loss, (0, 1, 2)), in_axes=(0, None, None, 0))(
        x, a, b, probe
    )

  fast, reference = per_record("fast"), per_record("reference")
  for grads in (fast, reference):
    np.testing.assert_array_equal(grads[0], 0.0)  # x is a constant
  _assert_trees_close(fast[1:], reference[1:])


def _expert_inputs(num_experts=4, rows=40, records=3, seed=0):
  rng = np.random.RandomState(seed)
  x, experts, w, a, b = expert_inputs(rng, num_experts, rows, records)
  experts = experts.at[2, 20:].set(num_experts)  # a padded tail of dropped rows
  probe = jnp.asarray(rng.normal(size=(records, rows, 7)), jnp.float32)
  return x, experts, w, a, b, probe


@pytest.mark.parametrize(
    "linear", [moe.grouped_linear, moe.batched_linear, moe.ragged_linear]
)
def test_frozen_expert_dispatch_with_lora_per_record(linear):
  """Per-record gradients of the input and of every expert's LoRA factors:
  the sorted dispatch ('fast') against its definition ('reference', every
  expert on every row), dropped rows included."""
  x, experts, w, a, b, probe = _expert_inputs()

  def per_record(kind):
    def loss(x, experts, a, b, p):
      return jnp.sum(p * jnp.tanh(linear(x, experts, w, (a, b), kind)))

    grad = jax.grad(loss, argnums=(0, 2, 3))
    return fast_jit(jax.vmap(grad, in_axes=(0, 0, None, None, 0)))(
        x, experts, a, b, probe
    )

  fast, reference = per_record("fast"), per_record("reference")
  assert fast[1].shape == (3,) + a.shape
  _assert_trees_close(fast, reference)


@pytest.mark.parametrize(
    "linear",
    [
        moe.grouped_linear_trainable,
        moe.batched_linear_trainable,
        moe.ragged_linear_trainable,
    ],
)
def test_trainable_expert_dispatch_batch_gradients(linear):
  """Pretraining's dispatch: the stacked kernels' and the input's gradient."""
  x, experts, w, _, _, probe = _expert_inputs()
  rows, flat, p = x.reshape(-1, 5), experts.reshape(-1), probe.reshape(-1, 7)

  def grads(kind):
    loss = lambda x, w: jnp.sum(p * jnp.tanh(linear(x, flat, w, kind)))
    return fast_jit(jax.grad(loss, argnums=(0, 1)))(rows, w)

  _assert_trees_close(grads("fast"), grads("reference"))
