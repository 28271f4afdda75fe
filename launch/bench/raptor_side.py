"""The Switch model of `vs_opacus` and `epoch_time`, and raptor_jax's steps on it.

`save_switch` saves one random Hugging Face Switch Transformer; both sides
load its weights (`raptor_model`, `torch_side.torch_model`). The steps are
the trainer's `PhaseStep` of each stream on every device (`phase_step`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from launch.bench import builders
from raptor_jax import models, roles
from raptor_jax.train import parallel


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The model and data sizes of one comparison."""

  d_model: int = 256
  d_kv: int = 64
  num_heads: int = 4
  d_ff: int = 1024
  num_layers: int = 4
  num_experts: int = 8
  expert_capacity: int = 64
  vocab_size: int = 8000
  seq_len: int = 128
  lora_rank: int = 8
  lora_alpha: float = 16.0
  buckets: int = 32
  max_distance: int = 128

  @property
  def expert_layer(self) -> int:
    """l*: the last sparse block (every 2nd block is sparse)."""
    return self.num_layers - 1 if self.num_layers % 2 == 0 else 1


QUICK = Sizes(**builders.TOY_SWITCH, seq_len=12, lora_alpha=4.0)
QUICK = dataclasses.replace(QUICK, buckets=8, max_distance=20)
L2_CLIP = 0.05  # small enough that most records are clipped


def save_switch(path: str, sizes: Sizes, seed: int = 0) -> str:
  """A random HF Switch (every 2nd block sparse) saved with `save_pretrained`."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(seed)
  same = ('vocab_size', 'd_model', 'd_kv', 'd_ff', 'num_layers', 'num_heads')
  same += ('num_experts', 'expert_capacity')  # HF's names too
  config = transformers.SwitchTransformersConfig(
      **{name: getattr(sizes, name) for name in same},
      num_sparse_encoder_layers=sizes.num_layers // 2,
      num_decoder_layers=1,
      relative_attention_num_buckets=sizes.buckets,
      relative_attention_max_distance=sizes.max_distance,
      dropout_rate=0.0,  # Opacus trains in train mode: no dropout, no jitter
      router_jitter_noise=0.0,
  )
  transformers.SwitchTransformersForConditionalGeneration(
      config
  ).save_pretrained(path)
  return path


def raptor_model(path: str, sizes: Sizes, seed: int = 0):
  """(classifier, params) from the checkpoint; LoRA B factors made non-zero."""
  module, params = models.from_pretrained(
      path,
      num_labels=2,
      lora_rank=sizes.lora_rank,
      lora_alpha=sizes.lora_alpha,
      attention_lora=True,
      expert_lora_layers=(sizes.expert_layer,),
      # Per-layer leaves, as torch_side names PyTorch's (at the default 4
      # blocks nothing would be scanned: block 0, one unit, l*).
      scan_layers=False,
  )
  flat = roles.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 7), len(flat))
  flat = {
      p: (0.05 * jax.random.normal(k, v.shape) if p.endswith('lora_b') else v)
      for k, (p, v) in zip(keys, sorted(flat.items()))
  }
  return module, roles.unflatten(flat)


def records(sizes: Sizes, m: int, seed: int):
  """((ids, mask, labels), owners) as jax arrays, right-padded."""
  return builders.batch(
      m, sizes.seq_len, sizes.vocab_size, sizes.num_experts, seed=seed
  )


def raptor_nonprivate(module, params, batch):
  """(step, mean-loss gradients) of the trainer's non-private LoRA step
  (attention adapters and head; `raptor_dp` of 'nonprivate')."""
  return raptor_dp(module, params, batch, None, None, 'nonprivate')


def phase_step(module, params, sizes: Sizes, stream: str, batch_size: float):
  """(PhaseStep, its state) of `stream` ('shared', 'expert': DP, clip
  L2_CLIP; 'nonprivate') at expected batch `batch_size` (the denominator,
  over E for the expert stream), on a mesh of every device."""
  expert = stream == 'expert'
  phase, extra = builders.stream_phase(
      stream,
      batch_size / (sizes.num_experts if expert else 1),
      sizes.expert_layer if expert else None,
      l2_clip=L2_CLIP,
  )
  dp = builders.phase_step(
      module, phase, key=jax.random.key(0), devices=0, **extra
  )
  return dp, dp.init(params)


def raptor_dp(module, params, batch, owners, sizes: Sizes, stream: str):
  """(step, update with noise off) of `phase_step(stream)` on one
  microbatch of m records, the whole expected batch: the step is
  `accumulate` then `update`, as the trainer runs it; the noiseless update
  is the accumulated sums over the denominator."""
  m = len(batch[2])
  devices = parallel.make_mesh(0).size
  if m % devices:
    raise ValueError(
        f'microbatch {m} is not a multiple of the {devices} devices; '
        'choose --microbatch_sizes divisible by it (or --cpu_devices=1)'
    )
  dp, state = phase_step(module, params, sizes, stream, m)
  host = builders.host_batch(*batch, owners)
  sums = dp.accumulate(state, dp.zero_sums(state), host)
  (part,) = dp.phase.parts
  update = {
      p: np.asarray(v) / part.denominator for p, v in sums[part.name].items()
  }

  def step():
    return dp.update(state, dp.accumulate(state, dp.zero_sums(state), host))

  return step, update
