"""One-run privacy audit of a training run, per stream; membership inference.

  python launch/audit.py --config=configs/switch_sst2.py:tiny --workdir=W

trains once in ``W/train`` and writes ``W/audit.json``. What it does:

1. **Canaries** (`raptor_jax.canaries`). m random token sequences with
   random labels, all owned by one expert e of l*, each included in the
   private training set independently with probability 1/2: the run's config
   gets an ``audit`` section and `build_run` inserts them, so they are
   sampled, clipped and counted in n like any record. The run trains once.
2. **Scores, per stream.** ``all`` (one-stream methods) and ``shared``: minus
   the canary's loss under the final model (the shared stream holds the
   classification head, so every prediction reads it). ``expert``: the
   canary's loss increase when only expert e's slice of the expert stream is
   put back to its initial value in the final model: what that slice
   learned. (Subtracting the initial model's loss instead only adds noise:
   its freshly initialised head scores random-label canaries at random.)
3. **Bounds.** `raptor_jax.audit.one_run_audit` (``epsilon_one_run``,
   Steinke, Nasr and Jagielski 2023) at 95% confidence on the included vs
   excluded canaries' scores, reported next to the run's claimed (composed)
   epsilon and, for RAPTOR, the stream's own epsilon (its Poisson-sampled
   Gaussian alone, at the run's delta). The scores read the final model,
   which depends on both streams, so "bound <= claim, with 95% confidence"
   is guaranteed against the composed epsilon; the stream's own epsilon is
   the informative comparison.
4. **Membership inference** (Yeom et al. 2018): score -loss(final) of the
   real training records (members) against held-out records of the same
   distribution (the ``data.holdout`` records, else dev): AUROC and TPR at
   0.1% and 1% FPR. Descriptive, not a bound.

A lower bound is not an estimate of the true epsilon: a bound far below the
claim may only mean the canaries or the score are weak (one run with random
canaries is a weak attack). A bound above the claim is evidence of a bug.

Privacy. This is an explicit private experiment: canary and member scores
are statistics of the private training data without noise. They go only to
``audit.json``, marked ``private_experiment: true``; keep it inside the trust
boundary of the data. The training run itself is a normal private run (its
own workdir, checkpoint and reports).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import accounting, audit as audit_lib, data
from raptor_jax import canaries as canaries_lib
from raptor_jax.train import plans, setup, step, train_and_evaluate
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import Run, build_run

log = logging.getLogger("raptor_jax")

WARNING = (
    "PRIVATE EXPERIMENT: canary and membership scores are statistics of the "
    "private training data without noise; not differentially private. Keep "
    "this file inside the data's trust boundary."
)

_SCORES = {
    "all": "-loss of the final model",
    "shared": "-loss of the final model",
    "expert": "loss increase when expert {}'s slice of the final model's "
    "expert stream is reset to its initial value",
}


def make_loss_fn(model) -> Callable:
  """Jitted per-record cross-entropy.

  (trainable, frozen, input_ids, attention_mask, labels) -> [N].
  """
  logits_fn = step.make_eval_fn(model)

  @jax.jit
  def loss_fn(trainable, frozen, input_ids, attention_mask, labels):
    logits = logits_fn(trainable, frozen, input_ids, attention_mask)
    return step.cross_entropy(logits, labels)

  return loss_fn


def per_record_losses(
    loss_fn, trainable, frozen, records: data.TextClassificationData, batch_size
) -> np.ndarray:
  """Cross-entropy of every record, in fixed-size (padded) batches."""
  losses = []
  for start in range(0, len(records), batch_size):
    real = min(batch_size, len(records) - start)
    batch = (
        np.pad(
            x[start : start + real],
            ((0, batch_size - real),) + ((0, 0),) * (x.ndim - 1),
        )
        for x in (records.input_ids, records.attention_mask, records.labels)
    )
    losses.append(np.asarray(loss_fn(trainable, frozen, *batch))[:real])
  return np.concatenate(losses).astype(np.float64)


def streams(plan: plans.Plan) -> dict[str, tuple[plans.Part, ...]]:
  """The audited streams: one per phase ('all' for one-phase methods)."""
  if len(plan.phases) == 1:
    return {"all": plan.phases[0].parts}
  return {phase.name: phase.parts for phase in plan.phases}


def reset_expert(final: dict, initial: dict, parts, expert: int) -> dict:
  """``final`` with ``expert``'s slice of every owner part at ``initial``."""
  out = dict(final)
  for part in parts:
    if part.owner:
      out[part.name] = {
          p: v.at[expert].set(initial[part.name][p][expert])
          for p, v in final[part.name].items()
      }
  return out


