"""`build_run`: the one assembly of a run from its config.

data -> backbone -> layer selection (public corpus) -> plan -> owner map ->
adapters -> classifier -> partition. The trainer, the diagnostics, the
benchmarks and the tests all build runs here, so they run what training runs.

Privacy. `Run.owners` is the owner map of the private records: it stays in
process memory and must never be logged, saved or returned to a user
(docs/method.md §1.2). The layer table is computed on the public corpus only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import numpy as np

from raptor_jax import _validate, compilation, data, length_buckets, models
from raptor_jax import canaries as canaries_lib
from raptor_jax import ownership, roles, sampling, vision
from raptor_jax.models import hf
from raptor_jax.train import methods, parallel, plans, setup

Flat = dict[str, Any]


def validate(config: ml_collections.ConfigDict) -> None:
  """Every check that needs no data and no model: run before loading anything.

  Raises:
    ValueError: a field is missing or invalid, or set but ignored by the
      chosen data source (one line naming it, `_validate`'s wording).
  """
  _validate.check(
      bool(config.model.name),
      "model.name",
      "a Hub id, a save_pretrained directory or 'random'",
      config.model.name,
      _validate.config_fix("model.name")
      + " (e.g. <pretrain workdir>/model from launch/pretrain.py)",
  )
  methods.check_config(config)
  setup.check_eval_split(config.data)
  setup.check_data_fields(config)
  sampling.check_microbatch_size(config.microbatch_size)
  length_buckets.from_config(config)  # data.length_buckets
  compilation.cache_directory(config.get("compilation_cache", "auto"))
  _validate.positive_int(
      "checkpoint_every_cycles",
      config.checkpoint_every_cycles,
      _validate.config_fix("checkpoint_every_cycles"),
  )
  _validate.non_negative(
      "checkpoint_every_minutes",
      config.checkpoint_every_minutes,
      _validate.config_fix("checkpoint_every_minutes") + " (0: off)",
  )


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's data, plan and model, ready to train or measure.

  Attributes:
    config: the config it was built from.
    data: tokenised splits (`data.train`: this host's records).
    n: number of private training records over all hosts.
    plan: phases, steps and calibrated noise (public).
    layer_table: public-corpus routing statistics per sparse layer, or None.
    model: the classifier (backbone with the plan's adapters, and a head).
    trainable: {part name: {path: array}} the plan's parts train.
    frozen: {path: array} every other parameter.
    owners: int32 owner of every record of `owner_records` at l* (zeros
      when no part needs owners). PRIVATE for training records.
    backbone_config: the backbone's config (sparse layers, experts, ...).
    canaries: an audit run's canaries (`config.audit`, see
      `raptor_jax.canaries`): the included ones are the last records
      of `data.train` and are counted in `n`. None for every other run.
      PRIVATE (the auditor's secret).
    validated: `validate(config)` passed before the run was built (True for
      `build_run`'s runs: `train_and_evaluate(run=...)` does not check again).
  """

  config: ml_collections.ConfigDict
  data: setup.RunData
  n: int
  plan: plans.Plan
  layer_table: list[dict[str, float]] | None
  model: models.SequenceClassifier
  trainable: dict[str, Flat]
  frozen: Flat
  owners: np.ndarray = dataclasses.field(repr=False)
  backbone_config: Any = None
  canaries: canaries_lib.Canaries | None = dataclasses.field(
      default=None, repr=False
  )
  validated: bool = False

  @property
  def expert_layer(self) -> int:
    return self.plan.expert_layer

  @property
  def num_experts(self) -> int:
    return self.backbone_config.num_experts


def build_run(
    config: ml_collections.ConfigDict,
    *,
    host: tuple[int, int] = (0, 1),
    owner_records: str = "train",
    validated: bool = False,
) -> Run:
  """Validates `config`, then loads and assembles its run as the trainer does.

  Args:
    host: (process index, process count): this host keeps the training
      records i with i % count == index (`parallel.host_shard()`); n counts
      the records of every host.
    owner_records: 'train' (the trainer) or 'dev' (diagnostics): whose
      owner map `Run.owners` holds.
    validated: the caller has just run `validate(config)`; skip it here.

  A config with an ``audit`` section builds an audit run: the included
  canaries join the private records before the plan, so n counts them.
  """
  if not validated:
    validate(config)
  _validate.one_of("owner_records", owner_records, ("train", "dev"))
  run_data = setup.load_run_data(config, host=host)
  n = (
      len(run_data.train)
      if host[1] == 1
      else parallel.global_count(len(run_data.train))
  )
  data.check_batch_size(methods.run_sizes(config, n)[0], n)
  backbone, backbone_params = setup.load_backbone(config, run_data)
  bc = backbone.config
  if not bc.sparse_layers:
    raise ValueError(
        f"{config.model.name} has no sparse (MoE) layer; RAPTOR needs an MoE model"
    )
  expert_layer, table = ownership.select_expert_layer(
      config, backbone, backbone_params, run_data
  )
  run_data, n, canaries = _insert_canaries(
      config, run_data, n, backbone, backbone_params, expert_layer, host
  )
  plan = methods.build_plan(
      config,
      n=n,
      num_experts=bc.num_experts,
      sparse_layers=bc.sparse_layers,
      expert_layer=expert_layer,
      shared_experts=roles.has_shared_experts(backbone_params),
      validated=True,  # `validate` ran `methods.check_config`
  )
  records = run_data.train if owner_records == "train" else run_data.dev
  owners = _owners(config, backbone, backbone_params, plan, records)
  backbone, backbone_params = hf.with_options(
      backbone,
      backbone_params,
      seed=config.seed,
      dtype=config.model.dtype,
      **plan.model_options,
  )
  pooling = config.model.pooling or setup.default_pooling(backbone)
  model, params = setup.classifier(
      backbone, backbone_params, run_data.task.num_labels, pooling, config.seed
  )
  params = vision.with_letter_head(params, run_data)  # image tasks only
  del backbone_params
  split = setup.partition(params, plan.parts)  # (trainable, frozen)
  built = (config, run_data, n, plan, table, model, *split, owners, bc)
  return Run(*built, canaries, validated=True)


def _owners(config, backbone, params, plan, records) -> np.ndarray:
  """The owner map of `records` at l* (zeros when no part needs owners)."""
  if not any(part.owner for part in plan.parts):
    return np.zeros((len(records),), np.int32)
  return ownership.private_owner_map(
      config, backbone, params, records, plan.expert_layer
  )


def _insert_canaries(config, run_data, n, backbone, params, expert_layer, host):
  """(run_data, n, canaries) with an audit run's included canaries appended
  (unchanged, None for every other run)."""
  if not canaries_lib.requested(config):
    return run_data, n, None
  if host[1] != 1:
    raise ValueError("an audit run (config.audit) needs a single-host run")
  canaries = canaries_lib.draw(
      config,
      run_data.tokenizer,
      run_data.task.num_labels,
      lambda records: ownership.private_owner_map(
          config, backbone, params, records, expert_layer
      ),
      backbone.config.num_experts,
  )
  inserted = canaries_lib.with_train_records(run_data, canaries.take(True))
  return inserted, n + int(canaries.included.sum()), canaries
