"""Mechanism diagnostics of App. G, on labelled dev data after training.

Three diagnostics of how a method's DP mechanism treats the roles of an MoE:

* Role mismatch (Eq. 37): ``M_role = 1/2 sum_r |s_r^norm - s_r^param|`` over the
  trainable roles r in {shared, router, head, experts}. s_r^param is the
  role's share of the trainable parameters; s_r^norm its share of the squared
  per-record gradient norm, summed over records, of the gradient the mechanism
  sums: after the residual weight and after the method's clipping (one joint
  clip or one per stream). The squared norm is the quantity the clip bounds
  and it splits exactly over roles, so the shares add up to one.
* Per-expert SNR at the selected layer l* (Sec. 7, Remark 2): the expected
  noisy sum of expert e over a Poisson batch is B * m_e, where m_e is the mean
  over records of their clipped contribution to expert e (zero for records
  that do not touch it); its noise is N(0, sigma^2 C^2 I_d). So
  SNR_e = B^2 ||m_e||^2 / (sigma^2 C^2 d) = (B q_e)^2 ||mu_e||^2 / (sigma^2 C^2 d),
  with the sigma and C of the part that trains the experts (the denominator
  cancels). Reported: the mean over experts and its coefficient of variation
  (population std / mean). Undefined for non-private methods and for methods
  that do not train l*'s experts.
* Noise-injection sensitivity (Tab. 10, Eq. 40): add xi ~ N(0, s^2 I) to one
  role's trainable parameters, measure the dev loss change dL,
  lambda_+ = max(dL, 0) / (s^2 d_r). Each draw is an antithetic pair +xi, -xi
  (xi and -xi have the same law, so E[dL] is unchanged), which cancels the
  first-order term grad . xi that otherwise swamps the curvature signal at
  small s. The paper's Tab. 10 values imply s = 1e-3, the default.

Privacy. Diagnostics read per-record gradients, so on private data they are
private statistics. They run on the dev split (labels needed; it is not the
private training set) and go to their own file, `diagnostics.json`, only when
asked (`launch/sweep.py --diagnostics` or `write_for_run`); never into training
logs or metrics. `split='train'` is an explicit private audit: it warns and
marks the output `private_audit: true`.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from raptor_jax import _validate, grads, roles, sampling
from raptor_jax.train import parallel, plans, step
from raptor_jax.train.run import build_run
from raptor_jax.train.checkpoint import Checkpointer

log = logging.getLogger("raptor_jax")

# -- formulas -------------------------------------------------------------------


def role_mismatch(
    squared_norms: Mapping[str, float], param_counts: Mapping[str, int]
) -> dict[str, Any]:
  """M_role (Eq. 37): total variation between gradient-norm and parameter shares.

  Args:
    squared_norms: per role, the sum over records of squared gradient norms.
    param_counts: per role, its number of trainable parameters (roles with no
      trainable parameter are left out).

  Returns:
    dict(M_role=, norm_share={role: s}, param_share={role: s}).
  """
  names = [r for r in param_counts if param_counts[r] > 0]
  total_norm = sum(squared_norms.get(r, 0.0) for r in names)
  total_params = sum(param_counts[r] for r in names)
  if total_norm <= 0 or total_params <= 0:
    raise ValueError(
        "role_mismatch needs a non-zero gradient and at least one trainable role"
    )
  norm_share = {r: float(squared_norms.get(r, 0.0) / total_norm) for r in names}
  param_share = {r: float(param_counts[r] / total_params) for r in names}
  m_role = 0.5 * sum(abs(norm_share[r] - param_share[r]) for r in names)
  return dict(
      M_role=float(m_role), norm_share=norm_share, param_share=param_share
  )


def expert_snr(
    signal_sums: np.ndarray,
    *,
    num_records: int,
    batch_size: float,
    noise_multiplier: float,
    l2_clip: float,
) -> np.ndarray:
  """Per-expert SNR_e = B^2 ||m_e||^2 / (sigma^2 C^2 d).

  Args:
    signal_sums: [E, d] per expert, the sum over `num_records` records of their
      clipped contribution to that expert's parameters.
    num_records: records the sums run over (m_e = signal_sums[e] / num_records).
    batch_size: expected batch size B.
    noise_multiplier: sigma of the part that trains the experts (> 0).
    l2_clip: its clip norm C.

  Returns:
    float64 [E].
  """
  if noise_multiplier <= 0:
    raise ValueError(
        "expert SNR needs a noise multiplier > 0 (a private method)"
    )
  signal = np.asarray(signal_sums, np.float64).reshape(len(signal_sums), -1)
  mean = signal / num_records
  d = signal.shape[1]
  return (
      batch_size**2
      * np.sum(mean**2, axis=1)
      / (noise_multiplier**2 * l2_clip**2 * d)
  )


def snr_summary(snr: Sequence[float]) -> dict[str, float]:
  """Mean per-expert SNR and its coefficient of variation (population std / mean)."""
  snr = np.asarray(snr, np.float64)
  mean = float(np.mean(snr))
  return dict(
      mean=mean, cv=float(np.std(snr) / mean) if mean > 0 else float("nan")
  )


def noise_sensitivity(
    delta_loss: float, noise_std: float, num_params: int
) -> float:
  """lambda_+ = max(dL, 0) / E||xi||^2 with E||xi||^2 = s^2 d (Eq. 40)."""
  return max(float(delta_loss), 0.0) / (noise_std**2 * num_params)


# -- per-record statistics of a trained run ------------------------------------------


def phase_statistics(
    fns: step.PhaseFunctions,
    expert_layer: int,
    num_experts: int,
    trainable,
    frozen,
    batch,
    mask,
):
  """Per role: sum of squared per-record norms; per part at l*: [E, ...] signal sums."""
  per_record = fns.released_per_record(trainable, frozen, batch, mask)
  squared = dict.fromkeys(roles.DIAGNOSTIC_ROLES, jnp.zeros((), jnp.float32))
  signal = {}
  prefix = roles.expert_prefix(expert_layer)
  for part in fns.phase.parts:
    for path, g in per_record[part.name].items():
      role = roles.diagnostic_role(path)
      squared[role] = squared[role] + jnp.sum(jnp.square(g.astype(jnp.float32)))
      if not path.startswith(prefix):
        continue
      if part.owner:  # [n, ...] owner slices -> [E, ...]
        signal[path] = grads.sum_by_owner(
            g.astype(jnp.float32), batch["owners"], num_experts
        )
      else:  # [n, E, ...] every expert of l*
        signal[path] = jnp.sum(g.astype(jnp.float32), axis=0)
  return squared, signal


def _restore_trainable(
    config: ml_collections.ConfigDict, workdir: str | Path
) -> dict:
  """The trainable parameters of the run's latest checkpoint (which must match `config`)."""
  checkpointer = Checkpointer(workdir, config)
  try:
    if checkpointer.restore_meta() is None:
      raise FileNotFoundError(f"no checkpoint in {workdir}; train first")
    state = checkpointer.manager.restore(
        checkpointer.latest(),
        args=ocp.args.Composite(state=ocp.args.StandardRestore()),
    )["state"]
  finally:
    checkpointer.close()
  return jax.tree.map(jnp.asarray, state["trainable"])


