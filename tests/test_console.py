"""The console: the run header, the closing summary, one-line config typos,
--dry_run."""

import dataclasses
import io
import subprocess
import sys
import types
from pathlib import Path

import pytest
import tqdm

from raptor_jax.train import loop, outputs
from raptor_jax.train.run import build_run

from helpers import ROOT, micro_config


@pytest.fixture(scope="module")
def run():
  return build_run(micro_config())


def test_the_header_says_what_the_run_will_do_before_it_trains(run):
  header = outputs.run_header(run, Path("/w")).splitlines()
  sigma = {p.name: p.noise_multiplier for p in run.plan.parts}
  assert header[0] == (
      "raptor on synthetic: n = 300 training records, expected batch B = 50,"
      " sample rate q = 0.1667, 6 cycles (1 epochs)"
  )
  assert header[1] == (
      f"privacy: target epsilon 8 at delta {run.plan.delta:.3g} (PLD"
      " accountant, Poisson sampling)"
  )
  for line, part in zip(header[2:4], ("shared", "expert")):
    count = sum(v.size for v in run.trainable[part].values())
    assert line == (  # the stream's name once (48.6)
        f"  stream {part}: sigma {sigma[part]:.4g}, clip 1,"
        f" {count:,} trainable parameters"
    )
  # 6 noisy steps: one warning line names the setting to raise.
  assert header[4] == (
      "warning: only 6 noisy steps; the noise of few steps does not average"
      " out and accuracy suffers: raise --config.epochs (e.g. 34 for 204"
      " steps), or set it to 0 to choose it from n"
  )
  assert header[5].startswith("outputs: /w (checkpoints/")


def test_the_run_ends_with_a_table_and_the_export_command(run):
  results = dict(cycles=6, finished=True, epsilon=1.5)
  summary = outputs.run_summary(run, results, {"accuracy": 0.75}, Path("/w"))
  assert summary.splitlines() == [
      "run finished:",
      "  cycles         6 of 6",
      f"  epsilon spent  1.5 at delta {run.plan.delta:.3g}",
      "  dev accuracy   0.7500",
      "  reports        /w/privacy_report.json, results.json",
      f"export: python {ROOT}/launch/export.py --workdir=/w --out=/w_model",
  ]


def _main(*args):
  return subprocess.run(
      [sys.executable, "launch/main.py", *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        (
            [
                "--config=configs/switch_sst2.py:tiny",
                "--config.data.train_pth=x",
            ],
            "error: --config.data.train_pth: no such config field; did you"
            " mean --config.data.train_path?",
        ),
        (
            ["--config=configs/switch_sst2.py:tny"],
            "error: preset: must be one of '', 'tiny', 'cpu', 'small', got"
            " 'tny'; pass comma-separated key=value pairs, e.g."
            " --config=configs/glue.py:task=mnli,model=olmoe,preset=tiny",
        ),
    ],
)
def test_a_config_typo_is_one_line_with_the_suggestion(tmp_path, args, line):
  proc = _main(*args, f"--workdir={tmp_path}")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      line + "  (RAPTOR_TRACEBACK=1 shows the traceback)"
  ]


@pytest.mark.slow
def test_dry_run_prints_the_header_and_config_and_trains_nothing(tmp_path):
  proc = _main(
      "--config=configs/switch_sst2.py:tiny",
      f"--workdir={tmp_path}",
      "--config.data.synthetic.n_train=300",
      "--dry_run",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "loading the data" in proc.stderr
  assert "raptor on synthetic: n = 300 training records" in proc.stderr
  assert "stream expert: sigma" in proc.stderr  # one part: no part name
  assert "n_train: 300" in proc.stderr  # the resolved config
  assert not list(tmp_path.iterdir())  # nothing written, not even the lock


def test_the_bar_shows_this_cycles_spend_and_its_last_line_once(monkeypatch):
  """48.6: the bar's epsilon was the previous log period's (17/18 at 6.62
  when 7.8 was spent) and its last line printed twice; 48.4: the
  evaluation rows of metrics.jsonl carry the epsilon they were made at."""
  out = io.StringIO()
  bar = tqdm.tqdm(
      total=4,
      file=out,
      mininterval=0,
      bar_format="{n_fmt}/{total_fmt}{postfix}",
  )
  spend = {2: 1.5, 4: 2.5}
  monkeypatch.setattr(
      loop.outputs, "epsilon_spent", lambda plan, state, **_: spend[state.cycle]
  )
  rows = []
  session = types.SimpleNamespace(
      run=types.SimpleNamespace(
          config=types.SimpleNamespace(log_every_cycles=2, eval_every_epochs=1),
          plan=types.SimpleNamespace(cycles=4),
      ),
      cycles_per_epoch=4,
      writer=types.SimpleNamespace(write=lambda c, r: rows.append((c, r))),
      evaluate=lambda: {"accuracy": 0.5},
  )
  for cycle in range(1, 5):
    session.state = types.SimpleNamespace(cycle=cycle)
    loop._Session._log_cycle(session, bar)
  frames = [f.strip() for f in out.getvalue().split("\r") if f.strip()]
  assert "2/4, eps 1.500 after cycle 2" in frames
  assert "3/4, eps 1.500 after cycle 2" in frames  # labelled, not passed off
  assert frames.count("4/4, eps 2.500 after cycle 4") == 1
  assert rows[-1] == (4, {"dev/accuracy": 0.5, "epsilon_spent": 2.5})


def test_the_end_table_says_results_vary_with_the_secret(run):
  """48.2: identical commands gave 0.35 to 0.51 and the table showed one
  number; a run with a fresh secret says so and points to the seeded sweep."""
  fresh = dataclasses.replace(
      run, config=micro_config(**{"privacy.secret_seed": -1})
  )
  results = dict(cycles=6, finished=True, epsilon=1.5)
  lines = outputs.run_summary(fresh, results, {"accuracy": 0.75}, Path("/w"))
  assert lines.splitlines()[-2] == (
      "note: each run draws a fresh secret (its Poisson samples and noise), so"
      " the same command gives another accuracy; for the spread, train seeds"
      " side by side with launch/sweep.py (docs/data.md, 'Results vary')"
  )
