"""The README's main-job commands, run as a user runs them (slow, end to end)."""

import json

import pytest

from helpers import launch_main as _launch


@pytest.mark.slow
def test_launch_main_tiny_end_to_end(tmp_path):
  """The README's main-job command on the embedded offline default, for half
  of its epochs (the suite's time budget; the budget is calibrated to them)."""
  results = _launch(
      tmp_path, "configs/switch_sst2.py:tiny", "--config.epochs=3"
  )
  assert results["cycles"] == 48
  assert (
      results["accuracy"] > 0.58
  )  # majority class is ~0.52; 0.616 here on 2 CPU cores


@pytest.mark.slow
def test_launch_main_deepseek_tiny_end_to_end(tmp_path):
  """RAPTOR on DeepSeek-MoE from the command line: the dense block 0 is no
  candidate layer, shared experts train in the shared stream, the routed
  experts of l* in the expert stream, and the accountant spends the budget as
  for OLMoE (one epoch, 1,000 records and one sparse block keep it short)."""
  results = _launch(
      tmp_path,
      "configs/deepseek_sst2.py:tiny",
      "--config.epochs=1",
      "--config.model.random.num_layers=2",
      "--config.data.synthetic.n_train=1000",
      fast_compile=True,
  )
  selection = json.loads((tmp_path / "layer_selection.json").read_text())
  assert [row["layer"] for row in selection["public_corpus"]] == [1]
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  assert report["epsilon"] <= report["target_epsilon"] == 8.0
  assert report["epsilon"] > 0.99 * report["target_epsilon"]
  assert results["cycles"] == 4
  assert results["trainable_parameters"]["expert"] > 0
  assert results["parameters_by_role"]["shared_expert_adapter"] > 0
  assert 0.0 <= results["accuracy"] <= 1.0
  print(
      f"deepseek tiny: accuracy {results['accuracy']:.3f}, "
      f"epsilon {report['epsilon']:.3f}"
  )
