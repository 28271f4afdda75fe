"""The sweep runner (grid, resume) and the results table and plots."""

import csv
import json
import subprocess
import sys

import pytest

from raptor_jax import diagnostics
from raptor_jax.studies import sweep, sweep_report
from raptor_jax.train import run as run_lib

from helpers import ROOT, micro_config, small_glue_on_files


def test_grid_runs_seed_by_seed_with_one_nonprivate_cell_per_seed():
  cells = sweep.grid("sst2", ["raptor", "nonprivate_lora"], [1.0, 8.0], [0, 1])
  assert [(c.variant, c.target_epsilon, c.seed) for c in cells] == [
      ("raptor", 1.0, 0),
      ("raptor", 8.0, 0),
      ("nonprivate_lora", None, 0),
      ("raptor", 1.0, 1),
      ("raptor", 8.0, 1),
      ("nonprivate_lora", None, 1),
  ]
  assert str(cells[2].directory("/w")) == "/w/sst2/nonprivate_lora/epsinf/seed0"
  assert str(cells[1].directory("/w")) == "/w/sst2/raptor/eps8/seed0"
  with pytest.raises(
      ValueError, match="variant: must be one of .*, got .magic."
  ):
    sweep.grid("sst2", ["raptor", "magic"], [1.0], [0])


def test_every_variant_is_a_valid_config():
  base = micro_config()
  for variant, overrides in sweep.VARIANTS.items():
    config = sweep.cell_config(base, sweep.Cell("synthetic", variant, 4.0, 3))
    run_lib.validate(config)
    assert config.seed == 3 and config.privacy.epsilon == 4.0
    for key, value in overrides.items():
      section, _, name = key.rpartition(".")
      assert (config[section] if section else config)[name] == value
  assert base.method == "raptor" and base.seed == 0  # the base is not modified


def test_a_tuning_cell_on_files_passes_validation(tmp_path):
  """A tuning cell evaluates on the holdout, so it drops the dev fields that
  validation would refuse as ignored."""
  base = small_glue_on_files(tmp_path)
  run_lib.validate(base)
  cell = sweep.Cell("sst2", "raptor", 1.0, 100, tune_clip=0.1)
  config = sweep.cell_config(base, cell)
  run_lib.validate(config)
  assert config.data.eval_split == "holdout" and not config.data.dev_path


def test_full_clip_is_the_one_change_ablation_and_the_old_one_has_a_name():
  """Tab. 5's `raptor_full_clip` keeps alternation; the two-change one is explicit."""
  base = micro_config()
  one_change = sweep.cell_config(
      base, sweep.Cell("synthetic", "raptor_full_clip", 4.0, 0)
  )
  reference = sweep.cell_config(base, sweep.Cell("synthetic", "raptor", 4.0, 0))
  one_change.raptor.joint_clip = False
  # Each cell derives its own fixed seed from (N, cell): not a method change.
  one_change.privacy.secret_seed = reference.privacy.secret_seed
  assert one_change.to_dict() == reference.to_dict()  # exactly one change
  old = sweep.cell_config(
      base, sweep.Cell("synthetic", "raptor_full_clip_one_sample", 4.0, 0)
  )
  assert old.raptor.joint_clip and not old.raptor.alternate


def test_a_stale_finished_cell_is_refused_not_skipped(tmp_path):
  """A cell trained under an older definition of its variant must not enter the table."""
  base = micro_config()
  cell = sweep.Cell("synthetic", "raptor_full_clip", 2.0, 0)
  directory = cell.directory(tmp_path)
  directory.mkdir(parents=True)
  (directory / "results.json").write_text("{}")
  stale = sweep.cell_config(base, cell)
  stale.raptor.alternate = False  # what `raptor_full_clip` used to run
  (directory / "config.json").write_text(stale.to_json_best_effort())
  run = dict(variants=["raptor_full_clip"], epsilons=[2.0], seeds=[0])
  with pytest.raises(ValueError, match="raptor.alternate=False"):
    sweep.run(base, tmp_path, train=None, **run)
  (directory / "config.json").write_text(
      sweep.cell_config(base, cell).to_json_best_effort()
  )
  assert sweep.run(base, tmp_path, train=None, **run) == [directory]


