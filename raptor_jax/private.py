"""The front door: a calibrated DP-SGD set-up in one call, like Opacus's.

``make_private`` takes the private data (arrays with one leading record axis)
and (target epsilon, delta, expected batch size, epochs, clip norm, a secret),
and returns the optax transform (``transforms.privatize_sums`` chained with
your optimizer), the run's Poisson microbatches (rows of the data, padding
masked) and an accountant whose ``epsilon()`` reports the spend;
``make_private_experts`` is the owner-aware variant for parameters stacked
per expert. Guarantee: the noise multiplier is calibrated (PLD accountant,
Poisson sampling, add/remove adjacency) so that the run's ``steps`` releases
spend at most the target at ``delta``, provided ``update`` gets each step's
sums clipped to ``l2_clip`` (``grads.clipped_grad_sum`` /
``grads.owner_clipped_grad_sum``).

No use of these pieces breaks that guarantee silently (jax_privacy's rule:
a utility that can be configured to break its stated guarantee is a bug).
Each way to release more than the accountant counts is refused in one line:

* Iterating ``microbatches`` again. It spans every epoch already, so a
  second pass (an Opacus-style ``for epoch in ...`` loop around it) would
  release every Poisson sample again; ``from_step(t)`` resumes at step t.
* Releasing a sample again (``from_step`` before the last step handed out),
  unless ``make_private(..., allow_overspend=True)``: it then warns once, and
  the accountant counts the sample's releases as one mechanism
  (``accounting.replayed_event``), never as fresh steps.
* More ``tx.update`` calls than samples handed out: one update per
  microbatch, or the user's own batches. ``epsilon()`` refuses to report.
* Resuming at step t in a new process without the run's saved
  ``accountant.state_dict()``: the accountant would report the resumed part
  alone.
* ``n`` larger than the data: there is no ``n``. It is the data's record
  count, and the microbatches hold the data's own rows, so no index can fall
  outside it (jax arrays would silently read the last record).
* Two runs with one secret: each ``make_private`` call draws a fresh public
  nonce; the Poisson seed and the 128-bit noise key derive from (secret,
  nonce), so two runs never share samples or noise. A resumed run reuses its
  nonce from the saved state (and so its samples and noise). Resume a saved
  state once: two processes resumed from one state are one run forked, and
  share their later samples and noise.
"""

from collections.abc import Iterator, Mapping, Sequence
import hashlib
import os
from typing import Any, NamedTuple
import warnings

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import _validate, accounting, calibration, sampling, transforms

PyTree = Any

_FORMAT_VERSION = 1


