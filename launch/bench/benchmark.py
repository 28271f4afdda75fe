r"""Benchmarks a DP training step against a non-private one, and expert-stream memory.

  python -m launch.bench.benchmark
  python -m launch.bench.benchmark --microbatch_sizes=32 --expert_num_experts=8,64 \
      --num_layers=12 --d_model=768 --d_ff=3072 --num_heads=12   # base width
  python -m launch.bench.benchmark --family=olmoe --microbatch_sizes=   # expert stream only

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  from raptor_jax import host_memory as _host_memory

  _host_memory.keep_unless_disabled(sys.argv)

import dataclasses

from absl import app
from absl import flags
import jax
import numpy as np

from launch.bench import builders
from launch.bench import harness

FAMILIES = ('switch', 'olmoe')


def define_flags() -> None:
  """Defines the flags; only when run as a script (tests import several)."""
  flags.DEFINE_enum('family', 'switch', list(FAMILIES), 'switch or olmoe.')
  flags.DEFINE_integer('top_k', 8, 'Experts per token (olmoe; Switch: 1).')
  flags.DEFINE_list('microbatch_sizes', ['8', '32', '128'], 'Shared-stream m.')
  flags.DEFINE_list('expert_num_experts', ['8', '64'], 'E of the expert step.')
  flags.DEFINE_integer('expert_microbatch', 32, 'm of the expert step.')
  for name, default in builders.SWITCH_SMALL.items():  # the model's sizes
    flags.DEFINE_integer(name, default, f'{name} (Switch names; the model).')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record.')
  flags.DEFINE_integer('repeats', 5, 'Timed rounds per variant.')


_MB = 2.0**20


def dp_step(module, params, phase, records, owners, *, key, **kwargs):
  """(state, (jitted accumulate, its compiled program, its arguments),
  update compile seconds, call) of the trainer's `PhaseStep` of `phase` on
  one device: `call()` runs one step on the microbatch exactly as training
  does (zero sums, accumulate, update)."""
  dp = builders.phase_step(module, phase, key=key, **kwargs)
  state = dp.init(params)
  compiled, update, args = builders.compile_phase(dp, state, records, owners)
  batch = builders.host_batch(*records, owners)

  def call():
    return dp.update(state, dp.accumulate(state, dp.zero_sums(state), batch))

  update_s = update.lower_s + update.compile_s
  return state, (dp.functions.accumulate, compiled, args), update_s, call


def _num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def run_shared(
    config, *, microbatch_sizes=(8, 32, 128), seq_len=128, repeats=5
):
  """The trainer's non-private vs DP shared-stream step (attention LoRA +
  head) per microbatch size m; one dict per m."""
  module, params = builders.build(config, seq_len)
  rows = []
  for m in microbatch_sizes:
    records, owners = builders.batch(
        m, seq_len, config.vocab_size, config.num_experts, seed=m
    )
    calls, row = {}, {'m': m}
    for name, stream in (('nonprivate', 'nonprivate'), ('dp', 'shared')):
      phase, _ = builders.stream_phase(stream, float(m))
      state, (_, compiled, _), update_s, calls[name] = dp_step(
          module, params, phase, records, owners, key=jax.random.key(0)
      )
      row[f'{name}_compile_s'] = (
          compiled.lower_s + compiled.compile_s + update_s
      )
      stats = harness.memory_stats(compiled.compiled)
      row[f'{name}_temp_mb'] = stats['temp'] / _MB if stats else float('nan')
    row['trainable'] = _num_params(state.trainable)
    row['frozen'] = _num_params(state.frozen)
    pair = ('dp', 'nonprivate')
    ms, ratios = harness.interleaved_medians(
        calls, repeats=repeats, pairs=[pair]
    )
    row.update({f'{name}_ms': v for name, v in ms.items()})
    row['dp_over_nonprivate'] = ratios[pair]
    rows.append(row)
  return rows


def run_expert(config, *, num_experts=(8, 64), microbatch=32, **options):
  """(rows, largest buffers) of RAPTOR's expert step per E as the trainer
  runs it (l*'s owner slices, denominator m/E): memory, FLOPs and time.
  `options`: seq_len (128), repeats (5), num_buffers (8)."""
  seq_len, repeats = options.get('seq_len', 128), options.get('repeats', 5)
  rows, calls, buffers = [], {}, {}
  for e in num_experts:
    cfg = dataclasses.replace(config, num_experts=e)
    layer = cfg.expert_lora_layers[0]
    module, params = builders.build(cfg, seq_len)
    records, owners = builders.batch(
        microbatch, seq_len, cfg.vocab_size, e, seed=e
    )
    phase, extra = builders.stream_phase('expert', microbatch / e, layer)
    state, (accumulate, compiled, args), update_s, calls[e] = dp_step(
        module, params, phase, records, owners, key=jax.random.key(1), **extra
    )
    stats = harness.memory_stats(compiled.compiled) or {}
    _, step_flops = harness.loop_corrected_flops(
        accumulate, *args, compiled=compiled.compiled
    )
    params = _num_params(state.trainable)
    row = dict(E=e, layer=layer, m=microbatch, expert_lora_params=params)
    row['frozen_params'] = _num_params(state.frozen)
    row['per_record_grad_mb'] = microbatch * (params // e) * 4 / _MB
    for k in ('temp', 'argument', 'output'):
      row[f'{k}_mb'] = stats.get(k, float('nan')) / _MB
    row['gflop'] = step_flops / 1e9
    row['compile_s'] = compiled.lower_s + compiled.compile_s + update_s
    rows.append(row)
    count = options.get('num_buffers', 8)
    buffers[e] = harness.largest_buffers(compiled.compiled, count)
  first = num_experts[0]
  ms, ratios = harness.interleaved_medians(
      calls, repeats=repeats, pairs=[(e, first) for e in num_experts]
  )
  for row in rows:
    row['step_ms'] = ms[row['E']]
    row['temp_over_first'] = row['temp_mb'] / rows[0]['temp_mb']
    row['flops_over_first'] = row['gflop'] / rows[0]['gflop']
    row['time_over_first'] = ratios[row['E'], first]
  return rows, buffers


SHARED_COLUMNS = (  # (header, key or keys, format)
    ('m', 'm', ''),
    ('non-private ms', 'nonprivate_ms', '.1f'),
    ('DP ms', 'dp_ms', '.1f'),
    ('DP/non-private', 'dp_over_nonprivate', '.2f'),
    (
        'compile s (non-priv, DP)',
        ('nonprivate_compile_s', 'dp_compile_s'),
        '.1f',
    ),
    ('temp MB (non-priv, DP)', ('nonprivate_temp_mb', 'dp_temp_mb'), '.1f'),
)
EXPERT_COLUMNS = (
    ('E', 'E', ''),
    ('expert LoRA params', 'expert_lora_params', ''),
    ('per-record grads MB', 'per_record_grad_mb', '.2f'),
    ('temp MB', 'temp_mb', '.1f'),
    ('temp / first', 'temp_over_first', '.2f'),
    ('argument MB', 'argument_mb', '.1f'),
    ('output MB', 'output_mb', '.2f'),
    ('GF (loops x trips)', 'gflop', '.1f'),
    ('GF / first', 'flops_over_first', '.2f'),
    ('step ms', 'step_ms', '.1f'),
    ('time / first', 'time_over_first', '.2f'),
    ('compile s', 'compile_s', '.1f'),
)


def shared_table(rows: list[dict]) -> str:
  return harness.dict_table(SHARED_COLUMNS, rows)


def expert_table(rows: list[dict]) -> str:
  return harness.dict_table(EXPERT_COLUMNS, rows)


def buffer_table(buffers: list[harness.Buffer]) -> str:
  op = lambda b: '/'.join(b.op_name.split('/')[-4:])
  body = [[f'{b.nbytes / _MB:.1f}', b.shape, b.opcode, op(b)] for b in buffers]
  return harness.format_table(['MB', 'shape', 'HLO op', 'JAX op'], body)


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  sizes = {n: FLAGS[n].value for n in builders.SMALL}
  if FLAGS.family == 'olmoe':
    config = builders.olmoe_config(
        **builders.decoder_sizes(sizes), num_experts_per_tok=FLAGS.top_k
    )
    routing = f'top-{config.top_k}, SwiGLU experts'
  else:
    config = builders.model_config(
        **{n: FLAGS[n].value for n in builders.SWITCH_SMALL}
    )
    routing = f'top-1, capacity {config.expert_capacity}'
  print(
      f'{FLAGS.family} classifier: d_model={FLAGS.d_model} d_ff={FLAGS.d_ff} '
      f'layers={FLAGS.num_layers} (sparse {list(config.sparse_layers)}, {routing}) '
      f'heads={FLAGS.num_heads} vocab={config.vocab_size} S={FLAGS.seq_len} '
      f'LoRA r={config.lora_rank}; {jax.devices()[0].platform}, jax {jax.__version__}; '
      f'medians of {FLAGS.repeats} interleaved rounds',
      flush=True,
  )
  options = dict(seq_len=FLAGS.seq_len, repeats=FLAGS.repeats)
  if FLAGS.microbatch_sizes:
    sizes_m = [int(m) for m in FLAGS.microbatch_sizes]
    shared = run_shared(config, microbatch_sizes=sizes_m, **options)
    print(
        f"\nShared stream, E={config.num_experts}: {shared[0]['trainable']:,} trainable "
        f"(attention LoRA + head), {shared[0]['frozen']:,} frozen parameters"
    )
    print(shared_table(shared), flush=True)
  num_experts = [int(e) for e in FLAGS.expert_num_experts]
  expert, buffers = run_expert(
      config,
      num_experts=num_experts,
      microbatch=FLAGS.expert_microbatch,
      **options,
  )
  print(
      f"\nExpert stream at block {expert[0]['layer']}, m={expert[0]['m']} "
      '(XLA memory analysis; temp excludes arguments, so parameters)'
  )
  print(expert_table(expert))
  for row in expert[:1] + expert[1:][-1:]:  # the smallest and the largest E
    print(f"\nLargest buffers of the E={row['E']} expert step (optimized HLO)")
    print(buffer_table(buffers[row['E']]))


if __name__ == '__main__':
  define_flags()
  app.run(main)
