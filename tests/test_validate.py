"""`_validate`: one wording for every bad value, at every entry point."""

import math
import re

import numpy as np
import pytest

from raptor_jax import _validate, accounting, calibration, ledger, sampling, transforms
from raptor_jax.train import run as run_lib

from helpers import micro_config

# <field>: must be <condition>, got <value>[; <fix>], on one line.
UNIFORM = re.compile(r"^[\w. ]+: must be .+, got .+$")


def _error(fn, *args, **kwargs) -> str:
  with pytest.raises(ValueError) as info:
    fn(*args, **kwargs)
  text = str(info.value)
  assert "\n" not in text and UNIFORM.match(text), text
  return text


def test_message_format():
  assert _validate.message("privacy.rho", "in (0, 1)", 1.5, "set it") == (
      "privacy.rho: must be in (0, 1), got 1.5; set it"
  )
  assert _validate.message("mode", "one of 'a'", "b") == (
      "mode: must be one of 'a', got 'b'"
  )
  assert _validate.message(
      "x", "a 1-D array", _validate.Shown("shape (2, 3)")
  ) == ("x: must be a 1-D array, got shape (2, 3)")
  assert (
      _validate.config_fix("batch_size", 250) == "set --config.batch_size=250"
  )


@pytest.mark.parametrize("good", [1, 2.5, np.float32(0.1), np.int64(3)])
def test_positive_accepts_and_returns_a_float(good):
  out = _validate.positive("x", good)
  assert out == float(good) and type(out) is float


@pytest.mark.parametrize(
    "bad", [0, -1.0, math.inf, math.nan, True, "1", None, np.array([1.0])]
)
def test_positive_refuses(bad):
  assert _error(_validate.positive, "x", bad, "fix it").startswith(
      "x: must be a finite number > 0, got "
  )


def test_non_negative_and_number():
  assert _validate.non_negative("x", 0) == 0.0
  _error(_validate.non_negative, "x", -1e-9)
  assert _validate.number("x", -3) == -3.0
  _error(_validate.number, "x", math.inf)


@pytest.mark.parametrize(
    "interval, inside, outside",
    [
        ("(0, 1]", [1e-12, 0.5, 1], [0, 1.0000001, -1, math.nan]),
        ("[0, 0.5)", [0, 0.49], [0.5, -1e-9]),
        ("(0, 1)", [0.9], [0, 1]),
        ("[1, inf)", [1, 1e300], [0.999]),
    ],
)
def test_in_interval_reads_brackets_as_in_maths(interval, inside, outside):
  for value in inside:
    assert _validate.in_interval("q", value, interval) == value
  for value in outside:
    text = _error(_validate.in_interval, "q", value, interval)
    assert text.startswith(f"q: must be in {interval}, got ")


def test_in_interval_refuses_non_numbers_with_the_same_line():
  assert _error(_validate.in_interval, "q", "0.5", "(0, 1]") == (
      "q: must be in (0, 1], got '0.5'"
  )
  _error(_validate.probability, "delta", True)


def test_integers():
  assert _validate.positive_int("steps", np.int64(3)) == 3
  assert _validate.non_negative_int("seed", 0) == 0
  assert _validate.int_at_least("n", 2, 2) == 2
  for bad in (0, 2.0, True, "3", None):
    assert _error(_validate.positive_int, "steps", bad).startswith(
        "steps: must be an int >= 1, got "
    )
  assert _error(_validate.non_negative_int, "seed", -1) == (
      "seed: must be an int >= 0, got -1"
  )


def test_one_of_and_check():
  assert _validate.one_of("m", "b", ("a", "b")) == "b"
  assert _error(_validate.one_of, "m", "c", ("a", "b"), "pick one") == (
      "m: must be one of 'a', 'b', got 'c'; pick one"
  )
  _validate.check(True, "x", "anything", 0)
  assert _error(_validate.check, False, "x", "even", 3) == (
      "x: must be even, got 3"
  )


def test_no_value_is_clamped():
  """A validator returns its input unchanged or raises; it never moves it."""
  for value in (1e-300, 1e300, 0.999999):
    assert _validate.positive("x", value) == value
    assert _validate.in_interval("x", value, "(0, inf)") == value