class Accountant:
  """What a `make_private` run has released, and the epsilon it spent (PLD).

  Guarantee: `epsilon()` is never below the epsilon of what the run
  released, or it raises. It counts each Poisson sample when
  ``private.microbatches`` hands it out, BEFORE the step runs (a sample drawn
  but never applied is counted too), and a sample handed out k times as k
  releases of ONE sample (``accounting.replayed_event``: one Gaussian with
  sigma / sqrt(k) on the same sample, never k fresh steps). Every execution
  of ``tx.update`` reports itself (a host callback that carries nothing but
  the fact of the call). More updates than samples handed out (an update per
  microbatch, or batches not from ``private.microbatches``) are not the
  mechanism the noise was calibrated for: the spend cannot be bounded, and
  `epsilon()` and `state_dict()` raise from then on. (So run ``tx.update``
  once per step in one program: under ``pmap`` or ``shard_map`` every
  device's call counts; reduce the sums first, as ``privatize_sums`` asks.)

  Handing out more than the plan (each of ``steps`` samples once) raises
  before the sample leaves, unless the run opted in with
  ``allow_overspend=True``: then it warns once and counts every release.

  Save `state_dict()` with every checkpoint and pass it to
  ``make_private(..., resume=...)`` in the process that resumes: the
  accountant then continues from it and `epsilon()` covers the whole run.
  """

  def __init__(
      self,
      *,
      sample_rate: float,
      noise_multiplier: float,
      delta: float,
      target_epsilon: float,
      steps: int,
      nonce: str,
      allow_overspend: bool,
      released: Sequence[int] | None = None,
  ):
    self.sample_rate, self.noise_multiplier = sample_rate, noise_multiplier
    self.delta, self.target_epsilon = delta, target_epsilon
    self._nonce, self._allow_overspend = nonce, allow_overspend
    self._released = list(released) if released is not None else [0] * steps
    self._updates = sum(self._released)  # a restored run released each once
    self._refusal = None
    self._warned = False

  @property
  def steps(self) -> int:
    """Samples handed out so far, each counted as often as it was."""
    return sum(self._released)

  def epsilon(self) -> float:
    """Epsilon spent at ``delta`` by what was handed out so far (0 before).

    Raises:
      ValueError: ``tx.update`` ran more often than samples were handed out,
        so the spend cannot be bounded.
    """
    self._check_updates()
    if not self.steps:
      return 0.0
    return accounting.epsilon(self.event(), self.delta)

  def event(self) -> Any:
    """The ``dp_accounting.DpEvent`` of what was handed out so far."""
    return accounting.replayed_event(
        noise_multiplier=self.noise_multiplier,
        sample_rate=self.sample_rate,
        releases=self._released,
    )

  def state_dict(self) -> dict[str, Any]:
    """The run's privacy state, JSON-compatible: save it with a checkpoint.

    It holds the public settings, the per-step release counts and the run's
    nonce (public: the samples and the noise also need the secret).
    """
    self._check_updates()
    return {
        'version': _FORMAT_VERSION,
        'nonce': self._nonce,
        'sample_rate': self.sample_rate,
        'noise_multiplier': self.noise_multiplier,
        'delta': self.delta,
        'released': list(self._released),
    }

  def _hand_out(self, step: int) -> None:
    """Records step's sample, refusing a release past the plan."""
    self._check_updates()
    if self._released[step]:
      if not self._allow_overspend:
        fresh = [t for t, k in enumerate(self._released) if not k]
        where = (
            f'the first step not yet released is {fresh[0]}'
            if fresh
            else f'all {len(self._released)} planned steps are released'
        )
        raise ValueError(
            f"private.microbatches: step {step}'s Poisson sample was already"
            ' released, and releasing it again spends past the target'
            f' epsilon {self.target_epsilon:g}; {where} (resume with'
            ' private.microbatches.from_step(t)), or pass'
            ' make_private(..., allow_overspend=True) to release it again,'
            ' accounted'
        )
      if not self._warned:
        self._warned = True
        warnings.warn(
            f"make_private: step {step}'s Poisson sample is released again"
            ' (allow_overspend=True); epsilon() accounts every release and'
            f' will exceed the target {self.target_epsilon:g}',
            stacklevel=3,
        )
    self._released[step] += 1

  def _count_update(self) -> None:
    """Called by every executed ``tx.update`` (a host callback)."""
    self._updates += 1

  def _check_updates(self) -> None:
    """Raises, from now on, once updates outnumber the samples handed out."""
    jax.effects_barrier()  # every update dispatched so far has reported
    if self._refusal is None and self._updates > self.steps:
      if not self.steps:
        self._refusal = (
            f'tx.update: released {self._updates} noisy updates, but'
            ' private.microbatches handed out no Poisson sample, so the'
            ' spend cannot be accounted; build every step from'
            ' private.microbatches (the accountant covers only its samples)'
        )
      else:
        self._refusal = (
            f'tx.update: ran {self._updates} times while'
            f' private.microbatches handed out {self.steps} Poisson'
            f' sample{"s" if self.steps > 1 else ""}, so the spend cannot be'
            ' bounded; call it'
            " once per step on the sum of all the step's microbatches"
            ' (never once per microbatch), in a new make_private run'
        )
    if self._refusal is not None:
      raise ValueError(self._refusal)


class MaskedBatch(NamedTuple):
  """A fixed-size microbatch: rows of the data and their padding mask."""

  batch: PyTree  # the data's leaves, [microbatch_size, ...]
  mask: np.ndarray  # float32 [microbatch_size], 1 real, 0 padding


