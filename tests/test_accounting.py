"""Tests for raptor_jax.accounting against independent accountants."""

import math
import os
import pathlib
import re
import subprocess
import sys

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution
import pytest
from scipy import optimize, stats

from raptor_jax import accounting, calibration

from helpers import raptor_kwargs

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RTOL = accounting.CALIBRATION_RTOL


def _rdp_epsilon(event, delta):
  return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def _pld_accountant_epsilon(event, delta):
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=accounting.VALUE_DISCRETIZATION_INTERVAL
  )
  return accountant.compose(event).get_epsilon(delta)


def _gaussian_epsilon(sigma, delta):
  """The exact epsilon of one Gaussian mechanism of sensitivity 1 (Balle and
  Wang 2018, Thm. 8), solved here: dp_accounting's `get_epsilon_gaussian`
  is newer than requirements-floors.txt's dp-accounting."""

  def excess(eps):
    return (
        stats.norm.cdf(0.5 / sigma - eps * sigma)
        - math.exp(eps) * stats.norm.cdf(-0.5 / sigma - eps * sigma)
        - delta
    )

  return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


def test_published_value():
  # Abadi et al. / Opacus: sigma=3, q=0.1, 512 steps is about 3.77 at 1e-6.
  eps = accounting.dpsgd_epsilon(
      noise_multiplier=3.0, sample_rate=0.1, steps=512, delta=1e-6
  )
  assert eps == pytest.approx(3.77, abs=0.01)


@pytest.mark.parametrize('joint', [False, True])
def test_epsilon_is_pld_accountant(joint):
  event = accounting.raptor_event(
      **raptor_kwargs(1.5, 3.0, 0.02, 100, joint=joint)
  )
  assert accounting.epsilon(event, 1e-5) == _pld_accountant_epsilon(event, 1e-5)


@pytest.mark.parametrize(
    'q, sigmas, steps, delta',
    [
        (0.1, (3.0,), 512, 1e-6),
        (0.01, (1.0,), 1000, 1e-5),
        (0.05, (2.0,), 300, 1e-6),
        (0.02, (1.0, 4.0), 500, 1e-5),
    ],
)
def test_never_above_rdp(q, sigmas, steps, delta):
  event = dp_accounting.ComposedDpEvent(
      [
          accounting.dpsgd_event(noise_multiplier=s, sample_rate=q, steps=steps)
          for s in sigmas
      ]
  )
  assert accounting.epsilon(event, delta) <= _rdp_epsilon(event, delta)


@pytest.mark.filterwarnings('ignore:Optimal order is the largest alpha')
@pytest.mark.parametrize(
    'history, delta',
    [
        ([(3.0, 0.1, 512)], 1e-6),
        ([(1.0, 0.01, 1000)], 1e-5),
        ([(2.0, 0.05, 300)], 1e-6),
        ([(1.0, 0.02, 500), (4.0, 0.02, 500)], 1e-5),  # Two streams.
    ],
)
def test_agrees_with_opacus_prv(history, delta):
  # Imported here: opacus pulls in torch, which is slow to import.
  from opacus.accountants import PRVAccountant

  prv = PRVAccountant()
  prv.history = list(history)
  expected = prv.get_epsilon(delta, eps_error=0.01)
  event = dp_accounting.ComposedDpEvent(
      [
          accounting.dpsgd_event(noise_multiplier=s, sample_rate=q, steps=t)
          for s, q, t in history
      ]
  )
  assert accounting.epsilon(event, delta) == pytest.approx(expected, rel=0.01)


def test_sigma_eff():
  assert accounting.sigma_eff(2.0) == 2.0
  assert accounting.sigma_eff(1.0, 1.0) == pytest.approx(2**-0.5)
  assert accounting.sigma_eff(3.0, 4.0) == pytest.approx(2.4)


