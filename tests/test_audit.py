"""Privacy audits: white-box audit of the transforms, planted bugs, one run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from raptor_jax import audit, data
from raptor_jax.studies import audit as train_audit
from raptor_jax import canaries as canaries_lib
from raptor_jax.train import plans, setup
from raptor_jax.train import run as run_lib
from raptor_jax.train.run import build_run

from helpers import MICRO_SHRINK, config_flags, micro_config, run_python, small_glue_on_files

SIGMA = (
    1.0  # near 1: the audit must reach at least half of the analytic epsilon
)
# Steps with the canary, and as many without. At 20,000 the bound is
# 2.07-2.30 over seeds 0-3 for per-leaf noise and 1.84-2.16 for one flat
# draw (the same N(0, I): unit variances, no correlation, normal tails over
# 200,000 draws): the 0.5 x 4.38 bar sat inside the audit's own spread. At
# 50,000 the flat draw gives 2.32-2.48 over seeds 0-3.
TRIALS = 50_000


@pytest.fixture(scope="module")
def owner_audit():
  return audit.audit_transform(
      "owner_dp_aggregate", noise_multiplier=SIGMA, trials=TRIALS
  )


@pytest.fixture(scope="module")
def dense_audit():
  return audit.audit_transform(
      "dp_aggregate", noise_multiplier=SIGMA, trials=TRIALS
  )


def test_analytic_epsilon_is_the_gaussian_mechanism():
  """Independent reference: Balle and Wang's exact delta(epsilon) of the
  Gaussian mechanism with sensitivity 1 and noise std sigma."""
  for sigma in (1.0, 2.0):
    eps = audit.analytic_epsilon(sigma, 1e-5)

    def delta(e):
      a, b = 1 / (2 * sigma), e * sigma
      return stats.norm.cdf(a - b) - np.exp(e) * stats.norm.cdf(-a - b)

    # The PLD accountant rounds pessimistically: its epsilon is at or just
    # above the exact one.
    assert delta(eps) <= 1e-5 < delta(eps - 0.02)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense_audit", "owner_audit"])
def test_real_transforms_stay_below_the_analytic_epsilon(name, request):
  result = request.getfixturevalue(name)
  assert result["confidence"] == 0.95
  assert result["trials_in"] == result["trials_out"] == TRIALS
  # A correct transform never exceeds its claim (except with probability 5%)...
  assert result["epsilon_lower_bound"] <= result["epsilon_analytic"]
  # ...and the audit is strong enough for that to mean something.
  assert result["epsilon_lower_bound"] >= 0.5 * result["epsilon_analytic"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "transform, bug, trials",
    [
        ("dp_aggregate", "no_clipping", 2_000),
        ("dp_aggregate", "noise_on_mean", 2_000),
        ("dp_aggregate", "half_noise", 50_000),
        ("dp_aggregate", "realised_count", 50_000),
        ("owner_dp_aggregate", "no_clipping", 2_000),
    ],
)
def test_planted_bugs_exceed_the_claimed_epsilon(transform, bug, trials):
  """The audit has power: each bug pushes the lower bound above the claim."""
  result = audit.audit_transform(
      transform, noise_multiplier=SIGMA, trials=trials, bug=bug
  )
  assert result["epsilon_lower_bound"] > result["epsilon_analytic"], result


@pytest.mark.slow
def test_expert_isolation_other_experts_show_no_signal(owner_audit):
  # The same canary scored on every expert that does not own it: their
  # releases do not depend on it at all (bit-identical with the same key)...
  assert owner_audit["expert"] == 1
  assert owner_audit["isolation_max_abs_diff"] == 0.0
  assert sorted(owner_audit["other_experts"]) == [0, 2, 3]
  for other in owner_audit["other_experts"].values():
    assert other["epsilon_lower_bound"] == 0.0
    assert abs(other["auroc"] - 0.5) < 0.01
  # ...while a transform that leaks a record into every expert is caught.
  leak = audit.audit_transform(
      "owner_dp_aggregate",
      noise_multiplier=SIGMA,
      trials=2_000,
      bug="owner_leak",
  )
  assert leak["isolation_max_abs_diff"] > 0.0
  for other in leak["other_experts"].values():
    assert other["epsilon_lower_bound"] > 0.5


def test_statistics_come_from_the_auditor():
  separated = audit.one_run_audit([1.0] * 200, [0.0] * 200, delta=1e-5)
  assert separated["epsilon_lower_bound"] > 1.0 and separated["auroc"] == 1.0
  assert separated["num_canaries"] == 400 and separated["num_included"] == 200
  same = audit.one_run_audit([0.0] * 200, [0.0] * 200, delta=1e-5)
  assert same["epsilon_lower_bound"] == 0.0 and same["auroc"] == 0.5
  mia = audit.membership_inference(list(range(1000, 2000)), list(range(1000)))
  assert mia["auroc"] == 1.0 and mia["tpr_at_fpr"] == {
      "0.001": 1.0,
      "0.01": 1.0,
  }
  with pytest.raises(ValueError, match="finite"):
    audit.trials_audit([float("nan")], [0.0], delta=1e-5)
  with pytest.raises(ValueError, match="confidence"):
    audit.one_run_audit([1.0], [0.0], delta=1e-5, confidence=1.0)
  with pytest.raises(ValueError, match="unknown planted bug"):
    audit.audit_transform(
        "dp_aggregate", noise_multiplier=1.0, bug="typo", trials=10
    )


@pytest.mark.slow
def test_one_run_audit_pipeline_writes_audit_json(tmp_path):
  """Micro model, 40 canaries: trains once and writes the marked audit.json."""
  result = train_audit.run(micro_config(), tmp_path, num_canaries=40)
  written = json.loads((tmp_path / "audit.json").read_text())
  assert written == json.loads(json.dumps(result))
  assert (
      written["private_experiment"] is True and "PRIVATE" in written["warning"]
  )
  report = json.loads((tmp_path / "train" / "privacy_report.json").read_text())
  included = written["canaries"]["num_included"]
  # The canaries are private records: counted in n, covered by the claim.
  assert 0 < included < 40 and report["n"] == 300 + included
  assert written["epsilon_claimed"] == report["epsilon"] <= 8.0
  config = json.loads((tmp_path / "train" / "config.json").read_text())
  assert config["audit"]["num_canaries"] == 40
  for stream in ("shared", "expert"):  # RAPTOR: one audit per stream
    entry = written[stream]
    assert entry["num_canaries"] == 40 and entry["confidence"] == 0.95
    assert entry["num_included"] == included
    assert 0.0 <= entry["auroc"] <= 1.0
    assert 0.0 <= entry["epsilon_lower_bound"] <= entry["epsilon_stream"]
    assert entry["epsilon_stream"] < report["epsilon"]
  mia = written["membership_inference"]
  assert mia["members"] == 300 and mia["non_members"] == 64
  assert mia["non_members_from"] == "dev"
  assert set(mia["tpr_at_fpr"]) == {"0.001", "0.01"}


# micro_config as command-line overrides of the tiny preset
MICRO_FLAGS = config_flags(MICRO_SHRINK)


@pytest.mark.slow
def test_audit_command_writes_one_stream_for_one_stream_methods(tmp_path):
  """The README's command, for monolithic_lora at epsilon 1: one 'all' stream."""
  proc = run_python(
      "launch/audit.py",
      "--config=configs/switch_sst2.py:tiny",
      f"--workdir={tmp_path}",
      "--num_canaries=40",
      "--config.method=monolithic_lora",
      "--config.privacy.epsilon=1",
      *MICRO_FLAGS,
      env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  written = json.loads((tmp_path / "audit.json").read_text())
  assert written["method"] == "monolithic_lora"
  assert 0.9 < written["epsilon_claimed"] <= 1.0
  assert "shared" not in written and "expert" not in written
  entry = written["all"]
  assert entry["num_canaries"] == 40 and entry["confidence"] == 0.95
  assert entry["epsilon_stream"] == written["epsilon_claimed"]
  assert 0.0 <= entry["epsilon_lower_bound"] <= written["epsilon_claimed"]
  assert "lower bound" in proc.stdout
  # Bad input: one line that says how to fix it.
  bad = run_python(
      "launch/audit.py",
      f"--workdir={tmp_path / 'b'}",
      timeout=120,
  )
  assert bad.returncode != 0
  assert bad.stderr.strip().splitlines()[-1].startswith("error: set --config")


def test_audited_streams_and_expert_reset():
  def part(name, owner):
    return plans.Part(name, (), None, owner, 1.0, 1.0, 1.0)

  def plan(*phases):
    return plans.Plan("m", phases, 1, 0.1, 1e-5, 1.0, 1, {})

  two = plan(
      plans.Phase("shared", 0, (part("shared", False),)),
      plans.Phase("expert", 1, (part("expert", True),)),
  )
  assert list(train_audit.streams(two)) == ["shared", "expert"]
  one = plan(plans.Phase("dpsgd", 0, (part("all", False),)))
  assert list(train_audit.streams(one)) == ["all"]
  # Resetting the expert part touches only the audited expert's slice.
  final = {"expert": {"w": np.ones((4, 2), np.float32)}}
  initial = {"expert": {"w": np.zeros((4, 2), np.float32)}}
  reset = train_audit.reset_expert(
      jax.tree.map(jnp.asarray, final), initial, two.phases[1].parts, 2
  )
  np.testing.assert_array_equal(reset["expert"]["w"].sum(axis=1), [2, 2, 0, 2])


def test_build_run_inserts_the_canaries_as_private_records():
  """The hook: an audit config's run holds the included canaries, owned by
  the audit's expert, at the end of the training records, counted in n."""
  config = micro_config()
  plain = setup.load_run_data(config)  # the run's real records
  audited = build_run(canaries_lib.audit_config(config, num_canaries=12))
  c = audited.canaries
  assert c.records.input_ids.shape == (12, config.data.max_length)
  k = int(c.included.sum())
  assert 0 < k < 12 and audited.n == len(plain.train) + k
  assert len(audited.data.train) == audited.n
  np.testing.assert_array_equal(
      audited.data.train.input_ids[-k:], c.records.input_ids[c.included]
  )
  np.testing.assert_array_equal(
      audited.data.train.labels[:-k], plain.train.labels
  )
  assert audited.plan.sample_rate == pytest.approx(
      config.batch_size / audited.n
  )
  # Every canary is owned by the audit's expert under the run's owner rule.
  assert np.all(audited.owners[-k:] == c.expert)
  # Random token sequences, a quarter to a half of max_length.
  lengths = c.records.attention_mask.sum(axis=1)
  assert np.all(lengths >= config.data.max_length // 4)
  assert np.all(lengths <= config.data.max_length // 2 + 2)  # + [CLS] [SEP]
  with pytest.raises(ValueError, match="num_canaries"):
    canaries_lib.audit_config(config, num_canaries=1)
  short = data.TextClassificationData(
      c.records.input_ids[:, :8],
      c.records.attention_mask[:, :8],
      c.records.labels,
  )
  with pytest.raises(ValueError, match="length"):
    canaries_lib.with_train_records(audited.data, short)


def test_membership_nonmembers_config_passes_validation(tmp_path):
  """The :small preset holds records out: the non-member config evaluates on
  them and drops the dev fields validation would refuse as ignored."""
  config = small_glue_on_files(tmp_path)
  assert config.data.holdout > 0 and config.data.eval_split == "dev"
  run_lib.validate(config)
  held = train_audit.holdout_config(config)
  run_lib.validate(held)
  assert held.data.eval_split == "holdout" and not held.data.dev_path
  assert config.data.dev_path  # the run's own config is untouched