def test_run_is_resumable_and_skips_finished_cells(tmp_path):
  calls = []

  def fake_train(config, workdir):
    calls.append((config.method, config.privacy.epsilon, config.seed))
    if len(calls) == 2:
      raise KeyboardInterrupt  # the sweep stops in the middle of its second cell
    (tmp_path / workdir / "results.json").write_text("{}")

  grid = dict(variants=["raptor", "baseline_a"], epsilons=[2.0], seeds=[0])
  with pytest.raises(KeyboardInterrupt):
    sweep.run(micro_config(), tmp_path, train=fake_train, **grid)
  sweep.run(micro_config(), tmp_path, train=fake_train, **grid)
  assert calls == [
      ("raptor", 2.0, 0),
      ("baseline_a", 2.0, 0),
      ("baseline_a", 2.0, 0),
  ]
  sweep.run(micro_config(), tmp_path, train=fake_train, **grid)
  assert len(calls) == 3
  cell = json.loads(
      (tmp_path / "synthetic/raptor/eps2/seed0/cell.json").read_text()
  )
  assert cell == {
      "task": "synthetic",
      "variant": "raptor",
      "target_epsilon": 2.0,
      "seed": 0,
      "tune_clip": None,
      "clip_shared": 1.0,
      "clip_expert": 1.0,
  }


def test_clip_tuning_scores_on_the_holdout_and_every_seed_uses_the_choice(
    tmp_path,
):
  """Each (variant, epsilon) tries the grid with the tuning seed on held-out train
  records, picks the best (ties: first in the grid), and its table cells use it.
  """
  calls = []
  holdout_accuracy = {0.1: 0.70, 1.0: 0.75, 10.0: 0.75}

  def fake_train(config, workdir):
    calls.append(
        (
            config.method,
            config.seed,
            config.privacy.clip_shared,
            config.privacy.clip_expert,
            config.data.eval_split,
        )
    )
    accuracy = holdout_accuracy[config.privacy.clip_shared]
    if config.method == "monolithic_lora":
      accuracy = 1.0 - accuracy  # its best clip is 0.1
    (tmp_path / workdir / "results.json").write_text(
        json.dumps(dict(accuracy=accuracy))
    )

  base = micro_config()
  one_cell = dict(variants=["raptor"], epsilons=[8.0], train=fake_train)
  with pytest.raises(ValueError, match="holdout"):
    sweep.run(base, tmp_path, seeds=[0], clip_grid=[0.1, 1.0], **one_cell)
  base.data.train_limit, base.data.holdout = 100, 20
  with pytest.raises(ValueError, match="tune_seed"):
    sweep.run(base, tmp_path, seeds=[0, 100], clip_grid=[0.1], **one_cell)
  grid = dict(
      variants=["raptor", "monolithic_lora", "nonprivate_lora"],
      epsilons=[8.0],
      seeds=[0, 1],
      clip_grid=[0.1, 1.0, 10.0],
      tune_seed=100,
  )
  sweep.run(base, tmp_path, train=fake_train, **grid)
  tuning = [c for c in calls if c[1] == 100]
  assert (
      all(c[4] == "holdout" and c[2] == c[3] for c in tuning)
      and len(tuning) == 6
  )
  table = [c for c in calls if c[1] != 100]
  assert all(c[4] == "dev" for c in table)
  assert [c[:3] for c in table] == [
      ("raptor", 0, 1.0),
      ("monolithic_lora", 0, 0.1),
      ("nonprivate_lora", 0, 1.0),
      ("raptor", 1, 1.0),
      ("monolithic_lora", 1, 0.1),
      ("nonprivate_lora", 1, 1.0),
  ]
  chosen = json.loads(
      (tmp_path / "synthetic/raptor/eps8/tuning.json").read_text()
  )
  assert chosen["chosen_clip"] == 1.0 and chosen["holdout_accuracy"] == {
      "0.1": 0.7,
      "1": 0.75,
      "10": 0.75,
  }
  assert (
      len(sweep.collect(tmp_path)) == 6
      and len(sweep.collect(tmp_path, tuning=True)) == 6
  )
  sweep.run(
      base, tmp_path, train=fake_train, **grid
  )  # everything done: nothing reruns
  assert len(calls) == 12
  assert (
      "| synthetic | 8 | Ours, entropy-sel. | 70.00 | 75.00 | 75.00 | 1 |"
      in sweep_report.tuning_markdown(tmp_path)
  )


