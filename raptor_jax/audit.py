"""Empirical privacy auditing: canaries, epsilon lower bounds, membership
inference.

A proof says a mechanism is (epsilon, delta)-DP; an audit checks the claim from
outside. The auditor plants *canaries* (records it controls), runs the
mechanism with each canary in or out, scores every canary (higher = looks more
like a member), and turns the scores into a statistical *lower bound* on
epsilon: with probability at least ``confidence`` over the mechanism's
randomness, no (epsilon_lb, delta)-DP mechanism separates the scores this well.
So a correct implementation gives a bound below its claimed epsilon (except
with probability ``1 - confidence``), and a bound above the claim is evidence
of a privacy bug. A bound below the claim is NOT an estimate of the true
epsilon: the canary or the score may simply be weak.

Every statistic comes from ``jax_privacy.auditing.CanaryScoreAuditor``:

* ``trials_audit``: independent runs of a mechanism, each with the canary in
  or out (Jagielski et al. 2020; Nasr et al. 2021): Clopper-Pearson bounds on
  the TPR and FPR of every threshold, Bonferroni-corrected
  (``epsilon_clopper_pearson``).
* ``one_run_audit``: ONE run in which each of m canaries was included
  independently with probability 1/2 (Steinke, Nasr and Jagielski 2023,
  ``epsilon_one_run``), with the f-DP refinement of Mahloujifar et al. 2024
  (``epsilon_one_run_fdp``; valid when the mechanism's trade-off curve is
  Gaussian-shaped, as DP-SGD's is in practice).
* ``membership_inference``: AUROC and TPR at low FPR of a score on real
  members and non-members. No epsilon: members were not randomised.

The white-box audit of the transforms (``audit_transform``) runs many
independent trials of ONE step of ``transforms.dp_aggregate`` or
``transforms.owner_dp_aggregate`` on a fixed batch, with and without a canary
whose clipped gradient is ``l2_clip * v`` for a fixed unit direction ``v``,
and scores each release by its projection on ``v`` (for the owner transform:
every expert's row, so the experts that do not own the canary are audited
too, and must show no signal). Add/remove of one record in one step is the
Gaussian mechanism with noise multiplier sigma, whose epsilon
``analytic_epsilon`` computes with the project's PLD accountant: the lower
bound must stay below it. ``planted_bug`` builds deliberately broken copies of
the transforms whose audits must exceed it: the audit has power.

Privacy. Audits are explicit private experiments: a score computed from a
model trained on private data is a statistic of that data without noise.
Write audit outputs only to their own file, marked as such, never to training
logs or metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax_privacy import auditing
import numpy as np
import optax

from raptor_jax import accounting, grads as grads_lib, transforms

PyTree = Any

CONFIDENCE = 0.95
DELTA = 1e-5  # delta of the white-box mechanism audit
FPRS = (0.001, 0.01)  # false positive rates of the membership-inference TPRs

PLANTED_BUGS = {
    "no_clipping": "records are clipped to 1e30 instead of l2_clip",
    "half_noise": "noise std sigma * C / 2 instead of sigma * C",
    "noise_on_mean": "noise calibrated for the mean (std sigma * C / "
    "denominator) added to the sum",
    "realised_count": "divides by the realised number of records (per "
    "expert for the owner transform) instead of the public denominator",
    "owner_leak": "owner transform only: every record's gradient is added "
    "to every expert",
}


# -- statistics (jax_privacy.auditing) ---------------------------------------


def _auditor(in_scores, out_scores) -> auditing.CanaryScoreAuditor:
  in_scores = np.asarray(in_scores, np.float64).reshape(-1)
  out_scores = np.asarray(out_scores, np.float64).reshape(-1)
  if not (np.all(np.isfinite(in_scores)) and np.all(np.isfinite(out_scores))):
    raise ValueError("audit scores must be finite")
  return auditing.CanaryScoreAuditor(in_scores, out_scores)


def _check_confidence(confidence: float) -> float:
  if not 0.5 < confidence < 1:
    raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
  return 1.0 - confidence


def trials_audit(
    in_scores, out_scores, *, delta: float, confidence: float = CONFIDENCE
) -> dict[str, float]:
  """Epsilon lower bound from independent trials with the canary in or out.

  Guarantee (``epsilon_clopper_pearson``, one-sided, Bonferroni over the
  thresholds): if the mechanism is (epsilon, delta)-DP and every score comes
  from an independent run, the bound exceeds epsilon with probability at most
  ``1 - confidence``.

  Args:
    in_scores: scores of the runs with the canary (higher = more member-like).
    out_scores: scores of the runs without it.
    delta: the delta of the claim being tested.
    confidence: 1 - the allowed probability of a false alarm.

  Returns:
    dict(epsilon_lower_bound=, confidence=, auroc=, trials_in=, trials_out=).
  """
  significance = _check_confidence(confidence)
  auditor = _auditor(in_scores, out_scores)
  return dict(
      epsilon_lower_bound=float(
          auditor.epsilon_clopper_pearson(significance, delta)
      ),
      confidence=confidence,
      auroc=float(auditor.attack_auroc()),
      trials_in=int(np.size(in_scores)),
      trials_out=int(np.size(out_scores)),
  )


def one_run_audit(
    in_scores, out_scores, *, delta: float, confidence: float = CONFIDENCE
) -> dict[str, float]:
  """Epsilon lower bound from ONE run with randomly included canaries.

  Precondition: each canary was included independently with probability 1/2
  before the run (Steinke, Nasr and Jagielski 2023); ``in_scores`` are the
  included canaries' scores. Guarantee (``epsilon_one_run``): if the training
  run is (epsilon, delta)-DP, the bound exceeds epsilon with probability at
  most ``1 - confidence``. ``epsilon_lower_bound_fdp`` (``epsilon_one_run_fdp``)
  tests the Gaussian trade-off curve with that (epsilon, delta) instead: a
  tighter bound, valid for mechanisms that are Gaussian-DP shaped.

  Returns:
    dict(epsilon_lower_bound=, epsilon_lower_bound_fdp=, confidence=, auroc=,
    num_canaries=, num_included=).
  """
  significance = _check_confidence(confidence)
  auditor = _auditor(in_scores, out_scores)
  return dict(
      epsilon_lower_bound=float(auditor.epsilon_one_run(significance, delta)),
      epsilon_lower_bound_fdp=float(
          auditor.epsilon_one_run_fdp(significance, delta)
      ),
      confidence=confidence,
      auroc=float(auditor.attack_auroc()),
      num_canaries=int(np.size(in_scores) + np.size(out_scores)),
      num_included=int(np.size(in_scores)),
  )


def membership_inference(
    member_scores, nonmember_scores, fprs: tuple[float, ...] = FPRS
) -> dict[str, Any]:
  """AUROC and TPR at low FPR of a membership score (higher = member).

  A descriptive attack statistic, not a bound: members are not randomised,
  so a score can also separate them through any distribution shift.

  Returns:
    dict(auroc=, tpr_at_fpr={str(fpr): tpr}, members=, non_members=).
  """
  auditor = _auditor(member_scores, nonmember_scores)
  tprs = np.atleast_1d(auditor.tpr_at_given_fpr(np.asarray(fprs)))
  return dict(
      auroc=float(auditor.attack_auroc()),
      tpr_at_fpr={f"{fpr:g}": float(tpr) for fpr, tpr in zip(fprs, tprs)},
      members=int(np.size(member_scores)),
      non_members=int(np.size(nonmember_scores)),
  )


def analytic_epsilon(noise_multiplier: float, delta: float = DELTA) -> float:
  """Epsilon at ``delta`` of ONE Gaussian step with this noise multiplier.

  The PLD accountant's value for sample rate 1 and one step (add/remove
  adjacency, pessimistic discretisation): an upper bound on the true
  epsilon of one ``dp_aggregate`` step on a fixed batch.
  """
  return accounting.dpsgd_epsilon(
      noise_multiplier=noise_multiplier, sample_rate=1.0, steps=1, delta=delta
  )


# -- planted bugs ------------------------------------------------------------


def planted_bug(
    bug: str,
    l2_clip: float,
    noise_multiplier: float,
    denominator: float,
    key: jax.Array,
    *,
    num_experts: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """A deliberately broken ``dp_aggregate`` (or ``owner_dp_aggregate``).

  NEVER train with it.

  It takes the same arguments and ``update`` extra args as the real transform
  and claims the same guarantee, but breaks it as ``PLANTED_BUGS[bug]``
  says, reusing the real clipping and noise code. An audit of it must give a
  lower bound above the epsilon claimed for ``noise_multiplier``: that shows
  the audit can find such bugs.

  Args:
    bug: a key of ``PLANTED_BUGS``.
    l2_clip: the claimed clip norm C.
    noise_multiplier: the claimed sigma.
    denominator: the claimed public denominator.
    key: PRNG key of the noise.
    num_experts: None for ``dp_aggregate``; E for ``owner_dp_aggregate``.
  """
  if bug not in PLANTED_BUGS:
    raise ValueError(
        f"unknown planted bug {bug!r}; choose one of {', '.join(PLANTED_BUGS)}"
    )
  if bug == "owner_leak" and num_experts is None:
    raise ValueError(
        "the owner_leak bug needs the owner transform (num_experts)"
    )
  sigma = {
      "half_noise": noise_multiplier / 2,
      "noise_on_mean": noise_multiplier / denominator,
  }.get(bug, noise_multiplier)
  privatizer = transforms.privatize_sums(
      l2_clip, sigma, 1.0 if bug == "realised_count" else denominator, key
  )
  clip = 1e30 if bug == "no_clipping" else l2_clip

  def update_fn(
      updates, state, params=None, *, owners=None, mask=None, **extra_args
  ):
    del params, extra_args
    clipped, norms = grads_lib.clip_per_record(updates, clip, mask)
    real = jnp.isfinite(norms).astype(jnp.float32)
    if mask is not None:
      real = real * (jnp.asarray(mask) != 0)
    if num_experts is None:
      sums = jax.tree.map(lambda g: jnp.sum(g, axis=0), clipped)
      counts = jnp.sum(real)
    elif bug == "owner_leak":
      sums = jax.tree.map(
          lambda g: jnp.broadcast_to(
              jnp.sum(g, axis=0), (num_experts,) + g.shape[1:]
          ),
          clipped,
      )
      counts = jnp.full((num_experts,), jnp.sum(real))
    else:
      sums = grads_lib.sum_by_owner(clipped, owners, num_experts)
      counts = jax.ops.segment_sum(real, owners, num_segments=num_experts)
    release, state = privatizer.update(sums, state)
    if bug == "realised_count":
      counts = jnp.maximum(counts, 1.0)
      release = jax.tree.map(
          lambda r: r
          / counts.reshape(counts.shape + (1,) * (r.ndim - counts.ndim)),
          release,
      )
    return release, state

  return optax.GradientTransformationExtraArgs(privatizer.init, update_fn)


# -- the white-box audit of one step -----------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditBatch:
  """A fixed batch with a canary in row 0.

  Rows: the canary (raw gradient ``canary_norm * C * v``, owner ``expert``);
  ``num_opposing`` records owned by ``expert`` and three owned by every other
  expert, all with gradients along ``-v`` of norm above C (clipped to
  ``-C v``: the worst case for a release that depends on a realised count);
  one record with NaN gradients; two padding rows (mask 0) with huge
  gradients along ``v``. Only the canary's mask differs between "in" (1) and
  "out" (0), the padding form of add/remove adjacency.
  """

  grads: PyTree  # leaves [n, *shape], float32
  mask: np.ndarray  # [n], canary row set per trial
  owners: np.ndarray  # int32 [n]
  direction: PyTree  # unit vector v, leaves [*shape]


def audit_batch(
    *,
    l2_clip: float = 1.0,
    num_experts: int = 4,
    expert: int = 1,
    canary_norm: float = 4.0,
    num_opposing: int = 15,
    shapes: Optional[dict[str, tuple[int, ...]]] = None,
    seed: int = 0,
) -> AuditBatch:
  """The fixed batch of the white-box audit (see ``AuditBatch``)."""
  shapes = shapes or {"kernel": (3, 2), "bias": (4,)}
  if not 0 <= expert < num_experts:
    raise ValueError(f"expert must be in [0, {num_experts}), got {expert}")
  rng = np.random.default_rng(seed)
  v = {k: rng.normal(size=s) for k, s in shapes.items()}
  norm = np.sqrt(sum(np.sum(x**2) for x in v.values()))
  v = {k: (x / norm).astype(np.float32) for k, x in v.items()}
  others = [e for e in range(num_experts) if e != expert]
  num_records = num_opposing + 3 * len(
      others
  )  # real records besides the canary
  scales = (
      [canary_norm]
      + [-(1.5 + i / num_records) for i in range(num_records)]
      + [np.nan, 100.0, 100.0]
  )
  owners = (
      [expert] * (num_opposing + 1)
      + [e for e in others for _ in range(3)]
      + [expert, 0, 0]
  )
  mask = [1.0] * (num_records + 2) + [0.0, 0.0]
  grads = {
      k: np.asarray(scales, np.float32).reshape((-1,) + (1,) * x.ndim)
      * l2_clip
      * x[None]
      for k, x in v.items()
  }
  return AuditBatch(
      grads, np.asarray(mask, np.float32), np.asarray(owners, np.int32), v
  )


def _make_transform(
    transform: str,
    bug: Optional[str],
    *,
    l2_clip: float,
    noise_multiplier: float,
    denominator: float,
    num_experts: int,
) -> Callable[[jax.Array], Any]:
  """key -> the transform under audit (real, or with a planted bug)."""
  owner = transform == "owner_dp_aggregate"
  if transform not in ("dp_aggregate", "owner_dp_aggregate"):
    raise ValueError(
        f"transform must be 'dp_aggregate' or 'owner_dp_aggregate', got "
        f"{transform!r}"
    )
  if bug is not None:
    return lambda key: planted_bug(
        bug,
        l2_clip,
        noise_multiplier,
        denominator,
        key,
        num_experts=num_experts if owner else None,
    )
  if owner:
    return lambda key: transforms.owner_dp_aggregate(
        l2_clip, noise_multiplier, num_experts, denominator, key
    )
  return lambda key: transforms.dp_aggregate(
      l2_clip, noise_multiplier, denominator, key
  )


def _release_scores(make_tx, batch: AuditBatch, owner: bool):
  """(key, canary_in) -> the release's projection on v: [] or [E]."""
  grads = jax.tree.map(jnp.asarray, batch.grads)
  owners, v = jnp.asarray(batch.owners), jax.tree.map(
      jnp.asarray, batch.direction
  )

  def release(key, canary_in):
    mask = jnp.asarray(batch.mask).at[0].set(canary_in.astype(jnp.float32))
    tx = make_tx(key)
    extra = dict(owners=owners) if owner else {}
    out, _ = tx.update(grads, tx.init(None), mask=mask, **extra)
    return out

  def score(key, canary_in):
    out = release(key, canary_in)
    if owner:
      return sum(
          jnp.sum((r * x[None]).reshape(r.shape[0], -1), axis=1)
          for r, x in zip(jax.tree.leaves(out), jax.tree.leaves(v))
      )
    return sum(
        jnp.vdot(r, x) for r, x in zip(jax.tree.leaves(out), jax.tree.leaves(v))
    )

  return release, score


