"""`train_and_evaluate`: one loop for RAPTOR, its baselines and ablations.

Per cycle (Alg. 1), every phase of the plan draws its own Poisson sample
(`numpy.random.default_rng((seed, stream, cycle))`), accumulates clipped
per-record gradient sums over fixed-size microbatches, and makes ONE noisy
DP-Adam update; the ledger records the release. The realised sample size only
decides how many microbatches run; nothing reads, branches on or logs it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import accounting, data, ownership, roles, sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.models import hf
from raptor_jax.train import methods, metrics, parallel, setup, step
from raptor_jax.train.checkpoint import Checkpointer

log = logging.getLogger("raptor_jax")


def _write_json(path: Path, payload: dict) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
  tmp.replace(path)


def _router_fn(backbone, params, layer_positions=None):
  @jax.jit
  def fn(ids, mask):
    logits = backbone.apply({"params": params}, ids, mask).router_logits
    return logits if layer_positions is None else tuple(logits[i] for i in layer_positions)
  return fn


def select_expert_layer(config, backbone, params, run_data: setup.RunData):
  """l* by the public corpus (Eq. 4); returns (layer, table or None)."""
  bc = backbone.config
  how = config.raptor.layer
  if isinstance(how, str) and how.lstrip("-").isdigit():
    how = int(how)
  table = None
  if how == "entropy" and run_data.public is not None:
    ids, mask = run_data.public
    if len(ids) == 0:
      raise ValueError("the public corpus is empty; set --config.data.public_corpus or "
                       "--config.data.public_path to a corpus with texts")
    public_owners = ownership.owners_per_layer(
        _router_fn(backbone, params), ids, mask, batch_size=config.eval_batch_size,
        top_k=bc.top_k, weighting=_weighting(config, bc), normalize=_normalize(bc))
    table = ownership.layer_table(public_owners, bc.sparse_layers, bc.num_experts)
  return ownership.select_layer(how, bc.sparse_layers, table), table


def _weighting(config, backbone_config) -> str:
  # Top-k models vote with their gate weights (SPEC 1.2); Switch as configured.
  return config.raptor.owner_weighting if backbone_config.top_k == 1 else "prob"


def _normalize(backbone_config) -> bool:
  return bool(getattr(backbone_config, "norm_topk_prob", False))


def private_owner_map(config, backbone, params, train: data.TextClassificationData,
                      layer: int) -> np.ndarray:
  """Owners of the private records at l*, from the frozen pretrained model.

  Never logged, saved or returned outside the process (SPEC 1.2).
  """
  bc = backbone.config
  position = bc.sparse_layers.index(layer)
  owners = ownership.owners_per_layer(
      _router_fn(backbone, params, (position,)), train.input_ids, train.attention_mask,
      batch_size=config.eval_batch_size, top_k=bc.top_k, weighting=_weighting(config, bc),
      normalize=_normalize(bc))
  return owners[0]


def _print_layer_table(table, chosen: int) -> None:
  lines = ["layer  H/logE  deficit    chi2      cv   (public corpus)"]
  for row in table:
    mark = "  <- l*" if row["layer"] == chosen else ""
    lines.append(f"{row['layer']:>5}  {row['entropy_norm']:.4f}  {row['entropy_deficit']:.4f}"
                 f"  {row['chi2']:.4f}  {row['cv']:.4f}{mark}")
  log.info("layer selection:\n%s", "\n".join(lines))


def _batch(train: data.TextClassificationData, owners: np.ndarray, indices: np.ndarray):
  return dict(input_ids=train.input_ids[indices], attention_mask=train.attention_mask[indices],
              labels=train.labels[indices], owners=owners[indices])


def secret_seed(config) -> int:
  """The seed of the Poisson samples and the noise: secret unless the user fixes it.

  Privacy amplification by sampling and the Gaussian noise both assume the
  adversary cannot reproduce the randomness, so by default it comes from the
  operating system's entropy, is kept in the (private) checkpoint for exact
  resumption, and is never written to config.json, logs or reports.
  `config.privacy.secret_seed >= 0` fixes it for reproducible experiments.
  """
  if config.privacy.secret_seed >= 0:
    return int(config.privacy.secret_seed)
  return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains per `config` in `workdir` (resuming if it holds a checkpoint).

  Writes `privacy_report.json`, `results.json`, `layer_selection.json` (public
  corpus statistics), `metrics.jsonl`, TensorBoard events and checkpoints.

  Returns:
    The results dict (also written to results.json).
  """
  start_time = time.time()
  workdir = Path(workdir).expanduser().resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  if not config.model.name:
    raise ValueError("set --config.model.name to a Hub id or a save_pretrained directory "
                     "(e.g. <pretrain workdir>/model from launch/pretrain.py)")
  if config.method not in methods.METHODS:
    raise ValueError(f"unknown method {config.method!r}; choose one of "
                     f"{', '.join(methods.METHODS)}")
  mesh = parallel.make_mesh(config.num_devices)
  # This host tokenises and keeps only its records (i % P == p); n counts all.
  run_data = setup.load_run_data(config, host=parallel.host_shard())
  n = parallel.global_count(len(run_data.train))
  data.check_batch_size(config.batch_size, n)
  sampling.check_microbatch_size(config.microbatch_size)
  backbone, backbone_params = setup.load_backbone(config, run_data)
  bc = backbone.config
  if not bc.sparse_layers:
    raise ValueError(f"{config.model.name} has no sparse (MoE) layer; RAPTOR needs an MoE model")

  expert_layer, table = select_expert_layer(config, backbone, backbone_params, run_data)
  _write_json(workdir / "layer_selection.json", dict(
      selected_layer=expert_layer, rule=str(config.raptor.layer), public_corpus=table))
  if table:
    _print_layer_table(table, expert_layer)

  plan = methods.build_plan(config, n=n, num_experts=bc.num_experts,
                            sparse_layers=bc.sparse_layers, expert_layer=expert_layer)
  needs_owners = any(part.owner for phase in plan.phases for part in phase.parts)
  owners = (private_owner_map(config, backbone, backbone_params, run_data.train, expert_layer)
            if needs_owners else np.zeros((len(run_data.train),), np.int32))

  backbone, backbone_params = hf.with_options(backbone, backbone_params, seed=config.seed,
                                              dtype=config.model.dtype, **plan.model_options)
  pooling = config.model.pooling or setup.default_pooling(backbone)
  model, params = setup.classifier(backbone, backbone_params, run_data.task.num_labels,
                                   pooling, config.seed)
  del backbone_params
  all_parts = [part for phase in plan.phases for part in phase.parts]
  trainable, frozen = setup.partition(params, all_parts)
  del params

  checkpointer = Checkpointer(workdir, config)
  meta = checkpointer.restore_meta()
  secret = meta["secret_seed"] if meta else parallel.agree(secret_seed(config))
  key = jax.random.PRNGKey(secret)
  phase_fns = [step.PhaseFunctions(
      model, phase, mesh=mesh, expert_layer=expert_layer, num_experts=bc.num_experts,
      learning_rate=config.learning_rate, residual=config.raptor.residual,
      residual_gamma=config.raptor.residual_gamma, key=jax.random.fold_in(key, i))
      for i, phase in enumerate(plan.phases)]
  opt_states = {}
  for fns in phase_fns:
    opt_states.update(fns.init_opt_states(trainable))
  trainable, frozen, opt_states = parallel.replicate((trainable, frozen, opt_states), mesh)
  ledger, cycle = PrivacyLedger(), 0
  # Wall time of earlier segments of a resumed run (0 for a fresh one).
  earlier_wall_s = float(meta.get("wall_time_s", 0.0)) if meta else 0.0
  if meta:
    state = checkpointer.restore_state({"trainable": trainable, "opt": opt_states})
    trainable, opt_states = state["trainable"], state["opt"]
    ledger, cycle = PrivacyLedger.from_json(meta["ledger"]), int(meta["cycle"])
    log.info("resumed from cycle %d of %d", cycle, plan.cycles)
  else:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

  if config.data.eval_split == "holdout":
    log.warning("data.eval_split='holdout': accuracy is measured on held-out records of the "
                "private train file; it is not differentially private (use it to tune "
                "hyperparameters, as the paper does, and do not publish it as private)")
  if config.log_private_stats:
    log.warning("log_private_stats=True: the private training loss will be logged; it is NOT "
                "differentially private and must not leave your trust boundary")
  writer = metrics.MetricWriter(workdir)
  logits_fn = step.make_eval_fn(model)
  cycles_per_epoch = accounting.steps_per_epoch(plan.sample_rate)
  local_microbatch = config.microbatch_size * len(mesh.local_devices)
  private = methods.is_private(plan)

  def eval_dev():
    return metrics.evaluate(lambda ids, mask: logits_fn(trainable, frozen,
                                                        *parallel.replicate((ids, mask), mesh)),
                            run_data.dev.input_ids, run_data.dev.attention_mask,
                            run_data.dev.labels, run_data.task.metrics, config.eval_batch_size)

  def spent() -> float | None:
    if not private:
      return None  # no privacy guarantee at all
    return ledger.epsilon(plan.delta) if cycle else 0.0

  def save():
    checkpointer.save(cycle, {"trainable": trainable, "opt": opt_states},
                      {"ledger": ledger.to_json(), "cycle": cycle, "secret_seed": secret,
                       "wall_time_s": earlier_wall_s + time.time() - start_time})

  stop_at = plan.cycles if not config.stop_after_cycles else min(
      plan.cycles, cycle + config.stop_after_cycles)
  progress = None
  if config.progress_bar:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    progress = tqdm(total=plan.cycles, initial=cycle, unit="cycle", dynamic_ncols=True)
  last_saved = cycle
  try:
    while cycle < stop_at:
      # The cycle's state is committed only when all its phases ran, so an
      # interruption leaves (trainable, opt_states, ledger, cycle) consistent.
      new_trainable, new_opt_states = trainable, opt_states
      for phase, fns in zip(plan.phases, phase_fns):
        sample = sampling.poisson_sample(n, plan.sample_rate, seed=secret,
                                         stream=phase.stream, step=cycle)
        sums = fns.zero_sums(new_trainable)
        loss_sum = 0.0
        for mb in parallel.local_microbatches(sample, local_microbatch):
          batch, mask = parallel.shard_records(
              (_batch(run_data.train, owners, mb.indices), mb.mask), mesh)
          if config.log_private_stats:
            loss_sum += float(fns.loss_sum(new_trainable, frozen, batch, mask))
          sums = fns.accumulate(new_trainable, frozen, sums, batch, mask)
        new_trainable, new_opt_states = fns.update(new_trainable, new_opt_states, sums)
        if config.log_private_stats:  # opted in, warned: a non-private statistic
          writer.write(cycle, {f"private/{phase.name}_train_loss":
                               loss_sum / max(len(sample), 1)})
      trainable, opt_states = new_trainable, new_opt_states
      for phase in plan.phases:
        if phase.private:
          ledger.record(phase.name, sample_rate=plan.sample_rate,
                        noise_multiplier=phase.noise_multiplier)
      cycle += 1
      if progress is not None:
        progress.update(1)
      end_of_epoch = cycle % cycles_per_epoch == 0 or cycle == plan.cycles
      if cycle % config.log_every_cycles == 0 or end_of_epoch:
        eps = spent()
        writer.write(cycle, {"epoch": cycle / cycles_per_epoch,
                             **({} if eps is None else {"epsilon_spent": eps})})
        if progress is not None:
          progress.set_postfix(eps="n/a" if eps is None else f"{eps:.3f}", refresh=False)
      if end_of_epoch and (cycle // cycles_per_epoch) % config.eval_every_epochs == 0:
        dev = eval_dev()
        writer.write(cycle, {f"dev/{k}": v for k, v in dev.items()})
        log.info("cycle %d: dev %s, epsilon spent %s", cycle, dev, spent())
      if cycle - last_saved >= config.checkpoint_every_cycles:
        save()
        last_saved = cycle
  except BaseException:
    # A crash loses no checkpoint: save the last completed cycle, then re-raise.
    if cycle > last_saved:
      save()
    raise
  finally:
    if progress is not None:
      progress.close()
  if cycle > last_saved:
    save()
  checkpointer.close()

  dev = eval_dev()
  finished = cycle >= plan.cycles
  noise = methods.noise_summary(plan)
  report = dict(
      method=plan.method, epsilon=spent(), target_epsilon=plan.target_epsilon if private else None,
      delta=plan.delta, sample_rate=plan.sample_rate, rho=config.privacy.rho,
      sigma_shared=noise.get("shared", noise.get("all", {})).get("noise_multiplier"),
      sigma_expert=noise.get("expert", {}).get("noise_multiplier"),
      steps_shared=cycle if ("shared" in noise or "all" in noise) else 0,
      steps_expert=cycle if "expert" in noise else 0,
      cycles=cycle, planned_cycles=plan.cycles, finished=finished, private=private,
      accountant="PLD (dp_accounting.pld.PLDAccountant, add/remove adjacency, Poisson sampling)",
      parts=noise, ledger=ledger.to_dict(), expert_layer=expert_layer,
      batch_size=config.batch_size, n=n)
  _write_json(workdir / "privacy_report.json", report)
  results = dict(
      method=plan.method, task=run_data.task.name, eval_split=config.data.eval_split,
      finished=finished, cycles=cycle,
      wall_time_s=earlier_wall_s + time.time() - start_time,  # every segment of the run
      wall_time_this_session_s=time.time() - start_time, epsilon=report["epsilon"],
      trainable_parameters={part.name: int(sum(np.size(v) for v in trainable[part.name].values()))
                            for part in all_parts},
      parameters_by_role=roles.count_by_role(step.merged_params(frozen, trainable)),
      expert_layer=expert_layer, **{f"dev_{k}": v for k, v in dev.items()}, **dev)
  _write_json(workdir / "results.json", results)
  writer.write(cycle, {f"final/dev_{k}": v for k, v in dev.items()})
  writer.close()
  log.info("done: %s", {k: results[k] for k in ("finished", "cycles", "epsilon", *dev)})
  return results
