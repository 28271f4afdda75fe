"""DP aggregation transforms: brute-force parity, neighbouring datasets, noise.

Property tests in the style of jax_privacy: build neighbouring datasets and
check the sensitivity bound the docstrings state; check the noise's
distribution with a Kolmogorov-Smirnov test that also rejects a wrong scale.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from raptor_jax import grads, sampling, transforms

N, E = 8, 4
L2_CLIP = 0.8
DENOMINATOR = 3.0
SHAPES = {'w': (3, 2), 'b': (2,)}


def _per_record(seed=0, n=N):
  """Per-record gradients with norms on both sides of L2_CLIP."""
  rng = np.random.default_rng(seed)
  scale = rng.uniform(0.05, 3.0, size=n) * L2_CLIP / 3.0
  return {
      k: (
          rng.normal(size=(n,) + s) * scale.reshape((n,) + (1,) * len(s))
      ).astype(np.float32)
      for k, s in SHAPES.items()
  }


def _owners(seed=0, n=N):
  # Expert E - 1 never owns a record: its output must be noise only.
  return (
      np.random.default_rng(seed + 100).integers(0, E - 1, n).astype(np.int32)
  )


def _np_aggregate(per_record, mask, owners=None):
  """Brute force: clip each record, (segment-)sum, divide; no noise."""
  keys = sorted(per_record)
  n = per_record[keys[0]].shape[0]
  out_rows = 1 if owners is None else E
  out = {k: np.zeros((out_rows,) + per_record[k].shape[1:]) for k in keys}
  for i in range(n):
    g = {k: per_record[k][i].astype(np.float64) for k in keys}
    norm = np.sqrt(sum(np.sum(v**2) for v in g.values()))
    if mask[i] == 0 or not np.isfinite(norm):
      continue
    row = 0 if owners is None else owners[i]
    for k in keys:
      out[k][row] += g[k] * min(1.0, L2_CLIP / norm)
  return {
      k: (v[0] if owners is None else v) / DENOMINATOR for k, v in out.items()
  }


def _dp(sigma, key=0):
  return transforms.dp_aggregate(L2_CLIP, sigma, DENOMINATOR, key)


def _owner_dp(sigma, key=0):
  return transforms.owner_dp_aggregate(L2_CLIP, sigma, E, DENOMINATOR, key)


@functools.cache
def _update(kind, sigma):
  """The transform's update, jitted once per (kind, sigma) and input shape.

  The key lives in the state (``init``), so one compiled update serves
  every key: pass the state of a transform built with the key you want.
  """
  return jax.jit((_dp if kind == 'dp' else _owner_dp)(sigma).update)


def _init(kind, sigma, key=0):
  return (_dp if kind == 'dp' else _owner_dp)(sigma, key).init(None)


def _apply(kind, sigma, per_record, mask, owners, key=0):
  extra = {'owners': owners} if kind == 'owner' else {}
  out, _ = _update(kind, sigma)(
      per_record, _init(kind, sigma, key), mask=mask, **extra
  )
  return jax.tree.map(np.asarray, out)


def _l2(a, b):
  return np.sqrt(sum(np.sum((np.float64(a[k]) - b[k]) ** 2) for k in a))


@pytest.mark.parametrize('kind', ['dp', 'owner'])
@pytest.mark.parametrize('seed', [0, 1])
def test_noiseless_output_equals_brute_force(kind, seed):
  per_record, owners = _per_record(seed), _owners(seed)
  per_record['w'][2, 0, 0] = np.nan  # non-finite record: contributes zero
  mask = np.ones(N, np.float32)
  mask[5] = 0.0
  got = _apply(kind, 0.0, per_record, mask, owners)
  want = _np_aggregate(per_record, mask, owners if kind == 'owner' else None)
  for k in SHAPES:
    assert got[k].dtype == np.float32
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)


def _neighbour(per_record, mask, owners, change, seed):
  """A dataset that differs from (per_record, mask, owners) in one record.

  Returns the neighbour and the owner of the changed record.
  """
  rng = np.random.default_rng(seed + 7)
  i = int(rng.integers(0, N))
  per_record = {k: v.copy() for k, v in per_record.items()}
  mask, owners = mask.copy(), owners.copy()
  if change == 'add':
    new = {
        k: rng.normal(size=(1,) + s).astype(np.float32) * 10
        for k, s in SHAPES.items()
    }
    owner = int(rng.integers(0, E))
    per_record = {k: np.concatenate([v, new[k]]) for k, v in per_record.items()}
    return per_record, np.append(mask, 1.0), np.append(owners, owner), owner
  if change == 'remove':
    keep = np.arange(N) != i
    return (
        {k: v[keep] for k, v in per_record.items()},
        mask[keep],
        owners[keep],
        owners[i],
    )
  if change == 'pad':
    mask[i] = 0.0
  elif change in ('nan', 'inf'):
    per_record['b'][i, 0] = np.nan if change == 'nan' else np.inf
  return per_record, mask, owners, owners[i]


@pytest.mark.parametrize('change', ['add', 'remove', 'pad', 'nan', 'inf'])
@pytest.mark.parametrize('kind', ['dp', 'owner'])
def test_neighbouring_datasets_change_output_by_at_most_clip_over_denominator(
    kind, change
):
  """Sensitivity l2_clip/denominator; owner transform: owner slice only."""
  for seed in range(3):
    per_record, owners = _per_record(seed), _owners(seed)
    mask = np.ones(N, np.float32)
    base = _apply(kind, 0.0, per_record, mask, owners)
    nb_grads, nb_mask, nb_owners, owner = _neighbour(
        per_record, mask, owners, change, seed
    )
    other = _apply(kind, 0.0, nb_grads, nb_mask, nb_owners)
    assert 0 < _l2(base, other) <= L2_CLIP / DENOMINATOR * (1 + 1e-5)
    if kind == 'owner':
      untouched = np.arange(E) != owner
      for k in SHAPES:
        np.testing.assert_array_equal(base[k][untouched], other[k][untouched])


@pytest.mark.parametrize('kind', ['dp', 'owner'])
def test_noise_depends_on_neither_the_data_nor_the_realised_size(kind):
  """Same state, neighbouring datasets (one more record): the same noise."""
  per_record, owners = _per_record(5), _owners(5)
  mask = np.ones(N, np.float32)
  nb_grads, nb_mask, nb_owners, _ = _neighbour(
      per_record, mask, owners, 'add', 5
  )
  noise = [
      {k: _apply(kind, 1.0, *d)[k] - _apply(kind, 0.0, *d)[k] for k in SHAPES}
      for d in ((per_record, mask, owners), (nb_grads, nb_mask, nb_owners))
  ]
  for k in SHAPES:
    assert np.all(noise[0][k] != 0)
    np.testing.assert_allclose(noise[0][k], noise[1][k], atol=1e-6)


def _big(kind, sigma, *, real, key=0, steps=1):
  """Outputs of `steps` steps on 4 bfloat16 records of 1230 numbers each.

  `real=False` masks every record as padding (pure noise); `real=True` gives
  them owners 0, 1, 2, 0, so expert 3 has no record. bfloat16 per-record
  gradients are what bfloat16 parameters give; the noise must be float32.
  """
  n = 4
  rng = np.random.default_rng(0)
  per_record = {
      'w': rng.normal(size=(n, 40, 30)).astype(jnp.bfloat16),
      'b': rng.normal(size=(n, 30)).astype(jnp.bfloat16),
  }
  extra = (
      {'owners': np.array([0, 1, 2, 0], np.int32)} if kind == 'owner' else {}
  )
  mask = np.full(n, float(real), np.float32)
  state, outs = _init(kind, sigma, key), []
  for _ in range(steps):
    out, state = _update(kind, sigma)(per_record, state, mask=mask, **extra)
    outs.append(jax.tree.map(np.asarray, out))
  return outs


def _assert_std(samples, std):
  samples = np.ravel(samples).astype(np.float64)
  assert stats.kstest(samples / std, 'norm').pvalue > 1e-3
  assert stats.kstest(samples / (0.5 * std), 'norm').pvalue < 1e-6
  assert stats.kstest(samples / (2.0 * std), 'norm').pvalue < 1e-6


@pytest.mark.parametrize('kind', ['dp', 'owner'])
def test_noise_std_is_sigma_clip_over_denominator_in_float32(kind):
  sigma = 1.0
  (out,) = _big(kind, sigma, real=False)
  assert out['w'].dtype == out['b'].dtype == np.float32
  rounded = np.asarray(jnp.asarray(out['w']).astype(jnp.bfloat16), np.float32)
  assert np.mean(rounded != out['w']) > 0.9  # not bfloat16-quantised noise
  std = sigma * L2_CLIP / DENOMINATOR
  for expert_noise in ([out['w']] if kind == 'dp' else out['w']):
    _assert_std(expert_noise, std)


def test_owner_noise_for_experts_with_and_without_records():
  """Every expert gets noise of the same std; expert 3 has no record."""
  sigma = 1.0
  (noisy,) = _big('owner', sigma, real=True)
  (clean,) = _big('owner', 0.0, real=True)
  np.testing.assert_array_equal(clean['w'][3], 0.0)
  assert np.all(np.abs(clean['w'][:3]).sum((1, 2)) > 0)
  for expert_noise in noisy['w'] - clean['w']:
    _assert_std(expert_noise, sigma * L2_CLIP / DENOMINATOR)


def test_noise_is_independent_across_experts_leaves_and_steps():
  out = _big('owner', 1.0, real=False, steps=2)
  first, second = out[0]['w'].reshape(E, -1), out[1]['w'].reshape(E, -1)
  corr = np.corrcoef(np.concatenate([first, second]))
  off_diagonal = corr[~np.eye(2 * E, dtype=bool)]
  assert np.max(np.abs(off_diagonal)) < 0.12  # 1200 samples each: 4 s.d.
  assert not np.allclose(out[0]['b'][0], out[0]['w'][0, 0])


def test_noise_is_a_function_of_key_and_step_count():
  """A run resumed from a saved state adds the same noise; keys differ."""
  a = _big('dp', 1.0, real=False, key=5, steps=2)
  b = _big('dp', 1.0, real=False, key=5, steps=2)
  c = _big('dp', 1.0, real=False, key=6, steps=1)
  np.testing.assert_array_equal(a[1]['w'], b[1]['w'])
  assert not np.allclose(a[0]['w'], a[1]['w'])
  assert not np.allclose(a[0]['w'], c[0]['w'])


@pytest.mark.parametrize('kind', ['dp', 'owner'])
def test_one_call_transforms_equal_grads_sums_then_privatize_sums(kind):
  """dp_aggregate/owner_dp_aggregate and the microbatched path share noise."""
  per_record, owners = _per_record(4), _owners(4)
  mask = np.ones(N, np.float32)
  key = jax.random.key(11)
  one_call = _apply(kind, 1.0, per_record, mask, owners, key)
  privatizer = transforms.privatize_sums(L2_CLIP, 1.0, DENOMINATOR, key)

  @jax.jit
  def split_path(per_record, owners, state):
    clipped, _ = grads.clip_per_record(per_record, L2_CLIP, mask)
    if kind == 'dp':
      sums = jax.tree.map(lambda g: g.sum(0), clipped)
    else:
      sums = grads.sum_by_owner(clipped, owners, E)
    return privatizer.update(sums, state)[0]

  split = split_path(per_record, owners, privatizer.init(None))
  for k in SHAPES:
    np.testing.assert_allclose(one_call[k], split[k], rtol=1e-6, atol=1e-7)


def test_chains_with_adam_under_jit():
  stacked = {'w': jnp.zeros((E, 3, 2), jnp.bfloat16), 'b': jnp.zeros((E, 2))}
  tx = optax.chain(_owner_dp(1.0, key=jax.random.key(3)), optax.adam(0.1))
  state = tx.init(stacked)

  @jax.jit
  def step(params, state, per_record, owners, mask):
    updates, state = tx.update(
        per_record, state, params, owners=owners, mask=mask
    )
    return optax.apply_updates(params, updates), state

  for t in range(2):
    stacked, state = step(
        stacked, state, _per_record(t), _owners(t), np.ones(N, np.float32)
    )
  assert stacked['w'].dtype == jnp.bfloat16
  assert stacked['w'].shape == (E, 3, 2)
  # Every expert moved, including expert E - 1, which owns no record.
  assert np.all(np.asarray(stacked['b'], np.float32) != 0)


def test_owner_update_requires_owners():
  with pytest.raises(ValueError, match='owners'):
    tx = _owner_dp(1.0)
    tx.update(_per_record(), tx.init(None))


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(l2_clip=0.0), 'l2_clip'),
        (dict(l2_clip=-1.0), 'l2_clip'),
        (dict(l2_clip=float('inf')), 'l2_clip'),
        (dict(noise_multiplier=-0.1), 'noise_multiplier'),
        (dict(noise_multiplier=float('nan')), 'noise_multiplier'),
        (dict(denominator=0), 'denominator'),
        (
            dict(denominator=jnp.float32(8.0)),
            'denominator',
        ),  # not a Python number
        (dict(num_experts=0), 'num_experts'),
        (dict(num_experts=2.0), 'num_experts'),
        (dict(key='seed'), 'key'),
    ],
)
def test_invalid_construction_raises(kwargs, message):
  args = (
      dict(
          l2_clip=1.0,
          noise_multiplier=1.0,
          num_experts=E,
          denominator=2.0,
          key=0,
      )
      | kwargs
  )
  with pytest.raises(ValueError, match=message):
    transforms.owner_dp_aggregate(**args)
  if 'num_experts' not in kwargs:
    args.pop('num_experts')
    with pytest.raises(ValueError, match=message):
      transforms.dp_aggregate(**args)
    with pytest.raises(ValueError, match=message):
      transforms.privatize_sums(**args)


def test_a_traced_denominator_is_rejected():
  @jax.jit
  def build(count):
    return transforms.dp_aggregate(1.0, 1.0, count, 0)

  with pytest.raises(ValueError, match='denominator'):
    build(jnp.float32(5.0))


def test_jitted_step_compiles_once_across_realised_sample_sizes():
  """Padding to fixed microbatches: one trace for any realised size."""
  n, q, microbatch_size = 40, 0.15, 4
  rng = np.random.default_rng(0)
  data = {
      'x': rng.normal(size=(n, 3)).astype(np.float32),
      'y': rng.normal(size=(n,)).astype(np.float32),
  }
  params = {'w': jnp.zeros(3)}
  traces = {'microbatch': 0, 'apply': 0}

  def loss_fn(p, record):
    return (record['x'] @ p['w'] - record['y']) ** 2

  @jax.jit
  def microbatch_step(params, sums, batch, mask):
    traces['microbatch'] += 1
    mb_sums, _ = grads.clipped_grad_sum(
        loss_fn, params, batch, l2_clip=1.0, mask=mask
    )
    return optax.tree.add(sums, mb_sums)

  tx = optax.chain(
      transforms.privatize_sums(1.0, 1.0, n * q, 0), optax.sgd(0.1)
  )
  opt_state = tx.init(params)

  @jax.jit
  def apply_step(params, opt_state, sums):
    traces['apply'] += 1
    updates, opt_state = tx.update(sums, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  num_microbatches = []
  for step in range(8):
    idx = sampling.poisson_sample(n, q, seed=0, stream=0, step=step)
    sums = grads.zeros_like_f32(params)
    mbs = sampling.microbatches(idx, microbatch_size)
    for mb in mbs:
      batch = jax.tree.map(lambda a: a[mb.indices], data)
      sums = microbatch_step(params, sums, batch, mb.mask)
    params, opt_state = apply_step(params, opt_state, sums)
    num_microbatches.append(len(mbs))
  assert len(set(num_microbatches)) > 1  # realised sizes did differ
  assert traces == {'microbatch': 1, 'apply': 1}


def test_state_names_its_key_as_optax_does():
  state = transforms.privatize_sums(1.0, 1.0, 1.0, 3).init(None)
  assert state._fields == optax.AddNoiseState._fields == ('count', 'rng_key')


def test_multisteps_is_refused_because_it_would_privatize_a_mean():
  """optax.MultiSteps hands the transform the running mean ([1, 2] for the
  sums [2, 0] and [0, 4]), not the step's sum, so the release would not be
  the step's (sum + noise) / denominator: the transforms refuse it."""
  tx = optax.MultiSteps(
      transforms.privatize_sums(1.0, 0.0, 1.0, 0), every_k_schedule=2
  )
  state = tx.init({'w': jnp.zeros(2)})
  with pytest.raises(ValueError, match='must not run inside optax.MultiSteps'):
    tx.update({'w': jnp.array([2.0, 0.0])}, state)
