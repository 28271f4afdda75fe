"""The README's main-job commands, run as a user runs them (slow, end to end)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _launch(tmp_path, config, *flags):
  # As a user runs it: default XLA optimisation (the suite's compile-fast flags off).
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", XLA_FLAGS="")
  proc = subprocess.run(
      [sys.executable, "launch/main.py", f"--config={config}", f"--workdir={tmp_path}",
       "--config.progress_bar=False", "--config.privacy.secret_seed=0", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  results = json.loads((tmp_path / "results.json").read_text())
  assert report["finished"] and report["epsilon"] <= report["target_epsilon"] == 8.0
  return results


@pytest.mark.slow
def test_launch_main_tiny_end_to_end(tmp_path):
  """The README's main-job command on the embedded offline default."""
  results = _launch(tmp_path, "configs/switch_sst2.py:tiny")
  assert results["accuracy"] > 0.6  # majority class is ~0.52


@pytest.mark.slow
def test_launch_main_olmoe_tiny_end_to_end(tmp_path):
  """RAPTOR on OLMoE: top-k gate-weighted owners, last-token pooling, every block a
  candidate layer (a smaller data set and 2 blocks keep it short)."""
  results = _launch(tmp_path, "configs/olmoe_sst2.py:tiny", "--config.epochs=1",
                    "--config.model.random.num_layers=2", "--config.data.synthetic.n_train=1000")
  selection = json.loads((tmp_path / "layer_selection.json").read_text())
  assert [row["layer"] for row in selection["public_corpus"]] == [0, 1]
  assert results["cycles"] == 4 and results["trainable_parameters"]["expert"] > 0
