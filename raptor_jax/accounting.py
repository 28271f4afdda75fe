"""Privacy accounting and noise calibration for RAPTOR's two streams.

Every mechanism this project runs is a Poisson-sampled Gaussian: each record
joins a step's batch independently with probability ``q`` (the sample rate),
its clipped gradient is summed, and Gaussian noise with standard deviation
``noise_multiplier * clip`` is added before division by a public constant. We
account such runs as ``dp_accounting`` events under add/remove-one adjacency
and compose them with privacy loss distributions (PLD, the same object as the
PRV composition of Gopi et al., 2021, used by the paper):

* Monolithic DP-SGD / DP-Adam: ``dpsgd_event`` (one stream).
* Alternating RAPTOR (SPEC 1.6): the shared and the expert stream draw
  independent Poisson samples, so the run is the sequential composition of two
  self-composed subsampled Gaussians (``raptor_event``). The ``E`` per-expert
  mechanisms of the expert stream act on disjoint owner groups and compose in
  parallel (paper Lemma 1), so the expert stream is ONE subsampled Gaussian
  with noise multiplier ``sigma_expert`` per step, not an ``E``-fold
  composition.
* One sample updating several parameter groups (the "w/o alternating"
  ablation): a record moves each group ``g`` by at most its clip, and each group
  gets independent noise ``sigma_g * clip_g``; whitening the noise shows the
  release is one Gaussian mechanism with noise multiplier
  ``sigma_eff = (sum_g sigma_g**-2) ** -0.5`` (``joint_event``). Adding the
  per-group epsilons instead is unjustified: the groups share one sample.

Events are composed by counts (``SelfComposedDpEvent``), never step by step.
``epsilon`` evaluates an event exactly as
``dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)`` does
(same calls in the same order, so the same float), but caches the PLD of each
Poisson-sampled Gaussian, which makes ledgers and calibration cheap. The PLDs
use pessimistic rounding, so every reported epsilon is an upper bound.

Calibration returns noise multipliers whose epsilon lies in
``[(1 - CALIBRATION_RTOL) * target, target]`` and is never above the target.
"""

from collections.abc import Callable, Iterator, Sequence
import functools
import math

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution

from raptor_jax import _validate

# Width of the PLD privacy-loss grid used for every reported epsilon. Rounding
# is pessimistic, so a coarser grid only overestimates epsilon; at 1e-4 the
# overestimate is below 1e-4 relative for epsilon >= 0.5 at paper scale.
VALUE_DISCRETIZATION_INTERVAL = 1e-4
# Calibrated noise gives epsilon within this relative distance below target.
CALIBRATION_RTOL = 1e-3
# Noise multipliers calibration searches over. Below 0.2 epsilon is in the
# hundreds at typical rates (no meaningful guarantee) and PLDs get huge.
NOISE_MULTIPLIER_RANGE = (0.2, 1e3)

# Calibration first searches on this coarser grid (10x cheaper), then refines
# on VALUE_DISCRETIZATION_INTERVAL starting next to the answer.
_COARSE_VALUE_DISCRETIZATION_INTERVAL = 1e-3
_MAX_LOG_STEP = math.log(3.0)
_MAX_EVALUATIONS = 60
_HINT = (
    'Raise target_epsilon or delta, or use fewer steps or a smaller'
    ' sample rate.'
)

_Mechanism = tuple[float, float, int]  # (sample_rate, noise_multiplier, count)


# Validation: one clear line per mistake (`_validate`); privacy parameters are
# never clamped.


def _check_rho(rho: float) -> None:
  _validate.probability(
      'rho',
      rho,
      "rho is the shared stream's share of the budget; the paper uses 0.9",
  )


def default_delta(n: int) -> float:
  """The default delta ``1 / n**1.1``: below ``1/n``, as DP requires."""
  n = _validate.int_at_least('n', n, 2, 'n is the dataset size')
  return 1.0 / n**1.1


def validate_delta(delta: float, n: int | None = None) -> None:
  """Raises ValueError unless ``0 < delta < 1`` and, given n, ``delta < 1/n``.

  A delta of ``1/n`` or more admits mechanisms that publish a random record in
  the clear, so callers that know the dataset size must pass it.

  Args:
    delta: the delta of the (epsilon, delta) guarantee.
    n: the number of private records, when known.
  """
  _validate.probability('delta', delta)
  if n is not None and delta >= 1.0 / n:
    _validate.fail(
        'delta',
        f'below 1/n = {1.0 / n:.3g} (n = {n})',
        delta,
        f'the default is 1/n**1.1 = {default_delta(n):.3g}',
    )


