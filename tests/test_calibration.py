"""calibration: our noise search against dp_accounting's own calibration."""

import json

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
import pytest

from raptor_jax import accounting, calibration

from helpers import raptor_kwargs


def _pld_epsilon(event, delta):
  accountant = pld_privacy_accountant.PLDAccountant(
      value_discretization_interval=accounting.VALUE_DISCRETIZATION_INTERVAL
  )
  return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize(
    "q, steps, eps", [(0.01, 300, 1.0), (0.05, 60, 8.0), (0.2, 20, 0.5)]
)
def test_dpsgd_matches_dp_accountings_calibration(q, steps, eps):
  delta = 1e-5
  ours = calibration.calibrate_dpsgd(
      target_epsilon=eps, delta=delta, sample_rate=q, steps=steps
  )
  event = lambda sigma: accounting.dpsgd_event(
      noise_multiplier=sigma, sample_rate=q, steps=steps
  )
  theirs = dp_accounting.calibrate_dp_mechanism(
      lambda: pld_privacy_accountant.PLDAccountant(
          value_discretization_interval=accounting.VALUE_DISCRETIZATION_INTERVAL
      ),
      event,
      eps,
      delta,
      bracket_interval=dp_accounting.ExplicitBracketInterval(0.2, 100.0),
      tol=1e-5,
  )
  # dp_accounting returns (up to tol) the least sigma within the target; ours
  # spends between (1 - rtol) * target and the target, so it is at least
  # that sigma and close to it.
  assert theirs - 1e-5 <= ours <= theirs * (1 + 2 * accounting.CALIBRATION_RTOL)
  spent = _pld_epsilon(event(ours), delta)
  assert (1 - accounting.CALIBRATION_RTOL) * eps <= spent <= eps


def test_raptor_spends_the_target_in_dp_accountings_pld():
  q, steps, eps, delta, rho = 0.05, 40, 2.0, 1e-5, 0.9
  shared, expert = calibration.calibrate_raptor(
      target_epsilon=eps, delta=delta, sample_rate=q, steps=steps, rho=rho
  )
  event = accounting.raptor_event(**raptor_kwargs(shared, expert, q, steps))
  spent = _pld_epsilon(event, delta)
  assert (1 - accounting.CALIBRATION_RTOL) * eps <= spent <= eps
  # The budget split: each stream alone at delta / 2 spends rho : 1 - rho.
  alone = [
      _pld_epsilon(
          accounting.dpsgd_event(
              noise_multiplier=s, sample_rate=q, steps=steps
          ),
          delta / 2,
      )
      for s in (shared, expert)
  ]
  assert alone[0] / alone[1] == pytest.approx(rho / (1 - rho), rel=5e-3)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("calibrate_dpsgd", dict(sample_rate=0.05, steps=60)),
        ("calibrate_raptor", dict(sample_rate=0.0625, steps=96, rho=0.8)),
    ],
)
def test_a_calibration_read_back_is_used_only_once_certified(
    name, kwargs, tmp_path, monkeypatch
):
  """The disk cache saves the search; a damaged or edited entry, or one
  whose noise would spend more than the target, is recalibrated."""
  kwargs = dict(kwargs, target_epsilon=4.0, delta=1e-5)
  calibrate = getattr(calibration, name)
  monkeypatch.setattr(accounting, "_CACHE_DIRECTORY", None)  # restored after
  accounting.set_cache_directory(tmp_path)
  calibrate.cache_clear()
  fresh = calibrate(**kwargs)
  (entry,) = tmp_path.iterdir()
  searches = []
  search = calibration._search  # pylint: disable=protected-access
  monkeypatch.setattr(
      calibration,
      "_search",
      lambda *a, **k: searches.append(1) or search(*a, **k),
  )

  def again():
    calibrate.cache_clear()
    return calibrate(**kwargs)

  assert again() == fresh and not searches  # read back, certified
  as_json = lambda x: list(x) if isinstance(x, tuple) else x
  lower = [0.9 * s for s in fresh] if isinstance(fresh, tuple) else 0.9 * fresh
  for text in (
      "{",
      '{"result": "x"}',
      json.dumps(dict(result=[fresh, fresh, fresh])),
      json.dumps(dict(result=1.0)),  # one float: a dpsgd entry's shape
      json.dumps(dict(result=lower)),  # spends over the target
  ):
    entry.write_text(text)
    searches.clear()
    assert again() == fresh and searches  # searched again
    assert json.loads(entry.read_text())["result"] == as_json(fresh)
  accounting.set_cache_directory(None)
  calibrate.cache_clear()
  entry.unlink()
  assert calibrate(**kwargs) == fresh and not list(tmp_path.iterdir())
