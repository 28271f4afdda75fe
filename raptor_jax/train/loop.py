"""`train_and_evaluate`: one loop for RAPTOR, its baselines and ablations.

Per cycle (Alg. 1), every phase of the plan draws its own Poisson sample
(`numpy.random.default_rng((seed, stream, cycle))`), accumulates clipped
per-record gradient sums over fixed-size microbatches, and makes ONE noisy
DP-Adam update; the ledger records the release. The realised sample size only
decides how many microbatches run; nothing reads, branches on or logs it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from raptor_jax import accounting, data, ownership, roles, sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import methods, metrics, parallel, step
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import Run, build_run, validate

log = logging.getLogger("raptor_jax")


def _is_writer() -> bool:
  """Whether this process writes the (shared) workdir's files: process 0 only."""
  return jax.process_index() == 0


def _write_json(path: Path, payload: dict) -> None:
  """Writes `payload` atomically, from process 0 only."""
  if not _is_writer():
    return
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
  tmp.replace(path)


def _batch(
    train: data.TextClassificationData, owners: np.ndarray, indices: np.ndarray
):
  return dict(
      input_ids=train.input_ids[indices],
      attention_mask=train.attention_mask[indices],
      labels=train.labels[indices],
      owners=owners[indices],
  )


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


@dataclasses.dataclass
class TrainState:
  """What a cycle changes, committed together once all its phases ran."""

  trainable: dict
  opt_states: dict
  ledger: PrivacyLedger
  cycle: int


def _phase_functions(run: Run, mesh, secret: int) -> list[step.PhaseFunctions]:
  """The jitted step of every phase; phase i's noise keys fold i into the secret key."""
  config, key = run.config, jax.random.PRNGKey(secret)
  return [
      step.PhaseFunctions(
          run.model,
          phase,
          mesh=mesh,
          expert_layer=run.expert_layer,
          num_experts=run.num_experts,
          learning_rate=config.learning_rate,
          residual=config.raptor.residual,
          residual_gamma=config.raptor.residual_gamma,
          key=jax.random.fold_in(key, i),
      )
      for i, phase in enumerate(run.plan.phases)
  ]


def _initial_state(
    run: Run, phase_fns, mesh, checkpointer: Checkpointer, meta: dict | None
) -> tuple[TrainState, Any]:
  """(state, frozen) placed on the mesh: fresh, or the latest checkpoint's."""
  opt_states = {}
  for fns in phase_fns:
    opt_states.update(fns.init_opt_states(run.trainable))
  trainable, frozen, opt_states = parallel.replicate(
      (run.trainable, run.frozen, opt_states), mesh
  )
  state = TrainState(trainable, opt_states, PrivacyLedger(), 0)
  if meta:
    restored = checkpointer.restore_state(
        {"trainable": trainable, "opt": opt_states}
    )
    state = TrainState(
        restored["trainable"],
        restored["opt"],
        PrivacyLedger.from_json(meta["ledger"]),
        int(meta["cycle"]),
    )
    log.info("resumed from cycle %d of %d", state.cycle, run.plan.cycles)
  return state, frozen


def _warn_if_not_private(config) -> None:
  if config.data.eval_split == "holdout":
    log.warning(
        "data.eval_split='holdout': accuracy is measured on held-out records of the "
        "private train file; it is not differentially private (use it to tune "
        "hyperparameters, as the paper does, and do not publish it as private)"
    )
  if config.log_private_stats:
    log.warning(
        "log_private_stats=True: the private training loss will be logged; it is NOT "
        "differentially private and must not leave your trust boundary"
    )


def _train_cycle(
    run: Run,
    phase_fns,
    mesh,
    state: TrainState,
    frozen,
    secret: int,
    writer: metrics.MetricWriter,
) -> TrainState:
  """Runs every phase of one cycle and returns the committed next state.

  Each phase draws its own Poisson sample, sums clipped gradients over
  fixed-size microbatches and makes one noisy update. The new state (and the
  ledger entry of every private phase) only exists once all phases ran, so an
  interruption leaves the previous state consistent.
  """
  config, plan, cycle = run.config, run.plan, state.cycle
  local_microbatch = config.microbatch_size * len(mesh.local_devices)
  trainable, opt_states = state.trainable, state.opt_states
  for phase, fns in zip(plan.phases, phase_fns):
    sample = sampling.poisson_sample(
        run.n, plan.sample_rate, seed=secret, stream=phase.stream, step=cycle
    )
    sums, loss_sum = fns.zero_sums(trainable), 0.0
    for mb in parallel.local_microbatches(sample, local_microbatch):
      batch, mask = parallel.shard_records(
          (_batch(run.data.train, run.owners, mb.indices), mb.mask), mesh
      )
      if config.log_private_stats:
        loss_sum += float(fns.loss_sum(trainable, frozen, batch, mask))
      sums = fns.accumulate(trainable, frozen, sums, batch, mask)
    trainable, opt_states = fns.update(trainable, opt_states, sums)
    if config.log_private_stats:  # opted in, warned: a non-private statistic
      writer.write(
          cycle,
          {f"private/{phase.name}_train_loss": loss_sum / max(len(sample), 1)},
      )
  ledger = PrivacyLedger(
      state.ledger.entries
  )  # a copy: `state` stays as it was
  for phase in plan.phases:
    if phase.private:
      ledger.record(
          phase.name,
          sample_rate=plan.sample_rate,
          noise_multiplier=phase.noise_multiplier,
      )
  return TrainState(trainable, opt_states, ledger, cycle + 1)


