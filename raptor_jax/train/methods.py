"""RAPTOR, its baselines and ablations as data: one plan, one training loop.

A `Plan` lists the phases of a training cycle. Each phase draws its own
Poisson sample (every record in with probability q) and makes one noisy
update of its parts. A part is a set of parameters with a clip norm, a noise
multiplier and a public denominator; an `owner` part holds the experts of
layer l*, where every record trains its owner's slice only::

  raptor           shared phase {attention adapters + shared-expert adapters +
                   head}, then expert phase {owner slices of l*'s routed
                   expert adapters} on an independent sample (Alg. 1);
                   sigmas split by rho
  baseline_a       RAPTOR's parameters (shared + every expert of l*, no owner
                   masking, no residual weight), one clip C (privacy.clip_shared)
                   over both, one sigma, denominator B for both (Tab. 6)
  baseline_b       RAPTOR's shared phase alone, the whole budget (experts frozen)
  baseline_c       RAPTOR's expert phase alone (owner slices, C_e, D_e, residual
                   weight), the whole budget (shared stream frozen)
  monolithic       every weight, routers included, one clip, one sigma,
                   denominator B (DP-Adam of Tholoniat et al.: the record's
                   gradient [g_sh, g_rt, g_head, g_exp] of Sec. 4.1)
  monolithic_lora  adapters of attention and of every expert (shared and
                   routed) of every sparse layer + head, one clip, one sigma,
                   denominator B
  nonprivate_lora  as monolithic_lora without clipping or noise
  nonprivate_full  as monolithic without clipping or noise

RAPTOR's ablations are switches of `config.raptor`, each replacing one
component (Tab. 5): `expert_denominator='B'`; `alternate=False` (both streams
from one sample, one step); `residual='none'`; `layer` (first | last |
entropy | a block index; the loop picks l*, every method uses it);
`joint_clip=True`, the full-model clip, described next.

Full-model clip (`joint_clip=True`, alternation kept). Each phase still draws
its own Poisson sample, but it differentiates each record's loss with respect
to ALL of RAPTOR's trainable parameters (shared + the record's owner slice,
the expert gradient weighted by w_i as usual), clips that joint gradient to
one C (`privacy.clip_shared`), and releases only its own part: the shared
phase the shared coordinates, the expert phase the owner-slice coordinates.
Guarantee: a released part is a sub-vector of a vector of norm <= C, so its
norm is <= C too; each step is therefore the Gaussian mechanism of RAPTOR
with sensitivity C, and the accounting (rho split, sigma_s, sigma_e, two
independent streams) is RAPTOR's with C_s = C_e = C. The unreleased part only
shrinks the clip factor, it is never released. Cost: every phase runs a
backward pass through both streams' parameters (inherent to the ablation).
With `alternate=False` as well, `joint_clip=True` is the older two-change
variant (one sample, one clip C_s over both streams, one sigma from DP-SGD
calibration): sweep variant `raptor_full_clip_one_sample`.

Shared experts (DeepSeek-MoE) see every token, so they belong to the shared
stream wherever it trains (docs/method.md §1.5); only routed experts have owners. Only
RAPTOR's expert stream (raptor, its ablations, baseline_c) trains owner
slices. Routers never train except in the full-weight monolithic baselines,
which treat the model as one dense block like the paper's DP-Adam baseline.
Every method samples every phase as Poisson, for the same number of cycles.

Accounting follows what runs: a phase whose parts share one clip (or that has
one part) is one Poisson-sampled Gaussian per step with that sigma; a phase
that updates separately clipped parts from one sample is one Gaussian with
sigma_eff = (sum_g sigma_g^-2)^-1/2; phases compose sequentially. Every
private method is calibrated to the same (epsilon, delta).
"""

from __future__ import annotations

import math
from typing import Mapping

from raptor_jax import _validate, accounting, calibration, roles, sampling
from raptor_jax.models import kernels, moe
from raptor_jax.sampling import EXPERT_STREAM, SHARED_STREAM
from raptor_jax.train import plans
from raptor_jax.train.plans import Part, Phase

# Expert dispatches of a fine-tuning run: `moe.DISPATCHES` without the
# pretraining '*_train' ones; runs that train expert kernels use 'dense'.
FINE_TUNING_DISPATCHES = tuple(
    d for d in moe.DISPATCHES if not d.endswith("_train")
)

PRIVATE_METHODS = (
    "raptor",
    "baseline_a",
    "baseline_b",
    "baseline_c",
    "monolithic",
    "monolithic_lora",
)
METHODS = PRIVATE_METHODS + ("nonprivate_lora", "nonprivate_full")