def audit_transform(
    transform: str,
    *,
    noise_multiplier: float,
    l2_clip: float = 1.0,
    trials: int = 100_000,
    bug: Optional[str] = None,
    num_experts: int = 4,
    expert: int = 1,
    denominator: float = 16.0,
    delta: float = DELTA,
    confidence: float = CONFIDENCE,
    seed: int = 0,
    chunk: int = 50_000,
) -> dict[str, Any]:
  """White-box audit of one step of ``dp_aggregate`` or ``owner_dp_aggregate``.

  Runs ``trials`` independent steps (fresh noise key each) with the canary of
  ``audit_batch`` in, and ``trials`` without it, vectorised with ``jax.vmap``;
  scores each release by its projection on the canary direction; and bounds
  epsilon with ``trials_audit``. For the owner transform the same is done for
  every expert's row: the canary's owner gives the bound, every other expert
  must show none (``other_experts``), and ``isolation_max_abs_diff`` is the
  largest change of another expert's release when the canary is added with
  the same noise key (exactly 0 for the real transform).

  Args:
    transform: 'dp_aggregate' or 'owner_dp_aggregate'.
    noise_multiplier: sigma.
    l2_clip: C.
    trials: steps with the canary, and as many without.
    bug: None for the real transform, or a key of ``PLANTED_BUGS``.
    num_experts: E (owner transform).
    expert: the canary's owner.
    denominator: the public denominator (the score's scale does not matter).
    delta: delta of the claim; also of ``epsilon_analytic``.
    confidence: of the lower bound; seed: of the batch and the noise keys.
    chunk: trials per vmapped call (memory only).

  Returns:
    dict(transform=, bug=, noise_multiplier=, delta=, epsilon_analytic=,
    epsilon_lower_bound=, confidence=, auroc=, trials_in=, trials_out=) and,
    for the owner transform, expert=, other_experts={e: {...}},
    isolation_max_abs_diff=.
  """
  owner = transform == "owner_dp_aggregate"
  make_tx = _make_transform(
      transform,
      bug,
      l2_clip=l2_clip,
      noise_multiplier=noise_multiplier,
      denominator=denominator,
      num_experts=num_experts,
  )
  batch = audit_batch(
      l2_clip=l2_clip, num_experts=num_experts, expert=expert, seed=seed
  )
  release, score = _release_scores(make_tx, batch, owner)
  key = jax.random.key(seed)
  scores = _trial_scores(score, key, trials, min(chunk, 2 * trials))
  result = dict(
      transform=transform,
      bug=bug,
      noise_multiplier=noise_multiplier,
      delta=delta,
      epsilon_analytic=analytic_epsilon(noise_multiplier, delta),
  )
  if owner:
    return dict(
        result,
        **_owner_audit(scores, release, key, trials, expert, delta, confidence),
    )
  return dict(
      result,
      **trials_audit(
          scores[:trials], scores[trials:], delta=delta, confidence=confidence
      ),
  )


