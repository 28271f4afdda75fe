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
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from raptor_jax import _validate, accounting, data, length_buckets, ownership
from raptor_jax import roles, sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import methods, metrics, parallel, preemption, secrecy, step
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.config import RESUME_INSENSITIVE
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


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a cycle changes, as ONE immutable value.

  The parameters, the optimizer states (whose noise transforms count the
  noisy updates applied), the ledger (which counts the updates accounted) and
  the cycle counter are built together by `_train_cycle` and swapped in by a
  single assignment, so no interrupt (KeyboardInterrupt, SIGTERM) can leave a
  state whose parameters hold more noisy updates than its ledger counts: the
  checkpoint saved by the error handler is always a completed cycle.
  """

  trainable: dict
  opt_states: dict
  ledger: PrivacyLedger
  cycle: int


def noise_counts(plan: methods.Plan, opt_states: dict) -> dict[str, int]:
  """Per phase (ledger stream name): noisy updates its noise transforms applied.

  Every part of a phase is updated once per cycle, so its `privatize_sums`
  state (the first element of its `optax.chain` state) counts the phase's
  updates; parts of one phase that disagree raise.
  """
  counts = {}
  for phase in plan.phases:
    seen = {int(opt_states[part.name][0].count) for part in phase.parts}
    if len(seen) != 1:
      raise ValueError(
          f"the parts of phase {phase.name!r} hold different noise step counts"
          f" {sorted(seen)}; the checkpoint is inconsistent"
      )
    counts[phase.name] = seen.pop()
  return counts


def check_consistent(plan: methods.Plan, state: TrainState, where) -> None:
  """Refuses a state whose applied and accounted noisy updates disagree.

  Applied: each phase's noise step count (the parameters hold exactly that
  many noisy updates of the phase). Accounted: the ledger's steps of the
  phase's stream (private phases; every phase runs once per cycle).

  Raises:
    ValueError: one line naming `where` (the checkpoint) and the counts.
  """
  applied = noise_counts(plan, state.opt_states)
  for phase in plan.phases:
    accounted = state.ledger.steps(phase.name) if phase.private else None
    if applied[phase.name] != state.cycle or accounted not in (
        None,
        state.cycle,
    ):
      raise ValueError(
          f"{where}: the parameters hold {applied[phase.name]} noisy updates of"
          f" stream {phase.name!r} but the ledger accounts {accounted} at cycle"
          f" {state.cycle}; this checkpoint under-reports its privacy cost: do"
          " not resume or release it, train again in a new --workdir"
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
    check_consistent(run.plan, state, checkpointer.latest_path())
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
      trainable, opt_states, _accounted(plan, state.ledger), cycle + 1
  )


def _accounted(plan: methods.Plan, ledger: PrivacyLedger) -> PrivacyLedger:
  """A new ledger: `ledger` plus one release of every private phase."""
  ledger = PrivacyLedger(ledger.entries)  # a copy: the old state is unchanged
  for phase in plan.phases:
    if phase.private:
      ledger.record(
          phase.name,
          sample_rate=plan.sample_rate,
          noise_multiplier=phase.noise_multiplier,
      )
  return ledger


def _epsilon_spent(plan: methods.Plan, state: TrainState) -> float | None:
  if not methods.is_private(plan):
    return None  # no privacy guarantee at all
  return state.ledger.epsilon(plan.delta) if state.cycle else 0.0


def _progress_bar(config, plan: methods.Plan, cycle: int):
  if not config.progress_bar or not _is_writer():
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


def _streams(plan: methods.Plan, state: TrainState) -> dict[str, dict]:
  """Per stream (phase): sigma, steps run and, when the plan has several
  private streams, the stream's own epsilon at delta/2 (SPEC 1.7)."""
  several = sum(p.private for p in plan.phases) > 1
  streams = {}
  for phase in plan.phases:
    entry = dict(noise_multiplier=phase.noise_multiplier, steps=state.cycle)
    if phase.private and several:
      entry["epsilon_at_half_delta"] = (
          state.ledger.stream_epsilon(phase.name, plan.delta / 2)
          if state.cycle
          else 0.0
      )
    streams[phase.name] = entry
  return streams


