"""Host-side Poisson sampling and padding to fixed-size microbatches.

Privacy amplification by subsampling, as the accountant models it, needs
*Poisson* sampling: every record joins a step's sample independently with
probability ``q``, so the realised sample size is random. Shuffled fixed-size
batches are a different mechanism and must not be accounted as Poisson.

The sample is drawn on the host with NumPy, from
``numpy.random.default_rng((seed, stream, step))``: the draw for a step is a
pure function of those three integers, so a run resumed at step ``t`` draws
exactly the samples the uninterrupted run would have drawn. A run with one
sampler (plain DP-SGD) can leave ``stream`` at its default. The shared and the
expert stream of RAPTOR (Algorithm 1, lines 5 and 7) pass different ``stream``
values (``SHARED_STREAM``, ``EXPERT_STREAM``), which makes their samples
independent; two samplers that share a seed and a stream draw the SAME
samples, so give every sampler of a run its own stream.

Jitted code must see one shape, so the realised sample is cut into
microbatches of a fixed size; the last one is padded with index 0 and mask 0
(padding rows contribute exactly zero, see ``grads.clip_per_record``). An
empty sample gives zero microbatches: that step's update is noise only.

The realised sample size only decides *how many* microbatches run. The
released update never depends on it (sums of clipped gradients, noise, a
public denominator), but the number of microbatches, and so the step's
running time, does: the same timing side channel as every Poisson DP-SGD
implementation. Do not log or report the number of microbatches.
"""

from typing import NamedTuple

import numpy as np

from raptor_jax import _validate

SHARED_STREAM = 0  # also the default stream of a run with one sampler
EXPERT_STREAM = 1


class Microbatch(NamedTuple):
  """Fixed-size record indices and their padding mask (1 real, 0 padding)."""

  indices: np.ndarray  # int64 [microbatch_size]
  mask: np.ndarray  # float32 [microbatch_size]


def check_sample_rate(sample_rate: float) -> float:
  """Returns ``sample_rate`` as a float; ValueError unless 0 < q <= 1."""
  return _validate.sample_rate(sample_rate)


def check_microbatch_size(microbatch_size: int, *, num_devices: int = 1) -> int:
  """Returns ``microbatch_size``; ValueError unless it is a positive int.

  Args:
    microbatch_size: records per microbatch (the one shape jitted code sees).
    num_devices: devices a microbatch is split across (data parallel); the
      microbatch size must be a multiple of it.

  Returns:
    ``microbatch_size`` as an int.
  """
  microbatch_size = _validate.positive_int(
      'microbatch_size',
      microbatch_size,
      _validate.config_fix('microbatch_size'),
  )
  num_devices = _validate.positive_int('num_devices', num_devices)
  _validate.check(
      microbatch_size % num_devices == 0,
      'microbatch_size',
      f'a multiple of the number of devices ({num_devices})',
      microbatch_size,
      f'e.g. {-(-microbatch_size // num_devices) * num_devices}',
  )
  return microbatch_size


def poisson_sample(
    n: int,
    sample_rate: float,
    *,
    seed: int,
    step: int,
    stream: int = SHARED_STREAM,
) -> np.ndarray:
  """Draws a Poisson sample: each of ``n`` records independently w.p. ``q``.

  Guarantee: record ``i`` is in the sample with probability exactly
  ``sample_rate``, independently of every other record and of the data,
  which is the sampling the Poisson-subsampled Gaussian accountant assumes.
  The draw is a deterministic function of ``(seed, stream, step)``, so a
  resumed run reproduces its samples, and different streams (or steps) give
  independent samples. The same ``(seed, stream, step)`` gives the same
  sample: samplers meant to be independent need distinct streams.

  Args:
    n: dataset size.
    sample_rate: inclusion probability ``q = B / n`` (B the public expected
      batch size), in (0, 1].
    seed: run seed (non-negative int).
    step: step index (non-negative int).
    stream: which sampler (non-negative int). The default suits a run with
      one sampler, e.g. plain DP-SGD; RAPTOR passes ``SHARED_STREAM`` or
      ``EXPERT_STREAM``.

  Returns:
    Sorted int64 indices of the sampled records (possibly empty).

  Example:
    >>> import numpy as np
    >>> from raptor_jax import sampling
    >>> idx = sampling.poisson_sample(1000, 0.05, seed=0, step=3)
    >>> idx.dtype, bool(np.all(np.diff(idx) > 0))
    (dtype('int64'), True)
    >>> shared = sampling.poisson_sample(
    ...     1000, 0.05, seed=0, step=3, stream=sampling.SHARED_STREAM)
    >>> expert = sampling.poisson_sample(
    ...     1000, 0.05, seed=0, step=3, stream=sampling.EXPERT_STREAM)
    >>> np.array_equal(idx, shared), np.array_equal(shared, expert)
    (True, False)
  """
  n = _validate.non_negative_int('n', n)
  sample_rate = check_sample_rate(sample_rate)
  rng = np.random.default_rng(
      (
          _validate.non_negative_int('seed', seed),
          _validate.non_negative_int('stream', stream),
          _validate.non_negative_int('step', step),
      )
  )
  return np.flatnonzero(rng.random(n) < sample_rate).astype(np.int64)


def microbatches(indices: np.ndarray, microbatch_size: int) -> list[Microbatch]:
  """Cuts a sample into fixed-size microbatches with a padding mask.

  Every microbatch has exactly ``microbatch_size`` rows; the last one is
  padded with index 0 and mask 0, so one jitted function serves every step
  whatever the realised sample size. An empty sample gives an empty list: the
  step then releases noise only (start the sums from zeros, e.g.
  ``grads.zeros_like_f32``).

  The realised size decides how many microbatches there are, and nothing
  else; see the module docstring for the timing side channel this leaves.

  Args:
    indices: 1-D integer record indices, e.g. from ``poisson_sample``.
    microbatch_size: rows per microbatch, >= 1.

  Returns:
    A list of ``Microbatch(indices int64 [m], mask float32 [m])``; the indices
    where the mask is 1, concatenated, equal ``indices``.

  Example:
    >>> import numpy as np
    >>> from raptor_jax import sampling
    >>> mbs = sampling.microbatches(np.array([4, 7, 9]), 2)
    >>> [mb.indices.tolist() for mb in mbs], [mb.mask.tolist() for mb in mbs]
    ([[4, 7], [9, 0]], [[1.0, 1.0], [1.0, 0.0]])
  """
  microbatch_size = check_microbatch_size(microbatch_size)
  indices = np.asarray(indices)
  _validate.check(
      indices.ndim == 1
      and (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)),
      'indices',
      'a 1-D integer array',
      _validate.Shown(f'dtype {indices.dtype}, shape {indices.shape}'),
  )
  num = -(-indices.size // microbatch_size)
  padded = np.zeros(num * microbatch_size, np.int64)
  padded[: indices.size] = indices
  mask = np.zeros(num * microbatch_size, np.float32)
  mask[: indices.size] = 1.0
  return [
      Microbatch(i, m)
      for i, m in zip(
          padded.reshape(num, microbatch_size),
          mask.reshape(num, microbatch_size),
      )
  ]
