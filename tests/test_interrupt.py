"""Interrupts, damaged checkpoints and changed data: what a resume accepts.

An interrupt (KeyboardInterrupt, a scheduler's SIGTERM) may land anywhere in
a cycle. Whatever the point, the checkpoint the error handler leaves must
hold exactly as many noisy updates per stream as its ledger accounts, and
resuming must end in the very state an uninterrupted run reaches (same
samples and noise), so the report counts every release the model holds.
"""

import dataclasses
import json
import shutil
import time

import jax
import numpy as np
import pytest

from raptor_jax import sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import cycle, loop, metrics, parallel, secrecy
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import build_run

from helpers import latest_state, micro_config

# End to end: every test resumes real sessions of one micro run (built once).
pytestmark = pytest.mark.slow


class Interrupt(BaseException):
  """Stands for KeyboardInterrupt / SIGTERM (a BaseException, not an Exception)."""


class Tripwire:
  """Counts calls of the wrapped functions; raises `Interrupt` after call `at`."""

  def __init__(self):
    self.calls, self.at = [], None

  def wrap(self, name, fn):
    def wrapped(*args, **kwargs):
      out = fn(*args, **kwargs)
      self.calls.append(name)
      if self.at is not None and len(self.calls) == self.at:
        raise Interrupt(f"after call {self.at}: {name}")
      return out

    return wrapped


def _config():
  # q = 150/300: 2 cycles of 2 phases (shared, expert), ~3 microbatches each.
  return micro_config(
      batch_size=150,
      microbatch_size=64,
      checkpoint_every_cycles=1,
      eval_every_epochs=100,
  )


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
  """The run (built once), cached jitted steps, a tripwire on every function
  a cycle calls, and a workdir checkpointed after cycle 0."""
  patch = pytest.MonkeyPatch()
  wire = Tripwire()
  run = build_run(_config())
  mesh = parallel.make_mesh(run.config.num_devices)
  cache = {}
  make = cycle.phase_functions

  def phase_functions(run_, mesh_, secret):
    key = bytes(secret) if isinstance(secret, bytes) else secret
    if key not in cache:
      cache[key] = make(run_, mesh_, secret)
      for fns in cache[key]:
        fns.accumulate = wire.wrap("accumulate", fns.accumulate)
        fns.update = wire.wrap("update", fns.update)
    return cache[key]

  patch.setattr(cycle, "phase_functions", phase_functions)
  for owner, name in [
      (sampling, "poisson_sample"),
      (parallel, "local_microbatches"),
      (parallel, "shard_records"),
      (PrivacyLedger, "record"),
      (metrics.MetricWriter, "write"),
      (loop._Session, "log_cycle"),
      (Checkpointer, "save"),
  ]:
    patch.setattr(owner, name, wire.wrap(name, getattr(owner, name)))

  def session(workdir, stop=0):
    config = run.config.copy_and_resolve_references()
    config.stop_after_cycles = stop  # resume-insensitive
    stopped = dataclasses.replace(run, config=config)
    return loop._Session(stopped, mesh, workdir, time.time())

  base = tmp_path_factory.mktemp("base")
  _finish(session(base, stop=1))
  yield run, wire, session, base
  patch.undo()


def applied_and_accounted(workdir):
  """({part: noise steps in the parameters}, {stream: ledger steps}, cycle)."""
  step, state, meta = latest_state(workdir)
  applied = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["opt"])[0]:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if str(keys[-1]) == "count" and str(keys[1]) == "0":
      applied[keys[0]] = int(leaf)
  ledger = json.loads(meta["ledger"])["entries"]
  return applied, {e["stream"]: e["steps"] for e in ledger}, step


def _finish(sess):
  sess.train()
  sess.checkpointer.close()