def final_trainable(workdir: Path, run: Run) -> dict:
  """The trainable parameters of `run`'s latest checkpoint in `workdir`.

  Only the parameters are read (`Checkpointer.restore_subtree`), never the
  optimizer states' secret noise keys.

  Raises:
    FileNotFoundError: the workdir holds no checkpoint.
    ValueError: it holds a checkpoint of another config.
  """
  checkpointer = Checkpointer(workdir, run.config)
  try:
    if checkpointer.restore_meta() is None:
      raise FileNotFoundError(f"no checkpoint in {workdir}; train first")
    state = checkpointer.restore_subtree({"trainable": run.trainable})
  finally:
    checkpointer.close()
  return jax.tree.map(jnp.asarray, state["trainable"])


def holdout_config(config: ml_collections.ConfigDict):
  """`config` evaluating on its held-out train records instead of dev.

  The dev fields are dropped: the holdout replaces dev, and validation refuses
  a set field that has no effect (`setup.check_data_fields`).
  """
  held = ml_collections.ConfigDict(config.to_dict())
  held.data.eval_split = "holdout"
  held.data.dev_path, held.data.dev_limit = "", 0
  return held


def nonmembers(run: Run) -> tuple[data.TextClassificationData, str]:
  """Held-out records of the training distribution: data.holdout, else dev."""
  config = run.config
  if config.data.holdout:
    if config.data.eval_split == "holdout":
      return run.data.dev, "holdout"
    return setup.load_run_data(holdout_config(config)).dev, "holdout"
  if config.data.task != "synthetic":
    log.warning(
        "membership inference against the dev split: set "
        "--config.data.train_limit and --config.data.holdout for non-members "
        "of the training distribution"
    )
  return run.data.dev, "dev"


def _stream_epsilon(plan, phase_name: str, report: dict) -> float | None:
  """The stream's own epsilon: its Poisson-sampled Gaussian alone."""
  if report["epsilon"] is None or phase_name == "all":
    return report["epsilon"]
  phase = next(p for p in plan.phases if p.name == phase_name)
  return accounting.dpsgd_epsilon(
      noise_multiplier=phase.noise_multiplier,
      sample_rate=report["sample_rate"],
      steps=report["cycles"],
      delta=report["delta"],
  )


def audit_streams(
    run: Run, final: dict, report: dict, confidence: float, loss_fn=None
):
  """{stream: one-run audit of the canaries} of the trained `run`."""
  canaries = run.canaries
  loss_fn = loss_fn or make_loss_fn(run.model)
  initial = jax.tree.map(jnp.asarray, run.trainable)
  frozen = jax.tree.map(jnp.asarray, run.frozen)

  def losses(trainable):
    return per_record_losses(
        loss_fn, trainable, frozen, canaries.records, run.config.eval_batch_size
    )

  final_losses = losses(final)
  out = {}
  for name, parts in streams(run.plan).items():
    scores = -final_losses
    if name == "expert":
      scores = scores + losses(
          reset_expert(final, initial, parts, canaries.expert)
      )
    entry = audit_lib.one_run_audit(
        scores[canaries.included],
        scores[~canaries.included],
        delta=report["delta"],
        confidence=confidence,
    )
    out[name] = dict(
        entry,
        epsilon_stream=_stream_epsilon(run.plan, name, report),
        score=_SCORES[name].format(canaries.expert),
    )
  return out


