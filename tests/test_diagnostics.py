"""App. G diagnostics: formulas on hand-made inputs, and what they measure on a model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import calibration, diagnostics, roles
from raptor_jax.train import setup, step
from raptor_jax.train.run import build_run

from helpers import micro_config, phase_functions, train_batch

TWO_BLOCKS = {
    "model.random.num_layers": 2
}  # one dense, one sparse block (block 1)


def test_role_mismatch_is_half_the_l1_distance_of_shares():
  # Gradient energy 3:1 on (shared, experts), parameters 1:3 -> shares .75/.25 vs .25/.75.
  out = diagnostics.role_mismatch(
      {"shared": 3.0, "experts": 1.0, "router": 0.0},
      {"shared": 10, "experts": 30, "router": 0, "head": 0},
  )
  assert out["M_role"] == pytest.approx(0.5)
  assert out["norm_share"] == pytest.approx({"shared": 0.75, "experts": 0.25})
  assert out["param_share"] == pytest.approx({"shared": 0.25, "experts": 0.75})
  # Proportionate signal: zero mismatch; all signal on a role with no parameters: one.
  assert (
      diagnostics.role_mismatch({"a": 2.0, "b": 6.0}, {"a": 1, "b": 3})[
          "M_role"
      ]
      == 0.0
  )
  assert diagnostics.role_mismatch(
      {"a": 1.0, "b": 0.0}, {"a": 1, "b": 10**9}
  )["M_role"] == pytest.approx(1.0, abs=1e-8)
  with pytest.raises(ValueError):
    diagnostics.role_mismatch({"a": 0.0}, {"a": 3})


def test_expert_snr_and_its_summary():
  # Expert 0: mean contribution m = (1, 0) over 2 records; expert 1: none.
  # SNR_0 = B^2 ||m||^2 / (sigma^2 C^2 d) = 100 * 1 / (4 * 0.25 * 2) = 50.
  snr = diagnostics.expert_snr(
      np.array([[2.0, 0.0], [0.0, 0.0]]),
      num_records=2,
      batch_size=10.0,
      noise_multiplier=2.0,
      l2_clip=0.5,
  )
  np.testing.assert_allclose(snr, [50.0, 0.0])
  assert diagnostics.snr_summary([1.0, 3.0]) == pytest.approx(
      {"mean": 2.0, "cv": 0.5}
  )
  assert diagnostics.snr_summary([2.0, 2.0, 2.0])["cv"] == 0.0
  # Owner load enters squared: (B q_e)^2 ||mu_e||^2; doubling the owners quadruples SNR.
  one, two = diagnostics.expert_snr(
      np.array([[1.0], [2.0]]),
      num_records=4,
      batch_size=8.0,
      noise_multiplier=1.0,
      l2_clip=1.0,
  )
  assert two == pytest.approx(4 * one)
  with pytest.raises(ValueError, match="private"):
    diagnostics.expert_snr(
        np.ones((2, 2)),
        num_records=1,
        batch_size=1.0,
        noise_multiplier=0.0,
        l2_clip=1.0,
    )


def test_noise_sensitivity_floors_at_zero():
  # lambda_+ = max(dL, 0) / (s^2 d): 0.02 / (0.01 * 2) = 1.
  assert diagnostics.noise_sensitivity(0.02, 0.1, 2) == pytest.approx(1.0)
  assert diagnostics.noise_sensitivity(-0.5, 0.1, 2) == 0.0
  # Tab. 10's shared row: 2.175e-4 / (1e-3^2 * 9,438,722) = 2.30e-5.
  assert diagnostics.noise_sensitivity(
      2.175e-4, 1e-3, 9_438_722
  ) == pytest.approx(2.305e-5, rel=2e-3)


def test_diagnostic_roles():
  role = roles.diagnostic_role
  assert role("backbone/block_1/attention/q/lora_a") == "shared"
  assert role("backbone/block_1/attention/q/kernel") == "shared"
  assert role("backbone/embed_tokens/embedding") == "shared"
  assert role("backbone/block_1/mlp/router/kernel") == "router"
  assert role("backbone/block_1/mlp/experts/wi/lora_b") == "experts"
  assert role("backbone/block_1/mlp/experts/wo/kernel") == "experts"
  assert (
      role("backbone/block_1/mlp/shared_experts/up/lora_a") == "shared_expert"
  )
  assert (
      role("backbone/block_1/mlp/shared_experts/down/kernel") == "shared_expert"
  )
  assert role("backbone/block_0/attention/kv_b/lora_b") == "shared"  # MLA
  assert role("head/kernel") == "head"


def _two_block_run(method):
  """The run `build_run` assembles (l* = sparse block 1), every adapter non-zero."""
  config = micro_config(
      method=method,
      **TWO_BLOCKS,
      **{
          "raptor.layer": "last",
          "privacy.clip_shared": 1e-3,
          "privacy.clip_expert": 2e-3,
      },
  )
  run = build_run(config)
  flat = {
      p: (0.5 * jnp.ones_like(v) if p.endswith("lora_b") else v)
      for p, v in roles.flatten(
          step.merged_params(run.frozen, run.trainable)
      ).items()
  }  # every adapter has a gradient
  trainable, frozen = setup.partition(roles.unflatten(flat), run.plan.parts)
  return run, trainable, frozen


@pytest.mark.parametrize("method", ["raptor", "baseline_a"])
def test_statistics_measure_exactly_the_clipped_sums_training_makes(
    method, monkeypatch
):
  """Signal sums at l* equal the phase's own clipped sums; energy of one record is C^2."""
  # The noise plays no part here: skip calibrating it.
  monkeypatch.setattr(calibration, "calibrate_dpsgd", lambda **_: 1.0)
  monkeypatch.setattr(calibration, "calibrate_raptor", lambda **_: (1.0, 1.0))
  run, trainable, frozen = _two_block_run(method)
  run_data, owners, model, plan = run.data, run.owners, run.model, run.plan
  phase = plan.phases[
      -1
  ]  # RAPTOR's expert phase (owner slices); Baseline A's one phase
  fns = phase_functions(model, phase, 1, 4)
  rows = np.arange(3)
  batch = train_batch(run_data.train, rows, owners[rows])
  mask = jnp.array([1.0, 1.0, 0.0])  # the third row is padding
  squared, signal = jax.jit(
      functools.partial(diagnostics.phase_statistics, fns, 1, 4)
  )(  # pylint: disable=protected-access
      trainable, frozen, batch, mask
  )
  sums = jax.jit(fns._local_sums)(  # pylint: disable=protected-access
      trainable, frozen, batch, mask
  )
  assert signal and set(signal) == set(sums["expert"])
  for path, value in signal.items():
    np.testing.assert_allclose(
        value, sums["expert"][path], rtol=1e-5, atol=1e-12
    )
  clip_energy = (
      1e-3**2 if phase.joint_clip else 2e-3**2
  )  # C^2 or C_e^2 per record
  # Each record's released gradient is clipped to C (raw norms are far
  # above it) unless it is zero: the padding row, or a record none of whose
  # tokens reach the expert it owns once the adapters move the routing.
  released = fns.released_per_record(trainable, frozen, batch, mask)
  per_record = sum(
      jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(len(rows), -1), axis=1)
      for part in released.values()
      for g in part.values()
  )
  active = np.asarray(per_record) > 0
  assert active[:2].any() and not active[2], per_record
  np.testing.assert_allclose(per_record[active], clip_energy, rtol=1e-3)
  assert sum(float(v) for v in squared.values()) == pytest.approx(
      int(active.sum()) * clip_energy, rel=1e-3
  )
  assert float(squared["router"]) == 0.0 and float(squared["experts"]) > 0
