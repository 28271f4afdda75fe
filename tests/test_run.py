"""`build_run`: one assembly of a run; its config is validated before any loading."""

import dataclasses
import os

import numpy as np
import pytest

from raptor_jax.train import run as run_lib
from raptor_jax.train import setup, train_and_evaluate

from helpers import load_config_module, micro_config, run_python

BAD = [
    ({"method": "sgd"}, "method: must be one of"),
    ({"model.name": ""}, "model.name"),
    ({"data.eval_split": "test"}, "eval_split"),
    ({"raptor.residual": "half"}, "raptor.residual"),
    ({"raptor.expert_full_weights": True}, "raptor.expert_full_weights"),
    ({"epochs": -1}, "epochs"),  # 0: chosen from n
    ({"microbatch_size": 0}, "microbatch"),
]


@pytest.fixture
def no_loading(monkeypatch):
  """Any data or model load fails the test."""

  def fail(*args, **kwargs):
    raise AssertionError(
        "data or a model was loaded before the config was validated"
    )

  monkeypatch.setattr(setup, "load_run_data", fail)
  monkeypatch.setattr(setup, "load_backbone", fail)


@pytest.mark.parametrize("overrides,match", BAD)
def test_a_bad_config_fails_before_any_data_or_model_is_loaded(
    overrides, match, no_loading
):
  with pytest.raises(ValueError, match=match):
    run_lib.build_run(micro_config(**overrides))


# Fields the generated task of :tiny ignores: set, they are refused, naming the
# field and the preset that reads them.
IGNORED_BY_TINY = [
    ("data.train_path", "/nonexistent/train.tsv"),
    ("data.dev_path", "dev.tsv"),
    ("data.public_path", "public.txt"),
    ("data.label_field", "label"),
    ("data.train_limit", 100),
    ("data.holdout", 20),
    ("data.public_corpus", "imdb"),
    ("model.tokenizer", "bert-base-uncased"),
]


@pytest.mark.parametrize("field, value", IGNORED_BY_TINY)
def test_a_field_the_tiny_preset_ignores_is_refused(field, value, no_loading):
  with pytest.raises(ValueError) as info:
    run_lib.build_run(micro_config(**{field: value}))
  message = str(info.value)
  assert "\n" not in message
  assert (
      message.startswith(f"{field}: must be ") and f"got {value!r}" in message
  )
  assert "preset=cpu" in message  # which preset reads it


def test_the_generated_tasks_own_fields_are_refused_on_a_real_task(no_loading):
  config = _cpu_config(**{"data.synthetic.n_train": 300})
  with pytest.raises(
      ValueError, match=r"^data.synthetic.n_train: .*preset=tiny$"
  ):
    run_lib.build_run(config)


def test_the_random_models_fields_are_refused_with_a_pretrained_model(
    no_loading,
):
  config = load_config_module("glue").get_config("")  # google/switch-base-8
  run_lib.validate(config)
  config.model.random.d_model = 32
  with pytest.raises(ValueError) as info:
    run_lib.build_run(config)
  assert str(info.value).startswith(
      "model.random.d_model: must be 64 (unset) with"
      " model.name='google/switch-base-8'"
  )
  assert "model.name=random" in str(info.value)
  olmoe = load_config_module("glue").get_config("model=olmoe")
  run_lib.validate(olmoe)  # its family's own defaults are unset too


def _cpu_config(**overrides):
  """`configs/glue.py:preset=cpu` (the tiny model on a real task's files)."""
  config = load_config_module("glue").get_config("preset=cpu")
  config.update_from_flattened_dict(overrides)
  return config


def _files(tmp_path, train_text):
  """(train, dev, public) paths of a tiny SST-2 in GLUE's TSV layout."""
  good = "sentence\tlabel\ngood tea\t1\ncold tea\t0\n"
  paths = [tmp_path / "train.tsv", tmp_path / "dev.tsv", tmp_path / "pub.txt"]
  for path, text in zip(paths, (train_text, good, "good tea\ncold tea\n")):
    path.write_text(text)
  return [str(p) for p in paths]


@pytest.mark.parametrize(
    "train_text, expected",
    [
        ("sentence\tlabel\ngood tea\tyes\n", "column 'label', data row 1"),
        ("", "is empty"),
        ("sentence\tlabel\n", "has no records"),
    ],
)
def test_a_bad_train_file_is_one_line_naming_it(tmp_path, train_text, expected):
  """:cpu reads the files: a bad one fails while loading, naming the file."""
  train, dev, public = _files(tmp_path, train_text)
  config = _cpu_config(
      **{
          "data.train_path": train,
          "data.dev_path": dev,
          "data.public_path": public,
      }
  )
  run_lib.validate(config)
  with pytest.raises(ValueError) as info:
    setup.load_run_data(config)
  message = str(info.value)
  assert "\n" not in message and train in message and expected in message


def test_a_missing_train_file_fails_validation_naming_it(tmp_path, no_loading):
  _, dev, public = _files(tmp_path, "")
  config = _cpu_config(
      **{
          "data.train_path": "/nonexistent/train.tsv",
          "data.dev_path": dev,
          "data.public_path": public,
      }
  )
  with pytest.raises(ValueError) as info:
    run_lib.build_run(config)
  assert str(info.value) == (
      "data.train_path: must be an existing file, got '/nonexistent/train.tsv';"
      " set --config.data.train_path to a file that exists"
  )


