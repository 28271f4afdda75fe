"""The controlled study's tables: paired intervals, ablations, Corollary 1."""

import math

import numpy as np

from raptor_jax.studies import controlled_report

T_975_DF9 = 2.2621571627  # Student t quantile, 9 degrees of freedom


def _rows(accuracy):
  """Rows of `accuracy(condition, epsilon, method, seed)` for 10 seeds."""
  rows = []
  for cond in ("r0_bal", "r100_bal"):
    for eps in ("0.5", "1", "8"):
      for method in ("raptor", "baseline_a", "raptor_no_residual"):
        for seed in range(10):
          rows.append(
              dict(
                  condition=cond,
                  epsilon=eps,
                  method=method,
                  seed=str(seed),
                  accuracy=str(accuracy(cond, eps, method, seed)),
                  lambda_s="0.01",
                  lambda_e=str(0.001 * (seed % 2)),
              )
          )
  return rows


def _noise(seed, method):
  return 0.001 * ((seed * 7 + len(method)) % 5)


def test_paired_interval_is_the_t_interval_of_the_differences():
  d = np.array([1.0, 2.0, 0.5, -1.0, 3.0, 2.5, 0.0, 1.5, 1.0, 2.0])
  mean, low, high = controlled_report.paired_interval(d)
  half = T_975_DF9 * d.std(ddof=1) / math.sqrt(10)
  assert math.isclose(mean, d.mean())
  assert math.isclose(low, d.mean() - half, rel_tol=1e-8)
  assert math.isclose(high, d.mean() + half, rel_tol=1e-8)


def test_ablation_and_corollary_rows_pair_by_seed():
  # RAPTOR gains 2 points over baseline_a at epsilon 0.5, 0.5 at epsilon 8,
  # and 1 point over the ablation variant; plus seed-dependent noise.
  gain = {"0.5": 0.02, "1": 0.01, "8": 0.005}

  def accuracy(cond, eps, method, seed):
    base = 0.6 + 0.01 * seed + _noise(seed, method)
    if method == "raptor":
      return base + gain[eps]
    if method == "raptor_no_residual":
      return base + gain[eps] - 0.01
    return base

  text = controlled_report.markdown(_rows(accuracy))
  seeds = range(10)
  raptor = lambda e, s: 100 * accuracy("r100_bal", e, "raptor", s)
  want = [
      raptor("1", s) - 100 * accuracy("r100_bal", "1", "raptor_no_residual", s)
      for s in seeds
  ]
  mean, low, high = controlled_report.paired_interval(want)
  assert (
      f"| raptor_no_residual | 10 | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |"
      in text
  )
  gains = lambda e: [
      raptor(e, s) - 100 * accuracy("r100_bal", e, "baseline_a", s)
      for s in seeds
  ]
  corollary = np.array(gains("0.5")) - np.array(gains("8"))
  mean, low, high = controlled_report.paired_interval(corollary)
  assert abs(mean - 1.5) < 0.3
  assert f"| r100_bal | 10 | {mean:+.2f} [{low:+.2f}, {high:+.2f}] |" in text
  # lambda: the grid methods' 60 runs (ablations excluded); every run has
  # lambda_s > 0, half have lambda_e > 0.
  assert "| r100_bal | 60 | 1.00 | 0.50 |" in text


def _ranks(values):
  values = np.asarray(values)
  return np.array(
      [np.mean(np.nonzero(np.sort(values) == v)[0]) + 1 for v in values]
  )


def test_predictors_rank_the_gain_against_the_public_entropy():
  entropy = {"r0_bal": 1.0, "r100_bal": 0.6}

  def accuracy(cond, eps, method, seed):
    base = 0.6 + 0.01 * seed
    lift = {"0.5": 3, "1": 2, "8": 1}[eps] * (2.0 - entropy[cond]) / 100
    return base + (lift if method == "raptor" else 0.0)

  owners = {
      c: dict(
          public_owner_entropy=h, relevance=float(c[1:].split("_")[0]) / 100
      )
      for c, h in entropy.items()
  }
  scan = [
      dict(relevance=0.0, lambda_ratio=None),
      dict(relevance=1.0, lambda_ratio=0.5),
  ]
  lines = controlled_report.predictors(_rows(accuracy), owners, scan)
  assert "Complete cells: 6." in lines
  gains = [
      100 * {"0.5": 3, "1": 2, "8": 1}[e] * (2.0 - entropy[c]) / 100
      for c in entropy
      for e in ("0.5", "1", "8")
  ]
  entropies = [entropy[c] for c in entropy for _ in range(3)]
  # Spearman = Pearson of the ranks; tied entropies get their mean rank.
  rho = np.corrcoef(_ranks(entropies), _ranks(gains))[0, 1]
  assert any(
      f"rho = {rho:+.2f}" in line and "entropy" in line for line in lines
  )
  assert any("lambda_e / lambda_s: not computable" in line for line in lines)
