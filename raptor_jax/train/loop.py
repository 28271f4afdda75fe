"""`train_and_evaluate`: one loop for RAPTOR, its baselines and ablations.

Per cycle (Alg. 1), every phase of the plan draws its own Poisson sample
(`numpy.random.default_rng((seed, stream, cycle))`, the seed a KDF of the
run's secret: `secrecy`), accumulates clipped per-record gradient sums over
fixed-size microbatches, and makes ONE noisy DP-Adam update; the ledger
records the release in the same immutable `TrainState`. The realised sample size only
decides how many microbatches run; nothing reads, branches on or logs it.

Length buckets (`data.length_buckets`, `raptor_jax.length_buckets`): each
sample's records run in fixed-shape microbatches of the smallest bucket
length that holds them, so each phase's step compiles once per bucket; the
clipped sums of every bucket add into the phase's one noisy update, the same
function of the sample as unbucketed (up to float summation order). Which
bucket a record lands in depends on its private length, so it changes the
layout and the wall time only; no bucket, count of records per bucket or
microbatches per bucket reaches a log, metric, progress bar or file.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from raptor_jax import _validate, accounting, data, length_buckets, ownership
from raptor_jax import sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import methods, metrics, parallel, preemption, secrecy, step
from raptor_jax.train import curves, outputs, workdir as workdir_lib
from raptor_jax.train.outputs import TrainState
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import Run, build_run, validate

log = logging.getLogger("raptor_jax")


def _batch(
    train: data.TextClassificationData,
    owners: np.ndarray,
    indices: np.ndarray,
    length: int | None = None,
):
  """The records `indices`, their tokens cut to `length` (None: max_length).

  Records are right padded, so cutting a record to a bucket that holds it
  drops padding only (a padding row, mask 0, may lose tokens: its weight is
  zero whatever it holds).
  """
  return dict(
      input_ids=train.input_ids[indices, :length],
      attention_mask=train.attention_mask[indices, :length],
      labels=train.labels[indices],
      owners=owners[indices],
  )


def _microbatches(sample, local_size, buckets, lengths):
  """[(length or None, Microbatch)]: this host's microbatches of `sample`.

  No buckets: `parallel.local_microbatches` (every record at max_length).
  Buckets: `parallel.local_bucketed_microbatches`, bucket by bucket. The
  layout is private (it follows the records' lengths and the realised
  sample); it is iterated over, never logged or counted anywhere public.
  """
  if not buckets:
    return [
        (None, mb) for mb in parallel.local_microbatches(sample, local_size)
    ]
  return list(
      parallel.local_bucketed_microbatches(sample, lengths, buckets, local_size)
  )


def _phase_functions(
    run: Run, mesh, secret: bytes
) -> list[step.PhaseFunctions]:
  """The jitted step of every phase; phase i's noise key is the KDF 'noise/i'."""
  config = run.config
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
          key=secrecy.noise_key(secret, i),
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
    outputs.check_consistent(run.plan, state, checkpointer.latest_path())
    log.info("resumed from cycle %d of %d", state.cycle, run.plan.cycles)
  return state, frozen


