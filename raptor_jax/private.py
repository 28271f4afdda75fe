"""The front door: a calibrated DP-SGD set-up in one call, like Opacus's.

``make_private`` takes (target epsilon, delta, n, expected batch size,
epochs, clip norm, a secret) and returns the optax transform
(``transforms.privatize_sums`` chained with your optimizer), a Poisson
microbatch iterator and an accountant whose ``epsilon()`` reports the spend;
``make_private_experts`` is the owner-aware variant for parameters stacked
per expert. Guarantee: the noise multiplier is calibrated (PLD accountant,
Poisson sampling, add/remove adjacency) so that the run's ``steps`` releases
spend at most the target at ``delta``, provided ``update`` gets each step's
sums clipped to ``l2_clip`` (``grads.clipped_grad_sum`` /
``grads.owner_clipped_grad_sum``). The Poisson seed and the 128-bit noise key
derive from the secret: a public seed would let anyone redraw the samples
and the noise. The names are also reachable as ``transforms.make_private``
etc.
"""

from typing import NamedTuple

import jax.numpy as jnp
import optax

from raptor_jax import _validate, transforms


class Accountant:
  """The privacy spent by a `make_private` run so far (PLD accountant).

  `PoissonMicrobatches` records one release per step it hands out, BEFORE
  the step runs (a step drawn but not applied is counted: the spend is never
  under-reported). `epsilon()` composes the steps recorded so far at the
  run's delta (`accounting.dpsgd_epsilon`).
  """

  def __init__(self, sample_rate: float, noise_multiplier: float, delta: float):
    from raptor_jax import ledger as ledger_lib  # pylint: disable=g-import-not-at-top

    self.sample_rate, self.noise_multiplier = sample_rate, noise_multiplier
    self.delta = delta
    self.ledger = ledger_lib.PrivacyLedger()

  @property
  def steps(self) -> int:
    return self.ledger.steps('dpsgd')

  def record_step(self) -> None:
    self.ledger.record(
        'dpsgd',
        sample_rate=self.sample_rate,
        noise_multiplier=self.noise_multiplier,
    )

  def epsilon(self) -> float:
    """Epsilon spent at `delta` by the steps handed out so far (0 before)."""
    return self.ledger.epsilon(self.delta) if self.steps else 0.0


class PoissonMicrobatches:
  """Each step's Poisson sample, cut into fixed-size padded microbatches.

  Iterating yields, for step t = 0 .. steps-1, the list of
  `sampling.Microbatch(indices, mask)` of `sampling.poisson_sample(n, q,
  seed, step=t)` (an empty list when the sample is empty: the step then
  releases noise only), and records the step in the accountant first.
  Iterate it again to redraw the same samples (a resumed run).
  """

  def __init__(
      self,
      n: int,
      sample_rate: float,
      steps: int,
      microbatch_size: int,
      seed: int,
      accountant: Accountant,
  ):
    self.n, self.sample_rate, self.steps = n, sample_rate, steps
    self.microbatch_size, self._seed = microbatch_size, seed
    self._accountant = accountant

  def __len__(self) -> int:
    return self.steps

  def step(self, t: int) -> list:
    """Step t's microbatches (recorded in the accountant)."""
    from raptor_jax import sampling  # pylint: disable=g-import-not-at-top

    self._accountant.record_step()
    sample = sampling.poisson_sample(
        self.n, self.sample_rate, seed=self._seed, step=t
    )
    return sampling.microbatches(sample, self.microbatch_size)

  def __iter__(self):
    for t in range(self.steps):
      yield self.step(t)


class PrivateTraining(NamedTuple):
  """What `make_private` returns: a calibrated DP-SGD setup.

  Attributes:
    tx: `privatize_sums` chained with your optimizer; `update` takes the
      step's clipped float32 sums (`grads.clipped_grad_sum`, or
      `grads.owner_clipped_grad_sum` for `make_private_experts`).
    microbatches: `PoissonMicrobatches`, one list of microbatches per step.
    accountant: `Accountant`; `accountant.epsilon()` is the spend so far.
    noise_multiplier: the calibrated sigma (public).
    steps: the number of noisy steps (epochs * ceil(n / B)).
    l2_clip: the clipping norm C the sums must be built with.
  """

  tx: optax.GradientTransformationExtraArgs
  microbatches: PoissonMicrobatches
  accountant: Accountant
  noise_multiplier: float
  steps: int
  l2_clip: float


def _derive(secret: bytes, label: str, size: int) -> bytes:
  import hashlib  # pylint: disable=g-import-not-at-top

  return hashlib.blake2b(label.encode(), key=secret, digest_size=size).digest()


def _sample_rate_and_steps(n, batch_size, epochs, delta) -> tuple[float, int]:
  """(q = B / n, steps = epochs * ceil(n / B)), the arguments validated."""
  from raptor_jax import accounting  # pylint: disable=g-import-not-at-top

  n = _validate.positive_int('n', n)
  batch_size = _validate.positive('batch_size', batch_size)
  _validate.check(
      batch_size <= n, 'batch_size', f'<= n = {n}', batch_size, 'lower it'
  )
  epochs = _validate.positive('epochs', epochs)
  accounting.validate_delta(delta, n)
  sample_rate = batch_size / n
  steps = max(1, round(epochs * accounting.steps_per_epoch(sample_rate)))
  return sample_rate, steps