def _epsilon_spent(plan: methods.Plan, state: TrainState) -> float | None:
  if not methods.is_private(plan):
    return None  # no privacy guarantee at all
  return state.ledger.epsilon(plan.delta) if state.cycle else 0.0


def _progress_bar(config, plan: methods.Plan, cycle: int):
  if not config.progress_bar or not _is_writer():
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(
      total=plan.cycles, initial=cycle, unit="cycle", dynamic_ncols=True
  )


def write_reports(
    workdir: Path,
    run: Run,
    state: TrainState,
    frozen,
    dev: dict[str, float],
    wall_time_s: float,
    session_s: float,
) -> dict[str, Any]:
  """Writes privacy_report.json and results.json (public quantities only); returns results."""
  config, plan, cycle = run.config, run.plan, state.cycle
  private = methods.is_private(plan)
  noise = methods.noise_summary(plan)
  finished = cycle >= plan.cycles
  report = dict(
      method=plan.method,
      epsilon=_epsilon_spent(plan, state),
      target_epsilon=plan.target_epsilon if private else None,
      delta=plan.delta,
      sample_rate=plan.sample_rate,
      rho=config.privacy.rho,
      sigma_shared=noise.get("shared", noise.get("all", {})).get(
          "noise_multiplier"
      ),
      sigma_expert=noise.get("expert", {}).get("noise_multiplier"),
      steps_shared=cycle if ("shared" in noise or "all" in noise) else 0,
      steps_expert=cycle if "expert" in noise else 0,
      cycles=cycle,
      planned_cycles=plan.cycles,
      finished=finished,
      private=private,
      accountant="PLD (dp_accounting.pld.PLDAccountant, add/remove adjacency, Poisson sampling)",
      parts=noise,
      ledger=state.ledger.to_dict(),
      expert_layer=run.expert_layer,
      batch_size=config.batch_size,
      n=run.n,
  )
  _write_json(workdir / "privacy_report.json", report)
  results = dict(
      method=plan.method,
      task=run.data.task.name,
      eval_split=config.data.eval_split,
      finished=finished,
      cycles=cycle,
      wall_time_s=wall_time_s,  # every segment of the run
      wall_time_this_session_s=session_s,
      epsilon=report["epsilon"],
      trainable_parameters={
          part.name: int(
              sum(np.size(v) for v in state.trainable[part.name].values())
          )
          for part in plan.parts
      },
      parameters_by_role=roles.count_by_role(
          step.merged_params(frozen, state.trainable)
      ),
      expert_layer=run.expert_layer,
      **{f"dev_{k}": v for k, v in dev.items()},
      **dev,
  )
  _write_json(workdir / "results.json", results)
  return results