def _warn_if_not_private(config) -> None:
  secrecy.warn_if_fixed(config)
  if config.data.eval_split == "holdout":
    log.warning(
        "data.eval_split='holdout': accuracy is measured on held-out records of the "
        "private train file; it is not differentially private (use it to tune "
        "hyperparameters, as the paper does, and do not publish it as private)"
    )
  if config.log_wall_time:
    log.warning(
        "log_wall_time=True: wall time depends on the realised Poisson sample"
        " sizes (the number of microbatches); it is NOT differentially private"
        " and must not leave your trust boundary"
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
    secret: bytes,
    writer: metrics.MetricWriter,
    lengths: np.ndarray | None = None,
) -> TrainState:
  """Runs every phase of one cycle and returns the committed next state.

  Each phase draws its own Poisson sample, sums clipped gradients over
  fixed-size microbatches (by length bucket with `data.length_buckets`;
  `lengths`: this host's record lengths, computed here when None) and makes
  one noisy update. The new state (and the ledger entry of every private
  phase) only exists once all phases ran, so an interruption leaves the
  previous state consistent.
  """
  config, plan, cycle = run.config, run.plan, state.cycle
  local_microbatch = config.microbatch_size * len(mesh.local_devices)
  buckets = length_buckets.from_config(config)
  if buckets and lengths is None:
    lengths = length_buckets.record_lengths(run.data.train.attention_mask)
  trainable, opt_states = state.trainable, state.opt_states
  seed = secrecy.sampler_seed(secret)
  for phase, fns in zip(plan.phases, phase_fns):
    sample = sampling.poisson_sample(
        run.n, plan.sample_rate, seed=seed, stream=phase.stream, step=cycle
    )
    sums, loss_sum = fns.zero_sums(trainable), 0.0
    for length, mb in _microbatches(sample, local_microbatch, buckets, lengths):
      batch, mask = parallel.shard_records(
          (_batch(run.data.train, run.owners, mb.indices, length), mb.mask),
          mesh,
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
  return TrainState(
      trainable, opt_states, outputs.accounted(plan, state.ledger), cycle + 1
  )


def _progress_bar(config, plan: methods.Plan, cycle: int):
  if not config.progress_bar or not outputs.is_writer():
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  # Without log_wall_time: no elapsed time, ETA or rate (they time the
  # realised sample sizes).
  timeless = "{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}"
  return tqdm(
      total=plan.cycles,
      initial=cycle,
      unit="cycle",
      dynamic_ncols=True,
      bar_format=None if config.log_wall_time else timeless,
  )


class _Session:
  """One training session of a run: its mesh, jitted steps, state, writers."""

  def __init__(self, run: Run, mesh, workdir: Path, start_time: float):
    self.run, self.mesh, self.start_time = run, mesh, start_time
    config = run.config
    self.checkpointer = Checkpointer(workdir, config)
    meta = self.checkpointer.restore_meta()
    self.data = secrecy.data_fingerprint(config)
    self.secret = workdir_lib.run_secret(
        config, meta, self.data, self.checkpointer
    )
    self.phase_fns = _phase_functions(run, mesh, self.secret)
    self.state, self.frozen = _initial_state(
        run, self.phase_fns, mesh, self.checkpointer, meta
    )
    # Wall time of earlier segments of a resumed run (0 for a fresh one).
    self.earlier_wall_s = float(meta.get("wall_time_s", 0.0)) if meta else 0.0
    if not meta and outputs.is_writer():
      (workdir / "config.json").write_text(secrecy.public_config(config))
    _warn_if_not_private(config)
    self.writer = metrics.MetricWriter(
        workdir,
        just_logging=not outputs.is_writer(),
        wall_time=config.log_wall_time,
    )
    self.logits_fn = step.make_eval_fn(run.model)
    # Length buckets and this host's record lengths (private: the layout
    # of each cycle's microbatches only, never logged or saved).
    self.buckets = length_buckets.from_config(config)
    self.lengths = (
        length_buckets.record_lengths(run.data.train.attention_mask)
        if self.buckets
        else None
    )
    self.cycles_per_epoch = accounting.steps_per_epoch(run.plan.sample_rate)
    self.last_saved = self.state.cycle
    self.clock = preemption.CheckpointClock(
        config.checkpoint_every_cycles,
        config.checkpoint_every_minutes,
        saved_cycle=self.state.cycle,
    )

  def public_data(self) -> dict:
    """The report's data field: the public source, or a keyed file digest."""
    if self.data["source"] != "file":
      return dict(self.data)
    return dict(
        source="file",
        keyed_sha256=secrecy.keyed_digest(self.secret, self.data),
    )

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
        buckets=self.buckets,
    )

  def save(self, stopping: bool = False) -> None:
    """Checkpoints the current state, once per cycle.

    An interrupt that lands after the checkpoint of this cycle was written
    (but before `last_saved` moved) finds it saved: the state of a cycle is
    one value, so that checkpoint is this state and is not written twice.
    A stop signal during the save waits for it to commit, then stops the run
    (or, `stopping`: the run already stops, it is dropped).
    """
    state = self.state
    if self.checkpointer.latest() == state.cycle:
      self.last_saved = state.cycle
      self.clock.saved(state.cycle)
      return
    with preemption.deferred_signals(raise_after=not stopping):
      self._write_checkpoint(state)
    self.last_saved = state.cycle
    self.clock.saved(state.cycle)

  def _write_checkpoint(self, state: TrainState) -> None:
    self.checkpointer.save(
        state.cycle,
        {"trainable": state.trainable, "opt": state.opt_states},
        {
            "ledger": state.ledger.to_json(),
            "cycle": state.cycle,
            "secret": self.secret.hex(),
            "data": self.data,
            "wall_time_s": self.wall_time_s(),
        },
    )

  def log_cycle(self, progress) -> None:
    """Public per-cycle output: epoch, epsilon spent, dev metrics at epoch ends.

    A stop signal waits for the cycle's rows (its evaluation included), then
    stops the run: the checkpoint of this cycle is saved next, and a resumed
    run starts after it, so rows skipped now would be lost for good.
    """
    with preemption.deferred_signals():
      self._log_cycle(progress)

  def _log_cycle(self, progress) -> None:
    config, plan, cycle = self.run.config, self.run.plan, self.state.cycle
    end_of_epoch = cycle % self.cycles_per_epoch == 0 or cycle == plan.cycles
    eps = None
    if cycle % config.log_every_cycles == 0 or end_of_epoch:
      eps = outputs.epsilon_spent(plan, self.state)
      self.writer.write(
          cycle,
          {
              "epoch": cycle / self.cycles_per_epoch,
              **({} if eps is None else {"epsilon_spent": eps}),
          },
      )
      if progress is not None:  # before the update that draws this cycle
        progress.set_postfix_str(
            "eps n/a" if eps is None else f"eps {eps:.3f} after cycle {cycle}",
            refresh=False,
        )
    if progress is not None and progress.n + 1 < progress.total:
      progress.update(1)
    elif progress is not None:  # the full bar is drawn once, by its close
      progress.n += 1
    if (
        end_of_epoch
        and (cycle // self.cycles_per_epoch) % config.eval_every_epochs == 0
    ):
      dev = self.evaluate()
      # The evaluation row carries the spend it was made at (48.4).
      self.writer.write(
          cycle,
          {
              **{f"dev/{k}": v for k, v in dev.items()},
              **({} if eps is None else {"epsilon_spent": eps}),
          },
      )
      line = f"cycle {cycle}: dev " + ", ".join(
          f"{k} {v:.4f}" for k, v in dev.items()
      )
      line += "" if eps is None else f", epsilon spent {eps:.3f}"
      if progress is not None and progress.n < progress.total:
        progress.write(line)  # above the bar, not glued onto it
      else:
        if progress is not None:
          progress.close()  # the full bar once, then the last line
        log.info("%s", line)

  def _checkpoint_due(self) -> bool:
    """Whether to save now; every process of a multi-host run agrees (the
    time-based period reads each host's clock, and orbax saves jointly)."""
    due = self.clock.due(self.state.cycle)
    if self.clock.seconds and jax.process_count() > 1:
      due = bool(parallel.agree(int(due)))
    return due

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
            self.lengths,
        )
        self.log_cycle(progress)
        if self._checkpoint_due():
          self.save()
    except BaseException:
      # A crash or a stop signal (`preemption.Stopped`) loses no checkpoint:
      # save the last completed cycle, then re-raise.
      if self.state.cycle > self.last_saved:
        self.save(stopping=True)
      raise
    finally:
      if progress is not None:
        progress.close()
    if self.state.cycle > self.last_saved:
      self.save()
    self.checkpointer.close()


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    run: Run | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
  """Trains per `config` in `workdir` (resuming if it holds a checkpoint).

  Writes `privacy_report.json`, `results.json`, `layer_selection.json` (public
  corpus statistics), `metrics.jsonl`, TensorBoard events and checkpoints.
  In a multi-host run only process 0 writes these files and shows the
  progress bar (checkpoints are written jointly, by orbax); every process
  returns the same results.

  Args:
    config: the run's config.
    workdir: where the run writes (and resumes from).
    run: optionally, the single-process `build_run(config)` already built
      by the caller (the audit reads its canaries); saves building it twice
      (and validating `config` twice: `build_run` did).
    dry_run: validate, check the workdir, build the run (data, model, noise
      calibration), log the run header and the resolved config, and return
      {} without training or writing a file.

  One process trains in a workdir at a time (`preemption.WorkdirLock`), and
  SIGINT and SIGTERM stop the run with a checkpoint of its last completed
  cycle (`preemption`).

  Returns:
    The results dict (also written to results.json).

  Raises:
    preemption.Stopped: a stop signal; its `cycle` is the cycle the
      workdir's checkpoint holds (None: no checkpoint yet).
    ValueError: bad config, a workdir in use by another process or of
      another config (one line).
  """
  start_time = time.time()
  if run is None or not run.validated:
    validate(config)  # before any data or model is loaded; once per run
  mesh = parallel.make_mesh(config.num_devices)
  workdir = Path(workdir).expanduser().resolve()
  if not dry_run:  # a dry run writes nothing, not even the workdir's lock
    workdir.mkdir(parents=True, exist_ok=True)
  lock = (
      preemption.WorkdirLock(workdir)
      if outputs.is_writer() and not dry_run
      else contextlib.nullcontext()
  )
  with lock, preemption.stop_on_signals():
    try:
      return _train_and_evaluate(
          config, workdir, mesh, run, start_time, dry_run
      )
    except preemption.Stopped as stopped:
      stopped.cycle = preemption.latest_checkpoint(workdir)
      raise