# Real entry points all speak the same line.


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"method": "sgd"}, "method: must be one of 'raptor', "),
        ({"privacy.clip_shared": 0.0}, "privacy.clip_shared: must be a finite"),
        (
            {"raptor.residual_gamma": 1.5},
            "raptor.residual_gamma: must be in (0, 1]",
        ),
        (
            {"epochs": -1},
            "epochs: must be an int >= 0, got -1; set --config.epochs (0:"
            " chosen from n)",
        ),
        (
            {"batch_size": -1},
            "batch_size: must be an int >= 0, got -1; set --config.batch_size"
            " (0: n / 10)",
        ),
        ({"data.eval_split": "test"}, "data.eval_split: must be one of 'dev'"),
        ({"microbatch_size": 0}, "microbatch_size: must be an int >= 1, got 0"),
        ({"model.name": ""}, "model.name: must be a Hub id"),
        ({"privacy.rho": 1.5}, "privacy.rho: must be in (0, 1), got 1.5"),
        ({"privacy.epsilon": 0.0}, "privacy.epsilon: must be a finite number"),
        ({"privacy.delta": 1.0}, "privacy.delta: must be in (0, 1), got 1.0"),
    ],
)
def test_config_validation_speaks_the_uniform_line(overrides, expected):
  text = _error(run_lib.validate, micro_config(**overrides))
  assert text.startswith(expected), text
  assert "; set --config." in text  # says how to fix it


def test_a_non_private_method_ignores_the_budget():
  """Only private methods calibrate: their budget is checked, no one else's."""
  run_lib.validate(
      micro_config(
          method="nonprivate_lora",
          **{"privacy.epsilon": 0.0, "privacy.rho": 2.0},
      )
  )
  run_lib.validate(
      micro_config(
          **{
              "privacy.rho": 2.0,
              "raptor.joint_clip": True,
              "raptor.alternate": False,
          }
      )
  )


def test_sampling_speaks_the_uniform_line():
  assert _error(sampling.poisson_sample, 10, 1.5, seed=0, step=0) == (
      "sample_rate: must be in (0, 1], got 1.5; q = B / n needs an expected"
      " batch size 1 <= B <= n"
  )
  _error(sampling.poisson_sample, 10, 0.5, seed=-1, step=0)
  _error(sampling.microbatches, np.zeros((2, 2), np.int64), 4)
  _error(sampling.check_microbatch_size, 6, num_devices=4)


def test_accounting_calibrate_speaks_the_uniform_line():
  kwargs = dict(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=10)
  assert _error(calibration.calibrate_raptor, **kwargs, rho=1.0).startswith(
      "rho: must be in (0, 1), got 1.0; "
  )
  assert _error(
      calibration.calibrate_dpsgd, **(kwargs | dict(target_epsilon=-1.0))
  ).startswith("target_epsilon: must be a finite number > 0, got -1.0")
  assert _error(accounting.validate_delta, 0.01, 100).startswith(
      "delta: must be below 1/n = 0.01 (n = 100), got 0.01; the default is"
  )
  _error(accounting.default_delta, 1)


def test_transforms_and_ledger_speak_the_uniform_line():
  assert _error(transforms.dp_aggregate, 0.0, 1.0, 4.0, 0) == (
      "l2_clip: must be a finite number > 0, got 0.0; "
      + _validate.PUBLIC_NUMBER
  )
  _error(transforms.privatize_sums, 1.0, -1.0, 4.0, 0)
  _error(transforms.owner_dp_aggregate, 1.0, 1.0, 0, 4.0, 0)
  _error(transforms.dp_aggregate, 1.0, 1.0, 4.0, "seed")
  _error(ledger.PrivacyLedger().record, "", sample_rate=0.1, noise_multiplier=1)


def test_entry_points_exit_with_one_line_unless_asked_for_the_traceback(
    monkeypatch,
):
  def bad():
    with _validate.errors_exit_in_one_line():
      _validate.positive("privacy.epsilon", -1.0, "set --config.x")

  monkeypatch.delenv(_validate.TRACEBACK_VARIABLE, raising=False)
  with pytest.raises(SystemExit) as info:
    bad()
  message = str(info.value.code)
  assert message.startswith("error: privacy.epsilon: must be") and (
      "\n" not in message and "RAPTOR_TRACEBACK=1" in message
  )
  monkeypatch.setenv(_validate.TRACEBACK_VARIABLE, "1")
  with pytest.raises(ValueError, match="privacy.epsilon"):
    bad()
  with pytest.raises(KeyError):  # a bug keeps its traceback
    with _validate.errors_exit_in_one_line():
      raise KeyError("x")