# Small helpers the trainer shares with the accountant.


def steps_per_epoch(sample_rate: float) -> int:
  """Cycles in one epoch, ``ceil(1 / sample_rate)`` (SPEC 1.8).

  ``1 / sample_rate`` is rounded to 9 decimals first so that a rate computed
  as ``B / n`` with ``n`` a multiple of ``B`` gives exactly ``n / B``.
  """
  _validate.sample_rate(sample_rate)
  return math.ceil(round(1.0 / sample_rate, 9))


def sigma_eff(*noise_multipliers: float) -> float:
  """Noise multiplier of one sample released through several noisy groups.

  Group ``g`` adds ``N(0, (sigma_g * clip_g)**2)`` to a sum in which one record
  moves it by at most ``clip_g``. Dividing group ``g`` by ``sigma_g * clip_g``
  makes the noise isotropic with unit variance and the sensitivity
  ``sqrt(sum_g sigma_g**-2)``: a single Gaussian mechanism with noise
  multiplier ``(sum_g sigma_g**-2) ** -0.5``.

  Args:
    *noise_multipliers: one positive noise multiplier per parameter group.

  Returns:
    The effective noise multiplier.
  """
  _validate.check(
      len(noise_multipliers) >= 1,
      'noise_multipliers',
      'at least one noise multiplier',
      noise_multipliers,
  )
  for sigma in noise_multipliers:
    _validate.positive('noise_multiplier', sigma)
  return math.fsum(sigma**-2 for sigma in noise_multipliers) ** -0.5


# DpEvents: the one description of what ran, for accountants and ledgers.


def dpsgd_event(
    *, noise_multiplier: float, sample_rate: float, steps: int
) -> dp_accounting.DpEvent:
  """``steps`` Poisson-sampled Gaussian releases with one noise multiplier.

  Args:
    noise_multiplier: noise std divided by the clip norm (sensitivity).
    sample_rate: Poisson inclusion probability ``q = B / n`` of every record.
    steps: number of releases.

  Returns:
    ``SelfComposed(PoissonSampled(q, Gaussian(noise_multiplier)), steps)``.
  """
  _validate.positive('noise_multiplier', noise_multiplier)
  _validate.sample_rate(sample_rate)
  _validate.positive_int('steps', steps)
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          float(sample_rate),
          dp_accounting.GaussianDpEvent(float(noise_multiplier)),
      ),
      int(steps),
  )


def joint_event(
    *, noise_multipliers: Sequence[float], sample_rate: float, steps: int
) -> dp_accounting.DpEvent:
  """``steps`` releases of several groups updated from ONE Poisson sample.

  Each step is one subsampled Gaussian with ``sigma_eff(*noise_multipliers)``
  (see ``sigma_eff``); the groups do not compose as separate mechanisms
  because a record enters all of them together or none.

  Args:
    noise_multipliers: the noise multiplier of every group the sample updates.
    sample_rate: Poisson inclusion probability of every record.
    steps: number of steps.

  Returns:
    ``SelfComposed(PoissonSampled(q, Gaussian(sigma_eff)), steps)``.
  """
  return dpsgd_event(
      noise_multiplier=sigma_eff(*noise_multipliers),
      sample_rate=sample_rate,
      steps=steps,
  )