def check_config(config) -> None:
  """Checks the method's fields of `config` (no data or model needed)."""
  rc, fix = config.raptor, _validate.config_fix
  _validate.one_of("method", config.method, METHODS, fix("method"))
  _validate.one_of(
      "model.dispatch",
      config.model.get("dispatch", "auto"),
      FINE_TUNING_DISPATCHES,
      fix("model.dispatch")
      + " ('auto' is 'grouped' on CPU, 'batched' elsewhere)",
  )
  _validate.one_of(
      "model.kernels",
      config.model.get("kernels", "auto"),
      kernels.KERNELS,
      fix("model.kernels") + " ('auto': fast on CPU, reference elsewhere)",
  )
  _validate.one_of(
      "raptor.expert_denominator",
      rc.expert_denominator,
      ("B/E", "B"),
      fix("raptor.expert_denominator"),
  )
  _validate.one_of(
      "raptor.residual",
      rc.residual,
      ("shared", "full", "none"),
      fix("raptor.residual"),
  )
  _validate.in_interval(
      "raptor.residual_gamma",
      rc.residual_gamma,
      "(0, 1]",
      fix("raptor.residual_gamma"),
  )
  if config.method in ("raptor", "baseline_c"):  # the expert stream's w_i
    _validate.check(
        not (rc.residual == "shared" and rc.expert_full_weights),
        "raptor.residual",
        "'full' or 'none' with raptor.expert_full_weights=True ('shared'"
        " switches l*'s expert updates off by zeroing their LoRA B factors,"
        " which full-weight experts do not have)",
        rc.residual,
        fix("raptor.residual", "full"),
    )
  _validate.non_negative_int(
      "epochs", config.epochs, fix("epochs") + " (0: chosen from n)"
  )
  _validate.non_negative_int(
      "batch_size", config.batch_size, fix("batch_size") + " (0: n / 10)"
  )
  _validate.positive(
      "learning_rate", config.learning_rate, fix("learning_rate")
  )
  for name in ("clip_shared", "clip_expert"):
    field = f"privacy.{name}"
    _validate.positive(field, config.privacy[name], fix(field))
  if config.method in PRIVATE_METHODS:
    _check_budget(config)


def _check_budget(config) -> None:
  """The budget fields a private method calibrates to, before any data loads.

  The accountant checks them again (and delta against 1/n once n is known).
  """
  pc, fix = config.privacy, _validate.config_fix
  _validate.positive("privacy.epsilon", pc.epsilon, fix("privacy.epsilon"))
  if pc.delta:  # 0 = the default 1/n**1.1
    _validate.probability(
        "privacy.delta", pc.delta, fix("privacy.delta") + " (0 = 1/n**1.1)"
    )
  rc = config.raptor
  if config.method == "raptor" and not (rc.joint_clip and not rc.alternate):
    _validate.probability(
        "privacy.rho", pc.rho, fix("privacy.rho") + " (the paper uses 0.9)"
    )


class _Calibration:
  """Noise multipliers calibrated to a target: `kwargs` are `calibration`'s
  target_epsilon, delta, sample_rate and steps."""

  def __init__(self, rho: float, **kwargs):
    self.rho, self.kwargs = rho, kwargs

  def dpsgd(self) -> float:
    return calibration.calibrate_dpsgd(**self.kwargs)

  def raptor(self, joint: bool) -> tuple[float, float]:
    return calibration.calibrate_raptor(
        **self.kwargs, rho=self.rho, joint=joint
    )


class _Given:
  """Noise multipliers given by name instead of calibrated (`noise_fields`)."""

  def __init__(self, noise: Mapping[str, float], method: str):
    self.noise, self.method, self.asked = dict(noise), method, []

  def _get(self, name: str) -> float:
    self.asked.append(name)
    if name not in self.noise:
      raise ValueError(
          f"{name}: needed by method {self.method!r} with this config (see"
          " methods.noise_fields); give it"
      )
    return self.noise[name]

  def dpsgd(self) -> float:
    return self._get("sigma")

  def raptor(self, joint: bool) -> tuple[float, float]:
    del joint
    return self._get("sigma_shared"), self._get("sigma_expert")


def noise_fields(config) -> tuple[str, ...]:
  """The noise multipliers `config`'s plan calibrates, by name.

  `('sigma',)` for the one-sigma methods (and RAPTOR with one sample and one
  clip), `('sigma_shared', 'sigma_expert')` for RAPTOR's two streams, `()`
  for the non-private methods: the names `build_plan(noise=...)` takes.
  """
  probe = _Given(dict(sigma=1.0, sigma_shared=1.0, sigma_expert=1.0), "")
  _phases(config, b=1.0, num_experts=1, expert_layer=0, sigmas=probe)
  if config.method not in PRIVATE_METHODS:
    return ()
  return tuple(dict.fromkeys(probe.asked))


