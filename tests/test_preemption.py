"""Preemption: stop signals, the workdir lock, time-based checkpoints, stale logs.

The end-to-end tests send REAL signals (SIGTERM as SLURM and Kubernetes
send it, SIGINT as Ctrl-C does) to `launch/main.py` in a subprocess, then
resume it with the same command and compare with an uninterrupted run.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from raptor_jax.train import loop, preemption
from raptor_jax.train import workdir as workdir_lib

from helpers import ROOT, latest_state, micro_config, micro_flags

# The micro run of `helpers.micro_config` on the command line, 5 epochs
# (30 cycles) so that two signals land mid-run.
_CYCLES = 30
_MICRO_FLAGS = [
    "--config=configs/switch_sst2.py:tiny",
    *micro_flags(epochs=5, eval_every_epochs=100),
]


def _main(workdir, *flags):
  """`launch/main.py` on the micro run, started (not waited for)."""
  return subprocess.Popen(
      [
          sys.executable,
          "launch/main.py",
          *_MICRO_FLAGS,
          f"--workdir={workdir}",
          *flags,
      ],
      cwd=ROOT,
      env=dict(os.environ, XLA_FLAGS=""),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def _wait_for_checkpoint(workdir, proc, cycle):
  deadline = time.monotonic() + 600
  while (preemption.latest_checkpoint(workdir) or 0) < cycle:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.2)


def _finished(proc):
  _, stderr = proc.communicate(timeout=900)
  assert proc.returncode == 0, stderr[-3000:]
  return stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _finished(_main(workdir))
  return latest_state(workdir)


def _stop(workdir, signum, after):
  """Runs the micro command, sends `signum` once a checkpoint past `after`
  exists; returns the cycle the run says it saved."""
  proc = _main(workdir)
  _wait_for_checkpoint(workdir, proc, after + 2)
  proc.send_signal(signum)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, stderr[-3000:]
  assert "Traceback" not in stderr
  cycle = preemption.latest_checkpoint(workdir)
  name = signal.Signals(signum).name
  assert stderr.strip().splitlines()[-1] == (
      f"stopped by {name} after cycle {cycle}; checkpoint saved; rerun the"
      " same command to resume"
  )
  assert after + 2 <= cycle < _CYCLES
  _, _, meta = latest_state(workdir)
  ledger = json.loads(meta["ledger"])["entries"]
  assert {entry["steps"] for entry in ledger} == {cycle}
  return cycle


@pytest.mark.slow
def test_sigterm_and_sigint_checkpoint_exit_in_one_line_and_resume_exactly(
    uninterrupted, tmp_path
):
  first = _stop(tmp_path, signal.SIGTERM, after=0)
  second = _stop(tmp_path, signal.SIGINT, after=first)  # the same command
  stderr = _finished(_main(tmp_path))
  assert f"resumed from cycle {second} of {_CYCLES}" in stderr
  want_step, want, _ = uninterrupted
  step, got, _ = latest_state(tmp_path)
  assert step == want_step == _CYCLES
  for part, params in want["trainable"].items():
    for path, value in params.items():
      np.testing.assert_array_equal(got["trainable"][part][path], value)


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_stops_before_loading(tmp_path):
  holder = _holding(tmp_path)
  try:
    second = subprocess.run(
        [
            sys.executable,
            "launch/main.py",
            *_MICRO_FLAGS,
            f"--workdir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
  finally:
    holder.kill()
    holder.wait()
  assert second.returncode == 1
  assert second.stderr.strip().splitlines() == [
      f"error: {tmp_path} is in use by process {holder.pid} on"
      f" {os.uname().nodename} (lock {tmp_path / '.lock'}); wait for it to"
      " end, or train in another --workdir  (RAPTOR_TRACEBACK=1 shows the"
      " traceback)"
  ]
  assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


@pytest.mark.slow
def test_the_default_device_split_survives_a_loaded_machine(tmp_path):
  # Busy processes on every core while the default run (one XLA device per
  # core, collectives across them) trains to the end.
  busy = [
      subprocess.Popen([sys.executable, "-c", "while True: pass"])
      for _ in range(os.cpu_count())
  ]
  try:
    stderr = _finished(
        _main(
            tmp_path,
            "--config.epochs=1",  # 6 cycles
            "--config.checkpoint_every_cycles=1000",
            "--config.checkpoint_every_minutes=0.00001",
        )
    )
  finally:
    for proc in busy:
      proc.kill()
      proc.wait()
  assert "Termination timeout" not in stderr
  assert json.loads((tmp_path / "privacy_report.json").read_text())["finished"]
  # Time-based checkpoints after every cycle (the cycle count alone: 6 only).
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
  assert saved == [5, 6]


_HOLD_LOCK = """
    import sys, time
    from pathlib import Path
    from raptor_jax.train import preemption
    with preemption.WorkdirLock(Path(sys.argv[1])):
      print('locked', flush=True)
      time.sleep(600)
