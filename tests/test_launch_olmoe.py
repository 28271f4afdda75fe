"""The OLMoE main-job command, end to end (its own file, so that pytest-xdist's
--dist loadfile runs it beside, not after, the Switch one)."""

import json

import pytest

from helpers import launch_main as _launch


@pytest.mark.slow
def test_launch_main_olmoe_tiny_end_to_end(tmp_path):
  """RAPTOR on OLMoE: top-k gate-weighted owners, last-token pooling, every block a
  candidate layer (a smaller data set and 2 blocks keep it short)."""
  results = _launch(tmp_path, "configs/olmoe_sst2.py:tiny", "--config.epochs=1",
                    "--config.model.random.num_layers=2", "--config.data.synthetic.n_train=1000",
                    fast_compile=True)
  selection = json.loads((tmp_path / "layer_selection.json").read_text())
  assert [row["layer"] for row in selection["public_corpus"]] == [0, 1]
  assert results["cycles"] == 4 and results["trainable_parameters"]["expert"] > 0
