"""The training loop: reports, resume equality, privacy hygiene, errors."""

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import data, roles
from raptor_jax.train import loop, methods, setup
from raptor_jax.train import run as run_lib
from raptor_jax.train import train_and_evaluate
from raptor_jax.train.run import build_run

from helpers import latest_state, micro_config, micro_model, phase_functions

_FULL_RUN_VALIDATIONS = collections.Counter()  # by validator


def _count_validations(patch, counts):
  """Counts the calls of the config validator (`run.validate`) and of the
  method checks it runs (`methods.check_config`; `build_plan` runs it too)."""

  def counting(name, validator):
    def counted(config):
      counts[name] += 1
      return validator(config)

    return counted

  validate = counting("validate", run_lib.validate)
  patch.setattr(run_lib, "validate", validate)
  patch.setattr(loop, "validate", validate)
  patch.setattr(
      methods, "check_config", counting("check_config", methods.check_config)
  )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("full")
  with pytest.MonkeyPatch.context() as patch:
    _count_validations(patch, _FULL_RUN_VALIDATIONS)
    results = train_and_evaluate(micro_config(), str(workdir))
  return workdir, results


def test_a_run_validates_its_config_once(full_run, monkeypatch, tmp_path):
  """launch/main.py's run (`train_and_evaluate(config, workdir)`): validated
  at its start, before anything loads, and never again (build_run and
  build_plan are told); the audit's (a prebuilt `build_run(config)`) too."""
  del full_run
  assert _FULL_RUN_VALIDATIONS == {"validate": 1, "check_config": 1}
  counts = collections.Counter()
  _count_validations(monkeypatch, counts)
  config = micro_config()
  run = build_run(config)
  train_and_evaluate(config, str(tmp_path), run=run, dry_run=True)
  assert counts == {"validate": 1, "check_config": 1}


def test_full_run_reports(full_run):
  workdir, results = full_run
  report = json.loads((workdir / "privacy_report.json").read_text())
  for key in (
      "epsilon",
      "target_epsilon",
      "delta",
      "sigma_shared",
      "sigma_expert",
      "sample_rate",
      "steps_shared",
      "steps_expert",
      "rho",
      "accountant",
  ):
    assert key in report, key
  assert (
      report["finished"]
      and report["steps_shared"] == report["steps_expert"] == 6
  )
  assert report["epsilon"] <= report["target_epsilon"]
  assert (
      report["epsilon"] > 0.99 * report["target_epsilon"]
  )  # the whole budget ran
  assert 0.0 <= results["accuracy"] <= 1.0
  assert "wall_time_s" not in results  # private unless log_wall_time
  assert results["parameters_by_role"]["expert_adapter"] > 0
  assert (workdir / "metrics.jsonl").exists() and list(
      (workdir / "tensorboard").iterdir()
  )


def test_resume_equals_uninterrupted(full_run, tmp_path):
  workdir, _ = full_run
  first = train_and_evaluate(
      micro_config(stop_after_cycles=2, log_wall_time=True), str(tmp_path)
  )
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  assert first["cycles"] == 2 and not first["finished"]
  assert report["steps_shared"] == report["steps_expert"] == 2
  assert 0 < report["epsilon"] < report["target_epsilon"]
  resumed = train_and_evaluate(micro_config(log_wall_time=True), str(tmp_path))
  assert resumed["finished"] and resumed["cycles"] == 6
  # Wall time counts both segments; the second session's own time is shown apart.
  assert resumed["wall_time_s"] > first["wall_time_s"]
  assert resumed["wall_time_s"] > resumed["wall_time_this_session_s"] > 0
  step_a, state_a, meta_a = latest_state(workdir)
  step_b, state_b, meta_b = latest_state(tmp_path)
  assert step_a == step_b == 6
  jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
  assert json.loads(meta_a["ledger"]) == json.loads(meta_b["ledger"])
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  assert [e["steps"] for e in report["ledger"]["entries"]] == [6, 6]


def test_every_step_function_compiles_once_per_run(tmp_path, caplog):
  """Fixed shapes: 3 cycles with different realised sample sizes, one compilation
  of each phase's microbatch step and update (an invariant of docs/method.md §3),
  compiled ahead of the first cycle.
  """
  jax.clear_caches()  # not served by another test's programs in this worker
  with caplog.at_level("WARNING"), jax.log_compiles():
    train_and_evaluate(micro_config(stop_after_cycles=3), str(tmp_path))
  compiled = [
      r.getMessage()
      for r in caplog.records
      if r.getMessage().startswith("Compiling")
  ]
  for name in ("_accumulate", "_packed_update", "_unpack", "_zero_sums"):
    assert sum(f"jit({name})" in m for m in compiled) == 2, name  # two phases


def test_a_checkpoint_of_another_config_is_refused(full_run):
  workdir, _ = full_run
  # Before any data is loaded, naming the field that differs.
  with pytest.raises(
      ValueError,
      match=r"holds a run of another config: privacy.epsilon \(then 8.0, now"
      r" 1.0\); use another --workdir",
  ):
    train_and_evaluate(micro_config(**{"privacy.epsilon": 1.0}), str(workdir))