class _Session:
  """One training session of a run: its mesh, jitted steps, state, writers."""

  def __init__(self, run: Run, mesh, workdir: Path, start_time: float):
    self.run, self.mesh, self.start_time = run, mesh, start_time
    config = run.config
    self.checkpointer = Checkpointer(workdir, config)
    meta = self.checkpointer.restore_meta()
    self.secret = (
        meta["secret_seed"] if meta else parallel.agree(secret_seed(config))
    )
    self.phase_fns = _phase_functions(run, mesh, self.secret)
    self.state, self.frozen = _initial_state(
        run, self.phase_fns, mesh, self.checkpointer, meta
    )
    # Wall time of earlier segments of a resumed run (0 for a fresh one).
    self.earlier_wall_s = float(meta.get("wall_time_s", 0.0)) if meta else 0.0
    if not meta and _is_writer():
      (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    _warn_if_not_private(config)
    self.writer = metrics.MetricWriter(workdir, just_logging=not _is_writer())
    self.logits_fn = step.make_eval_fn(run.model)
    self.cycles_per_epoch = accounting.steps_per_epoch(run.plan.sample_rate)
    self.last_saved = self.state.cycle

  def wall_time_s(self) -> float:
    return self.earlier_wall_s + time.time() - self.start_time

  def evaluate(self) -> dict[str, float]:
    """Metrics of the current parameters on the evaluation split."""
    dev, state = self.run.data.dev, self.state
    logits = lambda ids, mask: self.logits_fn(
        state.trainable,
        self.frozen,
        *parallel.replicate((ids, mask), self.mesh),
    )
    return metrics.evaluate(
        logits,
        dev.input_ids,
        dev.attention_mask,
        dev.labels,
        self.run.data.task.metrics,
        self.run.config.eval_batch_size,
    )

  def save(self) -> None:
    state = self.state
    self.checkpointer.save(
        state.cycle,
        {"trainable": state.trainable, "opt": state.opt_states},
        {
            "ledger": state.ledger.to_json(),
            "cycle": state.cycle,
            "secret_seed": self.secret,
            "wall_time_s": self.wall_time_s(),
        },
    )
    self.last_saved = state.cycle

  def log_cycle(self, progress) -> None:
    """Public per-cycle output: epoch, epsilon spent, dev metrics at epoch ends."""
    config, plan, cycle = self.run.config, self.run.plan, self.state.cycle
    if progress is not None:
      progress.update(1)
    end_of_epoch = cycle % self.cycles_per_epoch == 0 or cycle == plan.cycles
    if cycle % config.log_every_cycles == 0 or end_of_epoch:
      eps = _epsilon_spent(plan, self.state)
      self.writer.write(
          cycle,
          {
              "epoch": cycle / self.cycles_per_epoch,
              **({} if eps is None else {"epsilon_spent": eps}),
          },
      )
      if progress is not None:
        progress.set_postfix(
            eps="n/a" if eps is None else f"{eps:.3f}", refresh=False
        )
    if (
        end_of_epoch
        and (cycle // self.cycles_per_epoch) % config.eval_every_epochs == 0
    ):
      dev = self.evaluate()
      self.writer.write(cycle, {f"dev/{k}": v for k, v in dev.items()})
      log.info(
          "cycle %d: dev %s, epsilon spent %s",
          cycle,
          dev,
          _epsilon_spent(plan, self.state),
      )

  def train(self) -> None:
    """Cycles until the plan (or config.stop_after_cycles) ends, checkpointing."""
    config, plan = self.run.config, self.run.plan
    stop_at = (
        plan.cycles
        if not config.stop_after_cycles
        else min(plan.cycles, self.state.cycle + config.stop_after_cycles)
    )
    progress = _progress_bar(config, plan, self.state.cycle)
    try:
      while self.state.cycle < stop_at:
        self.state = _train_cycle(
            self.run,
            self.phase_fns,
            self.mesh,
            self.state,
            self.frozen,
            self.secret,
            self.writer,
        )
        self.log_cycle(progress)
        if self.state.cycle - self.last_saved >= config.checkpoint_every_cycles:
          self.save()
    except BaseException:
      # A crash loses no checkpoint: save the last completed cycle, then re-raise.
      if self.state.cycle > self.last_saved:
        self.save()
      raise
    finally:
      if progress is not None:
        progress.close()
    if self.state.cycle > self.last_saved:
      self.save()
    self.checkpointer.close()


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str
) -> dict[str, Any]:
  """Trains per `config` in `workdir` (resuming if it holds a checkpoint).

  Writes `privacy_report.json`, `results.json`, `layer_selection.json` (public
  corpus statistics), `metrics.jsonl`, TensorBoard events and checkpoints.
  In a multi-host run only process 0 writes these files and shows the
  progress bar (checkpoints are written jointly, by orbax); every process
  returns the same results.

  Returns:
    The results dict (also written to results.json).
  """
  start_time = time.time()
  validate(config)  # before any data or model is loaded
  mesh = parallel.make_mesh(config.num_devices)
  workdir = Path(workdir).expanduser().resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  # This host tokenises and keeps only its records (i % P == p); n counts all.
  run = build_run(config, host=parallel.host_shard())
  _write_json(
      workdir / "layer_selection.json",
      dict(
          selected_layer=run.expert_layer,
          rule=str(config.raptor.layer),
          public_corpus=run.layer_table,
          # Data-dependent (curator pre-processing, not DP): see README.
          public_texts_dropped_overlap_private=run.data.public_dropped,
      ),
  )
  if run.layer_table:
    log.info(
        "layer selection:\n%s",
        ownership.format_layer_table(run.layer_table, run.expert_layer),
    )
  session = _Session(run, mesh, workdir, start_time)
  session.train()
  dev = session.evaluate()
  results = write_reports(
      workdir,
      run,
      session.state,
      session.frozen,
      dev,
      wall_time_s=session.wall_time_s(),
      session_s=time.time() - start_time,
  )
  session.writer.write(
      session.state.cycle, {f"final/dev_{k}": v for k, v in dev.items()}
  )
  session.writer.close()
  log.info(
      "done: %s",
      {k: results[k] for k in ("finished", "cycles", "epsilon", *dev)},
  )
  return results