def _trial_scores(score, key, trials: int, chunk: int) -> np.ndarray:
  """Scores of ``2 * trials`` steps, vmapped; trial i has noise key
  ``fold_in(key, i)`` and the canary iff ``i < trials``. One compilation."""

  @jax.jit
  def score_chunk(index):
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)
    return jax.vmap(score)(keys, index < trials)

  parts = []
  for start in range(0, 2 * trials, chunk):
    index = np.arange(start, start + chunk, dtype=np.int32)
    parts.append(np.asarray(score_chunk(index))[: 2 * trials - start])
  return np.concatenate(parts).astype(np.float64)


def _owner_audit(
    scores, release, key, trials, expert, delta, confidence
) -> dict[str, Any]:
  """Per-expert audits of the owner transform and the isolation check.

  ``scores``: [2 * trials, E]. The canary's owner gives the bound; every
  other expert's release must not depend on the canary at all: with the same
  noise key, adding the canary changes it by exactly 0
  (``isolation_max_abs_diff``).
  """
  num_experts = scores.shape[1]
  per_expert = {
      e: trials_audit(
          scores[:trials, e],
          scores[trials:, e],
          delta=delta,
          confidence=confidence,
      )
      for e in range(num_experts)
  }

  def max_change(index):
    trial_key = jax.random.fold_in(key, index)  # the same noise, in and out
    with_canary = release(trial_key, jnp.asarray(True))
    without = release(trial_key, jnp.asarray(False))
    return jax.tree.map(
        lambda a, b: jnp.max(jnp.abs(a - b), axis=tuple(range(1, a.ndim))),
        with_canary,
        without,
    )

  diffs = np.max(
      np.stack(jax.tree.leaves(jax.jit(jax.vmap(max_change))(np.arange(64)))),
      axis=(0, 1),
  )  # [E]
  return dict(
      expert=expert,
      **per_expert[expert],
      other_experts={e: r for e, r in per_expert.items() if e != expert},
      isolation_max_abs_diff=float(np.max(np.delete(diffs, expert))),
  )