def test_no_private_statistics_reach_the_workdir(full_run):
  """Owner map, per-expert counts and private per-step statistics stay in memory."""
  workdir, _ = full_run
  run = build_run(micro_config())
  layer = json.loads((workdir / "layer_selection.json").read_text())[
      "selected_layer"
  ]
  assert layer == run.expert_layer
  owner_map = run.owners
  counts = np.bincount(owner_map, minlength=run.num_experts)
  assert (
      len(set(owner_map.tolist())) > 1
  )  # a non-trivial map, so the scan means something
  needles = [
      owner_map.astype(np.int32).tobytes(),
      owner_map.astype(np.int64).tobytes(),
      json.dumps(owner_map.tolist()).encode(),
      json.dumps(counts.tolist()).encode(),
      " ".join(map(str, owner_map.tolist())).encode(),
  ]
  files = [p for p in workdir.rglob("*") if p.is_file()]
  assert files
  for path in files:
    content = path.read_bytes()
    for needle in needles:
      assert needle not in content, f"private statistic found in {path}"
  allowed = {
      "step",
      "epoch",
      "epsilon_spent",
      "dev/accuracy",
      "final/dev_accuracy",
  }
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    assert set(json.loads(line)) <= allowed
  text = " ".join(p.read_text() for p in workdir.glob("*.json"))
  assert "owner" not in text.replace("owner_weighting", "")


def test_private_training_loss_only_on_explicit_opt_in(tmp_path, caplog):
  with caplog.at_level("WARNING", logger="raptor_jax"):
    train_and_evaluate(
        micro_config(stop_after_cycles=1, log_private_stats=True), str(tmp_path)
    )
  assert "NOT differentially private" in caplog.text
  keys = set().union(
      *(
          json.loads(line)
          for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
      )
  )
  assert {"private/shared_train_loss", "private/expert_train_loss"} <= keys


def _phase_setup(residual="shared"):
  _, run_data, plan, model, params, bc = micro_model()
  # Non-zero B factors so that every expert's adapter has a gradient.
  flat = roles.flatten(params)
  for i, path in enumerate(sorted(p for p in flat if p.endswith("lora_b"))):
    flat[path] = 0.5 * jax.random.normal(
        jax.random.PRNGKey(i), flat[path].shape
    )
  params = roles.unflatten(flat)
  expert_phase = plan.phases[1]
  trainable, frozen = setup.partition(params, expert_phase.parts)
  fns = phase_functions(
      model, expert_phase, plan.expert_layer, bc.num_experts, residual=residual
  )
  batch = dict(
      input_ids=jnp.asarray(run_data.train.input_ids[:8]),
      attention_mask=jnp.asarray(run_data.train.attention_mask[:8]),
      labels=jnp.asarray(run_data.train.labels[:8]),
      owners=jnp.zeros((8,), jnp.int32),
  )
  return fns, trainable, frozen, batch, bc.num_experts


def test_expert_without_records_still_changes_every_step():
  fns, trainable, frozen, batch, num_experts = _phase_setup()
  opt = fns.init_opt_states(trainable)
  before = trainable["expert"]
  for _ in range(2):
    sums = {
        "expert": jax.tree.map(
            lambda x: jnp.zeros(x.shape, jnp.float32), before
        )
    }
    sums = fns.accumulate(trainable, frozen, sums, batch, jnp.ones((8,)))
    # Every record is owned by expert 0: experts 1.. get no record.
    for path, s in sums["expert"].items():
      assert np.all(np.asarray(s[1:]) == 0), path
    new_trainable, opt = fns.update(trainable, opt, sums)
    for path in before:
      delta = np.asarray(
          new_trainable["expert"][path] - trainable["expert"][path]
      )
      for e in range(num_experts):
        assert np.any(delta[e] != 0), (path, e)
    trainable = new_trainable


def test_residual_weights_in_unit_interval_and_applied_before_clipping():
  fns, trainable, frozen, batch, _ = _phase_setup()
  params = {**frozen, **trainable["expert"]}
  weights = np.asarray(fns._residual_weights(params, batch))
  assert np.all((weights >= 0) & (weights <= 1)) and np.ptp(weights) > 0
  # Brute force: per-record owner-slice gradients, scaled by w_i, THEN clipped.
  clip = fns.phase.parts[0].l2_clip
  slices = jax.tree.map(lambda p: p[0], trainable["expert"])
  expected = jax.tree.map(jnp.zeros_like, slices)
  record_grad = jax.jit(
      jax.grad(
          lambda s, record: fns._record_loss({}, {"expert": s}, params, record)
      )
  )
  for i in range(8):
    g = record_grad(slices, jax.tree.map(lambda x: x[i], batch))
    g = jax.tree.map(lambda x: weights[i] * x, g)
    norm = np.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(g)))
    expected = jax.tree.map(
        lambda e, x: e + x * min(1.0, clip / max(norm, 1e-30)), expected, g
    )
  sums = {
      "expert": jax.tree.map(
          lambda x: jnp.zeros(x.shape, jnp.float32), trainable["expert"]
      )
  }
  got = fns.accumulate(trainable, frozen, sums, batch, jnp.ones((8,)))["expert"]
  for path in expected:
    np.testing.assert_allclose(
        got[path][0], expected[path], rtol=2e-3, atol=1e-6
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"data.task": "nope"}, "data.task: must be one of"),
        ({"raptor.layer": "2"}, "not a sparse layer"),
        ({"batch_size": 5000}, r"batch_size: must be in \[1, n\]"),
        ({"method": "magic"}, "method: must be one of"),
        ({"raptor.residual_gamma": 0.0}, "residual_gamma"),
        ({"model.name": ""}, "model.name"),
        (
            {"data.eval_split": "holdout"},
            "data.eval_split: must be one of 'dev'",
        ),
        ({"data.holdout": 10}, "data.holdout: must be unset"),
    ],
)
def test_bad_configs_fail_with_one_clear_line(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    train_and_evaluate(micro_config(**overrides), str(tmp_path))


def test_public_corpus_required_to_be_non_empty(tmp_path):
  corpus = tmp_path / "empty.txt"
  corpus.write_text("\n\n")
  with pytest.raises(ValueError, match="empty"):
    data.load_public_corpus(path=str(corpus))
