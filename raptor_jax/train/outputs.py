"""A run's privacy bookkeeping and its public outputs.

* Bookkeeping: the ledger gets one release per private phase per cycle
  (`accounted`), and a state whose applied noisy updates (the noise
  transforms' step counts) disagree with its ledger is refused
  (`check_consistent`): a checkpoint never under-reports its privacy cost.
* Reports: `privacy_report.json`, `results.json` and `layer_selection.json`,
  and the console's run header and summary. Every field is public: the
  plan (a function of the config, n and the public corpus), the ledger, the
  noisy parameters and dev metrics; nothing derived from the private data
  without noise (no training loss, owner map, realised or per-bucket count).
  In a multi-host run only process 0 writes (`is_writer`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from raptor_jax import roles
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import methods, plans, step

if TYPE_CHECKING:
  from raptor_jax.train.run import Run


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a cycle changes, as ONE immutable value.

  The parameters, the optimizer states (whose noise transforms count the
  noisy updates applied), the ledger (which counts the updates accounted) and
  the cycle counter are built together by `cycle.train_cycle` and swapped in
  by a single assignment, so no interrupt (KeyboardInterrupt, SIGTERM) can
  leave a state whose parameters hold more noisy updates than its ledger
  counts: the checkpoint saved by the error handler is a completed cycle.
  """

  trainable: dict
  opt_states: dict
  ledger: PrivacyLedger
  cycle: int


class Timing(NamedTuple):
  """Where a session's wall seconds went (operator output, like the log).

  Set-up (data, model, owner passes, state) and compile (every program,
  compiled ahead: `train.cycle.compile_run`) follow the public config; train
  and evaluate follow the realised sample sizes too (`log_wall_time`), so
  they are printed on the console only, never written to a file.
  """

  setup_s: float
  compile_s: float
  train_s: float
  evaluate_s: float


def is_writer() -> bool:
  """Whether this process writes the (shared) workdir's files: process 0 only."""
  return jax.process_index() == 0


def write_json(path: Path, payload: dict) -> None:
  """Writes `payload` atomically, from process 0 only."""
  if not is_writer():
    return
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
  tmp.replace(path)


def noise_counts(plan: plans.Plan, opt_states: dict) -> dict[str, int]:
  """Per phase (ledger stream name): noisy updates its noise transforms
  applied, as each part's `privatize_sums` state (the first of its
  `optax.chain` state) counts them; parts of one phase that disagree raise."""
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


def check_consistent(plan: plans.Plan, state: TrainState, where) -> None:
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
    steps = applied[phase.name]
    if steps != state.cycle or accounted not in (None, state.cycle):
      raise ValueError(
          f"{where}: the parameters hold {steps} noisy updates of"
          f" stream {phase.name!r} but the ledger accounts {accounted} at cycle"
          f" {state.cycle}; this checkpoint under-reports its privacy cost: do"
          " not resume or release it, train again in a new --workdir"
      )


def accounted(plan: plans.Plan, ledger: PrivacyLedger) -> PrivacyLedger:
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


def epsilon_spent(
    plan: plans.Plan, state: TrainState, *, logged: bool = False
) -> float | None:
  """Epsilon spent by `state` at the plan's delta (None: not private).

  `logged`: for a progress row, read from the accounting cache when a run
  of this plan logged it before (`PrivacyLedger.logged_epsilon`); results
  and the privacy card always compute it.
  """
  if not plans.is_private(plan):
    return None  # no privacy guarantee at all
  if not state.cycle:
    return 0.0
  ledger = state.ledger
  return (ledger.logged_epsilon if logged else ledger.epsilon)(plan.delta)


def streams(plan: plans.Plan, state: TrainState) -> dict[str, dict]:
  """Per stream (phase): sigma, steps run and, when the plan has several
  private streams, the stream's own epsilon at delta/2 (docs/method.md §1.7)."""
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
  private = plans.is_private(plan)
  noise = plans.noise_summary(plan)
  report = dict(
      method=plan.method,
      epsilon=epsilon_spent(plan, state),
      delta=plan.delta,
      sample_rate=plan.sample_rate,
      cycles=cycle,
      planned_cycles=plan.cycles,
      finished=cycle >= plan.cycles,
      private=private,
      accountant="PLD (dp_accounting.pld.PLDAccountant, add/remove adjacency, Poisson sampling)",
      parts=noise,
      streams=streams(plan, state),
      ledger=state.ledger.to_dict(),
      expert_layer=run.expert_layer,
      batch_size=plan.batch_size or config.batch_size,
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
  """Writes privacy_report.json and results.json (public quantities only); returns results.

  results.json holds each metric of the evaluation split once, under its
  name (`accuracy`, `f1`, `macro_f1`; `eval_split` says which split), and
  the (epsilon, delta) the run spent.
  """
  config, plan, cycle = run.config, run.plan, state.cycle
  finished = cycle >= plan.cycles
  report = privacy_report(run, state, data_digest)
  write_json(workdir / "privacy_report.json", report)
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
      delta=report["delta"],
      **dev,  # the metrics of `eval_split`, once
  )
  if config.log_wall_time:  # opted in, warned: a non-private quantity
    results["wall_time_s"] = wall_time_s  # every segment of the run
    results["wall_time_this_session_s"] = session_s
  write_json(workdir / "results.json", results)
  return results


