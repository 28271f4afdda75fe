"""RAPTOR, its baselines and ablations as data: one plan, one training loop.

A `Plan` lists the phases of a training cycle. Each phase draws its own
Poisson sample (every record in with probability q) and makes one noisy
update of its parts. A part is a set of parameters with a clip norm, a noise
multiplier and a public denominator; an `owner` part holds the experts of
layer l*, where every record trains its owner's slice only.

  raptor           shared phase {attention adapters + head}, then expert
                   phase {owner slices of l*'s expert adapters} on an
                   independent sample (Alg. 1)
  baseline_a       RAPTOR's parameters, one clip, one sigma, denominator B
  baseline_b       the shared phase only
  baseline_c       the expert phase only
  monolithic       every weight, one clip, one sigma, denominator B
  monolithic_lora  adapters of attention and of every expert of every sparse
                   layer + head, one clip, one sigma
  nonprivate_lora  as monolithic_lora without clipping or noise
  nonprivate_full  as monolithic without clipping or noise

RAPTOR ablations are switches of `config.raptor` (denominator B, joint
clip, no alternation, no residual weight, layer choice).

Accounting follows what runs: a phase whose parts share one clip (or that has
one part) is one Poisson-sampled Gaussian per step with that sigma; a phase
that updates separately clipped parts from one sample is one Gaussian with
sigma_eff = (sum_g sigma_g^-2)^-1/2; phases compose sequentially.
"""

from __future__ import annotations

import dataclasses
import math

from raptor_jax import accounting, sampling

METHODS = ("raptor", "baseline_a", "baseline_b", "baseline_c", "monolithic",
           "monolithic_lora", "nonprivate_lora", "nonprivate_full")
SHARED_ROLES = ("attention_adapter", "head")
SHARED_FULL_ROLES = ("attention_kernel", "head")
ALL_ROLES = ("attention_kernel", "head", "expert_kernel", "router", "base")


@dataclasses.dataclass(frozen=True)
class Part:
  """Parameters updated together by one phase.

  Attributes:
    name: unique name ('shared', 'expert', 'all').
    roles: parameter roles (see `roles.py`).
    blocks: restrict to these blocks (None = every block).
    owner: per-record owner slices of the stacked experts (expert stream).
    l2_clip: clip norm C.
    noise_multiplier: sigma (0 for non-private methods).
    denominator: public constant the noisy sum is divided by.
    residual: multiply each record's gradient by its residual weight w_i
      before clipping (Eq. 8).
  """

  name: str
  roles: tuple[str, ...]
  blocks: tuple[int, ...] | None
  owner: bool
  l2_clip: float
  noise_multiplier: float
  denominator: float
  residual: bool = False


