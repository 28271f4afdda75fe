"""`<workdir>/curves.png` (issue 48.4): a picture of every run."""

import json

import matplotlib.image

from raptor_jax.train import curves


def test_curves_draw_the_evaluation_rows_and_the_spend(tmp_path):
  rows = [
      {"step": 10, "epoch": 1.0, "epsilon_spent": 2.0},
      {"step": 10, "dev/accuracy": 0.4, "epsilon_spent": 2.0},
      {"step": 20, "epoch": 2.0, "epsilon_spent": 3.0},
      {"step": 20, "dev/accuracy": 0.6, "epsilon_spent": 3.0},
      {"step": 20, "private/shared_train_loss": 1.3},  # opted in: not drawn
  ]
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  assert curves._rows(tmp_path / "metrics.jsonl") == {
      10: {"epsilon_spent": 2.0, "dev/accuracy": 0.4},
      20: {"epsilon_spent": 3.0, "dev/accuracy": 0.6},
  }
  path = curves.write(tmp_path, "raptor on custom")
  assert path == tmp_path / "curves.png"
  assert matplotlib.image.imread(path).shape[:2] == (396, 704)


def test_no_evaluation_row_draws_nothing(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "epoch": 0.1}\n')
  assert curves.write(tmp_path, "t") is None
  assert not (tmp_path / "curves.png").exists()