@pytest.mark.parametrize('steps', [1, 10])
def test_joint_without_sampling_is_composition_of_gaussians(steps):
  # With q = 1 a one-sample step that releases two groups IS the composition
  # of two Gaussian mechanisms, and T of them a Gaussian with sigma/sqrt(T).
  event = accounting.joint_event(
      noise_multipliers=(1.5, 4.0), sample_rate=1.0, steps=steps
  )
  two_gaussians = dp_accounting.SelfComposedDpEvent(
      dp_accounting.ComposedDpEvent(
          [
              dp_accounting.GaussianDpEvent(1.5),
              dp_accounting.GaussianDpEvent(4.0),
          ]
      ),
      steps,
  )
  eps = accounting.epsilon(event, 1e-5)
  assert eps == pytest.approx(
      _pld_accountant_epsilon(two_gaussians, 1e-5), rel=1e-3
  )
  analytic = _gaussian_epsilon(
      accounting.sigma_eff(1.5, 4.0) / math.sqrt(steps), 1e-5
  )
  assert eps == pytest.approx(analytic, rel=1e-3)


def test_joint_is_one_gaussian_with_summed_sensitivity():
  # Whitened, the joint release is one unit-noise Gaussian whose sensitivity
  # is sqrt(sum sigma_g**-2): build that PLD directly and compare.
  sigmas, q, steps, delta = (2.0, 3.0, 6.0), 0.05, 200, 1e-5
  sensitivity = math.sqrt(sum(s**-2 for s in sigmas))
  expected = (
      privacy_loss_distribution.from_gaussian_mechanism(
          standard_deviation=1.0,
          sensitivity=sensitivity,
          sampling_prob=q,
          value_discretization_interval=accounting.VALUE_DISCRETIZATION_INTERVAL,
      )
      .self_compose(steps)
      .get_epsilon_for_delta(delta)
  )
  event = accounting.joint_event(
      noise_multipliers=sigmas, sample_rate=q, steps=steps
  )
  assert accounting.epsilon(event, delta) == pytest.approx(expected, rel=1e-4)


def test_epsilon_is_monotone():
  def eps(sigma=2.0, q=0.02, steps=200):
    return accounting.dpsgd_epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5
    )

  by_sigma = [eps(sigma=s) for s in (1.5, 2.0, 3.0)]
  by_steps = [eps(steps=t) for t in (50, 200, 800)]
  by_rate = [eps(q=q) for q in (0.005, 0.02, 0.08)]
  assert by_sigma == sorted(by_sigma, reverse=True)
  assert by_steps == sorted(by_steps) and by_rate == sorted(by_rate)
  assert len(set(by_sigma + by_steps + by_rate)) == 7  # Strictly.


@pytest.mark.parametrize(
    'target, q, steps',
    [(8.0, 1.0, 10), (2.0, 0.01, 300), (1.0, 0.02, 400), (0.5, 0.1, 100)],
)
def test_calibrate_dpsgd_round_trip(target, q, steps):
  sigma = calibration.calibrate_dpsgd(
      target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps
  )
  eps = accounting.dpsgd_epsilon(
      noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5
  )
  assert (1 - _RTOL) * target <= eps <= target


@pytest.mark.parametrize(
    'target, rho, joint',
    [(2.0, 0.9, False), (1.0, 0.9, False), (1.0, 0.5, False), (1.0, 0.9, True)],
)
def test_calibrate_raptor_round_trip(target, rho, joint):
  q, steps, delta = 0.02, 400, 1e-5
  sigmas = calibration.calibrate_raptor(
      target_epsilon=target,
      delta=delta,
      sample_rate=q,
      steps=steps,
      rho=rho,
      joint=joint,
  )
  eps = accounting.raptor_epsilon(
      **raptor_kwargs(*sigmas, q, steps), delta=delta, joint=joint
  )
  assert (1 - _RTOL) * target <= eps <= target
  # docs/method.md §1.7: each stream alone spends its share of one scale t at delta/2.
  own = [
      accounting.dpsgd_epsilon(
          noise_multiplier=s, sample_rate=q, steps=steps, delta=delta / 2
      )
      for s in sigmas
  ]
  assert own[0] / rho == pytest.approx(own[1] / (1 - rho), rel=2 * _RTOL)