def write_layer_selection(workdir: Path, run: Run) -> None:
  """layer_selection.json: l*, its rule and the public corpus's statistics.

  Public: every field is a function of the public corpus (used as loaded)
  and the frozen model, computed before the mechanism, so the file is the
  same for D and for every neighbour of D.
  """
  write_json(
      workdir / "layer_selection.json",
      dict(
          selected_layer=run.expert_layer,
          rule=str(run.config.raptor.layer),
          public_corpus=run.layer_table,
      ),
  )


def run_header(run: Run, workdir: Path) -> str:
  """What a run will do, printed before it trains: public quantities only
  (n too: the sample rate is a function of it)."""
  plan, config = run.plan, run.config
  lines = [
      f"{plan.method} on {run.data.task.name}: n = {run.n} training records,"
      f" expected batch B = {plan.batch_size or config.batch_size}, sample"
      f" rate q = {plan.sample_rate:.4g}, {plan.cycles} cycles"
      f" ({plan.epochs or config.epochs} epochs"
      f"{', chosen from n' if not config.epochs else ''})",
      (
          f"privacy: target epsilon {plan.target_epsilon:g} at delta"
          f" {plan.delta:.3g} (PLD accountant, Poisson sampling)"
          if plans.is_private(plan)
          else "privacy: NONE (this method trains without differential privacy)"
      ),
  ]
  for phase in plan.phases:
    for part in phase.parts:
      count = sum(int(np.size(v)) for v in run.trainable[part.name].values())
      noise, name = "no noise", f"stream {phase.name}"
      if phase.private:
        noise = f"sigma {part.noise_multiplier:.4g}, clip {part.l2_clip:.3g}"
      if part.name != phase.name:
        name += f", part {part.name}"
      lines.append(f"  {name}: {noise}, {count:,} trainable parameters")
  lines += header_warnings(run)
  lines.append(
      f"outputs: {workdir} (checkpoints/, metrics.jsonl, tensorboard/;"
      " at the end privacy_report.json and results.json)"
  )
  return "\n".join(lines)


def header_warnings(run: Run) -> list[str]:
  """The run header's warnings: settings a run on little data gets wrong
  (few noisy steps, a delta above 1/(10 n)), each with the value to set."""
  plan, config = run.plan, run.config
  warnings = []
  if not plans.is_private(plan):
    return warnings
  if plan.cycles < methods.FEW_STEPS:
    per_epoch = plan.cycles // max(plan.epochs or config.epochs, 1)
    epochs = -(-methods.AUTO_STEPS // max(per_epoch, 1))
    warnings.append(
        f"warning: only {plan.cycles} noisy steps; the noise of few steps"
        " does not average out and accuracy suffers: raise"
        f" --config.epochs (e.g. {epochs} for {epochs * per_epoch} steps),"
        " or set it to 0 to choose it from n"
    )
  smaller = 1.0 / (10 * run.n)
  if config.privacy.delta and plan.delta > smaller:
    warnings.append(
        f"warning: delta {plan.delta:.3g} is above 1/(10 n) = {smaller:.3g}:"
        " the guarantee may fail with a probability close to one in n"
        f" records; set --config.privacy.delta={smaller:.2g} or smaller"
    )
  return warnings


def export_script() -> str:
  """launch/export.py by its absolute path (it runs from any directory), or
  as `launch/export.py` where the package is installed without launch/."""
  script = Path(__file__).resolve().parents[2] / "launch" / "export.py"
  return str(script) if script.is_file() else "launch/export.py"


def dev_line(cycle: int, dev: dict, eps: float | None) -> str:
  """The console's line of one evaluation: dev metrics and epsilon spent."""
  line = f"cycle {cycle}: dev " + ", ".join(
      f"{k} {v:.4f}" for k, v in dev.items()
  )
  return line + ("" if eps is None else f", epsilon spent {eps:.3f}")


def run_summary(
    run: Run,
    results: dict,
    dev: dict,
    workdir: Path,
    timing: Timing | None = None,
) -> str:
  """The run's last lines: a table of the public results (and, on the
  console, where this session's time went) and the export command."""
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
  if timing is not None:
    names = ("set-up", "compile", "train", "evaluate")
    spent = ", ".join(f"{n} {s:.1f} s" for n, s in zip(names, timing))
    rows.append(("time", spent))
  width = max(len(name) for name, _ in rows)
  done = "finished" if results["finished"] else "stopped (stop_after_cycles)"
  lines = [f"run {done}:"]
  lines += [f"  {name:<{width}}  {value}" for name, value in rows]
  if results["finished"]:
    if results["epsilon"] is not None and run.config.privacy.secret_seed < 0:
      lines.append(
          "note: each run draws a fresh secret (its Poisson samples and"
          " noise), so the same command gives another accuracy; for the"
          " spread, train seeds side by side with launch/sweep.py"
          " (docs/data.md, 'Results vary')"
      )
    lines.append(
        f"export: python {export_script()} --workdir={workdir}"
        f" --out={workdir}_model"
    )
  else:
    lines.append("resume: rerun the same command")
  return "\n".join(lines)