def raptor_event(
    *,
    sigma_shared: float,
    sigma_expert: float,
    sample_rate: float,
    steps_shared: int,
    steps_expert: int,
    joint: bool = False,
) -> dp_accounting.DpEvent:
  """The DpEvent of a RAPTOR run (SPEC 1.6).

  Alternating (default): each cycle draws independent Poisson samples for the
  shared and the expert stream, so the streams compose sequentially. The
  expert stream is one subsampled Gaussian per step because its per-expert
  mechanisms act on disjoint owner groups (parallel composition, Lemma 1).

  Joint (``joint=True``, the "w/o alternating" ablation): one sample drives
  both streams each step, which is one Gaussian with ``sigma_eff``.

  Args:
    sigma_shared: noise multiplier of the shared stream.
    sigma_expert: noise multiplier of every expert of the expert stream.
    sample_rate: Poisson inclusion probability, the same for both streams.
    steps_shared: shared-stream steps.
    steps_expert: expert-stream steps; must equal ``steps_shared`` if joint.
    joint: whether one sample updates both streams.

  Returns:
    ``Composed[SelfComposed(PoissonSampled(q, Gaussian(sigma_shared)),
    steps_shared), SelfComposed(PoissonSampled(q, Gaussian(sigma_expert)),
    steps_expert)]``, or the ``joint_event`` of both sigmas.
  """
  if joint:
    _validate.check(
        steps_shared == steps_expert,
        'steps_expert',
        f'equal to steps_shared ({steps_shared}) when joint=True',
        steps_expert,
        'joint=True updates both streams from one sample each step',
    )
    return joint_event(
        noise_multipliers=(sigma_shared, sigma_expert),
        sample_rate=sample_rate,
        steps=steps_shared,
    )
  return dp_accounting.ComposedDpEvent(
      [
          dpsgd_event(
              noise_multiplier=sigma_shared,
              sample_rate=sample_rate,
              steps=steps_shared,
          ),
          dpsgd_event(
              noise_multiplier=sigma_expert,
              sample_rate=sample_rate,
              steps=steps_expert,
          ),
      ]
  )


# Epsilon of an event, with cached PLDs.


def _mechanisms(
    event: dp_accounting.DpEvent, count: int = 1
) -> Iterator[_Mechanism]:
  """The Poisson-sampled Gaussians of ``event``, in PLDAccountant's order."""
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    yield from _mechanisms(event.event, event.count * count)
  elif isinstance(event, dp_accounting.ComposedDpEvent):
    for sub_event in event.events:
      yield from _mechanisms(sub_event, count)
  elif isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
      event.event, dp_accounting.GaussianDpEvent
  ):
    yield (event.sampling_probability, event.event.noise_multiplier, count)
  else:
    raise TypeError(
        f'accounting.epsilon handles compositions of Poisson-sampled Gaussian'
        f' events only, got {type(event).__name__}; use'
        f' dp_accounting.pld.PLDAccountant for other mechanisms.'
    )


@functools.lru_cache(maxsize=32)
def _subsampled_gaussian_pld(
    sample_rate: float,
    noise_multiplier: float,
    value_discretization_interval: float,
) -> privacy_loss_distribution.PrivacyLossDistribution:
  return privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=noise_multiplier,
      value_discretization_interval=value_discretization_interval,
      sampling_prob=sample_rate,
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
  )


@functools.lru_cache(maxsize=8)
def _self_composed_pld(
    sample_rate: float,
    noise_multiplier: float,
    count: int,
    value_discretization_interval: float,
) -> privacy_loss_distribution.PrivacyLossDistribution:
  return _subsampled_gaussian_pld(
      sample_rate, noise_multiplier, value_discretization_interval
  ).self_compose(count)


def _epsilon(
    mechanisms: Sequence[_Mechanism],
    delta: float,
    value_discretization_interval: float,
) -> float:
  """Epsilon at ``delta`` of the sequential composition of ``mechanisms``."""
  pld = privacy_loss_distribution.identity(
      value_discretization_interval=value_discretization_interval
  )
  for sample_rate, noise_multiplier, count in mechanisms:
    if sample_rate == 0:
      continue
    if noise_multiplier == 0:
      return math.inf
    pld = pld.compose(
        _self_composed_pld(
            float(sample_rate),
            float(noise_multiplier),
            int(count),
            value_discretization_interval,
        )
    )
  return pld.get_epsilon_for_delta(delta)


def epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  """Epsilon at ``delta`` of ``event`` (add/remove adjacency, PLD accounting).

  Gives the same float as ``PLDAccountant(value_discretization_interval=
  VALUE_DISCRETIZATION_INTERVAL)`` composed with ``event``: an upper bound on
  the true epsilon (pessimistic discretization), adaptively composed. PLDs of
  recently seen mechanisms are cached, so repeated calls are cheap.

  Args:
    event: a composition (``ComposedDpEvent``, ``SelfComposedDpEvent``) of
      ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` events.
    delta: the target delta, in (0, 1).

  Returns:
    The smallest epsilon such that the run is (epsilon, delta)-DP.
  """
  validate_delta(delta)
  return _epsilon(
      tuple(_mechanisms(event)), delta, VALUE_DISCRETIZATION_INTERVAL
  )


