"""Theorem 1 of the RAPTOR paper, as formulas and as a Monte Carlo check.

Theorem 1 (Sec. 7.1): fix clipped per-record expert gradients h_i (||h_i|| <=
C_e), owner groups D_e of sizes n_e (q_e = n_e / n), target means
mu_e = mean_{i in D_e} h_i and within-group covariances Sigma_e (population,
1/n_e). Under Poisson sampling at rate p = B / n, the released expert update
g_e = (sum_{i in D_e, sampled} h_i + N(0, sigma^2 C^2 I_d)) / (B / E) has

  E ||g_e - mu_e||^2 = beta_e^2 + V_samp_e + V_DP_e,
  beta_e^2  = (E q_e - 1)^2 ||mu_e||^2,
  V_samp_e  = E^2 p n_e (1 - p) (||mu_e||^2 + tr Sigma_e) / B^2,
  V_DP_e    = E^2 sigma^2 C^2 d / B^2.

All three terms are exact for a fixed dataset (the expectation is over the
sample and the noise only), so a Monte Carlo estimate of the left side must
match the right side within its standard error. `monte_carlo` computes the
left side with the library's own `transforms.owner_dp_aggregate` on samples
from `sampling.poisson_sample`, so the check covers the code that trains.

It also reports the realised-count denominator ``sum / max(|B_e|, 1)``, which is
a NON-PRIVATE ORACLE: it divides by a private count, so it is not a DP
release and no method here may use it; it shows what the public denominator
costs relative to knowing the counts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import sampling, transforms


class GroupStatistics(NamedTuple):
  """Per owner group of a fixed dataset of clipped gradients (float64)."""

  counts: np.ndarray  # [E] n_e
  means: np.ndarray  # [E, d] mu_e
  trace_cov: np.ndarray  # [E] tr Sigma_e (population covariance)


class Theorem1Terms(NamedTuple):
  """The right side of Theorem 1 per expert (float64 [E] each)."""

  bias2: np.ndarray
  v_samp: np.ndarray
  v_dp: np.ndarray

  @property
  def total(self) -> np.ndarray:
    return self.bias2 + self.v_samp + self.v_dp


def group_statistics(
    h: np.ndarray, owners: np.ndarray, num_experts: int
) -> GroupStatistics:
  """n_e, mu_e and tr Sigma_e of clipped gradients `h` [n, d] by owner."""
  h = np.asarray(h, np.float64)
  counts = np.bincount(owners, minlength=num_experts).astype(np.float64)
  means = np.zeros((num_experts, h.shape[1]))
  trace_cov = np.zeros(num_experts)
  for e in range(num_experts):
    group = h[owners == e]
    if len(group):
      means[e] = group.mean(axis=0)
      trace_cov[e] = np.sum(np.mean((group - means[e]) ** 2, axis=0))
  return GroupStatistics(counts, means, trace_cov)


def theorem1_terms(
    stats: GroupStatistics,
    *,
    batch_size: float,
    noise_multiplier: float,
    l2_clip: float,
) -> Theorem1Terms:
  """beta_e^2, V_samp_e and V_DP_e (Eq. 11-13) for D_e = B / E."""
  num_experts, d = stats.means.shape
  n = stats.counts.sum()
  p = batch_size / n
  q = stats.counts / n
  mu2 = np.sum(stats.means**2, axis=1)
  bias2 = (num_experts * q - 1.0) ** 2 * mu2
  v_samp = (
      num_experts**2
      * p
      * stats.counts
      * (1.0 - p)
      * (mu2 + stats.trace_cov)
      / batch_size**2
  )
  v_dp = np.full(
      num_experts,
      num_experts**2 * noise_multiplier**2 * l2_clip**2 * d / batch_size**2,
  )
  return Theorem1Terms(bias2, v_samp, v_dp)


class MonteCarlo(NamedTuple):
  """Monte Carlo squared errors per expert (float64 [E] each)."""

  mse: np.ndarray  # E ||g_e - mu_e||^2, public denominator B / E
  stderr: np.ndarray  # its standard error
  oracle_mse: np.ndarray  # NON-PRIVATE ORACLE: realised-count denominator
  oracle_stderr: np.ndarray


def monte_carlo(
    h: np.ndarray,
    owners: np.ndarray,
    *,
    num_experts: int,
    batch_size: float,
    noise_multiplier: float,
    l2_clip: float,
    trials: int,
    seed: int = 0,
) -> MonteCarlo:
  """Squared error of `owner_dp_aggregate`'s release over Poisson samples.

  Each trial draws a Poisson sample (`sampling.poisson_sample`, rate B / n,
  step = trial), masks the other records, and calls the transform's update
  once (fresh noise per step from a 128-bit stacked key). `h` must already
  satisfy ||h_i|| <= l2_clip so that mu_e is the mean the theorem is about.
  """
  h = np.asarray(h, np.float32)
  n = len(h)
  norms = np.linalg.norm(h, axis=1)
  if np.any(norms > l2_clip * (1 + 1e-5)):
    raise ValueError(
        "monte_carlo needs clipped gradients: every ||h_i|| <= l2_clip"
    )
  stats = group_statistics(h, owners, num_experts)
  denominator = batch_size / num_experts
  tx = transforms.owner_dp_aggregate(
      l2_clip,
      noise_multiplier,
      num_experts,
      denominator,
      jax.random.split(jax.random.key(seed), 2),
  )
  state = tx.init(jnp.zeros((num_experts, h.shape[1])))
  h_j, owners_j = jnp.asarray(h), jnp.asarray(owners, jnp.int32)

  @jax.jit
  def release(state, mask):
    update, state = tx.update(h_j, state, owners=owners_j, mask=mask)
    return update, state

  errors, oracle = [], []
  counts_fn = jax.jit(
      lambda m: jax.ops.segment_sum(m, owners_j, num_segments=num_experts)
  )
  for trial in range(trials):
    idx = sampling.poisson_sample(
        n, batch_size / n, seed=seed, step=trial, stream=0
    )
    mask = np.zeros(n, np.float32)
    mask[idx] = 1.0
    update, state = release(state, jnp.asarray(mask))
    update = np.asarray(update, np.float64)
    errors.append(np.sum((update - stats.means) ** 2, axis=1))
    counts = np.asarray(counts_fn(jnp.asarray(mask)), np.float64)
    realised = update * denominator / np.maximum(counts, 1.0)[:, None]
    oracle.append(np.sum((realised - stats.means) ** 2, axis=1))
  errors, oracle = np.asarray(errors), np.asarray(oracle)
  root = np.sqrt(trials)
  return MonteCarlo(
      errors.mean(0),
      errors.std(0, ddof=1) / root,
      oracle.mean(0),
      oracle.std(0, ddof=1) / root,
  )


def synthetic_gradients(
    shares: np.ndarray,
    *,
    n: int,
    d: int,
    l2_clip: float,
    seed: int,
    mean_norm: float = 0.5,
    spread: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
  """Per-record gradients with known groups: (h [n, d], owners [n]).

  Group sizes are round(n * shares) (the last takes the rest), each group has
  a random mean direction of norm `mean_norm` * C and isotropic spread
  `spread` * C / sqrt(d) per coordinate; records are then clipped to C, so
  the group statistics of the returned h are exactly those of clipped
  gradients.
  """
  rng = np.random.default_rng(seed)
  sizes = np.floor(np.asarray(shares) * n).astype(int)
  sizes[-1] = n - sizes[:-1].sum()
  owners = np.repeat(np.arange(len(shares)), sizes)
  directions = rng.normal(size=(len(shares), d))
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  h = mean_norm * l2_clip * directions[owners] + (
      spread * l2_clip / np.sqrt(d)
  ) * rng.normal(size=(n, d))
  scale = np.minimum(1.0, l2_clip / np.linalg.norm(h, axis=1))
  return (h * scale[:, None]).astype(np.float32), owners.astype(np.int32)
