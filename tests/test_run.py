"""`build_run`: one assembly of a run; its config is validated before any loading."""

import dataclasses

import numpy as np
import pytest

from raptor_jax.train import run as run_lib
from raptor_jax.train import setup, train_and_evaluate

from helpers import micro_config

BAD = [
    ({"method": "sgd"}, "unknown method"),
    ({"model.name": ""}, "model.name"),
    ({"data.eval_split": "test"}, "eval_split"),
    ({"raptor.residual": "half"}, "raptor.residual"),
    ({"raptor.expert_full_weights": True}, "raptor.expert_full_weights"),
    ({"epochs": 0}, "epochs"),
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


def test_the_trainer_validates_before_loading_or_writing(tmp_path, no_loading):
  with pytest.raises(ValueError, match="unknown method"):
    train_and_evaluate(micro_config(method="sgd"), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_build_run_assembles_the_plan_model_and_partition():
  run = run_lib.build_run(micro_config())
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