def dpsgd_epsilon(
    *, noise_multiplier: float, sample_rate: float, steps: int, delta: float
) -> float:
  """Epsilon at ``delta`` of monolithic DP-SGD with Poisson sampling.

  Args:
    noise_multiplier: noise std divided by the clip norm.
    sample_rate: Poisson inclusion probability ``B / n``.
    steps: number of noisy steps.
    delta: the target delta, in (0, 1).

  Returns:
    Epsilon of ``dpsgd_event`` under add/remove adjacency.

  Example:
    >>> from raptor_jax import accounting
    >>> eps = accounting.dpsgd_epsilon(
    ...     noise_multiplier=1.1, sample_rate=0.01, steps=1000, delta=1e-5)
    >>> round(eps, 2)
    1.52
  """
  return epsilon(
      dpsgd_event(
          noise_multiplier=noise_multiplier,
          sample_rate=sample_rate,
          steps=steps,
      ),
      delta,
  )


def raptor_epsilon(
    *,
    sigma_shared: float,
    sigma_expert: float,
    sample_rate: float,
    steps_shared: int,
    steps_expert: int,
    delta: float,
    joint: bool = False,
) -> float:
  """Composed epsilon at ``delta`` of a RAPTOR run (see ``raptor_event``).

  Args:
    sigma_shared: noise multiplier of the shared stream.
    sigma_expert: noise multiplier of the expert stream.
    sample_rate: Poisson inclusion probability of both streams.
    steps_shared: shared-stream steps.
    steps_expert: expert-stream steps.
    delta: the target delta of the whole run, in (0, 1).
    joint: True if one sample updates both streams each step.

  Returns:
    Epsilon of the composed run under add/remove adjacency.
  """
  return epsilon(
      raptor_event(
          sigma_shared=sigma_shared,
          sigma_expert=sigma_expert,
          sample_rate=sample_rate,
          steps_shared=steps_shared,
          steps_expert=steps_expert,
          joint=joint,
      ),
      delta,
  )


# Calibration.


def _search(
    epsilon_of: Callable[[float], float],
    target: float,
    *,
    x0: float,
    slope: float,
    name: str,
    hint: str,
) -> tuple[float, float]:
  """Finds a noise multiplier x with ``(1-rtol)*target <= eps(x) <= target``.

  ``epsilon_of`` decreases in x and is close to a power law, so we take secant
  steps on log epsilon against log x (capped at a factor 3 per step) until the
  target is bracketed, then Illinois regula falsi, aiming at the middle of the
  tolerance window. Only an evaluated point inside the window is returned.

  Args:
    epsilon_of: epsilon as a function of the noise multiplier.
    target: the target epsilon.
    x0: the first noise multiplier to try.
    slope: a guess of d log(epsilon) / d log(x) (negative).
    name: what x is, for error messages.
    hint: what the user can change if the target is unreachable.

  Returns:
    The noise multiplier and the last secant slope (a guess for a refinement).
  """
  lower, upper = (math.log(x) for x in NOISE_MULTIPLIER_RANGE)
  aim = math.log1p(-CALIBRATION_RTOL / 2)
  bracket_end = previous = None  # (log x, log(eps/target) - aim)
  u = min(max(math.log(x0), lower), upper)
  for _ in range(_MAX_EVALUATIONS):
    eps = epsilon_of(math.exp(u))
    if (1 - CALIBRATION_RTOL) * target <= eps <= target:
      return math.exp(u), slope
    if eps > target:
      h = math.log(eps / target) - aim if eps < math.inf else math.inf
    else:
      h = math.log(eps / target) - aim if eps > 0 else -math.inf
    if (
        previous is not None
        and u != previous[0]
        and math.isfinite(h + previous[1])
    ):
      secant = (h - previous[1]) / (u - previous[0])
      slope = secant if secant < 0 else slope
    if previous is not None and h * previous[1] < 0:
      bracket_end = previous
    elif bracket_end is not None:
      bracket_end = (bracket_end[0], bracket_end[1] / 2)  # Illinois.
    previous = (u, h)
    if bracket_end is not None:
      (ua, ha), (ub, hb) = bracket_end, previous
      finite = math.isfinite(ha + hb)
      u = (ua * hb - ub * ha) / (hb - ha) if finite else (ua + ub) / 2
      continue
    step = -h / slope if math.isfinite(h) else math.copysign(math.log(2), h)
    step = min(max(step, -_MAX_LOG_STEP), _MAX_LOG_STEP)
    new_u = min(max(u + step, lower), upper)
    if new_u == u:
      if h > 0:
        raise ValueError(
            f'epsilon {target:.4g} is unreachable: even {name}='
            f'{math.exp(u):.4g} (the largest searched) gives epsilon'
            f' {eps:.4g}. {hint}'
        )
      raise ValueError(
          f'epsilon {target:.4g} is too large to calibrate: {name}='
          f'{math.exp(u):.4g} (the smallest searched) already gives epsilon'
          f' {eps:.4g}; ask for a smaller epsilon.'
      )
    u = new_u
  raise RuntimeError(f'calibration of {name} did not converge; please report.')


