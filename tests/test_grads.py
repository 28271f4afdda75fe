"""Per-record gradients, clipping, owner-slice gradients (properties)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import grads

N, D, H, CLASSES, E, T = 6, 5, 4, 3, 4, 3


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(jnp.tanh(nn.Dense(H)(x)))


# Jitted once per (loss_fn, l2_clip): eager dispatch would dominate test time.
_clipped_grad_sum = jax.jit(
    grads.clipped_grad_sum, static_argnums=0, static_argnames='l2_clip'
)
_owner_clipped_grad_sum = jax.jit(
    grads.owner_clipped_grad_sum,
    static_argnums=0,
    static_argnames=('l2_clip', 'num_experts'),
)
_per_record_grads = jax.jit(
    grads.per_record_grads, static_argnums=0, static_argnames='params_axis'
)
_clip_per_record = jax.jit(grads.clip_per_record, static_argnums=1)


@functools.cache
def _mlp_setup(seed=0):
  rng = np.random.default_rng(seed)
  batch = {
      'x': jnp.asarray(rng.normal(size=(N, D)), jnp.float32),
      'y': jnp.asarray(rng.integers(0, CLASSES, N), jnp.int32),
  }
  model = _Mlp()
  params = jax.jit(model.init)(jax.random.key(seed), batch['x'][0])['params']

  def loss_fn(p, record):
    logits = model.apply({'params': p}, record['x'])
    return -jax.nn.log_softmax(logits)[record['y']]

  return loss_fn, params, batch


def _flat(tree):
  """Concatenates the leaves of a per-record tree into [n, d] (NumPy)."""
  leaves = jax.tree.leaves(tree)
  return np.concatenate(
      [np.asarray(l, np.float64).reshape(l.shape[0], -1) for l in leaves], 1
  )


def _np_clip(rows, l2_clip, mask=None):
  """Brute force: clip every row to l2_clip; padding/non-finite rows -> 0."""
  out = np.zeros_like(rows)
  for i, g in enumerate(rows):
    norm = np.linalg.norm(g)
    if (mask is None or mask[i]) and np.isfinite(norm):
      out[i] = g * min(1.0, l2_clip / norm) if norm > 0 else g
  return out


def _record(batch, i):
  return jax.tree.map(lambda a: a[i], batch)


def test_vmap_per_record_grads_equal_a_loop_of_single_record_grads():
  loss_fn, params, batch = _mlp_setup()
  vmapped = _per_record_grads(loss_fn, params, batch)
  single_grad = jax.jit(jax.grad(loss_fn))
  for i in range(N):
    single = single_grad(params, _record(batch, i))
    jax.tree.map(
        lambda v, s: np.testing.assert_allclose(v[i], s, rtol=1e-5, atol=1e-6),
        vmapped,
        single,
    )


@pytest.mark.parametrize('l2_clip', [0.05, 0.5, 100.0])
def test_clipped_grad_sum_equals_brute_force(l2_clip):
  loss_fn, params, batch = _mlp_setup()
  mask = np.array([1, 1, 0, 1, 1, 0], np.float32)
  sums, norms = _clipped_grad_sum(
      loss_fn, params, batch, l2_clip=l2_clip, mask=mask
  )
  rows = _flat(_per_record_grads(loss_fn, params, batch))
  np.testing.assert_allclose(norms, np.linalg.norm(rows, axis=1), rtol=1e-5)
  expected = _np_clip(rows, l2_clip, mask).sum(0)
  np.testing.assert_allclose(
      _flat(jax.tree.map(lambda s: s[None], sums))[0],
      expected,
      rtol=1e-5,
      atol=1e-6,
  )
  assert all(l.dtype == jnp.float32 for l in jax.tree.leaves(sums))


def test_clip_bounds_norm_and_keeps_small_records():
  g = {
      'a': jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]),
      'b': jnp.zeros((3, 1, 2)),
  }
  clipped, norms = _clip_per_record(g, 1.0)
  np.testing.assert_allclose(norms, [5.0, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_allclose(
      clipped['a'], [[0.6, 0.8], [0.3, 0.4], [0, 0]], rtol=1e-6
  )
  assert np.all(np.isfinite(clipped['a']))


def test_padding_and_non_finite_records_contribute_exactly_zero():
  g = {
      'a': jnp.array(
          [[1.0, 2.0], [jnp.nan, 0.0], [1.0, jnp.inf], [5.0, 5.0], [2e30, 0.0]]
      ),
      'b': jnp.array([[1.0], [1.0], [1.0], [1.0], [0.0]]),
  }
  mask = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0])
  clipped, norms = _clip_per_record(g, 1.0, mask)
  for leaf in jax.tree.leaves(clipped):
    np.testing.assert_array_equal(leaf[1:], 0.0)
    assert leaf.dtype == jnp.float32
  assert not np.any(np.isfinite(norms[1:3]))
  np.testing.assert_allclose(np.linalg.norm(_flat(clipped)[0]), 1.0, rtol=1e-6)


def test_mask_value_never_scales_a_record():
  g = {'a': jnp.array([[3.0, 4.0], [3.0, 4.0]])}
  clipped, _ = _clip_per_record(g, 1.0, jnp.array([1.0, 7.0]))
  np.testing.assert_array_equal(clipped['a'][0], clipped['a'][1])


def test_bfloat16_gradients_are_clipped_and_summed_in_float32():
  g = {'a': jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)}
  clipped, norms = _clip_per_record(g, 2.0)
  assert clipped['a'].dtype == jnp.float32 and norms.dtype == jnp.float32


def test_nan_input_record_does_not_reach_the_sum():
  loss_fn, params, batch = _mlp_setup()
  bad = {'x': batch['x'].at[2, 0].set(jnp.nan), 'y': batch['y']}
  sums, _ = _clipped_grad_sum(loss_fn, params, bad, l2_clip=0.5)
  mask = np.ones(N, np.float32)
  mask[2] = 0
  ref, _ = _clipped_grad_sum(loss_fn, params, batch, l2_clip=0.5, mask=mask)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      sums,
      ref,
  )


def test_residual_weight_multiplies_the_loss_before_clipping():
  loss_fn, params, batch = _mlp_setup()
  weights = jnp.array([0.0, 0.2, 0.5, 1.0, 3.0, 1e4])
  l2_clip = 0.3
  sums, _ = _clipped_grad_sum(
      loss_fn, params, batch, l2_clip=l2_clip, weights=weights
  )
  rows = _flat(_per_record_grads(loss_fn, params, batch))
  expected = _np_clip(rows * np.asarray(weights)[:, None], l2_clip).sum(0)
  np.testing.assert_allclose(
      _flat(jax.tree.map(lambda s: s[None], sums))[0],
      expected,
      rtol=1e-5,
      atol=1e-6,
  )


@pytest.mark.parametrize('l2_clip', [0.0, -1.0, float('inf'), jnp.float32(1)])
def test_invalid_l2_clip_raises(l2_clip):
  with pytest.raises(ValueError, match='l2_clip'):
    grads.clip_per_record({'a': jnp.ones((2, 2))}, l2_clip)


def _with_owner_slice(stacked, owner, owner_slice):
  """Stacked experts whose gradient flows into row `owner` only (a reference)."""
  return jax.tree.map(
      lambda p, s: jax.lax.stop_gradient(p).at[owner].set(s.astype(p.dtype)),
      stacked,
      owner_slice,
  )


# A dense mixture of E experts: every expert runs on every token, so the full
# gradient reaches every expert and the owner-slice restriction is visible.
@functools.cache
def _moe_setup(seed=1):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  stacked = {'w_in': normal(E, D, H), 'w_out': normal(E, H) * 0.5}
  router = normal(D, E)
  batch = {
      'x': normal(N, T, D),
      'y': normal(N),
      'owner': jnp.array([2, 0, 2, 3, 0, 2], jnp.int32),
  }

  def model_loss(experts, record):
    gates = jax.nn.softmax(record['x'] @ router)  # [T, E]
    hidden = jnp.tanh(jnp.einsum('td,edh->teh', record['x'], experts['w_in']))
    out = jnp.einsum('teh,eh,te->t', hidden, experts['w_out'], gates)
    return (out.sum() - record['y']) ** 2

  def slice_loss(owner_slice, record):
    return model_loss(
        _with_owner_slice(stacked, record['owner'], owner_slice), record
    )

  return stacked, batch, model_loss, slice_loss


def test_with_owner_slice_leaves_the_forward_pass_unchanged():
  stacked, batch, model_loss, _ = _moe_setup()
  rebuilt_loss = jax.jit(
      lambda s, rec: model_loss(
          _with_owner_slice(
              s, rec['owner'], grads.owner_slices(s, rec['owner'])
          ),
          rec,
      )
  )
  model_loss = jax.jit(model_loss)
  for i in range(N):
    rec = _record(batch, i)
    assert rebuilt_loss(stacked, rec) == model_loss(stacked, rec)


def test_owner_slice_gradient_is_the_full_gradient_restricted_to_the_owner():
  stacked, batch, model_loss, slice_loss = _moe_setup()
  full_grad = jax.jit(jax.grad(model_loss))
  slice_grad = jax.jit(jax.grad(slice_loss))
  # Gradient w.r.t. the stacked tensor when only the owner slice is live.
  through_grad = jax.jit(
      jax.grad(
          lambda s, rec: model_loss(
              _with_owner_slice(
                  s, rec['owner'], grads.owner_slices(s, rec['owner'])
              ),
              rec,
          )
      )
  )
  for i in range(N):
    rec = _record(batch, i)
    owner = int(rec['owner'])
    full = full_grad(stacked, rec)
    sliced = slice_grad(grads.owner_slices(stacked, owner), rec)
    through = through_grad(stacked, rec)
    others = np.arange(E) != owner
    for name in stacked:
      assert np.all(np.abs(full[name][others]) > 0)  # test is not vacuous
      np.testing.assert_allclose(
          sliced[name], full[name][owner], rtol=1e-5, atol=1e-6
      )
      np.testing.assert_allclose(
          through[name][owner], full[name][owner], rtol=1e-5, atol=1e-6
      )
      np.testing.assert_array_equal(through[name][others], 0.0)


def test_vmapped_owner_slice_grads_equal_the_loop():
  stacked, batch, model_loss, slice_loss = _moe_setup()
  slices = grads.owner_slices(stacked, batch['owner'])
  vmapped = _per_record_grads(slice_loss, slices, batch, params_axis=0)
  full_grad = jax.jit(jax.grad(model_loss))
  for i in range(N):
    rec = _record(batch, i)
    full = full_grad(stacked, rec)
    for name in stacked:
      np.testing.assert_allclose(
          vmapped[name][i], full[name][int(rec['owner'])], rtol=1e-5, atol=1e-6
      )


def test_owner_clipped_grad_sum_equals_brute_force():
  stacked, batch, model_loss, slice_loss = _moe_setup()
  mask = np.array([1, 0, 1, 1, 0, 1], np.float32)  # expert 0: padding only
  weights = jnp.linspace(0.1, 1.0, N)
  l2_clip = 0.7
  sums, _ = _owner_clipped_grad_sum(
      slice_loss,
      grads.owner_slices(stacked, batch['owner']),
      batch,
      owners=batch['owner'],
      num_experts=E,
      l2_clip=l2_clip,
      mask=mask,
      weights=weights,
  )
  full_grad = jax.jit(jax.grad(model_loss))
  rows = (
      np.stack(
          [
              _flat(
                  jax.tree.map(
                      lambda g, o=int(batch['owner'][i]): g[o][None],
                      full_grad(stacked, _record(batch, i)),
                  )
              )[0]
              for i in range(N)
          ]
      )
      * np.asarray(weights)[:, None]
  )
  clipped = _np_clip(rows, l2_clip, mask)
  expected = np.stack(
      [clipped[np.asarray(batch['owner']) == e].sum(0) for e in range(E)]
  )
  got = np.concatenate(
      [np.asarray(sums[k]).reshape(E, -1) for k in sorted(stacked)], 1
  )
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  for name in stacked:  # experts 0 (padding only) and 1 (no record)
    np.testing.assert_array_equal(sums[name][:2], 0.0)


def test_sum_by_owner_drops_out_of_range_owners():
  g = {'a': jnp.ones((4, 2))}
  out = grads.sum_by_owner(g, jnp.array([0, 1, 3, -1]), 3)
  np.testing.assert_array_equal(out['a'], [[1, 1], [1, 1], [0, 0]])


def test_zeros_like_f32():
  z = grads.zeros_like_f32({'a': jnp.ones((2, 3), jnp.bfloat16)})
  assert z['a'].dtype == jnp.float32 and z['a'].shape == (2, 3)
  assert not np.any(z['a'])


def test_clip_and_sum_per_part_joint_and_by_owner_equal_brute_force():
  """Per-part clips, one joint clip, owner rows and the norms, by NumPy loops."""
  rng = np.random.default_rng(3)
  per_record = {
      'dense': {'w': jnp.asarray(rng.normal(size=(N, 3, 2)), jnp.float32)},
      'expert': {'w': jnp.asarray(rng.normal(size=(N, 4)), jnp.float32)},
  }
  mask = np.array([1, 1, 0, 1, 1, 1], np.float32)
  owners = jnp.array([0, 2, 1, 2, 0, 5])  # 5 is out of range: dropped
  clips = {'dense': 0.5, 'expert': 2.0}
  rows = {k: _flat(v) for k, v in per_record.items()}

  sums, norms = grads.clip_and_sum(
      per_record,
      clips,
      mask=mask,
      owners=owners,
      num_experts=3,
      owner_parts={'expert'},
      return_norms=True,
  )
  dense = _np_clip(rows['dense'], 0.5, mask)
  np.testing.assert_allclose(
      np.asarray(sums['dense']['w']).ravel(), dense.sum(0), rtol=1e-5
  )
  expert = _np_clip(rows['expert'], 2.0, mask)
  expected = [expert[np.asarray(owners) == e].sum(0) for e in range(3)]
  np.testing.assert_allclose(sums['expert']['w'], expected, rtol=1e-5)
  for k in clips:
    np.testing.assert_allclose(
        norms[k], np.linalg.norm(rows[k], axis=1), rtol=1e-5
    )

  joint = grads.clip_and_sum(per_record, 1.0, mask=mask)  # no norms by default
  both = _np_clip(np.concatenate([rows['dense'], rows['expert']], 1), 1.0, mask)
  got = np.concatenate(
      [np.asarray(joint[k]['w']).ravel() for k in ('dense', 'expert')]
  )
  np.testing.assert_allclose(got, both.sum(0), rtol=1e-5, atol=1e-7)

  kept = grads.clip_and_sum(per_record, clips, mask=mask, keep_batch_dim=True)
  np.testing.assert_allclose(_flat(kept['dense']), dense, rtol=1e-5)
  with pytest.raises(ValueError, match='one clip per part'):
    grads.clip_and_sum(per_record, {'dense': 1.0})


def test_residual_weights_are_one_minus_the_true_label_probability():
  logits = jnp.array([[2.0, 0.0], [0.0, 0.0], [-1.0, 3.0]])
  labels = jnp.array([0, 1, 0])
  p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(
      1, keepdims=True
  )
  want = (1.0 - p[np.arange(3), np.asarray(labels)]) ** 2.0
  got = grads.residual_weights(logits, labels, 2.0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert (
      float(
          jnp.sum(
              jax.grad(
                  lambda z: jnp.sum(grads.residual_weights(z, labels, 2.0))
              )(logits)
              ** 2
          )
      )
      == 0.0
  )