def test_joint_calibration_beats_splitting_the_budget():
  q, steps, delta, target, rho = 0.02, 400, 1e-5, 1.0, 0.9
  sigma_shared, sigma_expert = calibration.calibrate_raptor(
      target_epsilon=target, delta=delta, sample_rate=q, steps=steps, rho=rho
  )
  alone = [
      calibration.calibrate_dpsgd(
          target_epsilon=share * target,
          delta=delta / 2,
          sample_rate=q,
          steps=steps,
      )
      for share in (rho, 1 - rho)
  ]
  assert sigma_shared < alone[0] and sigma_expert < alone[1]


@pytest.mark.slow
def test_calibrate_raptor_at_paper_scale():
  n, batch_size, epochs = 67349, 1000, 20
  q = batch_size / n
  steps = epochs * accounting.steps_per_epoch(q)
  delta = accounting.default_delta(n)
  sigmas = calibration.calibrate_raptor(
      target_epsilon=8.0, delta=delta, sample_rate=q, steps=steps
  )
  eps = accounting.raptor_epsilon(
      **raptor_kwargs(*sigmas, q, steps), delta=delta
  )
  assert steps == 1360 and (1 - _RTOL) * 8.0 <= eps <= 8.0


def test_steps_per_epoch():
  assert accounting.steps_per_epoch(1000 / 67349) == 68
  assert accounting.steps_per_epoch(100 / 1000) == 10
  assert accounting.steps_per_epoch(1 / 3) == 3
  assert accounting.steps_per_epoch(1.0) == 1


def test_default_delta():
  assert accounting.default_delta(67349) == pytest.approx(67349**-1.1)
  accounting.validate_delta(accounting.default_delta(67349), 67349)


_VALID = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100)


@pytest.mark.parametrize(
    'override, match',
    [
        (dict(target_epsilon=0.0), 'target_epsilon'),
        (dict(target_epsilon=-1.0), 'target_epsilon'),
        (dict(target_epsilon=math.inf), 'target_epsilon'),
        (dict(delta=0.0), 'delta'),
        (dict(delta=1.0), 'delta'),
        (dict(sample_rate=0.0), 'sample_rate'),
        (dict(sample_rate=1.5), 'sample_rate'),
        (dict(steps=0), 'steps'),
        (dict(steps=2.5), 'steps'),
        (dict(rho=0.0), 'rho'),
        (dict(rho=1.0), 'rho'),
        (dict(target_epsilon=1e-5), 'unreachable.*smallest feasible'),
    ],
)
def test_invalid_arguments_raise_one_line(override, match):
  kwargs = {**_VALID, 'rho': 0.9, **override}
  with pytest.raises(ValueError, match=match) as error:
    calibration.calibrate_raptor(**kwargs)
  assert '\n' not in str(error.value)
  if 'rho' not in override:
    kwargs.pop('rho')
    with pytest.raises(ValueError, match=match):
      calibration.calibrate_dpsgd(**kwargs)


def test_invalid_mechanism_arguments():
  with pytest.raises(ValueError, match='noise_multiplier'):
    accounting.dpsgd_epsilon(
        noise_multiplier=0.0, sample_rate=0.1, steps=1, delta=1e-5
    )
  with pytest.raises(
      ValueError, match='steps_expert: must be equal to steps_shared'
  ):
    accounting.raptor_epsilon(
        **raptor_kwargs(
            1.0, 1.0, 0.1, 2, steps_expert=1, delta=1e-5, joint=True
        )
    )
  with pytest.raises(TypeError, match='Poisson-sampled Gaussian'):
    accounting.epsilon(dp_accounting.LaplaceDpEvent(1.0), 1e-5)


def test_delta_must_be_below_one_over_n():
  with pytest.raises(ValueError, match=r'below 1/n.*default'):
    accounting.validate_delta(1e-4, 67349)


def test_too_large_target_raises():
  with pytest.raises(ValueError, match='too large'):
    calibration.calibrate_dpsgd(
        target_epsilon=1e4, delta=1e-5, sample_rate=1.0, steps=1
    )


def _run_planner(*flags, env=None):
  return subprocess.run(
      [sys.executable, str(_ROOT / 'launch' / 'privacy.py'), *flags],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=_ROOT,
      env=env,
  )


