"""Length buckets: a Poisson sample cut into fixed-shape microbatches by length.

Real text is short next to `max_length` (SST-2 train averages about 12
tokens with the specials, against 64 or 128), so padding every record to
`max_length` spends most per-record FLOPs on padding. Bucketing groups a
step's sampled records by length: records of at most `b` tokens are run in
microbatches of shape [m, b] for the smallest bucket length `b` that holds
them, each bucket with its own fixed shape, so a jitted step compiles once
per (phase, bucket), never per step. A bucket's part-filled last
microbatch may instead run in a larger bucket when that processes fewer
tokens (`carried_counts`: the empty rows of part-filled microbatches were
most of the waste on SST-2).

Privacy. A record's bucket is a function of its private length, so the
number of microbatches per bucket depends on the data, exactly as the
number of microbatches already depends on the realised sample size. It
changes the computation's layout and wall time only, both private operator
information (see `sampling`): the clipped per-record gradients are the same
(right padding is masked, so a record's gradient does not depend on how far
it is padded), and the sums of every bucket add into the one noisy update,
which is the same function of the sample as without buckets, up to float
summation order. Nothing about buckets or their counts may reach a log, a
metric or a released file: the trainer only loops over the microbatches,
and none of its outputs (metrics.jsonl, TensorBoard, the progress bar,
results.json, privacy_report.json, checkpoints) names a bucket or counts
its records or microbatches.

Where buckets are used (`data.length_buckets`, `resolve`): the trainer's
cycle (`train.cycle`, `train.parallel.local_bucketed_microbatches`), the
evaluation (`train.metrics.evaluate`) and the forward passes before the
mechanism (`ownership.owners_per_layer`: l* on the public corpus, the
private owner map). `()` switches them off: every record is padded to
`max_length`, exactly the unbucketed code path.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

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
  max_length = _validate.positive_int("max_length", max_length)
  smallest = _validate.positive_int("smallest", smallest)
  buckets = []
  length = smallest
  while length < max_length:
    buckets.append(length)
    length *= 2
  return tuple(buckets) + (max_length,)


def check_buckets(buckets, max_length: int) -> tuple[int, ...]:
  """`buckets` as a sorted tuple, refused in one line unless it ends at
  `max_length` (every record must fit some bucket)."""
  fix = f"set --config.data.length_buckets, e.g. {default_buckets(max_length)}"
  try:
    buckets = tuple(int(b) for b in buckets)
  except (TypeError, ValueError):
    _validate.fail(
        "data.length_buckets",
        f"increasing positive lengths ending at max_length {max_length}",
        tuple(buckets),
        fix,
    )
  _validate.check(
      bool(buckets)
      and all(b > 0 for b in buckets)
      and list(buckets) == sorted(set(buckets))
      and buckets[-1] == max_length,
      "data.length_buckets",
      f"increasing positive lengths ending at max_length {max_length}",
      buckets,
      fix,
  )
  return buckets


# Tasks whose records all have about the same length: no buckets by default
# (the embedded synthetic task, at most 22 of 32 tokens, keeps its
# unbucketed runs and their documented numbers; the controlled study runs
# fixed-length records).
UNBUCKETED_TASKS = ("synthetic", "controlled")


def resolve(value, max_length: int, task: str = "") -> tuple[int, ...]:
  """The buckets a config asks for: `()` (off) or `check_buckets`' tuple.

  Args:
    value: `config.data.length_buckets`: None (the default: powers of two
      from 16 up to `max_length`, `default_buckets`; none for the
      `UNBUCKETED_TASKS`), `()` (off: everything padded to `max_length`), or
      increasing lengths ending at `max_length`.
    max_length: `config.data.max_length`.
    task: `config.data.task`.

  Example:
    >>> from raptor_jax import length_buckets
    >>> length_buckets.resolve(None, 64, 'sst2')
    (16, 32, 64)
    >>> length_buckets.resolve(None, 32, 'synthetic'), length_buckets.resolve((), 64)
    ((), ())
  """
  if value is None:
    return () if task in UNBUCKETED_TASKS else default_buckets(max_length)
  if not isinstance(value, str) and any(isinstance(v, str) for v in value):
    value = ",".join(map(str, value))  # ('16,32,64',) from ml_collections
  if isinstance(value, str):  # '16,32,64' from a shell
    value = [v for v in value.replace(" ", "").strip("()").split(",") if v]
  if len(tuple(value)) == 0:
    return ()
  return check_buckets(value, max_length)


def from_config(config) -> tuple[int, ...]:
  """`resolve` of a train config's `data.length_buckets` (absent: None)."""
  dc = config.data
  return resolve(dc.get("length_buckets"), int(dc.max_length), dc.task)