def make_private(
    optimizer: optax.GradientTransformation,
    *,
    target_epsilon: float,
    delta: float,
    n: int,
    batch_size: float,
    epochs: float,
    l2_clip: float,
    secret: bytes,
    microbatch_size: int = 32,
    num_experts: int | None = None,
) -> PrivateTraining:
  """DP-SGD in one call, calibrated to a budget (Opacus's ``make_private_with_epsilon``).

  Guarantee: if every step's input to ``tx.update`` is the sum over that
  step's microbatches of per-record gradients clipped to ``l2_clip``
  (``grads.clipped_grad_sum`` with this ``l2_clip``, padding masked), the
  released parameters after all ``steps`` steps are
  ``(target_epsilon, delta)``-DP under add/remove of one record: each step
  is a Poisson-subsampled Gaussian mechanism (rate ``q = batch_size / n``,
  noise multiplier calibrated by ``accounting.calibrate_dpsgd``) and the
  accountant composes them. The Poisson seed and the 128-bit noise key derive
  from ``secret``: whoever has it can redraw the samples and the noise.

  Args:
    optimizer: applied to the privatized update (``optax.adam(1e-3)``).
    target_epsilon: the budget, > 0.
    delta: in (0, 1), below 1/n (``accounting.validate_delta``).
    n: the number of private records (public).
    batch_size: the expected batch size B (public): q = B / n and the noisy
      sum is divided by B, never by a realised count.
    epochs: training length in epochs; steps = epochs * ceil(n / B).
    l2_clip: the per-record clipping norm C.
    secret: >= 16 secret bytes, e.g. ``os.urandom(32)``.
    microbatch_size: rows per microbatch (memory only; no effect on privacy).
    num_experts: None, or E for owner sums (`make_private_experts`).

  Returns:
    A `PrivateTraining`.

  Example (the whole loop: README, "Use the DP transforms"):
    >>> import os, optax
    >>> from raptor_jax import transforms
    >>> private = transforms.make_private(
    ...     optax.sgd(0.1), target_epsilon=2.0, delta=1e-3, n=200,
    ...     batch_size=50, epochs=2, l2_clip=1.0, secret=os.urandom(32))
    >>> for microbatches in private.microbatches:  # sum clipped grads over
    ...   pass                                      # them, then tx.update
    >>> private.steps, private.accountant.epsilon() <= 2.0
    (8, True)
  """
  from raptor_jax import accounting  # pylint: disable=g-import-not-at-top

  sample_rate, steps = _sample_rate_and_steps(n, batch_size, epochs, delta)
  _validate.check(
      isinstance(secret, bytes) and len(secret) >= 16,
      'secret',
      '>= 16 secret bytes',
      _validate.Shown(f'a {type(secret).__name__}'),
      'pass os.urandom(32), kept secret (never a public seed)',
  )
  sigma = accounting.calibrate_dpsgd(
      target_epsilon=target_epsilon,
      delta=delta,
      sample_rate=sample_rate,
      steps=steps,
  )
  experts = 1 if num_experts is None else num_experts
  denominator = batch_size / _validate.positive_int('num_experts', experts)
  key = jnp.frombuffer(_derive(secret, 'noise', 16), jnp.uint32).reshape(2, 2)
  tx = optax.chain(
      transforms.privatize_sums(l2_clip, sigma, denominator, key), optimizer
  )
  seed = int.from_bytes(_derive(secret, 'poisson', 32), 'little')
  accountant = Accountant(sample_rate, sigma, delta)
  batches = PoissonMicrobatches(
      n, sample_rate, steps, microbatch_size, seed, accountant
  )
  return PrivateTraining(tx, batches, accountant, sigma, steps, float(l2_clip))


def make_private_experts(
    optimizer: optax.GradientTransformation, *, num_experts: int, **kwargs
) -> PrivateTraining:
  """`make_private` for parameters stacked per expert ``[E, ...]`` (Eq. 9).

  Each record trains only its owner expert's slice: feed ``tx.update`` the
  step's ``grads.owner_clipped_grad_sum`` (leaves ``[E, ...]``), which the
  transform noises per expert and divides by the public ``B / E``.

  Guarantee: as `make_private`'s, provided each record's owner is a function
  of that record alone, fixed for the run (e.g. the frozen pretrained
  router's choice): one record then changes one expert's slice of the sums
  by at most ``l2_clip``, so the ``[E, ...]`` release has the same
  sensitivity as one tree's and the same accountant applies (parallel
  composition over the owner groups, RAPTOR Lemma 1).

  Args:
    optimizer: the optimizer of the expert slices.
    num_experts: E (>= 1).
    **kwargs: `make_private`'s keyword arguments.
  """
  return make_private(optimizer, num_experts=num_experts, **kwargs)
