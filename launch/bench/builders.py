"""Models, records and the trainer's steps, as the benchmarks build them.

Small random classifiers with LoRA on attention and on the experts of l*,
the last sparse block (`model_config`, `olmoe_config`, `build`), random
records (`batch`, `host_batch`), and RAPTOR's shared and expert streams as
the trainer's own `PhaseStep` (`stream_phase`, `phase_step`), compiled on
one microbatch (`compile_phase`). The HF Switch of `vs_opacus` and
`epoch_time` (`save_switch`; `raptor_model` loads it, `torch_side` too) and
the trainer's steps of each stream on it, on every device (`stream_step`,
`raptor_dp`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import harness
from raptor_jax import models, roles
from raptor_jax.train import parallel, plans
from raptor_jax.train import step as step_lib

_WIDTHS = ('d_model', 'd_kv', 'd_ff', 'num_heads', 'num_experts')
_WIDTHS += ('expert_capacity',)
# switch-base-8's widths (HF config.json; depth and vocabulary left out).
SWITCH_BASE_8 = dict(zip(_WIDTHS, (768, 64, 3072, 12, 8, 64)))
# A toy Switch, for smoke tests on a CPU (`--quick`).
TOY_SWITCH = dict(
    zip(_WIDTHS, (16, 8, 32, 2, 4, 5)), vocab_size=50, num_layers=2, lora_rank=2
)
L2_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 1e-3


# The small model's sizes, under Switch's names.
SMALL = dict(vocab_size=8000, d_model=256, d_ff=1024, num_layers=4)
SMALL.update(num_heads=4, num_experts=8, lora_rank=8)
SWITCH_SMALL = dict(SMALL, d_kv=64, expert_capacity=64)  # (decoders: neither)
# Switch's names of sizes -> a decoder's (OLMoE's).
DECODER_NAMES = dict(d_model='hidden_size', d_ff='intermediate_size')
DECODER_NAMES.update(
    num_layers='num_hidden_layers', num_heads='num_attention_heads'
)


def decoder_sizes(sizes: dict) -> dict:
  """`sizes` under a decoder's names (as many key-value heads as heads)."""
  out = {DECODER_NAMES.get(k, k): v for k, v in sizes.items()}
  return dict(out, num_key_value_heads=out['num_attention_heads'])


def model_config(**overrides) -> models.SwitchConfig:
  """A small Switch (`overrides` on top of the defaults: 4 blocks, every 2nd
  sparse) with LoRA on attention and on the experts of l* (`with_expert_layer`).
  """
  base = dict(SWITCH_SMALL, attention_lora=True, sparse_step=2)
  return with_expert_layer(models.SwitchConfig(**{**base, **overrides}))


def olmoe_config(**overrides) -> models.OlmoeConfig:
  """A small OLMoE (`overrides` on top of the defaults: 4 blocks, all sparse,
  top-8) with LoRA on attention and on the experts of l*."""
  base = dict(decoder_sizes(SMALL), attention_lora=True, num_experts_per_tok=8)
  return with_expert_layer(models.OlmoeConfig(**{**base, **overrides}))


def with_expert_layer(config):
  """`config` with LoRA on the experts of its last sparse block, l*, kept
  out of the scan as the trainer keeps it."""
  layer = config.sparse_layers[-1]
  return dataclasses.replace(
      config, expert_lora_layers=(layer,), unscanned_layers=(layer,)
  )


# Family -> (config class, backbone, its depth field, pooling).
_DECODERS = dict(olmoe='Olmoe', deepseek='Deepseek', qwen3_moe='Qwen3Moe')
_DECODERS.update(qwen2_moe='Qwen2Moe', mixtral='Mixtral')
BACKBONES = {
    'switch': (models.SwitchConfig, models.SwitchEncoder, 'num_layers', 'mean'),
    **{
        name: (
            getattr(models, f'{kind}Config'),
            getattr(models, f'{kind}Decoder'),
            'num_hidden_layers',
            'last',
        )
        for name, kind in _DECODERS.items()
    },
}


def classifier(config) -> models.SequenceClassifier:
  """A 2-label SequenceClassifier on `config`'s backbone (`BACKBONES`: mean
  pooling for Switch, the last token for a decoder)."""
  ((_, backbone, _, pooling),) = (
      b for b in BACKBONES.values() if type(config) is b[0]
  )
  return models.SequenceClassifier(backbone(config), 2, pooling=pooling)


def build(config, seq_len: int, seed: int = 0):
  """(module, params) of a randomly initialised `classifier`."""
  module = classifier(config)
  ids = jnp.zeros((1, seq_len), jnp.int32)
  params = models.init_params(
      module, jax.random.PRNGKey(seed), (ids, jnp.ones_like(ids))
  )
  return module, params


