"""Runs the README example: examples/dp_linear_regression.py."""

import importlib.util
import pathlib

import numpy as np

_PATH = (
    pathlib.Path(__file__).resolve().parents[1]
    / 'examples'
    / 'dp_linear_regression.py'
)


def _load_example():
  spec = importlib.util.spec_from_file_location('dp_linear_regression', _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_readme_example_trains_privately_with_plain_jax_and_optax():
  results = _load_example().main(steps=60)
  baseline = results['zero predictor']
  microbatched = results['microbatched privatize_sums']
  one_call = results['one-call dp_aggregate']
  assert microbatched < 0.3 * baseline
  assert results['owner_dp_aggregate (E experts)'] < 0.3 * baseline
  # Same Poisson samples and noise key: the microbatched path and the
  # one-call transform release the same updates (up to summation order).
  np.testing.assert_allclose(microbatched, one_call, rtol=1e-3)


def test_the_example_draws_samples_and_noise_from_a_fresh_secret():
  """Secret by default: two calls with the same public seed differ; the same
  secret reproduces them. A public seed would let anyone redraw both."""
  example = _load_example()
  fresh = [example.train_one_call(steps=3, seed=0)[1] for _ in range(2)]
  assert fresh[0] != fresh[1]
  secret = example.fresh_secret()
  assert len(secret) == 32
  again = [example.train_one_call(steps=3, secret=secret)[1] for _ in range(2)]
  assert again[0] == again[1]
  assert example.noise_key(secret, 'linear').shape == (2, 2)  # 128 bits
