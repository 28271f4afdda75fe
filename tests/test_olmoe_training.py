"""The baselines train OLMoE through the same loop as Switch (issue: OLMoE, item 5).

`launch/main.py --config=configs/olmoe_sst2.py:tiny` (tests/test_launch.py) runs
RAPTOR on OLMoE end to end; here a micro OLMoE runs a one-clip baseline with
an owner-sliced expert adapter (baseline_a) and a monolithic one (every
adapter from one sample), and each must finish within its budget and move the
adapters it trains.
"""

import json

import numpy as np
import pytest

from raptor_jax import roles
from raptor_jax.train import train_and_evaluate

from helpers import latest_state, load_config_module, micro_config

OLMOE = {
    "model.random.family": "olmoe",
    "model.random.num_experts": 4,
    "model.random.top_k": 2,
    "model.random.num_kv_heads": 1,
}


def _lora_b_moved(trainable, role):
  """Largest |lora_b| over the trained adapters of `role` (B starts at zero)."""
  flat = {
      p: v
      for part in trainable.values()
      for p, v in roles.flatten(part).items()
  }
  values = [
      np.abs(v).max()
      for p, v in flat.items()
      if roles.role_of(p) == role and p.endswith("lora_b")
  ]
  assert values, f"no {role} trained"
  return min(values)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["baseline_a", "monolithic_lora"])
def test_baselines_train_olmoe(method, tmp_path):
  config = micro_config(method=method, **OLMOE)
  results = train_and_evaluate(config, str(tmp_path))
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  assert results["finished"] and report["epsilon"] <= report["target_epsilon"]
  assert report["epsilon"] > 0.99 * report["target_epsilon"]
  _, state, _ = latest_state(tmp_path)
  assert _lora_b_moved(state["trainable"], "attention_adapter") > 0
  assert _lora_b_moved(state["trainable"], "expert_adapter") > 0


@pytest.mark.slow
def test_raptor_trains_the_olmoe_config_end_to_end(tmp_path):
  """configs/olmoe_sst2.py:tiny with RAPTOR: top-k gate-weighted owners, last-token
  pooling, every block a candidate layer (a smaller data set and 2 blocks keep it
  short; launch/main.py runs the same train_and_evaluate)."""
  config = load_config_module("olmoe_sst2").get_config("tiny")
  config.epochs, config.progress_bar, config.privacy.secret_seed = 1, False, 0
  config.model.random.num_layers, config.data.synthetic.n_train = 2, 1000
  results = train_and_evaluate(config, str(tmp_path))
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  assert (
      report["finished"]
      and report["epsilon"] <= report["target_epsilon"] == 8.0
  )
  selection = json.loads((tmp_path / "layer_selection.json").read_text())
  assert [row["layer"] for row in selection["public_corpus"]] == [0, 1]
  assert (
      results["cycles"] == 4 and results["trainable_parameters"]["expert"] > 0
  )