def _check_reachable(target: float, least_epsilon: float) -> None:
  """Raises if even the most noise searched spends more than ``target``."""
  if least_epsilon > target:
    raise ValueError(
        f'target_epsilon={target:.4g} is unreachable: even noise multipliers'
        f' of {NOISE_MULTIPLIER_RANGE[1]:g} give epsilon {least_epsilon:.4g},'
        f' the smallest feasible. {_HINT}'
    )


def _calibrate(
    epsilon_at: Callable[[float, float], float],
    target: float,
    name: str,
    hint: str,
) -> float:
  """Runs ``_search`` on the coarse grid, then refines on the reported one."""
  x, slope = 1.0, -1.0
  for interval in (
      _COARSE_VALUE_DISCRETIZATION_INTERVAL,
      VALUE_DISCRETIZATION_INTERVAL,
  ):
    x, slope = _search(
        functools.partial(epsilon_at, interval),
        target,
        x0=x,
        slope=slope,
        name=name,
        hint=hint,
    )
  return x


@functools.lru_cache(maxsize=256)  # pure in its (hashable) arguments
def calibrate_dpsgd(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int
) -> float:
  """Noise multiplier that spends ``target_epsilon`` in ``steps`` DP-SGD steps.

  Args:
    target_epsilon: the budget, > 0.
    delta: the target delta, in (0, 1) (below 1/n; see ``validate_delta``).
    sample_rate: Poisson inclusion probability, in (0, 1].
    steps: number of noisy steps, >= 1.

  Returns:
    ``sigma`` with ``dpsgd_epsilon(sigma) <= target_epsilon`` and at least
    ``(1 - CALIBRATION_RTOL) * target_epsilon``.
  """
  _validate.positive('target_epsilon', target_epsilon)
  validate_delta(delta)
  _validate.sample_rate(sample_rate)
  _validate.positive_int('steps', steps)

  def epsilon_at(interval: float, sigma: float) -> float:
    return _epsilon(((sample_rate, sigma, steps),), delta, interval)

  _check_reachable(
      target_epsilon,
      epsilon_at(VALUE_DISCRETIZATION_INTERVAL, NOISE_MULTIPLIER_RANGE[1]),
  )
  return _calibrate(epsilon_at, target_epsilon, 'noise_multiplier', _HINT)


