"""The controlled study's prediction rule (results/glue_small/PROTOCOL.md)."""

import json
import pathlib

import pytest

from launch import phase_placement
from raptor_jax.studies import sweep

CONTROLLED = pathlib.Path(__file__).parents[1] / "results" / "controlled"


def test_controlled_gains_are_the_studys_published_intervals():
  cells = phase_placement.controlled_cells(CONTROLLED)
  # results/controlled/README.md: r100_skew at epsilon 1, r100_bal at 1.
  mean, ci = cells["r100_skew"]["gains"][1.0]
  assert (round(mean, 2), round(ci[0], 2), round(ci[1], 2)) == (
      3.25,
      0.48,
      6.02,
  )
  assert round(cells["r100_bal"]["gains"][1.0][0], 2) == 1.40
  # results/controlled/results.md: median ratio over runs with lambda_s > 0.
  assert cells["r100_bal"]["median_ratio"] == pytest.approx(0.0248, abs=1e-4)
  assert [n for n, c in cells.items() if c["skewed"]] == [
      "r0_skew",
      "r50_skew",
      "r100_skew",
  ]


def _cell(root, variant, seed, accuracy, entropy=None, roles=None):
  directory = sweep.Cell("qnli", variant, 8.0, seed).directory(root)
  directory.mkdir(parents=True)
  (directory / "cell.json").write_text(
      json.dumps(
          dict(task="qnli", variant=variant, target_epsilon=8.0, seed=seed)
      )
  )
  (directory / "results.json").write_text(
      json.dumps(dict(accuracy=accuracy, finished=True, task="qnli"))
  )
  if entropy is not None:
    (directory / "layer_selection.json").write_text(
        json.dumps(
            dict(
                selected_layer=3,
                public_corpus=[
                    dict(layer=1, entropy_norm=0.99),
                    dict(layer=3, entropy_norm=entropy),
                ],
            )
        )
    )
    (directory / "diagnostics.json").write_text(
        json.dumps(dict(noise_sensitivity=dict(roles=roles)))
    )


def test_a_skewed_task_with_a_tiny_ratio_is_placed_at_r100_skew(tmp_path):
  roles = dict(shared=dict(lambda_plus=2.0), experts=dict(lambda_plus=0.001))
  _cell(tmp_path, "raptor", 0, 0.70, entropy=0.5, roles=roles)
  _cell(tmp_path, "raptor", 1, 0.71)
  _cell(tmp_path, "baseline_a", 0, 0.71)
  _cell(tmp_path, "baseline_a", 1, 0.73)
  (entry,) = phase_placement.place(tmp_path, CONTROLLED)
  assert entry["skewed"] and entry["ratio"] == pytest.approx(5e-4)
  assert entry["public_owner_entropy"] == 0.5  # the selected layer's
  assert entry["condition"] == "r100_skew"  # median ratio 0: nearest
  assert entry["predicted"][0] == pytest.approx(-0.14, abs=0.005)  # eps 8
  assert entry["observed"][0] == pytest.approx(-1.5)
  assert entry["right"] and not entry["confirmed"]  # intervals hold 0
  text = phase_placement.markdown([entry])
  assert "| qnli | 8 | 0.500 | skewed | 0.0005 | r100_skew |" in text


def test_a_balanced_task_goes_to_the_nearest_balanced_median(tmp_path):
  roles = dict(shared=dict(lambda_plus=1.0), experts=dict(lambda_plus=0.06))
  _cell(tmp_path, "raptor", 0, 0.70, entropy=0.95, roles=roles)
  (entry,) = phase_placement.place(tmp_path, CONTROLLED)
  assert not entry["skewed"] and entry["condition"] == "r50_bal"  # 0.0655
  assert entry["observed"] is None and "right" not in entry


def test_an_undefined_ratio_makes_no_prediction(tmp_path):
  # lambda_s = 0 (its noise probe raised no loss): the rule has no ratio to
  # place by, so the task gets no condition, no prediction and no verdict.
  roles = dict(shared=dict(lambda_plus=0.0), experts=dict(lambda_plus=5e-7))
  _cell(tmp_path, "raptor", 0, 0.58, entropy=0.83, roles=roles)
  _cell(tmp_path, "baseline_a", 0, 0.59)
  (entry,) = phase_placement.place(tmp_path, CONTROLLED)
  assert entry["ratio"] is None and entry["condition"] is None
  assert entry["predicted"] is None and "right" not in entry
  assert entry["observed"][0] == pytest.approx(-1.0)
  text = phase_placement.markdown([entry])
  assert "| balanced | undefined (λs = 0) | - | - |" in text
