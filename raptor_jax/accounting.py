"""Privacy accounting and noise calibration for RAPTOR's two streams.

Every mechanism this project runs is a Poisson-sampled Gaussian: each record
joins a step's batch independently with probability ``q`` (the sample rate),
its clipped gradient is summed, and Gaussian noise with standard deviation
``noise_multiplier * clip`` is added before division by a public constant. We
account such runs as ``dp_accounting`` events under add/remove-one adjacency
and compose them with privacy loss distributions (PLD, the same object as the
PRV composition of Gopi et al., 2021, used by the paper):

* Monolithic DP-SGD / DP-Adam: ``dpsgd_event`` (one stream).
* Alternating RAPTOR (docs/method.md §1.6): the shared and the expert stream draw
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
* One Poisson sample released ``k`` times with fresh noise (an epoch
  replayed): by the same whitening, one subsampled Gaussian with
  ``noise_multiplier / sqrt(k)`` (``replayed_event``), never ``k`` fresh
  steps.

Events are composed by counts (``SelfComposedDpEvent``), never step by step.
``epsilon`` evaluates an event exactly as
``dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)`` does
(same calls in the same order, so the same float), but caches the PLD of each
Poisson-sampled Gaussian, which makes ledgers and calibration cheap. The PLDs
use pessimistic rounding, so every reported epsilon is an upper bound.

Calibration (``raptor_jax.calibration``, built on this module) returns noise
multipliers
whose epsilon lies in ``[(1 - CALIBRATION_RTOL) * target, target]`` and is
never above the target.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence
import functools
import hashlib
from importlib import metadata
import json
import math
import os
from pathlib import Path
import tempfile

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


_Mechanism = tuple[float, float, int]  # (sample_rate, noise_multiplier, count)


# Validation: one clear line per mistake (`_validate`); privacy parameters are
# never clamped.


def check_rho(rho: float) -> None:
  """Refuses, in one line, a budget split ``rho`` outside [0, 1]."""
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
  """Cycles in one epoch, ``ceil(1 / sample_rate)`` (docs/method.md §1.8).

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


