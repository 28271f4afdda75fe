"""Noise calibration: the noise multipliers that spend a target epsilon.

``calibrate_dpsgd`` (one stream) and ``calibrate_raptor`` (RAPTOR's two
streams, budget split ``rho``; method section 1.7 of docs/method.md) search
the noise multiplier(s) whose epsilon, evaluated by ``raptor_jax.accounting``
(PLD, pessimistic rounding), lies in ``[(1 - CALIBRATION_RTOL) * target,
target]``. Only an evaluated point inside that window is returned, so a
calibrated run never spends more than its target; an unreachable target is
refused in one line, never clamped.

A calibration takes seconds (dp_accounting builds each PLD point by point),
so its results are also kept on disk (`accounting.set_cache_directory`;
the trainer uses `accounting/` inside its compilation cache). A result read
back is used only after the accountant certifies it afresh: its epsilon,
computed now, lies in the same window. The file can make a run
recalibrate, never spend more than its target.
"""

from collections.abc import Callable
import functools
import math

from raptor_jax import _validate, accounting  # pylint: disable=g-multiple-import

# Calibration first searches on this coarser grid (10x cheaper), then refines
# on VALUE_DISCRETIZATION_INTERVAL starting next to the answer.
_COARSE_VALUE_DISCRETIZATION_INTERVAL = 1e-3
_MAX_LOG_STEP = math.log(3.0)
_MAX_EVALUATIONS = 60
_HINT = (
    'Raise target_epsilon or delta, or use fewer steps or a smaller'
    ' sample rate.'
)


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
  lower, upper = (math.log(x) for x in accounting.NOISE_MULTIPLIER_RANGE)
  aim = math.log1p(-accounting.CALIBRATION_RTOL / 2)
  bracket_end = previous = None  # (log x, log(eps/target) - aim)
  u = min(max(math.log(x0), lower), upper)
  for _ in range(_MAX_EVALUATIONS):
    eps = epsilon_of(math.exp(u))
    if (1 - accounting.CALIBRATION_RTOL) * target <= eps <= target:
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
        f' of {accounting.NOISE_MULTIPLIER_RANGE[1]:g} give epsilon'
        f' {least_epsilon:.4g},'
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
      accounting.VALUE_DISCRETIZATION_INTERVAL,
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


def _in_window(spent: float, target: float) -> bool:
  return (1 - accounting.CALIBRATION_RTOL) * target <= spent <= target


def _remembered(certify: Callable[..., bool]):
  """Keeps a calibration's results on disk; a result read back is returned
  only if `certify(result, **kwargs)`, which recomputes its epsilon."""

  def wrap(calibrate):
    @functools.wraps(calibrate)
    def remembered(**kwargs):
      path = accounting.cache_entry(calibrate.__name__, kwargs)
      stored = accounting.cache_read(path)
      if isinstance(stored, list):
        stored = tuple(stored)
      valid = isinstance(stored, (float, tuple)) and all(
          isinstance(x, float)
          and accounting.NOISE_MULTIPLIER_RANGE[0]
          <= x
          <= accounting.NOISE_MULTIPLIER_RANGE[1]
          for x in (stored if isinstance(stored, tuple) else (stored,))
      )
      if valid and certify(stored, **kwargs):
        return stored
      result = calibrate(**kwargs)
      accounting.cache_write(path, result)
      return result

    return remembered

  return wrap


def _dpsgd_certified(
    sigma: float, *, target_epsilon, delta, sample_rate, steps
):
  if not isinstance(sigma, float):
    return False
  spent = accounting.epsilon_of_mechanisms(
      ((sample_rate, sigma, steps),),
      delta,
      accounting.VALUE_DISCRETIZATION_INTERVAL,
  )
  return _in_window(spent, target_epsilon)


@functools.lru_cache(maxsize=256)  # pure in its (hashable) arguments
@_remembered(_dpsgd_certified)
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
  accounting.validate_delta(delta)
  _validate.sample_rate(sample_rate)
  _validate.positive_int('steps', steps)

  def epsilon_at(interval: float, sigma: float) -> float:
    return accounting.epsilon_of_mechanisms(
        ((sample_rate, sigma, steps),), delta, interval
    )

  _check_reachable(
      target_epsilon,
      epsilon_at(
          accounting.VALUE_DISCRETIZATION_INTERVAL,
          accounting.NOISE_MULTIPLIER_RANGE[1],
      ),
  )
  return _calibrate(epsilon_at, target_epsilon, 'noise_multiplier', _HINT)


def _raptor_certified(
    sigmas, *, target_epsilon, delta, sample_rate, steps, rho=0.9, joint=False
):
  del rho  # the split is the search's; the guarantee is the composed spend
  if not isinstance(sigmas, tuple) or len(sigmas) != 2:
    return False
  spent = _raptor_spent(
      sigmas, sample_rate=sample_rate, steps=steps, delta=delta, joint=joint
  )
  return _in_window(spent, target_epsilon)


@functools.lru_cache(maxsize=256)  # pure in its (hashable) arguments
@_remembered(_raptor_certified)
def calibrate_raptor(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    rho: float = 0.9,
    joint: bool = False,
) -> tuple[float, float]:
  """Noise multipliers of both streams for a RAPTOR run (docs/method.md 1.7).

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
  accounting.validate_delta(delta)
  _validate.sample_rate(sample_rate)
  _validate.positive_int('steps', steps)
  accounting.check_rho(rho)

  _check_reachable(
      target_epsilon,
      _raptor_spent(
          (
              accounting.NOISE_MULTIPLIER_RANGE[1],
              accounting.NOISE_MULTIPLIER_RANGE[1],
          ),
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
      sigma_expert[accounting.VALUE_DISCRETIZATION_INTERVAL, sigma_shared],
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
  return accounting.raptor_epsilon(
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
  """The composed epsilon as a function of ``sigma_shared`` (docs/method.md 1.7).

  ``sigma_shared`` fixes the scale ``t`` (its stream alone spends ``rho * t``
  at ``delta / 2``); an inner search finds the ``sigma_expert`` whose stream
  alone spends ``(1 - rho) * t``, warm-started from the previous call.

  Returns:
    ``(composed_at, sigma_expert)``: ``composed_at(interval, sigma_shared)``
    is the epsilon at ``delta`` of both streams composed, and records the
    inner result in ``sigma_expert[interval, sigma_shared]``.
  """

  def stream_epsilon(interval: float, sigma: float) -> float:
    return accounting.epsilon_of_mechanisms(
        ((sample_rate, sigma, steps),), delta / 2, interval
    )

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
          (
              sample_rate,
              accounting.sigma_eff(sigma_shared, expert_guess),
              steps,
          ),
      )
    else:
      mechanisms = (
          (sample_rate, sigma_shared, steps),
          (sample_rate, expert_guess, steps),
      )
    return accounting.epsilon_of_mechanisms(mechanisms, delta, interval)

  return composed_at, sigma_expert
