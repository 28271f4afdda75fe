"""The README's main-job commands, run as a user runs them (slow, end to end)."""

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
