"""`train_and_evaluate`: one loop for RAPTOR, its baselines and ablations.

A session restores or starts the run's state, compiles every program the
run calls ahead (`train.cycle.compile_run`), then runs
`train.cycle.train_cycle` until the plan ends, checkpointing, evaluating and
logging as it goes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections

from raptor_jax import _validate, accounting, compilation, ownership
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import cycle as cycle_lib
from raptor_jax.train import metrics, parallel, preemption, secrecy, step
from raptor_jax.train import curves, outputs, workdir as workdir_lib
from raptor_jax.train.outputs import TrainState
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import Run, build_run, validate

log = logging.getLogger("raptor_jax")


def _initial_state(
    run: Run, phase_fns, mesh, checkpointer: Checkpointer, meta: dict | None
) -> tuple[TrainState, Any]:
  """(state, frozen) placed on the mesh: fresh, or the latest checkpoint's."""
  state, frozen = cycle_lib.initial_state(run, phase_fns, mesh)
  if meta:
    restored = checkpointer.restore_state(
        {"trainable": state.trainable, "opt": state.opt_states}
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


def _progress_bar(config, plan: plans.Plan, cycle: int):
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


def _checkpoint_due(clock: preemption.CheckpointClock, cycle: int) -> bool:
  """Whether to save now; every process of a multi-host run agrees (the
  time-based period reads each host's clock, and orbax saves jointly)."""
  if clock.seconds and jax.process_count() > 1:
    return bool(parallel.agree(int(clock.due(cycle))))
  return clock.due(cycle)


def _spent(eps: float | None) -> dict[str, float]:
  """The `epsilon_spent` field of a metrics row (none for a non-private run)."""
  return {} if eps is None else {"epsilon_spent": eps}


def _advance(progress) -> None:
  """One cycle on the bar; the full bar is drawn once, by its close."""
  if progress is not None and progress.n + 1 < progress.total:
    progress.update(1)
  elif progress is not None:
    progress.n += 1


def _show(progress, line: str) -> None:
  """`line` above the bar (not glued onto it), or after the full bar."""
  if progress is not None and progress.n < progress.total:
    progress.write(line)
    return
  if progress is not None:
    progress.close()  # the full bar once, then the last line
  log.info("%s", line)


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
    self.phase_fns = cycle_lib.phase_functions(run, mesh, self.secret)
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
    self.lengths = cycle_lib.record_lengths(run)  # private: layout only
    self.seconds = dict(train=0.0, evaluate=0.0)
    self.cycles_per_epoch = accounting.steps_per_epoch(run.plan.sample_rate)
    self.last_saved = self.state.cycle
    self.clock = preemption.CheckpointClock(
        config.checkpoint_every_cycles,
        config.checkpoint_every_minutes,
        saved_cycle=self.state.cycle,
    )

  def wall_time_s(self) -> float:
    return self.earlier_wall_s + time.time() - self.start_time

  def evaluate(self) -> dict[str, float]:
    """Metrics of the current parameters on the evaluation split."""
    start = time.perf_counter()
    result = cycle_lib.evaluate(
        self.run, self.logits_fn, self.state, self.frozen, self.mesh
    )
    self.seconds["evaluate"] += time.perf_counter() - start
    return result

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
    meta = dict(ledger=state.ledger.to_json(), cycle=state.cycle)
    meta.update(secret=self.secret.hex(), data=self.data)
    with preemption.deferred_signals(raise_after=not stopping):
      self.checkpointer.save(
          state.cycle,
          {"trainable": state.trainable, "opt": state.opt_states},
          dict(meta, wall_time_s=self.wall_time_s()),
      )
    self.last_saved = state.cycle
    self.clock.saved(state.cycle)

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
      eps = outputs.epsilon_spent(plan, self.state, logged=True)
      self.writer.write(
          cycle, {"epoch": cycle / self.cycles_per_epoch, **_spent(eps)}
      )
      if progress is not None:  # before the update that draws this cycle
        progress.set_postfix_str(
            "eps n/a" if eps is None else f"eps {eps:.3f} after cycle {cycle}",
            refresh=False,
        )
    _advance(progress)
    if (
        end_of_epoch
        and (cycle // self.cycles_per_epoch) % config.eval_every_epochs == 0
    ):
      dev = self.evaluate()
      if eps is None:
        eps = outputs.epsilon_spent(plan, self.state, logged=True)
      # The evaluation row carries the spend it was made at (48.4).
      dev_row = {f"dev/{k}": v for k, v in dev.items()}
      self.writer.write(cycle, {**dev_row, **_spent(eps)})
      _show(progress, outputs.dev_line(cycle, dev, eps))

  def train(self) -> None:
    """Cycles until the plan (or config.stop_after_cycles) ends, checkpointing."""
    config, plan = self.run.config, self.run.plan
    stop_at = plan.cycles
    if config.stop_after_cycles:
      stop_at = min(stop_at, self.state.cycle + config.stop_after_cycles)
    progress = _progress_bar(config, plan, self.state.cycle)
    start, evaluating = time.perf_counter(), self.seconds["evaluate"]
    try:
      while self.state.cycle < stop_at:
        self.state = cycle_lib.train_cycle(
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
        if _checkpoint_due(self.clock, self.state.cycle):
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
      self.seconds["train"] += (
          time.perf_counter() - start - (self.seconds["evaluate"] - evaluating)
      )
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
    workdir: where the run writes (and resumes from).
    run: the single-process `build_run(config)`, where the caller built it
      already (the audit reads its canaries): it is not built twice.
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
  # Before the model and the owner passes compile: they are cached too.
  compilation.enable_cache(config.get("compilation_cache", "auto"))
  compiled = compilation.totals()
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
          config, workdir, mesh, run, (start_time, compiled), dry_run
      )
    except preemption.Stopped as stopped:
      stopped.cycle = preemption.latest_checkpoint(workdir)
      raise


def _train_and_evaluate(config, workdir, mesh, run, start, dry_run):
  """`train_and_evaluate` inside the workdir lock and the stop signals.

  `start`: (wall time, `compilation.totals()`) when the call began.
  """
  start_time = start[0]
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
  session = _Session(run, mesh, workdir, start_time)
  setup_s, compile_s = _compile_ahead(session, workdir, start)
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
      data_digest=secrecy.public_data(session.secret, session.data),
  )
  session.writer.write(
      session.state.cycle, {f"final/dev_{k}": v for k, v in dev.items()}
  )
  session.writer.close()
  if outputs.is_writer():
    title = f"{run.plan.method} on {run.data.task.name}"
    curves.write(workdir, title, config.data.eval_split)
    train_s, evaluate_s = session.seconds["train"], session.seconds["evaluate"]
    timing = outputs.Timing(setup_s, compile_s, train_s, evaluate_s)
    log.info("%s", outputs.run_summary(run, results, dev, workdir, timing))
  return results


def _compile_ahead(session: _Session, workdir, start) -> tuple[float, float]:
  """Compiles the session's programs ahead and logs the run header and the
  time line; returns (set-up, compile) seconds since `start` (the owner
  passes of `build_run` count as compile)."""
  run, (start_time, start_compiled) = session.run, start
  cycle_lib.compile_run(
      run,
      session.phase_fns,
      session.logits_fn,
      session.mesh,
      session.state,
      session.frozen,
      progress=log.info if outputs.is_writer() else None,
  )
  total = compilation.totals()
  compile_s = total.seconds - start_compiled.seconds
  setup_s = time.time() - start_time - compile_s
  if outputs.is_writer():
    log.info("%s", outputs.run_header(run, workdir))
    log.info(
        "time: set-up %.1f s, compile %.1f s (%d programs of the run; %s)",
        setup_s,
        compile_s,
        total.programs - start_compiled.programs,
        _cache_line(run.config),
    )
  return setup_s, compile_s


def _cache_line(config) -> str:
  directory = compilation.cache_directory(
      config.get("compilation_cache", "auto")
  )
  return "cache off" if directory is None else f"cache {directory}"