def privacy_report(
    run: Run, state: TrainState, data_digest: dict | None = None
) -> dict[str, Any]:
  """privacy_report.json: public; a field that does not apply is absent.

  `target_epsilon` only for private methods; `rho` only where it splits the
  budget (alternating or unjoint RAPTOR); `sigma_<part>` and `steps_<part>`
  only for the parts 'shared' and 'expert' the plan trains; `streams` per
  ledger stream, with each stream's own epsilon at delta/2 when there are
  several.
  """
  config, plan, cycle = run.config, run.plan, state.cycle
  private = methods.is_private(plan)
  noise = methods.noise_summary(plan)
  report = dict(
      method=plan.method,
      epsilon=_epsilon_spent(plan, state),
      delta=plan.delta,
      sample_rate=plan.sample_rate,
      cycles=cycle,
      planned_cycles=plan.cycles,
      finished=cycle >= plan.cycles,
      private=private,
      accountant="PLD (dp_accounting.pld.PLDAccountant, add/remove adjacency, Poisson sampling)",
      parts=noise,
      streams=_streams(plan, state),
      ledger=state.ledger.to_dict(),
      expert_layer=run.expert_layer,
      batch_size=config.batch_size,
      n=run.n,
  )
  if private:
    report["target_epsilon"] = plan.target_epsilon
  rc = config.raptor
  if plan.method == "raptor" and not (rc.joint_clip and not rc.alternate):
    report["rho"] = config.privacy.rho  # it splits the budget between streams
  for name in ("shared", "expert"):
    if name in noise:
      report[f"sigma_{name}"] = noise[name]["noise_multiplier"]
      report[f"steps_{name}"] = cycle
  if data_digest is not None:
    report["data"] = data_digest
  return report


