"""Host-side Poisson sampling and fixed-size microbatches."""

import numpy as np
import pytest
from raptor_jax import sampling


def _sample(step, stream=sampling.SHARED_STREAM, n=1000, q=0.05, seed=7):
  return sampling.poisson_sample(n, q, seed=seed, stream=stream, step=step)


def test_sample_is_sorted_unique_int64_in_range():
  idx = _sample(step=3)
  assert idx.dtype == np.int64
  assert np.all(np.diff(idx) > 0)
  assert idx.min() >= 0 and idx.max() < 1000


def test_same_seed_stream_step_reproduces_the_sample():
  """A resumed run draws exactly the samples of the uninterrupted run."""
  np.testing.assert_array_equal(_sample(step=5), _sample(step=5))
  assert not np.array_equal(_sample(step=5), _sample(step=6))
  assert not np.array_equal(
      _sample(step=5), _sample(step=5, stream=sampling.EXPERT_STREAM)
  )
  assert not np.array_equal(_sample(step=5), _sample(step=5, seed=8))


def test_every_record_is_in_independently_with_probability_q():
  n, q, steps = 200, 0.1, 400
  hits = np.zeros((steps, n), bool)
  for t in range(steps):
    hits[t, _sample(step=t, n=n, q=q)] = True
  # Sample sizes are Binomial(n, q): compare mean and variance.
  sizes = hits.sum(axis=1)
  assert abs(sizes.mean() - n * q) < 4 * np.sqrt(n * q * (1 - q) / steps)
  assert 0.7 < sizes.var() / (n * q * (1 - q)) < 1.3
  # Each record's inclusion count over the steps is Binomial(steps, q).
  counts = hits.sum(axis=0)
  assert 0.7 < counts.var() / (steps * q * (1 - q)) < 1.3
  # Two streams are independent: joint inclusion rate is q^2.
  other = np.zeros((steps, n), bool)
  for t in range(steps):
    other[t, _sample(step=t, n=n, q=q, stream=sampling.EXPERT_STREAM)] = True
  both = (hits & other).mean()
  assert abs(both - q * q) < 4 * np.sqrt(q * q / (steps * n))


def test_rate_one_takes_everything_and_empty_dataset_is_empty():
  np.testing.assert_array_equal(_sample(step=0, n=10, q=1.0), np.arange(10))
  assert _sample(step=0, n=0).size == 0


@pytest.mark.parametrize('q', [0.0, -0.1, 1.5, float('nan'), '0.1', True])
def test_invalid_sample_rate_raises(q):
  with pytest.raises(ValueError, match='sample_rate'):
    _sample(step=0, q=q)


@pytest.mark.parametrize(
    'kwargs, name',
    [
        (dict(n=-1), 'n'),
        (dict(seed=-1), 'seed'),
        (dict(step=1.5), 'step'),
        (dict(stream=-2), 'stream'),
    ],
)
def test_invalid_integers_raise(kwargs, name):
  args = dict(n=10, seed=0, stream=0, step=0) | kwargs
  with pytest.raises(ValueError, match=name):
    sampling.poisson_sample(args.pop('n'), 0.5, **args)


@pytest.mark.parametrize('size', [0, 1, 7, 8, 9, 24])
def test_microbatches_pad_with_index_zero_and_mask_zero(size):
  indices = np.arange(size, dtype=np.int64) * 3 + 1
  mbs = sampling.microbatches(indices, 8)
  assert len(mbs) == -(-size // 8)
  for mb in mbs:
    assert mb.indices.shape == mb.mask.shape == (8,)
    assert mb.indices.dtype == np.int64 and mb.mask.dtype == np.float32
    np.testing.assert_array_equal(mb.indices[mb.mask == 0], 0)
  if mbs:
    real = np.concatenate([mb.indices[mb.mask == 1] for mb in mbs])
    np.testing.assert_array_equal(real, indices)


def test_empty_sample_gives_no_microbatches():
  assert sampling.microbatches(np.array([], np.int64), 4) == []


@pytest.mark.parametrize('size', [0, -3, 2.0, None])
def test_invalid_microbatch_size_raises(size):
  with pytest.raises(ValueError, match='microbatch_size'):
    sampling.microbatches(np.arange(5), size)


def test_check_microbatch_size_against_devices():
  assert sampling.check_microbatch_size(16, num_devices=4) == 16
  with pytest.raises(ValueError, match='multiple of the number of devices'):
    sampling.check_microbatch_size(10, num_devices=4)


def test_microbatches_rejects_non_integer_indices():
  with pytest.raises(ValueError, match='1-D integer'):
    sampling.microbatches(np.array([0.5, 1.0]), 4)
  with pytest.raises(ValueError, match='1-D integer'):
    sampling.microbatches(np.zeros((2, 2), np.int64), 4)


def test_default_stream_serves_a_run_with_one_sampler():
  """Plain DP-SGD needs no stream; the default is the shared stream."""
  default = sampling.poisson_sample(1000, 0.05, seed=7, step=4)
  np.testing.assert_array_equal(default, _sample(step=4))
  assert not np.array_equal(
      default, _sample(step=4, stream=sampling.EXPERT_STREAM)
  )