def test_the_tuning_table_names_the_task_of_each_row(tmp_path):
  """A sweep over two tasks gets one tuning row per task, each labelled."""
  for task, accuracy in (("qnli", 0.58), ("sst2", 0.77)):
    eps_dir = tmp_path / task / "raptor" / "eps1"
    eps_dir.mkdir(parents=True)
    (eps_dir / "tuning.json").write_text(
        json.dumps(
            dict(
                variant="raptor",
                epsilon=1.0,
                tune_seed=100,
                metric="holdout accuracy",
                holdout_accuracy={"0.1": accuracy, "1": accuracy - 0.01},
                chosen_clip=0.1,
            )
        )
    )
  rows = [
      line
      for line in sweep_report.tuning_markdown(tmp_path).splitlines()
      if "Ours" in line
  ]
  assert rows == [
      "| qnli | 1 | Ours, entropy-sel. | 58.00 | 57.00 | 0.1 |",
      "| sst2 | 1 | Ours, entropy-sel. | 77.00 | 76.00 | 0.1 |",
  ]


def test_an_archived_sweep_resumes_on_a_fresh_workdir(tmp_path):
  """A new clone has the committed archive but no workdir: nothing reruns.

  The archive keeps only the public records (no checkpoint), for the table
  cells, the tuning runs and the clip choice, and the report built on the
  restored workdir is the one the first machine wrote.
  """
  calls = []

  def fake_train(config, workdir):
    calls.append((config.method, config.seed, config.privacy.clip_shared))
    if len(calls) == 5:
      raise KeyboardInterrupt  # the first machine goes away mid-sweep
    directory = tmp_path / workdir
    accuracy = 0.5 + 0.1 * config.privacy.clip_shared + 0.01 * config.seed
    (directory / "results.json").write_text(
        json.dumps(dict(accuracy=accuracy, epsilon=8.0))
    )
    (directory / "checkpoint").mkdir()  # never archived

  base = micro_config()
  base.data.train_limit, base.data.holdout = 100, 20
  grid = dict(
      variants=["raptor", "monolithic_lora"],
      epsilons=[8.0],
      seeds=[0, 1],
      clip_grid=[0.1, 1.0],
      tune_seed=100,
  )
  first, archive = tmp_path / "machine1", tmp_path / "results/cells"
  with pytest.raises(KeyboardInterrupt):
    sweep.run(base, first, train=fake_train, archive=archive, **grid)
  # 2 raptor tuning runs, raptor seed 0, 1 monolithic tuning run archived.
  assert len(calls) == 5
  assert sorted(
      str(p.parent.relative_to(archive)) for p in archive.rglob("results.json")
  ) == [
      "synthetic/monolithic_lora/eps8/tune/clip0.1",
      "synthetic/raptor/eps8/seed0",
      "synthetic/raptor/eps8/tune/clip0.1",
      "synthetic/raptor/eps8/tune/clip1",
  ]
  assert (archive / "synthetic/raptor/eps8/tuning.json").exists()
  assert not list(archive.rglob("checkpoint"))

  second = tmp_path / "machine2"  # a fresh clone: the archive only
  sweep.run(base, second, train=fake_train, archive=archive, **grid)
  assert calls[5:] == [
      # The interrupted tuning run, not the first:
      ("monolithic_lora", 100, 1.0),
      ("monolithic_lora", 0, 1.0),
      ("raptor", 1, 1.0),
      ("monolithic_lora", 1, 1.0),
  ]
  assert len(sweep.collect(second)) == 4
  assert len(sweep.collect(second, tuning=True)) == 4
  assert sweep_report.tuning_markdown(second) == sweep_report.tuning_markdown(
      archive
  )
  sweep.run(
      base, tmp_path / "machine3", train=fake_train, archive=archive, **grid
  )
  assert len(calls) == 9  # everything archived: nothing reruns
  with pytest.raises(ValueError, match="not a finished cell"):
    (first / "x").mkdir()
    sweep.archive_cell(first, first / "x", archive)


def test_paired_difference_and_its_interval(tmp_path):
  diffs = [1.0, 3.0, 2.0]
  for seed, d in enumerate(diffs):
    _fake_cell(tmp_path, "sst2", "raptor", 1.0, seed, 0.60 + d / 100)
    _fake_cell(tmp_path, "sst2", "monolithic_lora", 1.0, seed, 0.60)
  _fake_cell(tmp_path, "sst2", "raptor", 8.0, 0, 0.7)  # no partner: no 8.0 row
  (pair,) = sweep_report.paired_differences(sweep.collect(tmp_path))
  assert pair["epsilon"] == 1.0 and pair["seeds"] == [0, 1, 2]
  assert pair["mean"] == pytest.approx(2.0)
  half = 4.302652729911275 * 1.0 / 3**0.5  # t_{0.975, 2} * sd / sqrt(n)
  assert pair["ci95"] == pytest.approx((2.0 - half, 2.0 + half))
  text = sweep_report.paired_markdown([pair])
  assert "+1.00, +3.00, +2.00 | +2.00 | [-0.48, +4.48]" in text