@functools.lru_cache(maxsize=256)  # pure in its (hashable) arguments
def calibrate_raptor(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    rho: float = 0.9,
    joint: bool = False,
) -> tuple[float, float]:
  """Noise multipliers of both streams for a RAPTOR run (SPEC 1.7).

  For a scale ``t``, ``sigma_shared(t)`` gives the shared stream alone epsilon
  ``rho * t`` and ``sigma_expert(t)`` the expert stream alone ``(1 - rho) * t``,
  each at ``delta / 2``. At ``t = target_epsilon`` the run is already
  (target, delta)-DP by basic composition; we search ``t`` so that the
  *composed* epsilon at ``delta`` meets the target, which lowers both sigmas.
  (We search over ``sigma_shared``, which determines ``t``, so the expensive
  stream is evaluated once per step.)

  Args:
    target_epsilon: the budget of the whole run, > 0.
    delta: the target delta of the whole run, in (0, 1), below 1/n.
    sample_rate: Poisson inclusion probability of both streams.
    steps: cycles; each cycle runs one shared and one expert step.
    rho: the shared stream's share of the budget, in (0, 1).
    joint: calibrate the one-sample variant (``raptor_event(joint=True)``).

  Returns:
    ``(sigma_shared, sigma_expert)`` whose ``raptor_epsilon`` at ``delta`` is
    at most ``target_epsilon`` and at least ``(1 - CALIBRATION_RTOL)`` of it.
  """
  _validate.positive('target_epsilon', target_epsilon)
  validate_delta(delta)
  _validate.sample_rate(sample_rate)
  _validate.positive_int('steps', steps)
  _check_rho(rho)

  _check_reachable(
      target_epsilon,
      _raptor_spent(
          (NOISE_MULTIPLIER_RANGE[1], NOISE_MULTIPLIER_RANGE[1]),
          sample_rate=sample_rate,
          steps=steps,
          delta=delta,
          joint=joint,
      ),
  )
  composed_at, sigma_expert = _composed_epsilon(
      sample_rate=sample_rate, steps=steps, delta=delta, rho=rho, joint=joint
  )
  sigma_shared = _calibrate(composed_at, target_epsilon, 'sigma_shared', _HINT)
  sigmas = (
      sigma_shared,
      sigma_expert[VALUE_DISCRETIZATION_INTERVAL, sigma_shared],
  )
  spent = _raptor_spent(
      sigmas, sample_rate=sample_rate, steps=steps, delta=delta, joint=joint
  )
  if spent > target_epsilon:
    raise RuntimeError(
        f'calibrated sigmas {sigmas} spend epsilon {spent} > target'
        f' {target_epsilon}; this is a bug, please report.'
    )
  return sigmas


def _raptor_spent(
    sigmas: tuple[float, float],
    *,
    sample_rate: float,
    steps: int,
    delta: float,
    joint: bool,
) -> float:
  """``raptor_epsilon`` of ``(sigma_shared, sigma_expert)``, ``steps`` each."""
  return raptor_epsilon(
      sigma_shared=sigmas[0],
      sigma_expert=sigmas[1],
      sample_rate=sample_rate,
      steps_shared=steps,
      steps_expert=steps,
      delta=delta,
      joint=joint,
  )


def _composed_epsilon(
    *,
    sample_rate: float,
    steps: int,
    delta: float,
    rho: float,
    joint: bool,
) -> tuple[Callable[[float, float], float], dict]:
  """The composed epsilon as a function of ``sigma_shared`` (SPEC 1.7).

  ``sigma_shared`` fixes the scale ``t`` (its stream alone spends ``rho * t``
  at ``delta / 2``); an inner search finds the ``sigma_expert`` whose stream
  alone spends ``(1 - rho) * t``, warm-started from the previous call.

  Returns:
    ``(composed_at, sigma_expert)``: ``composed_at(interval, sigma_shared)``
    is the epsilon at ``delta`` of both streams composed, and records the
    inner result in ``sigma_expert[interval, sigma_shared]``.
  """

  def stream_epsilon(interval: float, sigma: float) -> float:
    return _epsilon(((sample_rate, sigma, steps),), delta / 2, interval)

  sigma_expert = {}  # (interval, sigma_shared) -> sigma_expert
  expert_guess, expert_slope = 1.0, -1.0  # Warm start of the inner search.

  def composed_at(interval: float, sigma_shared: float) -> float:
    nonlocal expert_guess, expert_slope
    scale = stream_epsilon(interval, sigma_shared) / rho
    expert_guess, expert_slope = _search(
        functools.partial(stream_epsilon, interval),
        (1 - rho) * scale,
        x0=expert_guess,
        slope=expert_slope,
        name='sigma_expert',
        hint="This is the expert stream's share: lower rho.",
    )
    sigma_expert[interval, sigma_shared] = expert_guess
    if joint:
      mechanisms = (
          (sample_rate, sigma_eff(sigma_shared, expert_guess), steps),
      )
    else:
      mechanisms = (
          (sample_rate, sigma_shared, steps),
          (sample_rate, expert_guess, steps),
      )
    return _epsilon(mechanisms, delta, interval)

  return composed_at, sigma_expert