def record_lengths(attention_mask: np.ndarray) -> np.ndarray:
  """int64 [n]: each record's length, its last non-padding token + 1.

  Right padding (`data.tokenize`): truncating a record to any bucket of at
  least this length drops padding only.
  """
  mask = np.asarray(attention_mask) != 0
  if mask.ndim != 2:
    raise ValueError(f"attention_mask must be [n, length], got {mask.shape}")
  last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
  return np.where(mask.any(axis=1), last, 0).astype(np.int64)


def bucket_index(lengths: np.ndarray, buckets: tuple[int, ...]) -> np.ndarray:
  """int [n]: the smallest bucket that holds each length (lengths <= last)."""
  lengths = np.asarray(lengths)
  if lengths.size and int(lengths.max()) > buckets[-1]:
    raise ValueError(
        f"a record has {int(lengths.max())} tokens, more than the last bucket"
        f" {buckets[-1]}; end data.length_buckets at max_length"
    )
  return np.searchsorted(np.asarray(buckets), lengths, side="left")


def carried_counts(
    sizes: Sequence[int], buckets: tuple[int, ...], microbatch_size: int
) -> np.ndarray:
  """int64 [K]: records run in each bucket once remainders are carried up.

  A bucket's last microbatch is usually part-filled, and its empty rows
  cost as many tokens as real ones. Its remainder (fewer than
  `microbatch_size` records) may instead run in the next larger bucket,
  where it fits and may fill rows that would be empty anyway. Over the
  2^(K-1) carry-or-not choices (a dynamic programme over the carried
  count), this picks the one that processes the fewest tokens (rows x
  length), then the fewest microbatches, then carries least: exact, and
  deterministic.

  PRIVATE (a function of the sample's lengths), as `bucket_counts`.

  Example:
    >>> from raptor_jax import length_buckets
    >>> length_buckets.carried_counts([325, 140, 35], (16, 32, 64), 100)
    array([300, 100, 100])

    (3 + 1 + 1 microbatches, 14,400 tokens, against 4 + 2 + 1 and 19,200
    for every record in its own bucket.)
  """
  m = int(microbatch_size)
  # carry in -> (tokens, microbatches, carried so far, records per bucket)
  best = {0: (0, 0, 0, ())}
  for k, (n, length) in enumerate(zip(sizes, buckets)):
    step = {}
    for carry, (tokens, count, moved, runs) in best.items():
      total = int(n) + carry
      full, rest = divmod(total, m)
      options = [(0, total)]  # run everything here
      if rest and k < len(buckets) - 1:
        options.append((rest, total - rest))  # carry the remainder up
      for out, here in options:
        batches = -(-here // m)
        value = (
            tokens + batches * m * length,
            count + batches,
            moved + out,
            runs + (here,),
        )
        if out not in step or value < step[out]:
          step[out] = value
    best = step
  return np.asarray(best[0][3], np.int64)


def carried_buckets(
    lengths: np.ndarray, buckets: tuple[int, ...], microbatch_size: int
) -> np.ndarray:
  """int [n]: the bucket each record of a sample runs in (`carried_counts`).

  A carried record runs in a larger bucket than `bucket_index` gives it:
  only padding is added, so its gradient is unchanged. Records move up in
  index order within their bucket (the last ones of each bucket first).
  """
  which = bucket_index(lengths, buckets)
  runs = carried_counts(
      np.bincount(which, minlength=len(buckets)), buckets, microbatch_size
  )
  out = which.copy()
  carry = np.zeros(0, np.int64)
  for b in range(len(buckets)):
    members = np.concatenate([carry, np.flatnonzero(which == b)])
    members.sort()
    out[members[: runs[b]]] = b
    carry = members[runs[b] :]
  return out


def bucket_counts(
    local_indices: np.ndarray,
    local_lengths: np.ndarray,
    buckets: tuple[int, ...],
    microbatch_size: int,
) -> np.ndarray:
  """int64 [len(buckets)]: the microbatches one host's share needs per bucket.

  PRIVATE (a function of the sample and of private lengths): it decides the
  layout only and must never be logged or saved.
  """
  which = carried_buckets(
      np.asarray(local_lengths)[local_indices], buckets, microbatch_size
  )
  sizes = np.bincount(which, minlength=len(buckets))
  return -(-sizes // microbatch_size)


def host_bucketed_microbatches(
    local_indices: np.ndarray,
    local_lengths: np.ndarray,
    buckets: tuple[int, ...],
    microbatch_size: int,
    counts: Sequence[int] | None = None,
) -> list[BucketMicrobatch]:
  """One host's microbatches, bucket by bucket (shortest first).

  Args:
    local_indices: sorted indices into this host's records (its share of
      the step's sample).
    local_lengths: int [this host's records], each record's length.
    buckets: increasing sequence lengths (`check_buckets`).
    microbatch_size: rows per microbatch on this host.
    counts: microbatches per bucket, at least this host's `bucket_counts`
      (the hosts' maximum in a multi-host run, so collectives line up);
      None: this host's own counts.

  Returns:
    `BucketMicrobatch(length, Microbatch)` items, `counts[b]` of bucket b;
    rows beyond the bucket's records are padding (index 0, mask 0, zero
    weight exactly as `sampling.microbatches` pads). The records with mask
    1, over all items, are exactly `local_indices`, each once.
  """
  local_indices = np.asarray(local_indices, np.int64)
  which = carried_buckets(
      np.asarray(local_lengths)[local_indices], buckets, microbatch_size
  )
  if counts is None:
    counts = bucket_counts(
        local_indices, local_lengths, buckets, microbatch_size
    )
  padding = sampling.Microbatch(
      np.zeros(microbatch_size, np.int64),
      np.zeros(microbatch_size, np.float32),
  )
  out = []
  for b, length in enumerate(buckets):
    mine = sampling.microbatches(local_indices[which == b], microbatch_size)
    if len(mine) > counts[b]:
      raise ValueError(
          "counts must hold at least this host's microbatches of every bucket"
      )
    mine += [padding] * (int(counts[b]) - len(mine))
    out += [BucketMicrobatch(length, mb) for mb in mine]
  return out


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

  Every host's layout from every record's length (one process that knows
  them all, e.g. a test simulating hosts); the trainer, whose hosts hold
  their own records only, agrees on the counts instead
  (`train.parallel.local_bucketed_microbatches`).

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
  lengths = np.asarray(lengths)
  shares = [indices[indices % processes == p] for p in range(processes)]
  local_lengths = [lengths[p::processes] for p in range(processes)]
  counts = np.max(
      [
          bucket_counts(s // processes, l, buckets, microbatch_size)
          for s, l in zip(shares, local_lengths)
      ],
      axis=0,
  )
  return host_bucketed_microbatches(
      shares[process_index] // processes,
      local_lengths[process_index],
      buckets,
      microbatch_size,
      counts,
  )


def split_batches(
    lengths: np.ndarray, buckets: tuple[int, ...], batch_size: int
) -> list[tuple[int, np.ndarray]]:
  """A whole split cut into (length, indices) batches of at most
  `batch_size` records, by bucket (records in order within a bucket).

  For passes over every record (evaluation, owner maps): the caller pads a
  short batch to `batch_size` rows as it pads today, so each bucket's
  function compiles once. `()` gives today's batches: every record in
  order, at `max_length` (length None: the records' own width).
  """
  lengths = np.asarray(lengths)
  n = len(lengths)
  if not buckets:
    return [
        (None, np.arange(start, min(start + batch_size, n)))
        for start in range(0, n, batch_size)
    ]
  which = bucket_index(lengths, buckets)
  out = []
  for b, length in enumerate(buckets):
    members = np.flatnonzero(which == b)
    out += [
        (length, members[start : start + batch_size])
        for start in range(0, len(members), batch_size)
    ]
  return out


def map_split(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    buckets: tuple[int, ...],
    batch_size: int,
) -> np.ndarray:
  """`fn(ids, mask)` of every record, in the records' order.

  Each call gets `batch_size` rows (a short batch padded with zero rows, as
  the unbucketed passes pad) truncated to the bucket's length, and returns
  an array whose first axis is the rows; rows of padding are dropped.
  `buckets=()`: today's pass, every batch at the records' full width.
  """
  input_ids, attention_mask = np.asarray(input_ids), np.asarray(attention_mask)
  lengths = (
      record_lengths(attention_mask) if buckets else np.zeros(len(input_ids))
  )
  out = None
  for length, rows in split_batches(lengths, buckets, batch_size):
    ids, mask = input_ids[rows], attention_mask[rows]
    if length is not None:
      ids, mask = ids[:, :length], mask[:, :length]
    real = len(rows)
    if real < batch_size:
      pad = ((0, batch_size - real), (0, 0))
      ids, mask = np.pad(ids, pad), np.pad(mask, pad)
    result = np.asarray(fn(ids, mask))[:real]
    if out is None:
      out = np.zeros((len(input_ids),) + result.shape[1:], result.dtype)
    out[rows] = result
  if out is None:
    raise ValueError("no records to map over")
  return out