def _fake_cell(root, task, variant, eps, seed, accuracy, wall=10.0):
  cell = sweep.Cell(task, variant, eps, seed)
  directory = cell.directory(root)
  directory.mkdir(parents=True)

  def write(name, **fields):
    (directory / name).write_text(json.dumps(fields))

  write("cell.json", task=task, variant=variant, target_epsilon=eps, seed=seed)
  write(
      "results.json",
      accuracy=accuracy,
      wall_time_s=wall,
      finished=True,
      task=task,
      epsilon=eps,
  )
  table = [dict(layer=1, entropy_norm=0.4), dict(layer=3, entropy_norm=0.9)]
  write(
      "layer_selection.json",
      selected_layer=3,
      rule="entropy",
      public_corpus=table,
  )


def test_table_in_the_layout_of_tab_1(tmp_path):
  for seed, (a, b) in enumerate([(0.90, 0.80), (0.92, 0.82)]):
    _fake_cell(tmp_path, "sst2", "raptor", 8.0, seed, a, wall=10.0 + 2 * seed)
    _fake_cell(tmp_path, "sst2", "monolithic_lora", 8.0, seed, b)
    _fake_cell(tmp_path, "qnli", "raptor", 8.0, seed, b)
    _fake_cell(tmp_path, "sst2", "raptor", 1.0, seed, b)
  _fake_cell(tmp_path, "sst2", "nonprivate_lora", None, 0, 0.95)
  paths = sweep_report.write(tmp_path)
  assert [p.name for p in paths] == [
      "results.csv",
      "results.md",
      "accuracy_vs_epsilon.png",
      "routing_entropy.png",
      "cells.csv",
  ]
  md = (tmp_path / "results.md").read_text()
  rows = [line for line in md.splitlines() if line.startswith("| ")]
  assert rows[:5] == [
      "| ε | Method | qnli | sst2 |",
      "| ∞ | Non-priv. LoRA | - | 95.00 |",
      "| 1 | Ours, entropy-sel. | - | 81.00 ± 1.41 |",
      "| 8 | Monolith. DP-Adam LoRA | - | 81.00 ± 1.41 |",
      "|  | Ours, entropy-sel. | 81.00 ± 1.41 | 91.00 ± 1.41 |",
  ]
  assert (
      "| 8 | Monolith. DP-Adam LoRA | - | 10 |" in md
  )  # mean wall time per run
  assert "|  | Ours, entropy-sel. | 10 | 11 |" in md
  with open(tmp_path / "results.csv", encoding="utf-8") as f:
    table = list(csv.DictReader(f))
  assert [(r["epsilon"], r["variant"]) for r in table] == [
      ("inf", "nonprivate_lora"),
      ("1", "raptor"),
      ("8", "monolithic_lora"),
      ("8", "raptor"),
  ]
  assert float(table[3]["sst2_mean"]) == pytest.approx(91.0)
  assert float(table[3]["sst2_std"]) == pytest.approx(1.4142, abs=1e-4)
  assert (
      table[3]["sst2_seeds"] == "2"
      and float(table[3]["sst2_wall_time_s"]) == 11.0
  )
  assert table[0]["qnli_mean"] == "" and table[0]["sst2_std"] == ""
  for png in paths[2:4]:
    assert (
        png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and png.stat().st_size > 5000
    )


def test_report_needs_finished_cells(tmp_path):
  with pytest.raises(ValueError, match="no finished cells"):
    sweep_report.write(tmp_path)


