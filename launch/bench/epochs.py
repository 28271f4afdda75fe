"""One epoch of a task for `epoch_time`: records, Poisson samples (drawn
once), and the microbatches each column runs for a step (`Epoch.layout`:
raptor_jax's length buckets, raptor_jax at max_length, or PyTorch's dynamic
padding); `useful_flops` counts the matmul FLOPs of the real tokens only.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from launch.bench import builders
from raptor_jax import length_buckets, sampling

TASKS = {  # task: (train file under --data_dir, max_length)
    'sst2': ('glue/sst2/train.tsv', 64),
    'qnli': ('glue/qnli/train_sample.tsv', 128),
}
# The `:small` model shape (configs/pretrain_switch.py).
SMALL = dict(d_model=128, d_kv=32, num_heads=4, d_ff=512, num_layers=4)
SMALL.update(num_experts=8, expert_capacity=64, lora_rank=8, lora_alpha=16.0)


@dataclasses.dataclass
class Epoch:
  """One task's records and one epoch of Poisson samples."""

  task: str
  input_ids: np.ndarray  # int32 [n, max_length], right-padded
  lengths: np.ndarray  # int64 [n]
  labels: np.ndarray  # int32 [n]
  owners: np.ndarray  # int32 [n], random: the layout is timed, not the map
  samples: list[np.ndarray]  # one sorted index array per step
  buckets: tuple[int, ...]
  microbatch: int

  @property
  def max_length(self) -> int:
    return self.input_ids.shape[1]

  def arrays(self, length: int, idx: np.ndarray):
    """(ids, mask, labels) of the records `idx`, cut to `length` tokens."""
    mask = np.arange(length)[None] < self.lengths[idx, None]
    return self.input_ids[idx, :length], mask.astype(np.int32), self.labels[idx]

  def layout(self, column: str, step: int) -> list[tuple]:
    """[(length, indices, mask)]: the microbatches `column` runs for `step`:
    'raptor', the trainer's bucketed layout (padding rows: index 0, mask 0);
    'raptor unbucketed', every record at max_length; 'torch', the sample in
    its order, m at a time, each padded to its longest record."""
    sample, m = self.samples[step], self.microbatch
    if column == 'raptor':
      return [
          (b, mb.indices, mb.mask)
          for b, mb in length_buckets.bucketed_microbatches(
              sample, self.lengths, self.buckets, m
          )
      ]
    if column == 'raptor unbucketed':
      return [
          (self.max_length, mb.indices, mb.mask)
          for mb in sampling.microbatches(sample, m)
      ]
    chunks = (sample[i : i + m] for i in range(0, len(sample), m))
    return [
        (int(self.lengths[c].max()), c, np.ones(len(c), np.float32))
        for c in chunks
    ]

  def tokens(self, column: str) -> tuple[int, int]:
    """(real, processed) tokens of the whole epoch in `column`'s layout."""
    real = sum(int(self.lengths[s].sum()) for s in self.samples)
    processed = sum(
        length * len(indices)
        for step in range(len(self.samples))
        for length, indices, _ in self.layout(column, step)
    )
    return real, processed

  def timed_steps(self, count: int) -> list[int]:
    """`count` step indices spread evenly over the epoch."""
    n = len(self.samples)
    return sorted({int(i) for i in np.linspace(0, n - 1, max(count, 1))})


def make_epoch(task, data, *, batch_size, microbatch, num_experts, seed=0):
  """The epoch of `data` ((input_ids, attention_mask, labels)) at batch B."""
  ids, mask, labels = (np.asarray(x) for x in data)
  n = len(labels)
  lengths = length_buckets.record_lengths(mask)
  steps = max(n // batch_size, 1)
  samples = [
      sampling.poisson_sample(n, batch_size / n, seed=seed, stream=0, step=t)
      for t in range(steps)
  ]
  owners = np.random.default_rng(seed).integers(0, num_experts, n)
  buckets = length_buckets.default_buckets(ids.shape[1])
  ids, labels, owners = (x.astype(np.int32) for x in (ids, labels, owners))
  return Epoch(task, ids, lengths, labels, owners, samples, buckets, microbatch)


def load_records(task: str, data_dir: str, tokenizer: str):
  """(input_ids, attention_mask, labels) of the task's train file."""
  from raptor_jax.data import encoding, tasks  # pylint: disable=import-outside-toplevel

  path, max_length = TASKS[task]
  data = tasks.load_task_split(
      task,
      'train',
      tokenizer=encoding.load_tokenizer(tokenizer),
      path=os.path.join(data_dir, path),
      max_length=max_length,
  )
  return data.input_ids, data.attention_mask, data.labels


def generated_records(n: int, max_length: int, vocab: int, seed: int = 0):
  """Records with lengths like real text's (short, a long tail): --quick."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.geometric(3.0 / max_length, n) + 2, 2, max_length)
  mask = (np.arange(max_length)[None] < lengths[:, None]).astype(np.int32)
  ids = rng.integers(1, vocab, (n, max_length)).astype(np.int32) * mask
  return ids, mask, rng.integers(0, 2, n).astype(np.int32)


def useful_flops(epoch: Epoch, sizes: builders.Sizes) -> float:
  """2 x the forward matmul FLOPs of the epoch's real tokens (see module doc)."""
  d, h = sizes.d_model, sizes.num_heads * sizes.d_kv
  sparse = sizes.num_layers // 2
  per_token = sizes.num_layers * (8 * d * h + 4 * d * sizes.d_ff)
  per_token += sparse * 2 * d * sizes.num_experts  # routers
  total = 0.0
  for s in epoch.samples:
    lengths = epoch.lengths[s].astype(np.float64)
    total += per_token * lengths.sum()
    total += sizes.num_layers * 4 * h * (lengths**2).sum()  # scores, values
  return 2.0 * total


def model_sizes(max_length: int, vocab: int, quick: bool) -> builders.Sizes:
  """The `:small` shape (--quick: `builders.QUICK`) at `max_length`."""
  if quick:
    return dataclasses.replace(builders.QUICK, seq_len=max_length)
  return builders.Sizes(
      **SMALL, vocab_size=vocab, seq_len=max_length, max_distance=128
  )