def test_interrupt_at_every_point_of_a_cycle(harness, tmp_path):
  run, wire, session, base = harness
  reference = tmp_path / "reference"
  shutil.copytree(base, reference)
  wire.at = None
  first = session(reference)
  wire.calls = []  # from here: the cycle only
  _finish(first)
  calls = list(wire.calls)  # cycle 1 (phases shared, expert), log, save
  assert calls.count("update") == 2 and "record" in calls
  _, want, _ = latest_state(reference)
  # Every point: after the first call of each function in each phase (a
  # phase ends with its update), and after the last call of the cycle.
  firsts, phase = {}, 0
  for i, name in enumerate(calls):
    firsts.setdefault((name, phase), i)
    phase += name == "update"
  points = sorted(set(firsts.values()) | {len(calls) - 1})
  disagreements = []
  for i in points:
    workdir = tmp_path / f"cut{i}"
    shutil.copytree(base, workdir)
    cut_session = session(workdir)
    wire.calls, wire.at = [], i + 1
    with pytest.raises(Interrupt):
      cut_session.train()
    cut_session.checkpointer.close()
    wire.at = None
    cut = applied_and_accounted(workdir)
    _finish(session(workdir))
    end = applied_and_accounted(workdir)
    for applied, accounted, cycle in (cut, end):
      if (
          set(applied.values()) != {cycle}
          or set(accounted.values()) != {cycle}
          or len(applied) != 2
          or len(accounted) != 2
      ):
        disagreements.append((i, calls[i], applied, accounted, cycle))
    _, got, _ = latest_state(workdir)
    jax.tree.map(
        np.testing.assert_array_equal, want["trainable"], got["trainable"]
    )
  assert not disagreements, disagreements


def _copy(base, tmp_path, name):
  workdir = tmp_path / name
  shutil.copytree(base, workdir)
  return workdir


def _meta_file(workdir, step):
  """The JSON file of checkpoint `step`'s meta (orbax's layout)."""
  for path in (workdir / "checkpoints" / str(step) / "meta").rglob("*"):
    if path.is_file():
      try:
        if "ledger" in json.loads(path.read_text()):
          return path
      except (ValueError, UnicodeDecodeError):
        continue
  raise AssertionError(f"no meta file in checkpoint {step}")


@pytest.mark.parametrize("item", ["state", "meta", ""])
def test_an_unreadable_checkpoint_stops_with_one_line_naming_it(
    harness, tmp_path, item
):
  _, wire, session, base = harness
  wire.at = None
  workdir = _copy(base, tmp_path, "w")
  _finish(session(workdir))  # checkpoints 1 and 2
  for path in (workdir / "checkpoints" / "2" / item).rglob("*"):
    if path.is_file():
      path.write_bytes(b"")  # emptied, as a full disk or a crash leaves it
  with pytest.raises(ValueError) as error:
    session(workdir)
  message = str(error.value)
  assert "\n" not in message
  assert f"checkpoint {workdir / 'checkpoints' / '2'} is unreadable" in message
  assert "resume from cycle 1" in message
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [
      "1",
      "2",
  ]  # nothing started from scratch, nothing overwritten


def test_a_checkpoint_whose_ledger_misses_an_update_is_refused(
    harness, tmp_path
):
  _, wire, session, base = harness
  wire.at = None
  workdir = _copy(base, tmp_path, "w")
  path = _meta_file(workdir, 1)
  meta = json.loads(path.read_text())
  ledger = json.loads(meta["ledger"])
  ledger["entries"] = [e for e in ledger["entries"] if e["stream"] != "expert"]
  meta["ledger"] = json.dumps(ledger)
  path.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="1 noisy updates of stream 'expert'"):
    session(workdir)


def test_resuming_on_changed_data_stops_with_one_line(
    harness, tmp_path, monkeypatch
):
  _, wire, session, base = harness
  wire.at = None
  workdir = _copy(base, tmp_path, "w")
  changed = dict(
      source="file", files={"train.tsv": dict(size=10, sha256="ab" * 32)}
  )
  monkeypatch.setattr(secrecy, "data_fingerprint", lambda config: changed)
  with pytest.raises(ValueError) as error:
    session(workdir)
  message = str(error.value)
  assert message.startswith("the training data changed since")
  assert "\n" not in message
  # Neither the size nor a plain digest of the private file: the digests
  # keyed by the run's secret (privacy_report.json's keyed_sha256) only.
  assert "10 bytes" not in message and "abab" not in message
  _, _, meta = latest_state(workdir)
  secret = bytes.fromhex(meta["secret"])
  digest = secrecy.keyed_digest(secret, changed)
  assert f"(now keyed sha256 {digest}, then generated synthetic)" in message


def test_config_json_never_holds_the_secret_seed(harness):
  _, _, _, base = harness
  config = json.loads((base / "config.json").read_text())
  assert "secret_seed" not in config["privacy"]
  assert "secret_seed" not in (base / "config.json").read_text()


def test_no_fresh_start_where_an_earlier_run_reported(harness, tmp_path):
  _, wire, session, base = harness
  wire.at = None
  workdir = _copy(base, tmp_path, "w")
  shutil.rmtree(workdir / "checkpoints")
  (workdir / "privacy_report.json").write_text("{}")
  with pytest.raises(ValueError, match="reports an earlier run but"):
    session(workdir)
