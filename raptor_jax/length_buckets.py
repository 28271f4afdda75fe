"""Length buckets: a Poisson sample cut into fixed-shape microbatches by length.

Real text is short next to `max_length` (SST-2 train averages about 12
tokens with the specials, against 64 or 128), so padding every record to
`max_length` spends most per-record FLOPs on padding. Bucketing groups a
step's sampled records by length: records of at most `b` tokens are run in
microbatches of shape [m, b] for the smallest bucket length `b` that holds
them, each bucket with its own fixed shape, so a jitted step compiles once
per (phase, bucket), never per step.

Privacy. A record's bucket is a function of its private length, so the
number of microbatches per bucket depends on the data, exactly as the
number of microbatches already depends on the realised sample size. It
changes the computation's layout and wall time only, both private operator
information (see `sampling`): the clipped per-record gradients are the same
(right padding is masked, so a record's gradient does not depend on how far
it is padded), and the sums of every bucket add into the one noisy update,
which is the same function of the sample as without buckets, up to float
summation order. Nothing about buckets or their counts may reach a log, a
metric or a released file.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from raptor_jax import _validate, sampling


class BucketMicrobatch(NamedTuple):
  """A fixed-size microbatch whose records all fit `length` tokens."""

  length: int  # the bucket's sequence length (a static shape)
  microbatch: sampling.Microbatch


def default_buckets(max_length: int, smallest: int = 16) -> tuple[int, ...]:
  """Powers of two from `smallest` below `max_length`, then `max_length`.

  Example:
    >>> from raptor_jax import length_buckets
    >>> length_buckets.default_buckets(128)
    (16, 32, 64, 128)
    >>> length_buckets.default_buckets(100)
    (16, 32, 64, 100)
  """
  max_length = _validate.positive_int('max_length', max_length)
  smallest = _validate.positive_int('smallest', smallest)
  buckets = []
  length = smallest
  while length < max_length:
    buckets.append(length)
    length *= 2
  return tuple(buckets) + (max_length,)


def check_buckets(buckets, max_length: int) -> tuple[int, ...]:
  """`buckets` as a sorted tuple, refused in one line unless it ends at
  `max_length` (every record must fit some bucket)."""
  buckets = tuple(int(b) for b in buckets)
  _validate.check(
      bool(buckets)
      and all(b > 0 for b in buckets)
      and list(buckets) == sorted(set(buckets))
      and buckets[-1] == max_length,
      'data.length_buckets',
      f'increasing positive lengths ending at max_length {max_length}',
      buckets,
      f'set --config.data.length_buckets, e.g. {default_buckets(max_length)}',
  )
  return buckets


def bucket_index(lengths: np.ndarray, buckets: tuple[int, ...]) -> np.ndarray:
  """int [n]: the smallest bucket that holds each length (lengths <= last)."""
  lengths = np.asarray(lengths)
  if lengths.size and int(lengths.max()) > buckets[-1]:
    raise ValueError(
        f'a record has {int(lengths.max())} tokens, more than the last bucket'
        f' {buckets[-1]}; end data.length_buckets at max_length'
    )
  return np.searchsorted(np.asarray(buckets), lengths, side='left')


def bucketed_microbatches(
    indices: np.ndarray,
    lengths: np.ndarray,
    buckets: tuple[int, ...],
    microbatch_size: int,
    *,
    processes: int = 1,
    process_index: int = 0,
) -> list[BucketMicrobatch]:
  """A sample's fixed-size microbatches, bucket by bucket (shortest first).

  Args:
    indices: 1-D global record indices of one step's sample (sorted).
    lengths: int [n_records], every record's number of tokens (real ones).
    buckets: increasing sequence lengths (`check_buckets`).
    microbatch_size: rows per microbatch on this host.
    processes: hosts sharing the sample (record i belongs to host
      i % processes, as `parallel.local_microbatches`).
    process_index: this host.

  Returns:
    `BucketMicrobatch(length, Microbatch)` items. Each bucket runs as many
    microbatches on every host (the largest host share decides; the rest is
    padding, mask 0), so collectives line up; indices are this host's local
    ones (i // processes). The records with mask 1, over all items, are
    exactly this host's share of `indices`, each once.
  """
  indices = np.asarray(indices, np.int64)
  which = bucket_index(np.asarray(lengths)[indices], buckets)
  padding = sampling.Microbatch(
      np.zeros(microbatch_size, np.int64),
      np.zeros(microbatch_size, np.float32),
  )
  out = []
  for b, length in enumerate(buckets):
    in_bucket = indices[which == b]
    shares = [in_bucket[in_bucket % processes == p] for p in range(processes)]
    count = max(math.ceil(len(s) / microbatch_size) for s in shares)
    mine = sampling.microbatches(
        shares[process_index] // processes, microbatch_size
    )
    mine += [padding] * (count - len(mine))
    out += [BucketMicrobatch(length, mb) for mb in mine]
  return out
