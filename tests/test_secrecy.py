"""The run's secret, its derived randomness, the data fingerprint, the report."""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest

from raptor_jax import accounting, sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.studies import sweep
from raptor_jax.train import loop, parallel, plans, secrecy
from raptor_jax.train import outputs
from raptor_jax.transforms import DpAggregateState

from helpers import finished_report, micro_config, tensorboard_events


def test_the_secret_has_256_bits_from_the_os_and_labels_separate_streams():
  config = micro_config(**{"privacy.secret_seed": -1})
  a, b = secrecy.draw_secret(config), secrecy.draw_secret(config)
  assert len(a) == 32 and a != b
  outputs = {
      secrecy.derive(a, label) for label in ("poisson", "noise/0", "noise/1")
  }
  assert len(outputs) == 3 and all(len(o) == 32 for o in outputs)
  assert secrecy.sampler_seed(a) != secrecy.sampler_seed(b)
  assert secrecy.sampler_seed(a) >= 2**128 or secrecy.sampler_seed(b) >= 2**128
  # numpy's SeedSequence takes the whole wide seed: one bit apart, other sample.
  seed = secrecy.sampler_seed(a)
  x = sampling.poisson_sample(1000, 0.5, seed=seed, step=0)
  y = sampling.poisson_sample(1000, 0.5, seed=seed ^ (1 << 200), step=0)
  assert not np.array_equal(x, y)
  k0, k1 = secrecy.noise_key(a, 0), secrecy.noise_key(a, 1)
  assert not np.array_equal(k0, k1)
  with pytest.raises(ValueError, match="128 bits"):
    secrecy.derive(b"short", "poisson")


def test_noise_keys_hold_128_bits_and_the_noise_needs_all_of_them():
  """Two independent threefry keys (64 bits each) whose draws combine into
  one N(0, 1): changing either half changes the noise; the std is exact."""
  from raptor_jax import transforms  # pylint: disable=g-import-not-at-top

  key = secrecy.noise_key(secrecy.fixed_secret(3), 0)
  assert key.dtype == np.uint32 and key.shape == (2, 2)  # 2 x 64 bits
  assert np.asarray(key).tobytes() == secrecy.derive(
      secrecy.fixed_secret(3), "noise/0", 16
  )
  zeros = {"w": np.zeros(200_000, np.float32)}

  def noise(k):
    tx = transforms.privatize_sums(1.0, 2.0, 1.0, k)
    return np.asarray(tx.update(zeros, tx.init(zeros))[0]["w"])

  base = noise(key)
  assert abs(base.std() / 2.0 - 1) < 0.01 and abs(base.mean()) < 0.02
  for half in (0, 1):
    other = np.asarray(key).copy()
    other[half, 0] ^= 1
    assert not np.allclose(noise(jax.numpy.asarray(other)), base)
  np.testing.assert_array_equal(noise(key), base)  # deterministic


def test_a_fixed_seed_is_reproducible_and_warns_once(caplog, monkeypatch):
  monkeypatch.setattr(secrecy, "_warned_fixed", [])
  config = micro_config(**{"privacy.secret_seed": 7})
  assert secrecy.draw_secret(config) == secrecy.draw_secret(config)
  assert secrecy.draw_secret(config) != secrecy.fixed_secret(8)
  with caplog.at_level("WARNING", logger="raptor_jax"):
    secrecy.warn_if_fixed(config)
    secrecy.warn_if_fixed(config)
  assert sum("NO privacy" in r.getMessage() for r in caplog.records) == 1


def test_the_secret_seed_reaches_no_file():
  config = micro_config(**{"privacy.secret_seed": 123457})
  text = secrecy.public_config(config)
  assert "secret_seed" not in text and "123457" not in text
  assert json.loads(text)["privacy"]["epsilon"] == config.privacy.epsilon


def test_the_audit_seed_reaches_no_config_json():
  """It reproduces every canary's inclusion bit: the auditor's secret."""
  from raptor_jax import canaries  # pylint: disable=g-import-not-at-top

  config = canaries.audit_config(micro_config(), num_canaries=8, seed=918273645)
  text = secrecy.public_config(config)
  assert "918273645" not in text and "seed" not in json.loads(text)["audit"]
  assert json.loads(text)["audit"]["num_canaries"] == 8


def test_sweep_cells_derive_distinct_secrets_from_the_fixed_seed():
  base = micro_config(**{"privacy.secret_seed": 5})
  cells = [
      sweep.Cell("synthetic", v, 8.0, s)
      for v in ("raptor", "monolithic_lora")
      for s in (0, 1)
  ]
  seeds = [sweep.cell_config(base, c).privacy.secret_seed for c in cells]
  assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
  assert seeds == [
      sweep.cell_config(base, c).privacy.secret_seed for c in cells
  ]
  other = micro_config(**{"privacy.secret_seed": 6})
  assert sweep.cell_config(other, cells[0]).privacy.secret_seed != seeds[0]
  secret = micro_config(**{"privacy.secret_seed": -1})
  assert sweep.cell_config(secret, cells[0]).privacy.secret_seed == -1