def write_reports(
    workdir: Path,
    run: Run,
    state: TrainState,
    frozen,
    dev: dict[str, float],
    wall_time_s: float,
    session_s: float,
    data_digest: dict | None = None,
) -> dict[str, Any]:
  """Writes privacy_report.json and results.json (public quantities only); returns results."""
  config, plan, cycle = run.config, run.plan, state.cycle
  finished = cycle >= plan.cycles
  report = privacy_report(run, state, data_digest)
  _write_json(workdir / "privacy_report.json", report)
  results = dict(
      method=plan.method,
      task=run.data.task.name,
      eval_split=config.data.eval_split,
      finished=finished,
      cycles=cycle,
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
  if config.log_wall_time:  # opted in, warned: a non-private quantity
    results["wall_time_s"] = wall_time_s  # every segment of the run
    results["wall_time_this_session_s"] = session_s
  _write_json(workdir / "results.json", results)
  return results


def _secret(
    config, meta: dict | None, data_fingerprint: dict, checkpointer
) -> bytes:
  """The run's secret: fresh (agreed by every process) or the checkpoint's.

  Raises:
    ValueError: the checkpoint was trained on other data than the config
      names now (resuming would mix two datasets under one ledger), or the
      workdir reports an earlier run but has no checkpoint (a fresh start
      would hide that run's releases).
  """
  if not meta:
    report = checkpointer.directory.parent / "privacy_report.json"
    if report.exists():  # never restart from scratch under an old ledger
      raise ValueError(
          f"{report} reports an earlier run but {checkpointer.directory} holds"
          " no checkpoint of it; train in a new --workdir"
      )
    return parallel.agree_bytes(secrecy.draw_secret(config))
  secret = bytes.fromhex(meta["secret"])
  if meta.get("data") != data_fingerprint:
    raise ValueError(
        f"the training data changed since {checkpointer.latest_path()} was"
        f" written (now {_describe(data_fingerprint, secret)}, then"
        f" {_describe(meta.get('data'), secret)}); restore the data the run"
        " started on, or train in a new --workdir"
    )
  return secret


def _describe(fingerprint: dict | None, secret: bytes) -> str:
  """A description of a data fingerprint safe for error messages.

  A file's size and plain sha256 are functions of every record (an
  adversary who knows all records but one could test candidates against
  them), so a file is described by its digest keyed by the run's secret
  (the `keyed_sha256` of privacy_report.json) only; a hub or generated
  source by its public name.
  """
  if not fingerprint:
    return "unknown"
  if fingerprint.get("source") != "file":
    return f"{fingerprint.get('source')} {fingerprint.get('task')}"
  return f"keyed sha256 {secrecy.keyed_digest(secret, fingerprint)}"


class _Session:
  """One training session of a run: its mesh, jitted steps, state, writers."""

  def __init__(self, run: Run, mesh, workdir: Path, start_time: float):
    self.run, self.mesh, self.start_time = run, mesh, start_time
    config = run.config
    self.checkpointer = Checkpointer(workdir, config)
    meta = self.checkpointer.restore_meta()
    self.data = secrecy.data_fingerprint(config)
    self.secret = _secret(config, meta, self.data, self.checkpointer)
    self.phase_fns = _phase_functions(run, mesh, self.secret)
    self.state, self.frozen = _initial_state(
        run, self.phase_fns, mesh, self.checkpointer, meta
    )
    # Wall time of earlier segments of a resumed run (0 for a fresh one).
    self.earlier_wall_s = float(meta.get("wall_time_s", 0.0)) if meta else 0.0
    if not meta and _is_writer():
      (workdir / "config.json").write_text(secrecy.public_config(config))
    _warn_if_not_private(config)
    self.writer = metrics.MetricWriter(
        workdir,
        just_logging=not _is_writer(),
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
      eps = _epsilon_spent(plan, self.state)
      line = f"cycle {cycle}: dev " + ", ".join(
          f"{k} {v:.4f}" for k, v in dev.items()
      )
      line += "" if eps is None else f", epsilon spent {eps:.3f}"
      if progress is not None:
        progress.write(line)  # above the bar, not glued onto it
      else:
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


def write_layer_selection(workdir: Path, run: Run) -> None:
  """layer_selection.json: l*, its rule and the public corpus's statistics.

  Public: every field is a function of the public corpus (used as loaded)
  and the frozen model, computed before the mechanism, so the file is the
  same for D and for every neighbour of D.
  """
  _write_json(
      workdir / "layer_selection.json",
      dict(
          selected_layer=run.expert_layer,
          rule=str(run.config.raptor.layer),
          public_corpus=run.layer_table,
      ),
  )


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
      by the caller (the audit reads its canaries); saves building it twice.
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
  validate(config)  # before any data or model is loaded
  mesh = parallel.make_mesh(config.num_devices)
  workdir = Path(workdir).expanduser().resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  lock = (
      preemption.WorkdirLock(workdir)
      if _is_writer()
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


def check_workdir(config: ml_collections.ConfigDict, workdir: Path) -> None:
  """Refuses a workdir of another config before anything is loaded.

  The workdir's config.json (public) against `config`, every field that
  changes what the run computes; the checkpoint's fingerprint stays the
  authority (`Checkpointer.restore_meta`). A workdir without a checkpoint
  passes: `_start_fresh` handles it.

  Raises:
    ValueError: one line naming the fields that differ.
  """
  saved = workdir / "config.json"
  if preemption.latest_checkpoint(workdir) is None or not saved.exists():
    return
  try:
    then = _flat(json.loads(saved.read_text()))
  except ValueError:
    return  # unreadable: the checkpoint's fingerprint decides
  now = _flat(json.loads(secrecy.public_config(config)))
  differ = sorted(
      key
      for key in set(then) | set(now)
      if then.get(key) != now.get(key)
      and key.split(".")[0] not in RESUME_INSENSITIVE
      and key not in RESUME_INSENSITIVE
  )
  if differ:
    shown = ", ".join(
        f"{key} (then {then.get(key)!r}, now {now.get(key)!r})"
        for key in differ[:5]
    )
    more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
    raise ValueError(
        f"{workdir} holds a run of another config: {shown}{more}; use another"
        " --workdir, or rerun with the config in its config.json"
    )


def _flat(values: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in values.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def _start_fresh(workdir: Path) -> None:
  """A workdir with no checkpoint and no report: the outputs of a run that
  died before its first checkpoint (if any) are moved aside."""
  if (
      preemption.latest_checkpoint(workdir) is None
      and not (workdir / "privacy_report.json").exists()
  ):
    preemption.move_aside_unfinished_logs(workdir)


def _train_and_evaluate(config, workdir, mesh, run, start_time, dry_run):
  """`train_and_evaluate` inside the workdir lock and the stop signals."""
  check_workdir(config, workdir)
  if _is_writer() and not dry_run:
    _start_fresh(workdir)
  # This host tokenises and keeps only its records (i % P == p); n counts all.
  if run is None:
    if _is_writer():
      log.info(
          "loading the data, the public corpus and the model (%s)...",
          config.model.name,
      )
    run = build_run(config, host=parallel.host_shard())
  elif run.config is not config or jax.process_count() > 1:
    _validate.fail(
        "run",
        "build_run(config) of this config, in a single-process job",
        f"a run of {run.config.method!r} in {jax.process_count()} processes",
        "pass run=None to build it here",
    )
  if dry_run:
    if _is_writer():
      log.info("%s", run_header(run, workdir))
      log.info(
          "config (dry run: nothing trained, no output written):\n%s", config
      )
    return {}
  write_layer_selection(workdir, run)
  if run.layer_table:
    log.info(
        "layer selection:\n%s",
        ownership.format_layer_table(run.layer_table, run.expert_layer),
    )
  if _is_writer():
    log.info("%s", run_header(run, workdir))
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
      data_digest=session.public_data(),
  )
  session.writer.write(
      session.state.cycle, {f"final/dev_{k}": v for k, v in dev.items()}
  )
  session.writer.close()
  if _is_writer():
    log.info("%s", run_summary(run, results, dev, workdir))
  return results


def run_header(run: Run, workdir: Path) -> str:
  """What a run will do, printed before it trains: public quantities only.

  The method, n (public: the sample rate is a function of it), the sample
  rate, the cycles, delta and the target epsilon, sigma and the clip norm of
  every stream with its trainable parameter count, and where outputs go.
  """
  plan, config = run.plan, run.config
  lines = [
      f"{plan.method} on {run.data.task.name}: n = {run.n} training records,"
      f" expected batch B = {config.batch_size}, sample rate q ="
      f" {plan.sample_rate:.4g}, {plan.cycles} cycles ({config.epochs} epochs)",
      (
          f"privacy: target epsilon {plan.target_epsilon:g} at delta"
          f" {plan.delta:.3g} (PLD accountant, Poisson sampling)"
          if methods.is_private(plan)
          else "privacy: NONE (this method trains without differential privacy)"
      ),
  ]
  for phase in plan.phases:
    for part in phase.parts:
      count = sum(int(np.size(v)) for v in run.trainable[part.name].values())
      noise = (
          f"sigma {part.noise_multiplier:.4g}, clip {part.l2_clip:.3g}"
          if phase.private
          else "no noise"
      )
      lines.append(
          f"  stream {phase.name}, part {part.name}: {noise},"
          f" {count:,} trainable parameters"
      )
  lines.append(
      f"outputs: {workdir} (checkpoints/, metrics.jsonl, tensorboard/;"
      " at the end privacy_report.json and results.json)"
  )
  return "\n".join(lines)


def run_summary(run: Run, results: dict, dev: dict, workdir: Path) -> str:
  """The run's last lines: a table of the public results and the export
  command."""
  rows = [
      ("cycles", f"{results['cycles']} of {run.plan.cycles}"),
      (
          "epsilon spent",
          "n/a (not private)"
          if results["epsilon"] is None
          else f"{results['epsilon']:.4g} at delta {run.plan.delta:.3g}",
      ),
      *(
          (f"{run.config.data.eval_split} {k}", f"{v:.4f}")
          for k, v in dev.items()
      ),
      ("reports", f"{workdir}/privacy_report.json, results.json"),
  ]
  width = max(len(name) for name, _ in rows)
  done = "finished" if results["finished"] else "stopped (stop_after_cycles)"
  lines = [f"run {done}:"]
  lines += [f"  {name:<{width}}  {value}" for name, value in rows]
  if results["finished"]:
    lines.append(
        f"export: python launch/export.py --workdir={workdir}"
        f" --out={workdir}_model"
    )
  else:
    lines.append("resume: rerun the same command")
  return "\n".join(lines)
