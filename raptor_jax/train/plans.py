"""A run's plan as data: its phases, their parts, and what is accounted.

`raptor_jax.train.methods` builds a `Plan` from a config (`build_plan`); this
module holds the plan's types, which need no config: a `Part` is a set of
parameters with a clip norm, a noise multiplier and a public denominator, a
`Phase` one Poisson sample and one noisy update of its parts per cycle, and a
`Plan` the phases of a run with its steps, sample rate and budget.
"""

from __future__ import annotations

import dataclasses

import dp_accounting

from raptor_jax import accounting


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
    joint_clip: clip each record's gradient over all parts (and `clip_with`)
      together, to the one l2_clip they all share; the parts share one sigma
      too (refused otherwise: the release is one Gaussian mechanism of
      sensitivity C, accounted with that sigma, so a part with a smaller
      sigma * C would be under-noised).
    private: False for the non-private upper bounds (no clip, no noise).
    clip_with: parts of another phase whose per-record gradient joins this
      phase's clip norm but is neither released nor updated here (the
      full-model clip with alternation); needs `joint_clip`.
  """

  name: str
  stream: int
  parts: tuple[Part, ...]
  joint_clip: bool = False
  private: bool = True
  clip_with: tuple[Part, ...] = ()

  def __post_init__(self):
    if self.clip_with and not self.joint_clip:
      raise ValueError(
          f"phase {self.name!r}: clip_with parts join the clip norm, which "
          "needs joint_clip=True"
      )
    if not self.joint_clip:
      return
    clips = sorted({p.l2_clip for p in self.parts + self.clip_with})
    sigmas = sorted({p.noise_multiplier for p in self.parts})
    if len(clips) > 1 or len(sigmas) > 1:
      raise ValueError(
          f"phase {self.name!r}: a joint clip is one Gaussian mechanism, but"
          f" its parts have l2_clip {clips} and noise_multiplier {sigmas};"
          " give every part (and clip_with part) the same l2_clip and its"
          " parts the same noise_multiplier, or set joint_clip=False"
      )

  @property
  def noise_multiplier(self) -> float:
    """The sigma of this phase's one Gaussian mechanism per step."""
    if self.joint_clip or len(self.parts) == 1:
      return self.parts[0].noise_multiplier
    return accounting.sigma_eff(*(p.noise_multiplier for p in self.parts))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything public about a run: phases, steps, sampling, budget.

  `target_epsilon` is None for the non-private methods. Every phase draws
  its own Poisson stream (refused otherwise): the ledger composes the phases
  as independent samples, which two phases of one stream are not.
  """

  method: str
  phases: tuple[Phase, ...]
  cycles: int
  sample_rate: float
  delta: float
  target_epsilon: float | None
  expert_layer: int
  model_options: dict
  # The expected batch size B and the epochs: the config's, or chosen from
  # n (`methods.run_sizes`); 0 where a plan is built by hand.
  batch_size: int = 0
  epochs: int = 0

  def __post_init__(self):
    streams = [phase.stream for phase in self.phases]
    if len(set(streams)) != len(streams):
      raise ValueError(
          f"plan {self.method!r}: phases {[p.name for p in self.phases]} share"
          f" a Poisson stream ({streams}), which the ledger would compose as"
          " independent samples; give every phase its own stream id"
      )

  @property
  def parts(self) -> tuple[Part, ...]:
    return tuple(part for phase in self.phases for part in phase.parts)

  def event(self) -> dp_accounting.DpEvent | None:
    """The DpEvent of the whole planned run (None for non-private methods):
    the ledger's event once every cycle is recorded."""
    if not is_private(self):
      return None
    return accounting.sequential_event(
        (p.noise_multiplier, self.sample_rate, self.cycles) for p in self.phases
    )


def noise_summary(plan: Plan) -> dict:
  """Per-part sigmas, clips and denominators (public; for the privacy report)."""
  return {
      part.name: dict(
          noise_multiplier=part.noise_multiplier,
          l2_clip=part.l2_clip,
          denominator=part.denominator,
          phase=phase.name,
      )
      for phase in plan.phases
      for part in phase.parts
  }


def is_private(plan: Plan) -> bool:
  """Whether the plan clips and adds noise in every phase (has an epsilon)."""
  return all(p.private for p in plan.phases)