@pytest.mark.parametrize('method', ['raptor', 'joint', 'dpsgd'])
def test_planner_meets_target_and_compares(method):
  result = _run_planner(
      '--epsilon=1',
      '--n=5000',
      '--batch_size=250',
      '--epochs=2',
      '--rho=0.9',
      f'--method={method}',
  )
  assert result.returncode == 0, result.stderr
  header, *lines = result.stdout.splitlines()
  assert 'steps=40 ' in header and 'delta=8.53e-05' in header
  rows = dict(re.split(r'\s{2,}', line.strip(), maxsplit=1) for line in lines)
  spent = [float(v) for k, v in rows.items() if k.startswith('epsilon (PLD')]
  assert len(spent) == 1 and 1 - _RTOL <= spent[0] <= 1
  assert float(rows['epsilon (RDP, same sigmas)']) >= spent[0]
  if method == 'raptor':
    assert {
        'sigma_shared',
        'sigma_expert',
        'bound: shared stream alone at delta/2',
        'bound: expert stream alone at delta/2',
    } <= set(rows)
    assert float(rows['bound: basic composition (sum)']) >= spent[0]
    # The run's epsilon comes first, above the per-stream bounds (48.6).
    labels = list(rows)
    assert labels.index('epsilon (PLD, composed)') < labels.index(
        'bound: shared stream alone at delta/2'
    )


def _planner_error_lines(*flags, env=None):
  """The planner's stderr lines of a run that must fail."""
  result = _run_planner(*flags, env=env)
  assert result.returncode != 0, result.stdout
  return result.stderr.strip().splitlines()


def test_planner_rejects_large_delta():
  lines = _planner_error_lines('--n=1000', '--delta=0.01')
  assert lines[-1].startswith('error: delta: must be below 1/n')


def _planner_rows(stdout):
  header, *lines = stdout.splitlines()
  rows = dict(re.split(r'\s{2,}', line.strip(), maxsplit=1) for line in lines)
  return header, rows


def _tiny_plan(**overrides):
  """The trainer's plan of configs/glue.py:preset=tiny (n as it loads it)."""
  from raptor_jax.train import config as config_lib
  from raptor_jax.train import methods

  config = config_lib.glue_config(preset='tiny')
  config.epochs = 2
  for key, value in overrides.items():
    config[key] = value
  # n as build_run counts it: the generated task's train records.
  n = config.data.synthetic.n_train
  return methods.build_plan(
      config, n=n, num_experts=4, sparse_layers=(1, 3), expert_layer=1
  )


@pytest.mark.slow
def test_planner_of_a_config_gives_the_trainers_sigmas():
  """--config as launch/main.py takes it: n, B and epochs from the config,
  the sigmas those of `methods.build_plan`, which the trainer runs."""
  plan = _tiny_plan()
  result = _run_planner(
      '--config=configs/glue.py:preset=tiny', '--config.epochs=2'
  )
  assert result.returncode == 0, result.stderr
  header, rows = _planner_rows(result.stdout)
  assert header.startswith('raptor: n=4000 B=250 q=0.0625 epochs=2 steps=32 ')
  sigmas = {p.name: p.noise_multiplier for p in plan.phases}
  assert float(rows['sigma_shared']) == pytest.approx(sigmas['shared'], 1e-5)
  assert float(rows['sigma_expert']) == pytest.approx(sigmas['expert'], 1e-5)
  assert f'delta={plan.delta:.3g}' in header