def _mean_loss(logits_fn, trainable, frozen, records, batch_size: int) -> float:
  """Mean cross-entropy of `records` = (ids, mask, labels) in fixed-size batches."""
  ids, mask, labels = records
  losses = []
  for start in range(0, len(labels), batch_size):
    real = len(labels[start : start + batch_size])
    pad = ((0, batch_size - real), (0, 0))
    logits = logits_fn(
        trainable,
        frozen,
        jnp.asarray(np.pad(ids[start : start + real], pad)),
        jnp.asarray(np.pad(mask[start : start + real], pad)),
    )
    losses.append(
        np.asarray(
            step.cross_entropy(logits[:real], labels[start : start + real])
        )
    )
  return float(np.mean(np.concatenate(losses)))


def _perturbed(trainable, role: str, scale: float, key: jax.Array):
  """`trainable` with scale * N(0, I) added to every leaf of `role`."""
  out, index = {}, 0
  for name in sorted(trainable):
    out[name] = {}
    for path in sorted(trainable[name]):
      value = trainable[name][path]
      if roles.diagnostic_role(path) == role:
        value = value + scale * jax.random.normal(
            jax.random.fold_in(key, index), value.shape, value.dtype
        )
        index += 1
      out[name][path] = value
  return out


def gradient_statistics(
    phase_fns,
    trainable,
    frozen,
    records,
    owners,
    *,
    expert_layer: int,
    num_experts: int,
    microbatch_size: int,
    statistics_fn=None,
):
  """Squared norms per role (all phases) and l* signal sums per phase, over `records`.

  `statistics_fn(fns)`: the jitted `phase_statistics` of a phase (default:
  jitted here; the controlled study passes its cached one).
  """
  if statistics_fn is None:
    statistics_fn = lambda fns: jax.jit(
        functools.partial(phase_statistics, fns, expert_layer, num_experts)
    )
  ids, mask, labels = records
  squared = dict.fromkeys(roles.DIAGNOSTIC_ROLES, 0.0)
  signals: dict[str, dict[str, np.ndarray]] = {}
  for fns in phase_fns:
    stats_fn = statistics_fn(fns)
    signal_sums = signals.setdefault(fns.phase.name, {})
    for mb in sampling.microbatches(np.arange(len(labels)), microbatch_size):
      batch = dict(
          input_ids=ids[mb.indices],
          attention_mask=mask[mb.indices],
          labels=labels[mb.indices],
          owners=owners[mb.indices],
      )
      sq, signal = stats_fn(
          trainable,
          frozen,
          jax.tree.map(jnp.asarray, batch),
          jnp.asarray(mb.mask),
      )
      for role, value in sq.items():
        squared[role] += float(value)
      for path, value in signal.items():
        signal_sums[path] = signal_sums.get(path, 0.0) + np.asarray(value)
  return squared, signals