@dataclasses.dataclass(frozen=True)
class Phase:
  """One Poisson sample and one noisy update of its parts per cycle.

  Attributes:
    name: ledger stream name.
    stream: Poisson stream id (independent samples per id).
    parts: the parameter groups updated from this sample.
    joint_clip: clip each record's gradient over all parts together (the
      parts then share one l2_clip and one sigma).
    private: False for the non-private upper bounds (no clip, no noise).
  """

  name: str
  stream: int
  parts: tuple[Part, ...]
  joint_clip: bool = False
  private: bool = True

  @property
  def noise_multiplier(self) -> float:
    """The sigma of this phase's one Gaussian mechanism per step."""
    if self.joint_clip or len(self.parts) == 1:
      return self.parts[0].noise_multiplier
    return accounting.sigma_eff(*(p.noise_multiplier for p in self.parts))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything public about a run: phases, steps, sampling, budget."""

  method: str
  phases: tuple[Phase, ...]
  cycles: int
  sample_rate: float
  delta: float
  target_epsilon: float
  expert_layer: int
  model_options: dict

  def event(self):
    """The DpEvent of the whole planned run (None for non-private methods)."""
    if not all(p.private for p in self.phases):
      return None
    import dp_accounting  # pylint: disable=g-import-not-at-top
    return dp_accounting.ComposedDpEvent([
        accounting.dpsgd_event(noise_multiplier=p.noise_multiplier,
                               sample_rate=self.sample_rate, steps=self.cycles)
        for p in self.phases])


def _check(config, n: int) -> None:
  if config.method not in METHODS:
    raise ValueError(f"unknown method {config.method!r}; choose one of {', '.join(METHODS)}")
  if config.raptor.expert_denominator not in ("B/E", "B"):
    raise ValueError(f"raptor.expert_denominator must be 'B/E' or 'B', got "
                     f"{config.raptor.expert_denominator!r}")
  if config.raptor.residual not in ("shared", "full", "none"):
    raise ValueError(f"raptor.residual must be 'shared', 'full' or 'none', got "
                     f"{config.raptor.residual!r}")
  if not 0.0 < config.raptor.residual_gamma <= 1.0:
    raise ValueError(f"raptor.residual_gamma must be in (0, 1], got {config.raptor.residual_gamma}")
  if config.epochs < 1:
    raise ValueError(f"epochs must be >= 1, got {config.epochs}")
  if not config.learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {config.learning_rate}")
  for name in ("clip_shared", "clip_expert"):
    if not config.privacy[name] > 0:
      raise ValueError(f"privacy.{name} must be > 0, got {config.privacy[name]}")


def build_plan(config, *, n: int, num_experts: int, sparse_layers: tuple[int, ...],
               expert_layer: int) -> Plan:
  """Turns a config into phases with calibrated noise.

  Every private method is calibrated by the PLD accountant to the same
  (epsilon, delta) for the same number of cycles and the same sample rate.

  Args:
    config: the training ConfigDict.
    n: number of private training records.
    num_experts: E.
    sparse_layers: block indices of the sparse layers.
    expert_layer: the selected layer l*.

  Returns:
    The Plan.
  """
  _check(config, n)
  method, rc, pc = config.method, config.raptor, config.privacy
  q = config.batch_size / n
  sampling.check_sample_rate(q)
  cycles = config.epochs * accounting.steps_per_epoch(q)
  delta = pc.delta or accounting.default_delta(n)
  accounting.validate_delta(delta, n)
  eps = pc.epsilon
  b = float(config.batch_size)
  d_e = b / num_experts if rc.expert_denominator == "B/E" else b
  shared_roles = SHARED_FULL_ROLES if rc.shared_full_weights else SHARED_ROLES
  expert_roles = ("expert_kernel",) if rc.expert_full_weights else ("expert_adapter",)
  residual = rc.residual != "none"
  lora = dict(lora_rank=config.model.lora_rank, lora_alpha=config.model.lora_alpha,
              attention_lora=not rc.shared_full_weights, expert_lora_layers=(expert_layer,),
              dispatch="grouped")

  def dpsgd_sigma():
    return accounting.calibrate_dpsgd(target_epsilon=eps, delta=delta, sample_rate=q,
                                      steps=cycles)

  def shared(sigma, clip=pc.clip_shared, denominator=b):
    return Part("shared", shared_roles, None, False, clip, sigma, denominator)

  def expert(sigma, clip=pc.clip_expert):
    return Part("expert", expert_roles, (expert_layer,), True, clip, sigma, d_e, residual)

  if method == "raptor" and rc.joint_clip:
    sigma = dpsgd_sigma()
    phases = (Phase("joint", sampling.SHARED_STREAM,
                    (shared(sigma), expert(sigma, clip=pc.clip_shared)), joint_clip=True),)
  elif method == "raptor":
    s_sh, s_ex = accounting.calibrate_raptor(target_epsilon=eps, delta=delta, sample_rate=q,
                                            steps=cycles, rho=pc.rho, joint=not rc.alternate)
    if rc.alternate:
      phases = (Phase("shared", sampling.SHARED_STREAM, (shared(s_sh),)),
                Phase("expert", sampling.EXPERT_STREAM, (expert(s_ex),)))
    else:
      phases = (Phase("joint", sampling.SHARED_STREAM, (shared(s_sh), expert(s_ex))),)
  elif method == "baseline_b":
    phases = (Phase("shared", sampling.SHARED_STREAM, (shared(dpsgd_sigma()),)),)
  elif method == "baseline_c":
    phases = (Phase("expert", sampling.EXPERT_STREAM, (expert(dpsgd_sigma()),)),)
  elif method == "baseline_a":
    part = Part("all", shared_roles + expert_roles, None, False, pc.clip_shared,
                dpsgd_sigma(), b)
    phases = (Phase("dpsgd", sampling.SHARED_STREAM, (part,)),)
  else:  # monolithic and non-private variants
    private = not method.startswith("nonprivate")
    full = method in ("monolithic", "nonprivate_full")
    if full:
      lora = dict(lora_rank=0, attention_lora=False, expert_lora_layers=(), dispatch="dense")
      roles = ALL_ROLES
    else:
      lora.update(expert_lora_layers=tuple(sparse_layers))
      roles = ("attention_adapter", "head", "expert_adapter")
    part = Part("all", roles, None, False, pc.clip_shared, dpsgd_sigma() if private else 0.0, b)
    phases = (Phase("dpsgd" if private else "nonprivate", sampling.SHARED_STREAM, (part,),
                    private=private),)
  return Plan(method, phases, cycles, q, delta, eps, expert_layer, lora)


def noise_summary(plan: Plan) -> dict:
  """Per-part sigmas, clips and denominators (public; for the privacy report)."""
  return {part.name: dict(noise_multiplier=part.noise_multiplier, l2_clip=part.l2_clip,
                          denominator=part.denominator, phase=phase.name)
          for phase in plan.phases for part in phase.parts}


def steps_per_stream(plan: Plan) -> dict[str, int]:
  """How many noisy updates each part gets in the whole run."""
  return {part.name: plan.cycles for phase in plan.phases for part in phase.parts}


def is_private(plan: Plan) -> bool:
  return all(p.private for p in plan.phases)


def sigma_or_nan(plan: Plan, part_name: str) -> float:
  for phase in plan.phases:
    for part in phase.parts:
      if part.name == part_name:
        return part.noise_multiplier
  return math.nan