def batch(num_records, seq_len, vocab_size, num_experts, seed=0):
  """Random records (ids, mask, label) with right padding, and random owners."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, vocab_size, (num_records, seq_len), dtype=np.int32)
  lengths = rng.integers(seq_len // 2, seq_len + 1, num_records)
  mask = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int32)
  labels = rng.integers(0, 2, num_records, dtype=np.int32)
  owners = rng.integers(0, num_experts, num_records, dtype=np.int32)
  return (
      (jnp.asarray(ids * mask), jnp.asarray(mask), jnp.asarray(labels)),
      jnp.asarray(owners),
  )


def host_batch(ids, mask, labels, owners=None) -> dict:
  """The trainer's host batch of one microbatch (owners zero when unused)."""
  return {
      'input_ids': ids,
      'attention_mask': mask,
      'labels': labels,
      'owners': jnp.zeros_like(labels) if owners is None else owners,
  }


def stream_phase(stream: str, denominator: float, layer=None, l2_clip=L2_CLIP):
  """(phase, `PhaseStep` keywords) of RAPTOR's 'shared' stream (attention
  LoRA + head), its 'expert' stream (owner slices of block `layer`'s expert
  LoRA, the residual weight 'shared') or the 'nonprivate' step of the
  shared stream's adapters: one part, the benchmark's noise multiplier."""
  expert, private = stream == 'expert', stream != 'nonprivate'
  name = 'expert' if expert else 'shared'
  part = plans.Part(
      name=name,
      roles=tuple(roles.EXPERT_ROLES if expert else roles.SHARED_ROLES),
      blocks=(layer,) if expert else None,
      owner=expert,
      l2_clip=l2_clip,
      noise_multiplier=NOISE_MULTIPLIER if private else 0.0,
      denominator=denominator,
      residual=expert,
  )
  extra = dict(expert_layer=layer, residual='shared') if expert else {}
  phase = plans.Phase(name=name, stream=0, parts=(part,), private=private)
  return phase, extra


def phase_step(module, phase, *, key, devices=1, **kwargs):
  """The trainer's `PhaseStep` of `phase` on a mesh of `devices` (0: every
  device); `kwargs` as `stream_phase`'s."""
  return step_lib.PhaseStep(
      module,
      phase,
      key=key,
      learning_rate=LEARNING_RATE,
      mesh=parallel.make_mesh(devices),
      **kwargs,
  )


def accumulate_args(dp, state, records, owners, sums=None) -> tuple:
  """The accumulate's arguments on one microbatch (`sums`, default zero
  sums; the records placed as the trainer places them)."""
  placed = parallel.shard_records(
      (host_batch(*records, owners), np.ones(len(owners), np.float32)),
      dp.mesh,
  )
  sums = dp.zero_sums(state) if sums is None else sums
  return (state.trainable, state.frozen, sums, *placed)


def compile_phase(dp, state, records, owners):
  """(accumulate, update, the accumulate's arguments): both programs
  compiled on one microbatch (`harness.compile_timed`)."""
  args = accumulate_args(dp, state, records, owners)
  accumulate = harness.compile_timed(dp.functions.accumulate, *args)
  update = harness.compile_timed(
      dp.functions.update, state.trainable, state.opt_state, args[2]
  )
  return accumulate, update, args


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


QUICK = Sizes(**TOY_SWITCH, seq_len=12, lora_alpha=4.0)
QUICK = dataclasses.replace(QUICK, buckets=8, max_distance=20)
HF_L2_CLIP = 0.05  # vs_opacus' and epoch_time's: most records clipped


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
  return batch(m, sizes.seq_len, sizes.vocab_size, sizes.num_experts, seed=seed)


def raptor_nonprivate(module, params, batch):
  """(step, mean-loss gradients) of the trainer's non-private LoRA step
  (attention adapters and head; `raptor_dp` of 'nonprivate')."""
  return raptor_dp(module, params, batch, None, None, 'nonprivate')


def stream_step(module, params, sizes: Sizes, stream: str, batch_size: float):
  """(PhaseStep, its state) of `stream` ('shared', 'expert': DP, clip
  HF_L2_CLIP; 'nonprivate') at expected batch `batch_size` (the denominator,
  over E for the expert stream), on a mesh of every device."""
  expert = stream == 'expert'
  phase, extra = stream_phase(
      stream,
      batch_size / (sizes.num_experts if expert else 1),
      sizes.expert_layer if expert else None,
      l2_clip=HF_L2_CLIP,
  )
  dp = phase_step(module, phase, key=jax.random.key(0), devices=0, **extra)
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
  dp, state = stream_step(module, params, sizes, stream, m)
  host = host_batch(*batch, owners)
  sums = dp.accumulate(state, dp.zero_sums(state), host)
  (part,) = dp.phase.parts
  update = {
      p: np.asarray(v) / part.denominator for p, v in sums[part.name].items()
  }

  def step():
    return dp.update(state, dp.accumulate(state, dp.zero_sums(state), host))

  return step, update