def snr_of_plan(
    plan: plans.Plan,
    signals,
    trainable,
    *,
    num_records: int,
    batch_size: float,
    num_experts: int,
) -> dict[str, Any] | None:
  """Per-expert SNR of the private part that trains l*'s experts (None if none does)."""
  prefix = roles.expert_prefix(plan.expert_layer)
  for phase in plan.phases:
    for part in phase.parts:
      paths = sorted(p for p in trainable[part.name] if p.startswith(prefix))
      if phase.private and paths:
        stacked = np.concatenate(
            [signals[phase.name][p].reshape(num_experts, -1) for p in paths],
            axis=1,
        )
        snr = expert_snr(
            stacked,
            num_records=num_records,
            batch_size=batch_size,
            noise_multiplier=part.noise_multiplier,
            l2_clip=part.l2_clip,
        )
        return dict(per_expert=snr.tolist(), **snr_summary(snr))
  return None


def sensitivities(
    config,
    model,
    trainable,
    frozen,
    records,
    *,
    noise_std: float,
    draws: int,
    logits_fn=None,
) -> tuple[float, dict[str, Any]]:
  """(base loss, per trainable role: params, mean dL over antithetic draws, lambda_+).

  `logits_fn`: `step.make_eval_fn(model)` (default: a new one, i.e. one
  compilation per call; pass one to reuse it across runs of one model).
  """
  logits_fn = logits_fn or step.make_eval_fn(model)
  param_counts = role_param_counts(trainable)
  base_loss = _mean_loss(
      logits_fn, trainable, frozen, records, config.eval_batch_size
  )
  sensitivity = {}
  for role in (r for r, count in param_counts.items() if count):
    keys = [
        jax.random.fold_in(jax.random.PRNGKey(config.seed), draw)
        for draw in range(draws)
    ]
    deltas = [
        _mean_loss(
            logits_fn,
            _perturbed(trainable, role, sign * noise_std, key),
            frozen,
            records,
            config.eval_batch_size,
        )
        - base_loss
        for key in keys
        for sign in (1.0, -1.0)
    ]
    delta = float(np.mean(deltas))
    sensitivity[role] = dict(
        params=param_counts[role],
        delta_loss=delta,
        lambda_plus=noise_sensitivity(delta, noise_std, param_counts[role]),
    )
  return base_loss, sensitivity


def _check_split(split: str) -> None:
  """Refuses an unknown split; warns that 'train' gives a private audit."""
  _validate.one_of(
      "split", split, ("dev", "train"), "'train' gives a private audit"
  )
  if split == "train":
    log.warning(
        "diagnostics on the private training split: the output is a private audit "
        "statistic, NOT differentially private; keep it inside your trust boundary"
    )