"""


def _holding(workdir):
  proc = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(_HOLD_LOCK), str(workdir)],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      text=True,
  )
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_busy_workdir_is_refused_and_a_killed_holders_lock_taken_over(
    tmp_path, caplog
):
  holder = _holding(tmp_path)
  try:
    with pytest.raises(ValueError) as error:
      with preemption.WorkdirLock(tmp_path):
        pass
    assert str(error.value) == (
        f"{tmp_path} is in use by process {holder.pid} on"
        f" {os.uname().nodename} (lock {tmp_path / '.lock'}); wait for it to"
        " end, or train in another --workdir"
    )
  finally:
    holder.kill()  # SIGKILL: no handler runs, the lock file stays
    holder.wait()
  assert str(holder.pid) in (tmp_path / ".lock").read_text()
  with caplog.at_level(logging.WARNING, logger="raptor_jax"):
    with preemption.WorkdirLock(tmp_path):
      assert str(os.getpid()) in (tmp_path / ".lock").read_text()
  assert f"from process {holder.pid} on" in caplog.text
  assert "which no longer runs" in caplog.text
  assert (tmp_path / ".lock").read_text() == ""  # released normally


def test_one_process_cannot_lock_a_workdir_twice(tmp_path):
  with preemption.WorkdirLock(tmp_path):
    with pytest.raises(ValueError, match=f"in use by process {os.getpid()}"):
      with preemption.WorkdirLock(tmp_path):
        pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signals_raise_stopped_and_handlers_are_restored(signum):
  before = signal.getsignal(signum)
  with pytest.raises(preemption.Stopped) as stopped:
    with preemption.stop_on_signals():
      os.kill(os.getpid(), signum)
      time.sleep(5)  # interrupted by the handler
  assert stopped.value.signum == signum
  assert isinstance(stopped.value, KeyboardInterrupt)
  assert signal.getsignal(signum) is before


def test_a_signal_during_a_save_waits_for_it():
  written = []
  with pytest.raises(preemption.Stopped):
    with preemption.stop_on_signals():
      with preemption.deferred_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        written.append("checkpoint")
  assert written == ["checkpoint"]
  with preemption.stop_on_signals():
    with preemption.deferred_signals(raise_after=False):
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)


def test_stopped_says_where_the_run_stopped():
  stopped = preemption.Stopped(signal.SIGTERM)
  stopped.cycle = 11
  assert stopped.one_line() == (
      "stopped by SIGTERM after cycle 11; checkpoint saved; rerun the same"
      " command to resume"
  )
  stopped.cycle = None
  assert "no checkpoint yet" in stopped.one_line()


def test_checkpoints_are_due_by_cycles_and_by_minutes():
  now = [0.0]
  clock = preemption.CheckpointClock(10, 5.0, clock=lambda: now[0])
  assert not clock.due(3)
  now[0] = 299.0
  assert not clock.due(4)
  now[0] = 300.0
  assert clock.due(5)
  clock.saved(5)
  assert not clock.due(14) and clock.due(15)
  assert not preemption.CheckpointClock(10, 0.0, clock=lambda: 1e9).due(1)


def test_logs_of_a_run_that_died_before_its_first_checkpoint_move_aside(
    tmp_path,
):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  (tmp_path / "tensorboard").mkdir()
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1").mkdir()  # uncommitted
  workdir_lib.start_fresh(tmp_path)
  aside = tmp_path / "stopped_before_checkpoint.0"
  assert sorted(p.name for p in aside.iterdir()) == [
      "config.json",
      "metrics.jsonl",
      "tensorboard",
  ]
  assert not (tmp_path / "metrics.jsonl").exists()
  (tmp_path / "metrics.jsonl").write_text("")
  workdir_lib.start_fresh(tmp_path)
  assert (tmp_path / "stopped_before_checkpoint.1" / "metrics.jsonl").exists()
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "checkpoints" / "4").mkdir()  # a committed checkpoint: resume
  workdir_lib.start_fresh(tmp_path)
  assert (tmp_path / "metrics.jsonl").exists()


def test_a_workdir_of_another_config_is_refused_naming_the_fields(tmp_path):
  config = micro_config()
  (tmp_path / "config.json").write_text(
      loop.secrecy.public_config(micro_config(batch_size=60, **{"seed": 3}))
  )
  workdir_lib.check_workdir(config, tmp_path)  # no checkpoint: a fresh start
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(ValueError) as error:
    workdir_lib.check_workdir(config, tmp_path)
  assert str(error.value) == (
      f"{tmp_path} holds a run of another config: batch_size (then 60, now"
      " 50), seed (then 3, now 0); use another --workdir, or rerun with the"
      " config in its config.json"
  )
  resume_insensitive = micro_config(checkpoint_every_minutes=5.0)
  (tmp_path / "config.json").write_text(loop.secrecy.public_config(config))
  workdir_lib.check_workdir(resume_insensitive, tmp_path)


def test_checkpoint_every_minutes_is_validated():
  with pytest.raises(ValueError, match="checkpoint_every_minutes: must be"):
    loop.validate(micro_config(checkpoint_every_minutes=-1.0))


@pytest.mark.slow
def test_a_signal_during_evaluation_keeps_the_cycles_rows(
    tmp_path, monkeypatch
):
  """SIGTERM in the end-of-epoch evaluation: the evaluation ends and its rows
  are written, then the run stops with that cycle checkpointed (a resumed run
  starts after it, so rows skipped then were lost for good)."""
  config = micro_config(epochs=2)  # 6 cycles per epoch: evaluations at 6, 12
  evaluate = loop._Session.evaluate
  signalled = []

  def evaluate_and_signal(session):
    if not signalled:
      signalled.append(session.state.cycle)
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)  # the handler runs here
    return evaluate(session)

  monkeypatch.setattr(loop._Session, "evaluate", evaluate_and_signal)
  with pytest.raises(preemption.Stopped) as stopped:
    loop.train_and_evaluate(config, str(tmp_path))
  assert signalled == [6] and stopped.value.cycle == 6
  rows = [
      json.loads(line)
      for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  assert [r["step"] for r in rows if "dev/accuracy" in r] == [6]
  assert preemption.latest_checkpoint(tmp_path) == 6