class PoissonMicrobatches:
  """The run's Poisson samples, one step at a time, in ONE pass.

  Iterating yields, for step t = 0 .. steps-1, the list of `MaskedBatch` of
  ``sampling.poisson_sample(n, q, seed, step=t)`` cut by
  ``sampling.microbatches`` (padding rows are record 0, masked; an empty list
  when the sample is empty: the step then releases noise only), and records
  the step in the accountant first. It spans every epoch: iterate it once;
  a second iteration raises. ``from_step(t)`` resumes at step t.
  """

  def __init__(
      self,
      data: PyTree,
      sample_rate: float,
      steps: int,
      microbatch_size: int,
      seed: int,
      accountant: Accountant,
  ):
    self.n = _records(data)
    self.sample_rate, self.steps = sample_rate, steps
    self.microbatch_size = sampling.check_microbatch_size(microbatch_size)
    self._data, self._seed, self._accountant = data, seed, accountant

  def __len__(self) -> int:
    return self.steps

  def __iter__(self) -> Iterator[list[MaskedBatch]]:
    if self._accountant.steps:
      raise ValueError(
          'private.microbatches: iterate it once; it already spans all'
          f' {self.steps} steps of every epoch, and a second pass would'
          ' release every Poisson sample again; to resume an interrupted'
          ' loop, iterate private.microbatches.from_step(t), t the first step'
          ' not applied'
      )
    return self.from_step(0)

  def from_step(self, step: int) -> Iterator[list[MaskedBatch]]:
    """Steps ``step .. steps-1``: a run resumed at ``step``.

    Every step before ``step`` must be in the accountant (handed out in this
    process, or restored by ``make_private(..., resume=saved)``): otherwise
    ``epsilon()`` would report the resumed part alone, and this raises.
    Resuming before the last step handed out releases those samples again
    (`Accountant`: refused unless ``allow_overspend=True``), accounted as
    releases with fresh noise: keep the current optimizer state, whose step
    count selects the noise (an older one redraws old noise, which is safe
    only for the same parameters and sums).

    Args:
      step: the first step to hand out, in [0, steps].

    Returns:
      An iterator over the steps' lists of `MaskedBatch`.
    """
    step = _validate.non_negative_int('step', step)
    _validate.check(
        step <= self.steps, 'step', f'<= steps = {self.steps}', step
    )
    missing = [t for t in range(step) if not self._accountant._released[t]]
    if missing:
      raise ValueError(
          f'private.microbatches.from_step({step}): {len(missing)} steps'
          f' before it (the first: {missing[0]}) are not in the accountant,'
          ' so epsilon() would report the resumed part alone; pass'
          ' make_private(..., resume=saved), saved ='
          ' private.accountant.state_dict() of the interrupted run'
      )
    return self._steps(step)

  def _steps(self, start: int) -> Iterator[list[MaskedBatch]]:
    for t in range(start, self.steps):
      self._accountant._hand_out(t)
      sample = sampling.poisson_sample(
          self.n, self.sample_rate, seed=self._seed, step=t
      )
      yield [
          MaskedBatch(
              jax.tree.map(lambda a: a[mb.indices], self._data), mb.mask
          )
          for mb in sampling.microbatches(sample, self.microbatch_size)
      ]