def test_the_sweeps_environment_record_hides_the_seed(tmp_path):
  argv = ["launch/sweep.py", "--config.privacy.secret_seed=4242", "--seeds=0"]
  text = sweep.write_environment(tmp_path, argv).read_text()
  assert "4242" not in text and "secret_seed=<redacted> --seeds=0" in text
  argv = ["launch/sweep.py", "--config.privacy.secret_seed", "4343", "--x=1"]
  text = sweep.write_environment(tmp_path, argv).read_text()
  assert "4343" not in text and "secret_seed <redacted> --x=1" in text


def test_wide_secrets_survive_the_multihost_broadcast():
  secret = bytes(range(200, 232))
  assert parallel.broadcast_bytes(secret) == secret
  assert parallel.agree_bytes(secret) == secret


def test_data_fingerprint_follows_every_byte_of_the_train_file(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text("sentence\tlabel\ngood\t1\n")
  config = micro_config(**{"data.task": "sst2", "data.train_path": str(path)})
  before = secrecy.data_fingerprint(config)
  assert before["files"]["train.tsv"]["size"] == path.stat().st_size
  path.write_text("sentence\tlabel\ngood\t0\n")  # same size, one label flipped
  after = secrecy.data_fingerprint(config)
  assert (
      after["files"]["train.tsv"]["size"]
      == before["files"]["train.tsv"]["size"]
  )
  assert after != before
  assert secrecy.data_fingerprint(micro_config()) == dict(
      source="generated", task="synthetic"
  )
  # The published digest is keyed: other secret, other digest; no raw sha256.
  k1 = secrecy.keyed_digest(b"k" * 32, before)
  assert k1 != secrecy.keyed_digest(b"j" * 32, before)
  assert before["files"]["train.tsv"]["sha256"] not in k1


def _state(counts, ledger_steps, cycle):
  opt = {
      name: (DpAggregateState(np.int32(c), None), ())
      for name, c in counts.items()
  }
  ledger = PrivacyLedger()
  for stream, steps in ledger_steps.items():
    ledger.record(stream, sample_rate=0.1, noise_multiplier=1.0, steps=steps)
  return loop.TrainState({}, opt, ledger, cycle)


def _plan_of(*phases):
  def part(name):
    return plans.Part(name, (), None, False, 1.0, 1.0, 1.0)

  return types.SimpleNamespace(
      phases=tuple(
          plans.Phase(name, i, tuple(part(p) for p in parts))
          for i, (name, parts) in enumerate(phases)
      )
  )


def test_a_state_with_more_updates_than_its_ledger_is_refused():
  plan = _plan_of(("shared", ["shared"]), ("expert", ["expert"]))
  outputs.check_consistent(
      plan,
      _state({"shared": 3, "expert": 3}, {"shared": 3, "expert": 3}, 3),
      "ck",
  )
  for counts, steps in [
      ({"shared": 3, "expert": 3}, {"shared": 3, "expert": 2}),
      ({"shared": 4, "expert": 3}, {"shared": 3, "expert": 3}),
  ]:
    with pytest.raises(
        ValueError, match=r"ck: the parameters hold \d noisy"
    ) as e:
      outputs.check_consistent(plan, _state(counts, steps, 3), "ck")
    assert "\n" not in str(e.value)
  joint = _plan_of(("joint", ["shared", "expert"]))
  with pytest.raises(ValueError, match="different noise step counts"):
    outputs.check_consistent(
        joint, _state({"shared": 3, "expert": 2}, {"joint": 3}, 3), "ck"
    )


def _report(method, sigmas):
  """privacy_report of a finished run of a hand-built plan (no calibration)."""
  config = micro_config(method=method)
  private = method != "nonprivate_lora"
  phases = _plan_of(*[(name, [name]) for name in sigmas]).phases
  phases = tuple(
      plans.Phase(
          p.name,
          p.stream,
          tuple(
              dataclasses.replace(part, noise_multiplier=sigmas[p.name])
              for part in p.parts
          ),
          private=private,
      )
      for p in phases
  )
  plan = plans.Plan(
      method, phases, 6, 1 / 6, 1e-5, 8.0 if private else None, 1, {}
  )
  return plan, finished_report(config, plan)


def test_report_carries_each_streams_epsilon_at_half_delta():
  plan, report = _report("raptor", dict(shared=1.0, expert=2.0))
  assert report["rho"] == 0.9 and report["steps_expert"] == plan.cycles
  for phase in plan.phases:
    want = accounting.epsilon(
        accounting.dpsgd_event(
            noise_multiplier=phase.noise_multiplier,
            sample_rate=plan.sample_rate,
            steps=plan.cycles,
        ),
        plan.delta / 2,
    )
    got = report["streams"][phase.name]["epsilon_at_half_delta"]
    assert got == pytest.approx(want, rel=1e-9)
  shared = report["streams"]["shared"]["epsilon_at_half_delta"]
  expert = report["streams"]["expert"]["epsilon_at_half_delta"]
  assert shared > expert  # the shared stream has the smaller sigma
  assert report["epsilon"] == pytest.approx(ledger_epsilon(plan, plan.delta))
  assert report["epsilon"] < shared + expert  # composition beats adding up
  assert report["data"] == dict(source="generated")


def ledger_epsilon(plan, delta):
  return accounting.epsilon(
      accounting.raptor_event(
          sigma_shared=plan.phases[0].noise_multiplier,
          sigma_expert=plan.phases[1].noise_multiplier,
          sample_rate=plan.sample_rate,
          steps_shared=plan.cycles,
          steps_expert=plan.cycles,
      ),
      delta,
  )


@pytest.mark.parametrize("method", ["monolithic_lora", "nonprivate_lora"])
def test_fields_of_other_methods_are_absent_not_filled_in(method):
  _, report = _report(
      method, {"dpsgd" if method == "monolithic_lora" else "nonprivate": 1.0}
  )
  for key in (
      "rho",
      "sigma_shared",
      "sigma_expert",
      "steps_shared",
      "steps_expert",
  ):
    assert key not in report, key
  (stream,) = report["streams"].values()
  assert "epsilon_at_half_delta" not in stream
  assert ("target_epsilon" in report) == (method == "monolithic_lora")


_AGREE = """
import sys
import jax
from raptor_jax.train import parallel
parallel.initialize_distributed(sys.argv[1], 2, int(sys.argv[2]))
mine = bytes([int(sys.argv[2]) + 1]) * 16 + bytes(range(240, 256))
print(parallel.agree_bytes(mine).hex())
"""


@pytest.mark.slow
def test_two_processes_agree_on_process_0s_wide_secret():
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:
    s.bind(("localhost", 0))
    address = f"localhost:{s.getsockname()[1]}"
  procs = [
      subprocess.Popen(
          [sys.executable, "-c", _AGREE, address, str(i)],
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
  want = (bytes([1]) * 16 + bytes(range(240, 256))).hex()
  assert [o.split()[-1] for o, _ in outs] == [want, want]


def test_sweep_tables_show_no_wall_time_unless_every_run_logged_it(tmp_path):
  from raptor_jax.studies import sweep_report  # pylint: disable=g-import-not-at-top

  def row(seed, **extra):
    return dict(
        target_epsilon=8.0,
        variant="raptor",
        task="sst2",
        seed=seed,
        accuracy=0.8,
        finished=True,
        **extra,
    )

  (private,) = sweep_report.summarize([row(0), row(1, wall_time_s=5.0)])
  (logged,) = sweep_report.summarize(
      [row(0, wall_time_s=5.0), row(1, wall_time_s=7.0)]
  )
  assert private["wall_time_s"] is None and logged["wall_time_s"] == 6.0
  assert "| 8 | Ours, entropy-sel. | - |" in sweep_report.markdown([private])
  assert "| 8 | Ours, entropy-sel. | 6 |" in sweep_report.markdown([logged])
  sweep_report.write_csv([private], tmp_path / "t.csv")
  assert (tmp_path / "t.csv").read_text().splitlines()[1].endswith(",2,")


@pytest.mark.parametrize("opt_in", [False, True])
def test_the_progress_bar_times_nothing_unless_opted_in(opt_in):
  config = micro_config(progress_bar=True, log_wall_time=opt_in)
  bar = loop._progress_bar(config, types.SimpleNamespace(cycles=10), 0)
  bar.update(3)
  text = str(bar)
  bar.close()
  assert "3/10" in text
  assert ("cycle/s" in text or "s/cycle" in text) == opt_in
  assert ("00:" in text) == opt_in  # elapsed and remaining time


@pytest.mark.parametrize("opt_in", [False, True])
def test_tensorboard_events_carry_walltime_0_unless_opted_in(tmp_path, opt_in):
  """No time and no host in the event files' names or in any event (the
  file's first event included) unless the run opted in to wall time."""
  import socket  # pylint: disable=g-import-not-at-top

  from raptor_jax.train import metrics  # pylint: disable=g-import-not-at-top

  for session in range(2):  # a resumed run: one file per session
    writer = metrics.MetricWriter(tmp_path, wall_time=opt_in)
    writer.write(3 + session, {"epsilon_spent": 0.5})
    writer.close()
  files = sorted((tmp_path / "tensorboard").iterdir())
  assert [p.name for p in files] == [
      "events.out.tfevents.0000000000.raptor_jax",
      "events.out.tfevents.0000000001.raptor_jax",
  ]
  assert not any(socket.gethostname() in p.name for p in files)
  events = tensorboard_events(files[1])
  assert events[0].file_version == "brain.Event:2"
  assert [(e.step, e.summary.value[0].tag) for e in events[1:]] == [
      (4, "epsilon_spent")
  ]
  assert events[1].summary.value[0].simple_value == 0.5
  times = [e.wall_time for f in files for e in tensorboard_events(f)]
  assert all(t > 1e9 for t in times) if opt_in else set(times) == {0.0}
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert json.loads(lines[0]) == {"step": 3, "epsilon_spent": 0.5}