def _train_and_evaluate(config, workdir, mesh, run, start_time, dry_run):
  """`train_and_evaluate` inside the workdir lock and the stop signals."""
  workdir_lib.check_workdir(config, workdir)
  finished = None if dry_run else workdir_lib.finished_results(workdir)
  if finished is not None:  # nothing to load, train or write
    log.info(
        "already finished: %s holds the finished run of this config; results"
        " in %s",
        workdir,
        workdir / "results.json",
    )
    return finished
  if outputs.is_writer() and not dry_run:
    workdir_lib.start_fresh(workdir)
  # This host tokenises and keeps only its records (i % P == p); n counts all.
  if run is None:
    if outputs.is_writer():
      log.info(
          "loading the data, the public corpus and the model (%s)...",
          config.model.name,
      )
    run = build_run(config, host=parallel.host_shard(), validated=True)
  elif run.config is not config or jax.process_count() > 1:
    _validate.fail(
        "run",
        "build_run(config) of this config, in a single-process job",
        f"a run of {run.config.method!r} in {jax.process_count()} processes",
        "pass run=None to build it here",
    )
  if dry_run:
    if outputs.is_writer():
      log.info("%s", outputs.run_header(run, workdir))
      log.info(
          "config (dry run: nothing trained, no output written):\n%s", config
      )
    return {}
  outputs.write_layer_selection(workdir, run)
  if run.layer_table:
    log.info(
        "layer selection:\n%s",
        ownership.format_layer_table(run.layer_table, run.expert_layer),
    )
  if outputs.is_writer():
    log.info("%s", outputs.run_header(run, workdir))
  session = _Session(run, mesh, workdir, start_time)
  session.train()
  dev = session.evaluate()
  results = outputs.write_reports(
      workdir,
      run,
      session.state,
      session.frozen,
      dev,
      wall_time_s=session.wall_time_s(),
      session_s=time.time() - start_time,
      data_digest=session.public_data(),
  )
  session.writer.write(
      session.state.cycle, {f"final/dev_{k}": v for k, v in dev.items()}
  )
  session.writer.close()
  if outputs.is_writer():
    curves.write(
        workdir,
        f"{run.plan.method} on {run.data.task.name}",
        config.data.eval_split,
    )
    log.info("%s", outputs.run_summary(run, results, dev, workdir))
  return results