class PrivateTraining(NamedTuple):
  """What `make_private` returns: a calibrated DP-SGD setup.

  Attributes:
    tx: `privatize_sums` chained with your optimizer; `update` takes the
      step's clipped float32 sums (`grads.clipped_grad_sum`, or
      `grads.owner_clipped_grad_sum` for `make_private_experts`), once per
      step.
    microbatches: `PoissonMicrobatches`, one list of microbatches per step,
      every epoch in one pass.
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
  return hashlib.blake2b(label.encode(), key=secret, digest_size=size).digest()


def _records(data: PyTree) -> int:
  """n: the leading axis shared by every leaf of ``data`` (one line if not)."""
  leaves = jax.tree.leaves(data)
  shapes = [tuple(getattr(leaf, 'shape', ())) for leaf in leaves]
  _validate.check(
      bool(leaves) and all(shapes),
      'data',
      'a pytree of arrays with one leading record axis',
      _validate.Shown(
          f'leaves {sorted({type(leaf).__name__ for leaf in leaves})} of'
          f' shapes {sorted(set(shapes))}'
      ),
      "e.g. {'x': x[n, ...], 'y': y[n]} as numpy or jax arrays",
  )
  counts = sorted({shape[0] for shape in shapes})
  _validate.check(
      len(counts) == 1,
      'data',
      'arrays with one record count n (their leading axis)',
      _validate.Shown(f'leading axes {counts}'),
      'pass only per-record arrays, one row per record',
  )
  return _validate.int_at_least('data', counts[0], 2, 'n records, n >= 2')


def _report_updates(
    privatizer: optax.GradientTransformationExtraArgs, accountant: Accountant
) -> optax.GradientTransformationExtraArgs:
  """``privatizer`` whose every executed update reports to ``accountant``."""

  def update_fn(updates, state, params=None, **extra_args):
    io_callback(accountant._count_update, None, ordered=False)
    return privatizer.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(privatizer.init, update_fn)


def _restored(
    resume: Mapping[str, Any],
    sample_rate: float,
    sigma: float,
    delta: float,
    steps: int,
) -> tuple[str, list[int]]:
  """(nonce, released) of a saved state, checked against this run."""
  fix = "pass the interrupted run's private.accountant.state_dict(), unchanged"
  _validate.check(
      isinstance(resume, Mapping),
      'resume',
      'a dict from private.accountant.state_dict()',
      _validate.Shown(f'a {type(resume).__name__}'),
      fix,
  )
  _validate.one_of('resume version', resume.get('version'), (_FORMAT_VERSION,))
  saved = tuple(
      resume.get(key) for key in ('sample_rate', 'noise_multiplier', 'delta')
  )
  _validate.check(
      saved == (sample_rate, sigma, delta),
      'resume',
      'the state of a run with these settings (q, sigma, delta) ='
      f' {(sample_rate, sigma, delta)}',
      _validate.Shown(f'a state of {saved}'),
      "pass make_private the interrupted run's own arguments",
  )
  nonce, released = resume.get('nonce'), resume.get('released')
  _validate.check(
      isinstance(nonce, str) and len(nonce) == 32,
      'resume nonce',
      '32 hex digits',
      nonce,
      fix,
  )
  _validate.check(
      isinstance(released, list) and len(released) == steps,
      'resume released',
      f'a list of one release count per step ({steps} steps)',
      _validate.Shown(f'a {type(released).__name__}'),
      "pass make_private the interrupted run's own arguments",
  )
  return nonce, [
      _validate.non_negative_int('resume released', k) for k in released
  ]


def _sample_rate_and_steps(
    data: PyTree, batch_size: float, epochs: float, delta: float, secret: bytes
) -> tuple[float, int]:
  """(q = B / n, steps = epochs * ceil(n / B)), the arguments validated."""
  n = _records(data)
  batch_size = _validate.positive('batch_size', batch_size)
  _validate.check(
      batch_size <= n,
      'batch_size',
      f'<= n = {n} records',
      batch_size,
      'lower it',
  )
  epochs = _validate.positive('epochs', epochs)
  accounting.validate_delta(delta, n)
  _validate.check(
      isinstance(secret, bytes) and len(secret) >= 16,
      'secret',
      '>= 16 secret bytes',
      _validate.Shown(f'a {type(secret).__name__}'),
      'pass os.urandom(32), kept secret (never a public seed)',
  )
  sample_rate = batch_size / n
  return sample_rate, max(
      1, round(epochs * accounting.steps_per_epoch(sample_rate))
  )


def _accountant(
    *,
    sample_rate: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    allow_overspend: bool,
    resume: Mapping[str, Any] | None,
) -> Accountant:
  """The run's accountant: calibrated sigma, fresh or restored from resume."""
  _validate.check(
      isinstance(allow_overspend, bool),
      'allow_overspend',
      'True or False',
      allow_overspend,
  )
  sigma = calibration.calibrate_dpsgd(
      target_epsilon=target_epsilon,
      delta=delta,
      sample_rate=sample_rate,
      steps=steps,
  )
  nonce, released = os.urandom(16).hex(), None
  if resume is not None:
    nonce, released = _restored(resume, sample_rate, sigma, delta, steps)
  return Accountant(
      sample_rate=sample_rate,
      noise_multiplier=sigma,
      delta=delta,
      target_epsilon=target_epsilon,
      steps=steps,
      nonce=nonce,
      allow_overspend=allow_overspend,
      released=released,
  )


def _experts(num_experts: int | None) -> int:
  return _validate.positive_int(
      'num_experts', 1 if num_experts is None else num_experts
  )