def _raptor_phases(rc, shared, expert, sigmas: _Calibration):
  """RAPTOR's phases and its `config.raptor` ablations.

  `shared(sigma)` and `expert(sigma, clip=...)` build the two streams' parts;
  `clip=None` gives the expert part C_s, the one C of the full-model clip.
  """
  if rc.joint_clip and not rc.alternate:
    # one sample, one clip, one sigma: rho plays no part
    sigma = sigmas.dpsgd()
    parts = (shared(sigma), expert(sigma, clip=None))
    return (Phase("joint", SHARED_STREAM, parts, joint_clip=True),)
  s_sh, s_ex = sigmas.raptor(joint=not rc.alternate)
  sh = shared(s_sh)
  ex = expert(s_ex, clip=None) if rc.joint_clip else expert(s_ex)
  if not rc.alternate:
    return (Phase("joint", SHARED_STREAM, (sh, ex)),)

  def clip_with(other: Part) -> dict:
    # joint_clip: RAPTOR's phases and sigmas with C_s = C_e = C; each phase
    # clips jointly with the other's part, which it does not release.
    return dict(joint_clip=True, clip_with=(other,)) if rc.joint_clip else {}

  return (
      Phase("shared", SHARED_STREAM, (sh,), **clip_with(ex)),
      Phase("expert", EXPERT_STREAM, (ex,), **clip_with(sh)),
  )


def _phases(
    config,
    *,
    b: float,
    num_experts: int,
    expert_layer: int,
    sigmas: _Calibration,
) -> tuple[Phase, ...]:
  """The phases of `config.method`, with noise from `sigmas`."""
  method, rc, pc = config.method, config.raptor, config.privacy
  d_e = b / num_experts if rc.expert_denominator == "B/E" else b
  shared_roles = (
      roles.SHARED_FULL_ROLES if rc.shared_full_weights else roles.SHARED_ROLES
  )
  expert_roles = (
      roles.EXPERT_FULL_ROLES if rc.expert_full_weights else roles.EXPERT_ROLES
  )
  residual = rc.residual != "none"

  def shared(sigma, clip=pc.clip_shared):
    return Part("shared", shared_roles, None, False, clip, sigma, b)

  def expert(sigma, clip=pc.clip_expert):
    clip = pc.clip_shared if clip is None else clip
    return Part(
        "expert",
        expert_roles,
        (expert_layer,),
        True,
        clip,
        sigma,
        d_e,
        residual,
    )

  if method == "raptor":
    return _raptor_phases(rc, shared, expert, sigmas)
  if method == "baseline_a":
    sigma = sigmas.dpsgd()
    every_expert = Part(
        "expert", expert_roles, (expert_layer,), False, pc.clip_shared, sigma, b
    )
    parts = (shared(sigma), every_expert)
    return (Phase("dpsgd", SHARED_STREAM, parts, joint_clip=True),)
  if method in ("baseline_b", "baseline_c"):  # one stream of RAPTOR's two
    name, stream, make = (
        ("shared", SHARED_STREAM, shared)
        if method == "baseline_b"
        else ("expert", EXPERT_STREAM, expert)
    )
    return (Phase(name, stream, (make(sigmas.dpsgd()),)),)
  full = method in ("monolithic", "nonprivate_full")
  every = roles.ALL_ROLES if full else roles.LORA_ROLES
  private = method in PRIVATE_METHODS
  sigma = sigmas.dpsgd() if private else 0.0
  part = Part("all", every, None, False, pc.clip_shared, sigma, b)
  name = "dpsgd" if private else "nonprivate"
  return (Phase(name, SHARED_STREAM, (part,), private=private),)


def _model_options(
    config, phases, sparse_layers, expert_layer, shared_experts
) -> dict:
  """Adapters the methods' parts train, and the expert dispatch they need.

  A non-owner part that trains expert kernels needs the dense dispatch (the
  grouped and ragged ones treat expert kernels as frozen constants). Blocks
  that a part selects by block (l*) stay out of any scan, so their
  parameters and owner slices keep their per-layer paths (`models.stack`).
  Shared-expert adapters exist exactly when attention adapters do: both are
  the shared stream's LoRA.
  """
  method, mc, rc = config.method, config.model, config.raptor
  parts = [part for phase in phases for part in phase.parts]
  dense = any("expert_kernel" in p.roles and not p.owner for p in parts)
  options = dict(
      dispatch="dense" if dense else mc.get("dispatch", "auto"),
      kernels=mc.get("kernels", "auto"),
      scan_layers=mc.get("scan_layers", True),
      unscanned_layers=tuple(
          sorted({b for p in parts for b in p.blocks or ()})
      ),
  )
  if method in ("monolithic", "nonprivate_full"):
    options.update(lora_rank=0, attention_lora=False, expert_lora_layers=())
  elif method in ("monolithic_lora", "nonprivate_lora"):
    options.update(
        lora_rank=mc.lora_rank,
        lora_alpha=mc.lora_alpha,
        attention_lora=True,
        expert_lora_layers=tuple(sparse_layers),
    )
  else:
    options.update(
        lora_rank=mc.lora_rank,
        lora_alpha=mc.lora_alpha,
        attention_lora=not rc.shared_full_weights,
        expert_lora_layers=() if rc.expert_full_weights else (expert_layer,),
    )
  if shared_experts:
    options["shared_expert_lora"] = options["attention_lora"]
  return options