def sequential_event(
    runs: Iterable[tuple[float, float, int]],
) -> dp_accounting.DpEvent:
  """Runs on independent Poisson samples, one after another.

  Args:
    runs: ``(noise_multiplier, sample_rate, steps)`` of each run, in order.

  Returns:
    ``Composed[dpsgd_event(...) of each run]``.
  """
  return dp_accounting.ComposedDpEvent(
      [
          dpsgd_event(noise_multiplier=sigma, sample_rate=q, steps=steps)
          for sigma, q, steps in runs
      ]
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


def replayed_event(
    *,
    noise_multiplier: float,
    sample_rate: float,
    releases: Sequence[int],
) -> dp_accounting.DpEvent:
  """Poisson samples, sample ``t`` released ``releases[t]`` times.

  A replayed epoch (the same Poisson samples iterated again, each release
  with fresh noise) is NOT ``sum(releases)`` fresh steps: a record that is
  in sample ``t`` is in all of its releases. The ``k`` releases of one
  sample, each the Gaussian mechanism with sensitivity C and independent
  noise ``noise_multiplier * C``, are together the Gaussian mechanism with
  noise multiplier ``noise_multiplier / sqrt(k)`` (``sigma_eff`` of ``k``
  copies; Gaussian mechanisms compose this way adaptively too), applied to
  one Poisson sample of rate ``q``. Accounting them as ``k`` fresh samples
  under-reports: 50 samples released 5 times each at the sigma calibrated
  to epsilon 2 for 50 steps spend 8.43 at delta 1e-5, not the 4.55 of 250
  fresh steps. Samples released 0 times spend nothing.

  Args:
    noise_multiplier: noise std divided by the clip norm, of every release.
    sample_rate: Poisson inclusion probability ``q`` of every sample.
    releases: per sample, how many times it was released (>= 0 each).

  Returns:
    The composition, over the distinct counts ``k >= 1``, of
    ``dpsgd_event(noise_multiplier / sqrt(k), q, steps=#{t: releases[t]=k})``.
  """
  by_count = {}
  for k in releases:
    by_count[k] = by_count.get(k, 0) + 1
  return sequential_event(
      (noise_multiplier / math.sqrt(k), sample_rate, samples)
      for k, samples in sorted(by_count.items())
      if _validate.non_negative_int('releases', k) > 0
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
  """The DpEvent of a RAPTOR run (docs/method.md §1.6).

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
  return sequential_event(
      [
          (sigma_shared, sample_rate, steps_shared),
          (sigma_expert, sample_rate, steps_expert),
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


def epsilon_of_mechanisms(
    mechanisms: Sequence[_Mechanism],
    delta: float,
    value_discretization_interval: float,
) -> float:
  """Epsilon at ``delta`` of the sequential composition of ``mechanisms``.

  Args:
    mechanisms: ``(sample_rate, noise_multiplier, count)`` triples, each a
      Poisson-sampled Gaussian composed ``count`` times (PLDs cached).
    delta: the target delta.
    value_discretization_interval: the PLD grid (pessimistic rounding, so
      the result is an upper bound; calibration searches on a coarser one).
  """
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


# Results kept on disk: calibrations (re-certified when read) and the
# epsilons of progress logs.

_CACHE_DIRECTORY: Path | None = None


def set_cache_directory(directory: str | os.PathLike | None) -> None:
  """Keeps calibrations and logged epsilons in `directory` (None: off).

  An entry holds a hash of its arguments and a result: numbers of the
  public plan (target epsilon, delta, sample rate, steps, rho, noise
  multipliers), nothing of the data beyond what the plan states.
  """
  global _CACHE_DIRECTORY
  _CACHE_DIRECTORY = None if directory is None else Path(directory)


def cache_entry(name: str, arguments) -> Path | None:
  """The file of `name(arguments)`, keyed also by this module's and
  calibration's code and dp_accounting's version (a change recomputes);
  None when the cache is off."""
  if _CACHE_DIRECTORY is None:
    return None
  here = Path(__file__)
  code = hashlib.sha256()
  for module in (here, here.with_name('calibration.py')):
    code.update(module.read_bytes())
  key = json.dumps(
      [name, arguments, metadata.version('dp-accounting'), code.hexdigest()],
      sort_keys=True,
  )
  return _CACHE_DIRECTORY / f'{hashlib.sha256(key.encode()).hexdigest()}.json'


def cache_read(path: Path | None):
  """The result stored at `path`, or None (no cache, no entry, unreadable)."""
  try:
    return json.loads(path.read_text())['result']
  except (AttributeError, OSError, ValueError, KeyError, TypeError):
    return None


def cache_write(path: Path | None, result) -> None:
  """Writes atomically; a cache that cannot be written is skipped."""
  if path is None:
    return
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        'w', dir=path.parent, suffix='.tmp', delete=False
    ) as f:
      json.dump({'result': result}, f)
    os.replace(f.name, path)
  except OSError:
    pass


def logged_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  """``epsilon(event, delta)``, kept in the cache: for progress logs only.

  A run logs the spend every few cycles, each a fresh composition (0.34 s
  in the README tiny run, 25 of them); a rerun of the same plan reads them
  back. A value read back is
  not recomputed, so anything that certifies a release (calibration, the
  privacy card, results.json) calls ``epsilon``.
  """
  mechanisms = tuple(_mechanisms(event))
  path = cache_entry(
      'epsilon', [mechanisms, delta, VALUE_DISCRETIZATION_INTERVAL]
  )
  stored = cache_read(path)
  if isinstance(stored, float):
    return stored
  value = epsilon(event, delta)
  cache_write(path, value)
  return value


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
  return epsilon_of_mechanisms(
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