@pytest.mark.slow  # a subprocess: ~10 s of imports on an idle machine
def test_launch_main_refuses_an_ignored_field_in_one_line(tmp_path):
  """The issue's command: exit status 1, one error line, no traceback."""
  proc = run_python(
      "launch/main.py",
      "--config=configs/glue.py:preset=tiny",
      f"--workdir={tmp_path / 'w'}",
      "--config.data.train_path=/nonexistent/train.tsv",
      env=dict(os.environ, RAPTOR_TRACEBACK=""),
      timeout=300,
  )
  assert proc.returncode == 1
  errors = [line for line in proc.stderr.splitlines() if "error" in line]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert errors[0].startswith("error: data.train_path: must be unset")
  assert "preset=cpu" in errors[0]
  assert not (tmp_path / "w").exists()


def test_the_trainer_validates_before_loading_or_writing(tmp_path, no_loading):
  with pytest.raises(ValueError, match="method: must be one of"):
    train_and_evaluate(micro_config(method="sgd"), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_build_run_assembles_the_plan_model_and_partition(tmp_path):
  config = micro_config()
  run = run_lib.build_run(config)
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.n = 0  # pytype: disable=attribute-error
  assert run.n == len(run.data.train) == 300
  assert set(run.trainable) == {part.name for part in run.plan.parts}
  assert run.expert_layer in run.backbone_config.sparse_layers
  assert run.owners.shape == (run.n,) and run.owners.dtype == np.int32
  assert not set(run.frozen) & {
      p for part in run.trainable.values() for p in part
  }
  assert "owners" not in repr(run)  # the private owner map is never printed
  # A prebuilt run is only taken for its own config (the audit's shortcut).
  with pytest.raises(ValueError, match="^run: must be build_run"):
    train_and_evaluate(micro_config(), str(tmp_path / "w"), run=run)
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_an_unversioned_checkpoint_is_refused_with_one_clear_line(tmp_path):
  """Checkpoints of the old layout ({"noise", "adam"} states, no format version)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import checkpoint  # pylint: disable=g-import-not-at-top

  Checkpointer = checkpoint.Checkpointer  # pylint: disable=invalid-name
  config = micro_config()
  old = Checkpointer(tmp_path, config)
  old.manager.save(
      3,
      args=ocp.args.Composite(
          state=ocp.args.StandardSave({"x": np.zeros(2)}),
          meta=ocp.args.JsonSave({"fingerprint": old.fingerprint, "cycle": 3}),
      ),
      force=True,
  )
  old.manager.wait_until_finished()
  old.close()
  with pytest.raises(ValueError, match="unversioned") as info:
    Checkpointer(tmp_path, config).restore_meta()
  message = str(info.value)
  assert (
      "\n" not in message
      and "checkpoints/3" in message
      and str(checkpoint.FORMAT_VERSION) in message
  )


def test_phase_step_is_the_trainers_step_and_takes_typed_keys():
  """The public one-phase API gives exactly the trainer's update (same key bits)."""
  import jax  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import parallel, step  # pylint: disable=g-import-not-at-top

  config = micro_config()
  run = run_lib.build_run(config)
  phase, mesh, m = (
      run.plan.phases[0],
      parallel.make_mesh(1),
      config.microbatch_size,
  )
  params = step.merged_params(run.frozen, run.trainable)
  train = run.data.train
  batch = dict(
      input_ids=train.input_ids[:m],
      attention_mask=train.attention_mask[:m],
      labels=train.labels[:m],
      owners=run.owners[:m],
  )
  options = dict(
      learning_rate=config.learning_rate,
      residual=config.raptor.residual,
      residual_gamma=config.raptor.residual_gamma,
  )

  dp = step.PhaseStep(
      run.model, phase, key=jax.random.key(3), mesh=mesh, **options
  )
  state = dp.init(params)
  new = dp.update(state, dp.accumulate(state, dp.zero_sums(state), batch))

  fns = step.PhaseFunctions(
      run.model,
      phase,
      mesh=mesh,
      expert_layer=run.expert_layer,
      num_experts=run.num_experts,
      key=jax.random.PRNGKey(3),
      **options,
  )
  trainable, frozen = setup.partition(params, phase.parts)
  trainable, frozen, opt = parallel.replicate(
      (trainable, frozen, fns.init_opt_states(trainable)), mesh
  )
  placed = parallel.shard_records((batch, np.ones(m, np.float32)), mesh)
  sums = fns.accumulate(trainable, frozen, fns.zero_sums(trainable), *placed)
  expected, _ = fns.update(trainable, opt, sums)
  for name, part in expected.items():
    for path, value in part.items():
      np.testing.assert_array_equal(
          np.asarray(new.trainable[name][path]), np.asarray(value)
      )
  assert any(
      not np.array_equal(np.asarray(new.trainable[name][p]), np.asarray(v))
      for name, part in state.trainable.items()
      for p, v in part.items()
  )