@pytest.mark.slow
@pytest.mark.parametrize(
    'method, flags',
    [
        ('raptor', ('sigma_shared', 'sigma_expert')),
        ('baseline_b', ('sigma',)),
    ],
)
def test_planner_reverse_mode_spends_the_target_epsilon(method, flags):
  """Given the trainer's calibrated sigmas, the planner returns the epsilon
  the trainer's ledger reports for them: the target, within tolerance."""
  from raptor_jax.ledger import PrivacyLedger

  plan = _tiny_plan(method=method)
  sigma = {p.name: p.noise_multiplier for p in plan.phases}
  given = (
      [sigma['shared'], sigma['expert']]
      if len(flags) == 2
      else [*sigma.values()]
  )
  result = _run_planner(
      '--config=configs/glue.py:preset=tiny',
      '--config.epochs=2',
      f'--method={method}',
      *(f'--{f}={s!r}' for f, s in zip(flags, given)),
  )
  assert result.returncode == 0, result.stderr
  header, rows = _planner_rows(result.stdout)
  assert ' given ' in header and 'target' not in header
  spent = [float(v) for k, v in rows.items() if k.startswith('epsilon (PLD')]
  ledger = PrivacyLedger()
  for phase in plan.phases:
    ledger.record(
        phase.name,
        sample_rate=plan.sample_rate,
        noise_multiplier=phase.noise_multiplier,
        steps=plan.cycles,
    )
  assert spent == [pytest.approx(ledger.epsilon(plan.delta), abs=1e-4)]
  assert 8 * (1 - _RTOL) - 1e-4 <= spent[0] <= 8 + 1e-4


@pytest.mark.parametrize(
    'flags, start',
    [
        (('--sigma=1',), 'error: --sigma: must be unset for method raptor'),
        (
            ('--method=baseline_b', '--sigma_shared=1'),
            'error: --sigma_shared: must be unset for method baseline_b',
        ),
        (('--method=nonprivate_lora',), 'error: --method: must be a private'),
        (
            ('--sigma=1', '--epsilon=2', '--method=monolithic'),
            'error: --epsilon:',
        ),
    ],
)
def test_planner_bad_input_is_one_line_naming_the_fix(flags, start):
  lines = _planner_error_lines('--config=configs/glue.py:preset=tiny', *flags)
  assert len(lines) == 1 and lines[0].startswith(start), lines


@pytest.mark.slow
def test_planner_without_data_asks_for_n(tmp_path):
  """A hub task that is not cached: one line saying to pass --n."""
  env = dict(
      os.environ,
      HF_DATASETS_OFFLINE='1',
      HF_HUB_OFFLINE='1',
      HF_DATASETS_CACHE=str(tmp_path),
  )
  lines = _planner_error_lines('--config=configs/glue.py:task=qnli', env=env)
  assert len(lines) == 1 and lines[0].startswith('error: n: ')
  assert '--n=N' in lines[0]
  result = _run_planner(
      '--config=configs/glue.py:task=qnli', '--n=104743', env=env
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith('raptor: n=104743 B=1000 ')


def test_a_replayed_sample_is_one_mechanism_not_fresh_steps():
  # k releases of one Poisson sample (a replayed epoch) are one subsampled
  # Gaussian with sigma / sqrt(k); test_front_door checks the README's
  # numbers (8.43 spent, 4.55 if counted as fresh steps).
  sigma, q, releases = 3.0, 0.1, [2, 1, 0, 3, 2] * 4
  event = accounting.replayed_event(
      noise_multiplier=sigma, sample_rate=q, releases=releases
  )
  assert accounting.epsilon(event, 1e-5) == _pld_accountant_epsilon(event, 1e-5)
  fresh = accounting.dpsgd_epsilon(
      noise_multiplier=sigma, sample_rate=q, steps=sum(releases), delta=1e-5
  )
  assert accounting.epsilon(event, 1e-5) > fresh  # fresh steps under-report
  # Without sampling, k releases with independent noise compose exactly as
  # k Gaussians (dp_accounting's own composition): one Gaussian sigma/sqrt(k).
  unsampled = accounting.replayed_event(
      noise_multiplier=sigma, sample_rate=1.0, releases=[3, 0, 1]
  )
  composed = dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma)] * 4
  )
  assert accounting.epsilon(unsampled, 1e-5) == pytest.approx(
      _pld_accountant_epsilon(composed, 1e-5), rel=1e-3
  )
  nothing = accounting.replayed_event(
      noise_multiplier=sigma, sample_rate=q, releases=[0, 0]
  )
  assert accounting.epsilon(nothing, 1e-5) == 0.0
  with pytest.raises(ValueError, match='releases'):
    accounting.replayed_event(
        noise_multiplier=sigma, sample_rate=q, releases=[1, -1]
    )
