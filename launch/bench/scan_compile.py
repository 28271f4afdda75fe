r"""Compile time against depth: scanned blocks against the unrolled twin.

  python -m launch.bench.scan_compile
  python -m launch.bench.scan_compile --depths=2,12 --dtypes=bfloat16

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  from raptor_jax import host_memory as _host_memory

  _host_memory.keep_unless_disabled(sys.argv)

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import benchmark
from launch.bench import profiling
from raptor_jax import models
from raptor_jax.train import parallel

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command-line flags; only when run as a script, so that tests
  can import several scripts into one process."""
  flags.DEFINE_list('depths', ['2', '12'], 'Blocks of each row.')
  flags.DEFINE_list('dtypes', ['float32', 'bfloat16'], 'Dtypes.')
  flags.DEFINE_integer('microbatch', 8, 'Records per microbatch.')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record.')
  flags.DEFINE_integer('vocab_size', 8000, 'Reduced vocabulary.')
  flags.DEFINE_list('streams', ['shared', 'expert'], 'Streams.')
  flags.DEFINE_integer('passes', 2, 'Rounds over every row.')


BASE_8 = dict(
    d_model=768,
    d_kv=64,
    d_ff=3072,
    num_heads=12,
    num_experts=8,
    expert_capacity=64,
)


def _seconds(fn) -> tuple[float, object]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def row(
    num_layers: int,
    scan: bool,
    dtype: str,
    *,
    m: int,
    seq_len: int,
    vocab_size: int,
    streams,
) -> dict:
  """One row's seconds: set-up, forward compile, each stream's compile."""
  config = benchmark.model_config(
      **BASE_8,
      num_layers=num_layers,
      vocab_size=vocab_size,
      dtype=dtype,
      scan_layers=scan,
  )
  module = models.SequenceClassifier(models.SwitchEncoder(config), 2)
  ids = jnp.zeros((1, seq_len), jnp.int32)
  args = (ids, jnp.ones_like(ids))
  out = dict(blocks=num_layers, scan=scan, dtype=dtype)
  out['init_params_s'], params = _seconds(
      lambda: models.init_params(module, jax.random.key(0), args)
  )
  if dtype == 'float32':
    out['jit_init_s'], _ = _seconds(
        lambda: jax.jit(module.init)(jax.random.key(0), *args)
    )
  records, owners = benchmark.batch(m, seq_len, vocab_size, config.num_experts)
  forward = profiling.compile_timed(
      module.apply, {'params': params}, *records[:2]
  )
  out['forward_s'] = forward.lower_s + forward.compile_s
  layer = config.sparse_layers[-1]
  for stream in streams:
    denominator = float(m) / (config.num_experts if stream == 'expert' else 1)
    phase, extra = benchmark.stream_phase(stream, denominator, layer)
    dp = benchmark.phase_step(module, phase, key=jax.random.key(1), **extra)
    state = dp.init(params)
    placed = parallel.shard_records(
        (benchmark.host_batch(*records, owners), np.ones(m, np.float32)),
        dp.mesh,
    )
    args = (state.trainable, state.frozen, dp.zero_sums(state), *placed)
    compiled = profiling.compile_timed(dp.functions.accumulate, *args)
    out[f'{stream}_accumulate_s'] = compiled.lower_s + compiled.compile_s
    runs = [_seconds(lambda: compiled.compiled(*args))[0] for _ in range(3)]
    out[f'{stream}_run_s'] = float(np.median(runs))
  return out


def _cell(value) -> str:
  if isinstance(value, float):
    return f'{value:>12.2f}'
  return f'{value!s:>12}'


def main(argv):
  del argv
  settings = [
      (dtype, depth, scan)
      for _ in range(FLAGS.passes)
      for dtype in FLAGS.dtypes
      for depth in map(int, FLAGS.depths)
      for scan in (True, False)
  ]
  columns = None
  for dtype, depth, scan in settings:
    r = row(
        depth,
        scan,
        dtype,
        m=FLAGS.microbatch,
        seq_len=FLAGS.seq_len,
        vocab_size=FLAGS.vocab_size,
        streams=FLAGS.streams,
    )
    r.setdefault('jit_init_s', float('nan'))
    if columns is None:
      columns = list(r)
      print(' '.join(f'{c[:12]:>12}' for c in columns), flush=True)
    print(' '.join(_cell(r[c]) for c in columns), flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
