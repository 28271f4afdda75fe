r"""Part 3 of the GPU check: switch-base-8's DP steps at B = 1000, GPU defaults.

`launch/bench/gpu_check.sh` runs it under its own time budget: a random
classifier of switch-base-8's shape (12 blocks, every 2nd sparse, E = 8;
LoRA r = 8 on attention and on l*'s experts) in bfloat16 with every option
at its default ('auto' dispatch and kernels, resolved for this backend).
Each line is printed as soon as it is known: the set-up seconds, then per
stream (shared, expert; the trainer's `PhaseStep`) a probe compile at
m = --probe records whose XLA memory plan gives the microbatch m
(`choose_microbatch`), the compile seconds at m, and the step at expected
batch 1000 (ceil(1000 / m) accumulates, one noisy update; median of
--repeats) with the accumulate's TFLOP/s.

  python -m launch.bench.gpu_check                  # on the GPU
  python -m launch.bench.gpu_check --quick          # toy sizes, any backend
"""

import sys

from raptor_jax import host_memory

host_memory.keep_unless_disabled(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import math
import time

from absl import app
from absl import flags
import jax

from launch.bench import builders
from launch.bench import harness
from raptor_jax.models import dispatch as dispatch_lib
from raptor_jax.models import kernels as kernels_lib

SWITCH_BASE_8 = dict(builders.SWITCH_BASE_8, vocab_size=32128, num_layers=12)
QUICK = builders.TOY_SWITCH
EXPECTED_BATCH = 1000
# Of the device's memory, the share the accumulate's plan may take (the rest:
# the update, the runtime, fragmentation).
MEMORY_SHARE = 0.6
MAX_MICROBATCH = 512


def define_flags() -> None:
  flags.DEFINE_bool('quick', False, 'Toy sizes, one repeat: a smoke test.')
  flags.DEFINE_integer('probe', 16, 'Records of the probe compile.')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record.')
  flags.DEFINE_integer('repeats', 3, 'Timed steps per stream (median).')
  flags.DEFINE_string('dtype', 'bfloat16', 'Activation dtype.')
  flags.DEFINE_bool(
      'keep_host_memory', True, host_memory.FLAG_HELP, short_name=None
  )


say = functools.partial(print, flush=True)


def choose_microbatch(plan: dict, probe: int, device_bytes) -> int:
  """The microbatch m that the memory plan (`harness.memory_stats`) of a
  probe compile at `probe` records allows on `device_bytes` (None: m =
  probe): temporaries taken as all per record (an over-estimate),
  arguments and outputs as fixed; the largest power of two that fits in
  `MEMORY_SHARE` of the device, in [1, min(MAX_MICROBATCH, the batch)]. A
  function of the shapes and the device, never of the data."""
  if not device_bytes:
    return probe
  fixed = plan.get('argument', 0) + plan.get('output', 0)
  per_record = max(plan.get('temp', 0) / probe, 1.0)
  fits = (MEMORY_SHARE * device_bytes - fixed) / per_record
  cap = min(MAX_MICROBATCH, EXPECTED_BATCH)
  return 1 if fits < 1 else int(min(cap, 2 ** int(math.log2(fits))))


def stream(name, module, params, config, *, probe, seq_len, repeats):
  """Prints one stream's lines: probe, compile, step at B = 1000."""
  layer = config.sparse_layers[-1]
  denominator = EXPECTED_BATCH / (config.num_experts if name == 'expert' else 1)
  phase, extra = builders.stream_phase(name, float(denominator), layer)
  dp = builders.phase_step(module, phase, key=jax.random.key(0), **extra)
  state = dp.init(params)
  device_bytes = harness.device_memory('bytes_limit')
  # (compiled accumulate, compiled update, the accumulate's arguments) at m.
  programs = lambda m: builders.compile_phase(
      dp,
      state,
      *builders.batch(m, seq_len, config.vocab_size, config.num_experts),
  )
  accumulate, update, args = programs(probe)
  plan = harness.memory_stats(accumulate.compiled) or {}
  m = choose_microbatch(plan, probe, device_bytes)
  mib = lambda b: f'{b / 2**20:.0f} MiB'
  memory = mib(device_bytes) if device_bytes else 'no device memory reported'
  say(
      f'{name}: probe m={probe}: compile'
      f' {accumulate.lower_s + accumulate.compile_s:.1f} s, plan'
      f" {mib(sum(plan.get(k, 0) for k in ('argument', 'output', 'temp')))}"
      f' (temp {mib(plan.get("temp", 0))}) of {memory} -> m={m}'
  )
  if m != probe:
    accumulate, update, args = programs(m)
  acc_s = accumulate.lower_s + accumulate.compile_s
  upd_s = update.lower_s + update.compile_s
  say(
      f'{name}: compile {acc_s + upd_s:.1f} s at m={m} (accumulate'
      f' {accumulate.lower_s:.1f} + {accumulate.compile_s:.1f} s, update'
      f' {update.lower_s:.1f} + {update.compile_s:.1f} s; lower + compile)'
  )
  trainable, frozen, _, batch, mask = args
  acc, upd = accumulate.compiled, update.compiled
  microbatches = math.ceil(EXPECTED_BATCH / m)

  def one_microbatch():
    return acc(trainable, frozen, dp.zero_sums(state), batch, mask)

  def one_step():
    sums = dp.zero_sums(state)
    for _ in range(microbatches):
      sums = acc(trainable, frozen, sums, batch, mask)
    return upd(trainable, state.opt_state, sums)

  micro_s = harness.median(harness.call_times(one_microbatch, repeats))
  step_s = harness.median(harness.call_times(one_step, repeats))
  flops = harness.flops(acc)
  rate = f'{flops / micro_s / 1e12:.1f} TFLOP/s' if flops == flops else '-'
  say(
      f'{name}: step B={EXPECTED_BATCH}: {step_s:.3f} s ({microbatches} x m={m};'
      f' one microbatch {micro_s * 1e3:.1f} ms, accumulate {rate})'
  )


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  quick = FLAGS.quick
  probe, seq_len = (2, 8) if quick else (FLAGS.probe, FLAGS.seq_len)
  repeats = 1 if quick else FLAGS.repeats
  device = jax.devices()[0]
  backend = jax.default_backend()
  say(
      f'{device.device_kind} ({device.platform}), jax {jax.__version__};'
      f" {'toy sizes' if quick else 'switch-base-8 shape'}, {FLAGS.dtype},"
      f' seq {seq_len}, B={EXPECTED_BATCH}; defaults: dispatch'
      f" {dispatch_lib.resolve_dispatch('auto', backend)}, kernels"
      f" {kernels_lib.resolve('auto', backend)}"
  )
  start = time.perf_counter()
  sizes = dict(QUICK if quick else SWITCH_BASE_8)
  config = builders.model_config(**sizes, dtype=FLAGS.dtype)
  module, params = builders.build(config, seq_len)
  jax.block_until_ready(params)
  say(f'set-up: {time.perf_counter() - start:.1f} s (model and parameters)')
  for name in ('shared', 'expert'):
    options = dict(probe=probe, seq_len=seq_len, repeats=repeats)
    stream(name, module, params, config, **options)


if __name__ == '__main__':
  define_flags()
  app.run(main)
