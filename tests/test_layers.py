"""The shared layers' hand-written backward passes against plain autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax.models import attention, lora, low_rank

from helpers import attention_inputs


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _reference_attention(q, k, v, *biases):
  """The einsum + jax.nn.softmax formulation the families used before."""
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) + sum(biases)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def test_attend_matches_autodiff_of_the_plain_formula():
  q, k, v, position, padding, _ = attention_inputs()
  probe = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda f: lambda q, k, v: jnp.sum(
      probe * f(q, k, v, position, padding)
  )
  np.testing.assert_allclose(
      attention.attend(q, k, v, position, padding),
      _reference_attention(q, k, v, position, padding),
      rtol=1e-5,
      atol=1e-6,
  )
  ours = jax.grad(loss(attention.attend), argnums=(0, 1, 2))(q, k, v)
  theirs = jax.grad(loss(_reference_attention), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", ours, theirs):
    assert _rel(a, b) < 1e-5, name


def test_attend_per_record_gradients_under_vmap_match_a_loop():
  q, k, v, position, padding, _ = attention_inputs()

  def loss(q, k, v, padding):
    return jnp.sum(jnp.sin(attention.attend(q, k, v, position, padding)))

  per_record = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(
      q[:, None], k[:, None], v[:, None], padding[:, None]
  )
  for i in range(q.shape[0]):
    one = jax.grad(loss, argnums=(0, 1, 2))(
        q[i : i + 1], k[i : i + 1], v[i : i + 1], padding[i : i + 1]
    )
    for a, b in zip(per_record, one):
      np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)


def test_attend_under_vmap_of_the_mask_alone_matches_a_loop():
  q, k, v, position, padding, _ = attention_inputs()
  masks = jnp.stack([padding, jnp.zeros_like(padding)])  # [2, B, 1, 1, S]
  loss = lambda q, mask: jnp.sum(
      jnp.sin(attention.attend(q, k, v, position, mask))
  )
  values = jax.vmap(lambda mask: attention.attend(q, k, v, position, mask))(
      masks
  )
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(q, masks)
  for i in range(2):
    np.testing.assert_allclose(
        values[i],
        _reference_attention(q, k, v, position, masks[i]),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        grads[i], jax.grad(loss)(q, masks[i]), rtol=1e-5, atol=1e-6
    )


def test_attend_keeps_bfloat16_values_and_float32_softmax():
  q, k, v, position, padding, _ = attention_inputs()
  out = attention.attend(
      *(t.astype(jnp.bfloat16) for t in (q, k, v)), position, padding
  )
  assert out.dtype == jnp.bfloat16
  assert (
      _rel(
          out.astype(jnp.float32),
          _reference_attention(q, k, v, position, padding),
      )
      < 2e-2
  )


def _split_form(x, kernel, a, b, scale):
  return x @ kernel + scale * ((x @ a) @ b)


@pytest.mark.parametrize("leading", [(6,), (2, 3)])
def test_low_rank_linear_matches_the_split_form_and_its_gradients(leading):
  keys = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(keys[0], leading + (8,))
  kernel = jax.random.normal(keys[1], (8, 5)) / 3
  a = jax.random.normal(keys[2], (8, 3)) / 3
  b = jax.random.normal(keys[3], (3, 5)) / 3
  probe = jax.random.normal(keys[4], leading + (5,))
  loss = lambda f: lambda *args: jnp.sum(probe * jnp.tanh(f(*args, 2.0)))
  np.testing.assert_allclose(
      lora.low_rank_linear_fast(x, kernel, a, b, 2.0),
      _split_form(x, kernel, a, b, 2.0),
      rtol=1e-5,
      atol=1e-6,
  )
  args = (x, kernel, a, b)
  ours = jax.grad(loss(lora.low_rank_linear_fast), argnums=(0, 1, 2, 3))(*args)
  theirs = jax.grad(loss(_split_form), argnums=(0, 1, 2, 3))(*args)
  for name, g, h in zip(("x", "kernel", "a", "b"), ours, theirs):
    assert g.shape == h.shape, name
    assert _rel(g, h) < 1e-5, name


def test_rows_contraction_is_the_transposed_product():
  keys = jax.random.split(jax.random.key(8), 2)
  small = jax.random.normal(keys[0], (40, 3))
  big = jax.random.normal(keys[1], (40, 7))
  np.testing.assert_allclose(
      jax.jit(low_rank.rows_contraction)(small, big),
      np.asarray(small).T @ np.asarray(big),
      rtol=1e-5,
      atol=1e-5,
  )


def test_low_rank_update_per_record_gradients_match_autodiff():
  """Under vmap (per-record gradients): the factors' gradients equal autodiff
  of the plain formula record by record, and x gets none."""
  keys = jax.random.split(jax.random.key(9), 4)
  x = jax.random.normal(keys[0], (5, 6, 8))  # 5 records of 6 rows
  a = jax.random.normal(keys[1], (8, 3)) / 3
  b = jax.random.normal(keys[2], (3, 4)) / 3
  probe = jax.random.normal(keys[3], (5, 6, 4))

  def loss(f):
    return lambda x, a, b, p: jnp.sum(p * jnp.tanh(f(x, a, b)))

  ours = jax.vmap(
      jax.grad(
          loss(lambda x, a, b: low_rank.low_rank_update(x, a, b, 2.0)),
          (0, 1, 2),
      ),
      in_axes=(0, None, None, 0),
  )(x, a, b, probe)
  plain = lambda x, a, b: 2.0 * ((jax.lax.stop_gradient(x) @ a) @ b)
  theirs = jax.vmap(
      jax.grad(loss(plain), (0, 1, 2)), in_axes=(0, None, None, 0)
  )(x, a, b, probe)
  assert ours[1].shape == (5, 8, 3) and ours[2].shape == (5, 3, 4)
  np.testing.assert_array_equal(ours[0], 0.0)
  for g, h in zip(ours[1:], theirs[1:]):
    assert _rel(g, h) < 1e-5


def test_lora_dense_is_the_split_form_in_float32_and_bfloat16():
  x = jax.random.normal(jax.random.key(2), (4, 8))
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
    layer = lora.LoRADense(5, rank=2, alpha=4.0, dtype=dtype)
    params = layer.init(jax.random.key(3), x)["params"]
    params = dict(params, lora_b=jax.random.normal(jax.random.key(4), (2, 5)))
    out = layer.apply({"params": params}, x)
    assert out.dtype == dtype
    expected = _split_form(
        x, params["kernel"], params["lora_a"], params["lora_b"], 2.0
    )
    assert _rel(out.astype(jnp.float32), expected) < tol, dtype


def test_low_rank_linear_forward_is_the_split_form_bit_for_bit():
  """No merged kernel in the forward, with or without a gradient taken.

  A forward through kernel + scale a b rounds the effective weights once for
  every record: a shared perturbation that moved the mean gradient of the
  fixed-shape Switch benchmark (launch/bench/vs_opacus.py) 25x further from float64 PyTorch (see the docstring).
  """
  keys = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(keys[0], (64, 32))
  kernel = jax.random.normal(keys[1], (32, 48)) / 6
  a = jax.random.normal(keys[2], (32, 4)) / 6
  b = jax.random.normal(keys[3], (4, 48)) / 6
  want = jax.jit(_split_form, static_argnums=4)(x, kernel, a, b, 2.0)
  got = jax.jit(lora.low_rank_linear_fast, static_argnums=4)(
      x, kernel, a, b, 2.0
  )
  np.testing.assert_array_equal(got, want)
  primal, _ = jax.jit(
      lambda *args: jax.vjp(
          lambda *p: lora.low_rank_linear_fast(*p, 2.0), *args
      )
  )(x, kernel, a, b)
  np.testing.assert_array_equal(primal, want)