def _assemble(
    optimizer: optax.GradientTransformation,
    data: PyTree,
    accountant: Accountant,
    *,
    secret: bytes,
    steps: int,
    l2_clip: float,
    denominator: float,
    microbatch_size: int,
) -> PrivateTraining:
  """The transform and the microbatches, keyed by (secret, the run's nonce)."""
  nonce = accountant._nonce  # pylint: disable=protected-access
  key = _derive(secret, f'noise/{nonce}', 16)
  privatizer = transforms.privatize_sums(
      l2_clip,
      accountant.noise_multiplier,
      denominator,
      jnp.frombuffer(key, jnp.uint32).reshape(2, 2),
  )
  tx = optax.chain(_report_updates(privatizer, accountant), optimizer)
  seed = int.from_bytes(_derive(secret, f'poisson/{nonce}', 32), 'little')
  batches = PoissonMicrobatches(
      data, accountant.sample_rate, steps, microbatch_size, seed, accountant
  )
  return PrivateTraining(
      tx, batches, accountant, accountant.noise_multiplier, steps, l2_clip
  )


def make_private(
    optimizer: optax.GradientTransformation,
    *,
    data: PyTree,
    target_epsilon: float,
    delta: float,
    batch_size: float,
    epochs: float,
    l2_clip: float,
    secret: bytes,
    microbatch_size: int = 32,
    num_experts: int | None = None,
    allow_overspend: bool = False,
    resume: Mapping[str, Any] | None = None,
) -> PrivateTraining:
  """DP-SGD in one call, calibrated to a budget (Opacus's ``make_private_with_epsilon``).

  Guarantee: if ``tx.update`` runs once per step, on the sum over the step's
  microbatches of per-record gradients clipped to ``l2_clip``
  (``grads.clipped_grad_sum``), the parameters after all ``steps`` steps
  are ``(target_epsilon, delta)``-DP under add/remove of one record (each
  step a Poisson-subsampled Gaussian, sigma from
  ``calibration.calibrate_dpsgd``). What would break this is refused (module
  docstring); ``accountant.epsilon()`` is never below what was released.

  Args:
    optimizer: applied to the privatized update (``optax.adam(1e-3)``).
    data: the private records: numpy or jax arrays (a pytree, owners and
      labels as leaves) with one leading record axis of public length n.
    target_epsilon: the budget, > 0.
    delta: in (0, 1), below 1/n (``accounting.validate_delta``).
    batch_size: the expected batch size B (public): the noisy sum is
      divided by B, never by a realised count.
    epochs: ``steps = epochs * ceil(n / B)``, in ONE pass of microbatches.
    l2_clip: the per-record clipping norm C.
    secret: >= 16 secret bytes, e.g. ``os.urandom(32)``; with a fresh nonce
      per call (in ``accountant.state_dict()``) it keys samples and noise.
    microbatch_size: rows per microbatch (memory only; no effect on privacy).
    num_experts: None, or E for owner sums (`make_private_experts`).
    allow_overspend: a sample released again warns once instead of raising;
      ``epsilon()`` then counts it and exceeds the target.
    resume: the interrupted run's ``accountant.state_dict()`` (same
      arguments and secret): its ledger, samples and noise continue; then
      iterate ``microbatches.from_step(t)``.

  Returns:
    A `PrivateTraining`.

  Example (the whole loop: README, "Use the DP transforms"):
    >>> import os, numpy as np, optax, raptor_jax
    >>> private = raptor_jax.make_private(
    ...     optax.sgd(0.1), data={'x': np.zeros((200, 3))}, target_epsilon=2.0,
    ...     delta=1e-3, batch_size=50, epochs=2, l2_clip=1.0,
    ...     secret=os.urandom(32))
    >>> for microbatches in private.microbatches:  # every epoch, one pass
    ...   pass  # sum the clipped grads of (batch, mask) in it, then update
    >>> private.steps, private.accountant.epsilon() <= 2.0
    (8, True)
  """
  sample_rate, steps = _sample_rate_and_steps(
      data, batch_size, epochs, delta, secret
  )
  accountant = _accountant(
      sample_rate=sample_rate,
      steps=steps,
      target_epsilon=target_epsilon,
      delta=delta,
      allow_overspend=allow_overspend,
      resume=resume,
  )
  return _assemble(
      optimizer,
      data,
      accountant,
      secret=secret,
      steps=steps,
      l2_clip=float(l2_clip),
      denominator=batch_size / _experts(num_experts),
      microbatch_size=microbatch_size,
  )


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