# `batch_size = 0` and `epochs = 0` (configs/custom.py) choose both from n.
AUTO_BATCH_FRACTION = 10  # B = n / 10: a Poisson sample rate q of 0.1 ...
AUTO_BATCH_MAX = 1000  # ... up to B = 1000 (q = 1000 / n below that)
AUTO_STEPS = 200  # the fewest epochs that give at least this many steps
# Fewer noisy steps than this get a warning in the run header: the noise of
# a few large steps does not average out (issue 48: on 600 records, 18 steps
# gave 0.42 where 120 gave 0.76 to 0.88). The :tiny run's 96 steps pass.
FEW_STEPS = 50


def run_sizes(config, n: int) -> tuple[int, int]:
  """(expected batch size B, epochs) of a run on n records.

  The config's, or, where it sets 0 (configs/custom.py does), chosen from n:
  B = n / 10, at most `AUTO_BATCH_MAX`, so that the sample rate stays at
  most 0.1 and the noise of one step is spread over many records; and the
  fewest epochs that give `AUTO_STEPS` noisy steps, so that the noise of
  the steps averages out. n is public (the sample rate and the default
  delta are functions of it; see docs/privacy.md), so a choice made from n
  spends no privacy budget.
  """
  b = config.batch_size or max(1, min(n // AUTO_BATCH_FRACTION, AUTO_BATCH_MAX))
  epochs = config.epochs or max(
      1, math.ceil(AUTO_STEPS / accounting.steps_per_epoch(min(b / n, 1.0)))
  )
  return b, epochs


def default_delta(config, n: int) -> float:
  """`privacy.delta = 0`: 1/n**1.1 (the paper's, SPEC), and for a task of
  the user's own (`data.task='custom'`) the smaller 1/(10 n), so that a small
  dataset's delta stays well below 1/n (1/n**1.1 is 1/(1.9 n) at n = 600)."""
  delta = accounting.default_delta(n)
  if config.data.task == "custom":  # data.CUSTOM
    delta = min(delta, 1.0 / (10 * n))
  return delta


def build_plan(
    config,
    *,
    n: int,
    num_experts: int,
    sparse_layers: tuple[int, ...],
    expert_layer: int,
    shared_experts: bool = False,
    noise: Mapping[str, float] | None = None,
    validated: bool = False,
) -> plans.Plan:
  """Turns a config into phases with calibrated noise.

  Every private method is calibrated by the PLD accountant to the same
  (epsilon, delta) for the same number of cycles and the same sample rate.

  Args:
    config: the training ConfigDict.
    n: number of private training records.
    num_experts, sparse_layers, expert_layer: E, the sparse blocks and l*.
    shared_experts: the model has always-active shared experts (their
      adapters then join the shared stream's LoRA).
    noise: the noise multipliers by name (`noise_fields(config)`) instead of
      calibrating them to `privacy.epsilon` (launch/privacy.py's reverse
      mode: the epsilon that given noise spends); the plan's
      `target_epsilon` is then None.
    validated: the caller has checked `config` already (`run.validate`, which
      runs `check_config`); skip the check here.
  """
  if not validated:
    check_config(config)
  batch_size, epochs = run_sizes(config, n)
  q = batch_size / n
  sampling.check_sample_rate(q)
  cycles = epochs * accounting.steps_per_epoch(q)
  delta = config.privacy.delta or default_delta(config, n)
  accounting.validate_delta(delta, n)
  private, pc = config.method in PRIVATE_METHODS, config.privacy
  if noise is None:
    target = dict(target_epsilon=pc.epsilon, delta=delta, sample_rate=q)
    sigmas = _Calibration(pc.rho, steps=cycles, **target)
  else:
    sigmas = _Given(noise, config.method)
  phases = _phases(
      config,
      b=float(batch_size),
      num_experts=num_experts,
      expert_layer=expert_layer,
      sigmas=sigmas,
  )
  return plans.Plan(
      config.method,
      phases,
      cycles,
      q,
      delta,
      config.privacy.epsilon if private and noise is None else None,
      expert_layer,
      _model_options(
          config, phases, sparse_layers, expert_layer, shared_experts
      ),
      batch_size=batch_size,
      epochs=epochs,
  )