@pytest.mark.slow
def test_tiny_sweep_trains_and_writes_table_plots_and_diagnostics(tmp_path):
  """2 methods x 1 epsilon x 1 seed through the real loop; App. G diagnostics of one."""

  def diagnose_baseline_c(config, directory):
    if config.method == "baseline_c":
      diagnostics.write_for_run(config, directory)

  config = micro_config(
      **{"model.random.num_layers": 2, "data.synthetic.n_train": 100}
  )
  sweep.run(
      config,
      tmp_path,
      variants=["baseline_c", "nonprivate_lora"],
      epsilons=[8.0],
      seeds=[0],
      after=diagnose_baseline_c,
  )
  sweep_report.write(tmp_path)
  md = (tmp_path / "results.md").read_text()
  assert (
      "| ∞ | Non-priv. LoRA |" in md
      and "| 8 | Baseline C (expert-only) |" in md
  )
  for name in ("accuracy_vs_epsilon.png", "routing_entropy.png"):
    assert (tmp_path / name).stat().st_size > 5000
  cell = tmp_path / "synthetic" / "baseline_c" / "eps8" / "seed0"
  results = json.loads((cell / "results.json").read_text())
  assert results["finished"] and results["epsilon"] <= 8.0
  diag = json.loads((cell / "diagnostics.json").read_text())
  assert diag["data"].startswith("dev split") and not diag["private_audit"]
  assert diag["method"] == "baseline_c" and diag["expert_layer"] == 1
  mismatch = diag["role_mismatch"]
  assert (
      set(mismatch["param_share"]) == {"experts"} and mismatch["M_role"] == 0.0
  )
  assert (
      len(diag["expert_snr"]["per_expert"]) == 4
      and diag["expert_snr"]["mean"] > 0
  )
  assert set(diag["noise_sensitivity"]["roles"]) == {"experts"}
  assert (
      "M_role" not in (cell / "metrics.jsonl").read_text()
  )  # never in training logs
  assert not (
      tmp_path / "synthetic/nonprivate_lora/epsinf/seed0/diagnostics.json"
  ).exists()
  table = (tmp_path / "diagnostics.md").read_text()
  assert "| synthetic | 8 | Baseline C (expert-only) | 0 |" in table
  assert "Non-priv" not in table


def test_launch_script_rebuilds_the_table(tmp_path):
  _fake_cell(tmp_path, "sst2", "raptor", 8.0, 0, 0.9)
  proc = subprocess.run(
      [
          sys.executable,
          "launch/sweep.py",
          f"--workdir={tmp_path}",
          "--table_only",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "results.md" in proc.stdout
  assert (
      "| 8 | Ours, entropy-sel. | 90.00 |"
      in (tmp_path / "results.md").read_text()
  )


def test_report_pairs_raptor_with_every_baseline_and_lists_every_cell(
    tmp_path,
):
  for seed in range(2):
    _fake_cell(tmp_path, "qnli", "raptor", 8.0, seed, 0.70)
    _fake_cell(tmp_path, "qnli", "baseline_a", 8.0, seed, 0.68 - seed / 100)
    _fake_cell(tmp_path, "qnli", "baseline_b", 8.0, seed, 0.71)
  _fake_cell(tmp_path, "qnli", "nonprivate_lora", None, 0, 0.80)
  paths = sweep_report.write(tmp_path)
  text = (tmp_path / "results.md").read_text()
  assert "Ours, entropy-sel. − Baseline A" in text
  assert "| qnli | 8 | 2 | +2.00, +3.00 | +2.50 |" in text
  assert "| qnli | 8 | 2 | -1.00, -1.00 | -1.00 |" in text  # vs baseline_b
  assert "Monolith" not in text  # not run: no pair
  cells = (tmp_path / "cells.csv").read_text().splitlines()
  assert tmp_path / "cells.csv" in paths and len(cells) == 1 + 7
  assert cells[1].startswith("qnli,baseline_a,8,0,0.680000")
  assert cells[-1].startswith("qnli,nonprivate_lora,inf,0,0.800000")


def test_the_plot_legend_uses_the_method_names(tmp_path, monkeypatch):
  """48.4: the legend said "Ours, entropy-sel." where the config, the CLI and
  the tables say raptor."""
  import matplotlib.figure

  saved = []
  monkeypatch.setattr(
      matplotlib.figure.Figure,
      "savefig",
      lambda fig, *a, **k: saved.append(fig),
  )
  entry = lambda variant, epsilon, mean: dict(
      task="sst2",
      variant=variant,
      epsilon=epsilon,
      mean=mean,
      std=1.0,
      values=[mean],
  )
  sweep_report.plot_accuracy(
      [
          entry("raptor", 8.0, 70.0),
          entry("monolithic_lora", 8.0, 71.0),
          entry("nonprivate_lora", None, 75.0),
      ],
      tmp_path / "a.png",
  )
  legend = saved[0].axes[0].get_legend()
  assert sorted(t.get_text() for t in legend.get_texts()) == [
      "monolithic_lora",
      "nonprivate_lora",
      "raptor",
  ]