def _phase_functions(config, run) -> list[step.PhaseFunctions]:
  """The step functions of each phase of `run`'s plan, on one device.

  Only their per-record loss and residual weights are used (no noise, no
  update).
  """
  return [
      step.PhaseFunctions(
          run.model,
          phase,
          mesh=parallel.make_mesh(1),
          expert_layer=run.expert_layer,
          num_experts=run.backbone_config.num_experts,
          learning_rate=config.learning_rate,
          residual=config.raptor.residual,
          residual_gamma=config.raptor.residual_gamma,
          key=jax.random.PRNGKey(0),
      )
      for phase in run.plan.phases
  ]


def role_param_counts(trainable) -> dict[str, int]:
  """Number of trainable parameters per diagnostic role (0 for absent roles)."""
  counts = dict.fromkeys(roles.DIAGNOSTIC_ROLES, 0)
  for part_params in trainable.values():
    for path, value in part_params.items():
      counts[roles.diagnostic_role(path)] += int(np.size(value))
  return counts


def _data_note(split: str, n: int) -> str:
  """The `data` field: which records were measured, and whether it is private."""
  return f"{split} split, first {n} records" + (
      " (PRIVATE AUDIT: not differentially private)"
      if split == "train"
      else " (not the private training data)"
  )


def compute(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    split: str = "dev",
    max_records: int = 512,
    noise_std: float = 1e-3,
    draws: int = 4,
) -> dict[str, Any]:
  """App. G diagnostics of the run in `workdir` (its latest checkpoint).

  Rebuilds the run's model and plan from `config` exactly as the training loop
  does, restores the trained parameters and measures them on `split`.

  Args:
    config: the run's config (the checkpoint must match it).
    workdir: the run's directory.
    split: 'dev' (default), or 'train' for a private audit (warns, marked).
    max_records: use the first records of the split (0 = all).
    noise_std: s of the noise-injection sensitivity.
    draws: antithetic noise pairs per role (dL is the mean over the 2 * draws).

  Returns:
    dict(data=, private_audit=, records=, method=, expert_layer=, role_mismatch=,
    expert_snr= (None if undefined), noise_sensitivity=).
  """
  _check_split(split)
  run = build_run(config, owner_records=split)
  plan, bc, expert_layer = run.plan, run.backbone_config, run.expert_layer
  data = run.data.dev if split == "dev" else run.data.train
  n = min(len(data.labels), max_records) if max_records else len(data.labels)
  records = (data.input_ids[:n], data.attention_mask[:n], data.labels[:n])
  owners, model, frozen = run.owners[:n], run.model, run.frozen
  trainable = _restore_trainable(config, workdir)
  squared, signals = gradient_statistics(
      _phase_functions(config, run),
      trainable,
      frozen,
      records,
      owners,
      expert_layer=expert_layer,
      num_experts=bc.num_experts,
      microbatch_size=config.microbatch_size,
  )
  param_counts = role_param_counts(trainable)
  base_loss, sensitivity = sensitivities(
      config,
      model,
      trainable,
      frozen,
      records,
      noise_std=noise_std,
      draws=draws,
  )
  return dict(
      data=_data_note(split, n),
      private_audit=split == "train",
      records=n,
      method=plan.method,
      expert_layer=expert_layer,
      role_mismatch=role_mismatch(squared, param_counts),
      expert_snr=snr_of_plan(
          plan,
          signals,
          trainable,
          num_records=n,
          batch_size=float(plan.batch_size or config.batch_size),
          num_experts=bc.num_experts,
      ),
      noise_sensitivity=dict(
          noise_std=noise_std,
          draws=draws,
          base_loss=base_loss,
          roles=sensitivity,
      ),
  )


def write_for_run(
    config: ml_collections.ConfigDict, workdir: str | Path, **kwargs
) -> Path:
  """Computes `compute(config, workdir, **kwargs)` and writes `<workdir>/diagnostics.json`."""
  result = compute(config, workdir, **kwargs)
  path = Path(workdir) / "diagnostics.json"
  path.write_text(json.dumps(result, indent=2, sort_keys=True))
  return path