def membership_inference(run: Run, final: dict, loss_fn=None) -> dict[str, Any]:
  """Loss-threshold attack: the real training records against non-members."""
  loss_fn = loss_fn or make_loss_fn(run.model)
  frozen = jax.tree.map(jnp.asarray, run.frozen)
  num_real = len(run.data.train) - int(run.canaries.included.sum())
  members = canaries_lib.take(run.data.train, slice(num_real))
  held, source = nonmembers(run)
  scores = [
      -per_record_losses(loss_fn, final, frozen, r, run.config.eval_batch_size)
      for r in (members, held)
  ]
  return dict(
      audit_lib.membership_inference(*scores),
      non_members_from=source,
      score="-loss of the final model (loss threshold)",
  )


def run(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    num_canaries: int = 1000,
    seed: int = 0,
    expert: int = -1,
    confidence: float = audit_lib.CONFIDENCE,
) -> dict[str, Any]:
  """Trains once with random canaries and audits every stream (module doc).

  Rerunning with the same workdir reuses the finished (or resumes the
  interrupted) training run in ``workdir/train``.

  Args:
    config: the training config (any method).
    workdir: the audit's own directory; gets ``audit.json`` and ``train/``.
    num_canaries: m, canaries drawn (each included with probability 1/2).
    seed: seed of the canaries and of their inclusion (the auditor's).
    expert: the expert of l* owning the canaries; -1 = the expert owning
      most random candidates.
    confidence: of the lower bounds.

  Returns:
    The audit dict written to ``audit.json``.
  """
  audit_config = canaries_lib.audit_config(
      config, num_canaries=num_canaries, seed=seed, expert=expert
  )
  workdir = Path(workdir).expanduser().resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  log.warning(WARNING)
  train_dir = workdir / "train"
  audit_run = build_run(audit_config)  # the run with its canaries
  results = train_and_evaluate(audit_config, str(train_dir), run=audit_run)
  report = json.loads((train_dir / "privacy_report.json").read_text())
  final = final_trainable(train_dir, audit_run)
  loss_fn = make_loss_fn(audit_run.model)  # one compile for every score
  canaries = audit_run.canaries
  out: dict[str, Any] = dict(
      private_experiment=True,
      warning=WARNING,
      method=audit_run.plan.method,
      epsilon_claimed=report["epsilon"],
      delta=report["delta"],
      confidence=confidence,
      finished=report["finished"],
      dev_accuracy=results.get("accuracy"),
      canaries=dict(
          num_canaries=num_canaries,
          num_included=int(canaries.included.sum()),
          owner_expert=canaries.expert,
          expert_layer=audit_run.expert_layer,
          kind=canaries_lib.KIND,
      ),
      **audit_streams(audit_run, final, report, confidence, loss_fn),
      membership_inference=membership_inference(audit_run, final, loss_fn),
  )
  (workdir / "audit.json").write_text(json.dumps(out, indent=2, sort_keys=True))
  return out


def summary(result: dict[str, Any]) -> str:
  """A few lines for the terminal: bound vs claim per stream, and the MIA."""

  def fmt(x):
    return "none" if x is None else f"{x:.3f}"

  c = result["canaries"]
  lines = [
      f"{result['method']}: epsilon claimed {fmt(result['epsilon_claimed'])} "
      f"(delta {result['delta']:.3g}), {c['num_canaries']} canaries "
      f"({c['num_included']} included), owner expert {c['owner_expert']} of "
      f"layer {c['expert_layer']}"
  ]
  for name in ("all", "shared", "expert"):
    if name in result:
      s = result[name]
      lines.append(
          f"  {name:<7} epsilon lower bound {fmt(s['epsilon_lower_bound'])} "
          f"(f-DP {fmt(s['epsilon_lower_bound_fdp'])}, {s['confidence']:.0%})"
          f" vs stream epsilon {fmt(s['epsilon_stream'])}; AUROC "
          f"{s['auroc']:.3f}"
      )
  mia = result["membership_inference"]
  lines.append(
      f"  membership inference ({mia['members']} members vs "
      f"{mia['non_members']} {mia['non_members_from']}): AUROC "
      f"{mia['auroc']:.3f}, TPR {mia['tpr_at_fpr']['0.001']:.4f} at 0.1% "
      f"FPR, {mia['tpr_at_fpr']['0.01']:.4f} at 1% FPR"
  )
  return "\n".join(lines)
