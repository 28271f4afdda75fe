r"""The one GPU check: the trainer's steps of a switch-base-8-shaped classifier.

For a lent accelerator (`launch/bench/gpu_check.sh` runs it with the OLMoE
layer of `gpu_dispatch` and a time budget). Each row is one (dtype,
expert dispatch, kernels) setting of a randomly initialised classifier of
switch-base-8's shape (12 blocks, every 2nd sparse, E = 8, d_model 768,
d_ff 3072, 12 heads; LoRA r = 8 on attention and on l*'s experts, l* the
last sparse block), timed through the trainer's `PhaseStep` (`benchmark.
dp_step`): the shared DP step and the expert DP step at expected batch
1000, run as the trainer runs it, ceil(1000 / m) microbatches of m records
(seq 128) accumulated, then one noisy update. Printed per row and stream:

* ms per microbatch (median of --repeats) and the projected step at B=1000
  (microbatches x that + one update);
* XLA's buffers of the compiled accumulate (arguments + outputs + temps) and
  the device's peak memory in use (process-wide: each row runs in its own
  child process where the device reports it);
* the fraction of the device's measured matmul peak (a GEMM of the model's
  d_model x d_ff shape in the row's dtype, timed in the same process) that
  the microbatch's FLOPs reach (XLA's cost analysis of the compiled
  accumulate, scans counted fully: `profiling.loop_corrected_flops`; every
  executed FLOP, padding tokens included).

A second table times DeepSeek-VL2-Tiny's language model (12 blocks, the
first dense, E = 64 routed top-6 + 2 shared, hidden 1280, 10 heads, plain
multi-head attention; LoRA r = 8 on attention, the shared experts and the
last block's routed experts) at the sequence lengths real image records
have: 1 + 421 image tokens (one local tile) or 1 + 617 (two) plus the
prompt, run in the image config's buckets 512 and 768. The frozen tower
runs once per record before training (`train.vision`), so a step costs
what a text step of that length costs.

  python -m launch.bench.gpu_check                  # on the GPU
  python -m launch.bench.gpu_check --quick          # toy sizes, any backend
"""

import sys

from raptor_jax import host_memory

host_memory.keep_unless_disabled(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import json
import math
import os
import subprocess
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from launch.bench import benchmark
from launch.bench import harness
from launch.bench import profiling
from raptor_jax import models

SWITCH_BASE_8 = dict(
    vocab_size=32128,
    d_model=768,
    d_kv=64,
    d_ff=3072,
    num_layers=12,
    num_heads=12,
    num_experts=8,
    expert_capacity=64,
)
QUICK = dict(
    vocab_size=50,
    d_model=16,
    d_kv=8,
    d_ff=32,
    num_layers=2,
    num_heads=2,
    num_experts=4,
    expert_capacity=5,
    lora_rank=2,
)
# DeepSeek-VL2-Tiny's language model (docs/models.md) and a toy twin.
VL2_TINY = dict(
    vocab_size=129280,
    hidden_size=1280,
    intermediate_size=6848,
    moe_intermediate_size=896,
    num_hidden_layers=12,
    num_attention_heads=10,
    num_key_value_heads=10,
    use_mla=False,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
)
VL2_QUICK = dict(
    VL2_TINY,
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
)
# (seq_len, microbatch): the image config's buckets for one and two local
# tiles (configs/deepseek_vl2_scienceqa.py), in bfloat16, grouped dispatch.
VL2_ROWS = ((512, 16), (768, 16))
EXPECTED_BATCH = 1000
# (dtype, dispatch, kernels) rows: every dispatch in bfloat16 with the
# default kernels, and the grouped dispatch in float32 and with the plain
# reference kernels (what 'auto' runs on a GPU for attention and LoRA).
ROWS = (
    ('bfloat16', 'grouped', 'auto'),
    ('bfloat16', 'ragged', 'auto'),
    ('bfloat16', 'tokamax', 'auto'),
    ('bfloat16', 'grouped', 'fast'),
    ('float32', 'grouped', 'auto'),
)


def define_flags() -> None:
  flags.DEFINE_bool('quick', False, 'Toy sizes, one repeat: a smoke test.')
  flags.DEFINE_integer('microbatch', 64, 'Records per microbatch (m).')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record.')
  flags.DEFINE_integer('repeats', 5, 'Timed calls per step.')
  flags.DEFINE_enum(
      'isolate',
      'auto',
      ['auto', 'yes', 'no'],
      'Each row in its own process (auto: where the device reports a peak).',
  )
  flags.DEFINE_string('child', '', 'Internal: one row as JSON.')
  flags.DEFINE_bool(
      'keep_host_memory', True, host_memory.FLAG_HELP, short_name=None
  )


def matmul_peak_tflops(m: int, k: int, n: int, dtype: str, repeats: int):
  """TFLOP/s of an [m, k] @ [k, n] product in `dtype` on this device."""
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  a = jax.random.normal(keys[0], (m, k), dtype)
  b = jax.random.normal(keys[1], (k, n), dtype)
  product = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(product(a, b))
  times = []
  for _ in range(max(repeats, 3)):
    start = time.perf_counter()
    jax.block_until_ready(product(a, b))
    times.append(time.perf_counter() - start)
  return 2 * m * k * n / harness.median(times) / 1e12


def _peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get('peak_bytes_in_use')


def _time(call, repeats: int) -> float:
  jax.block_until_ready(call())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return harness.median(times)


def vl2_config(quick: bool, **options):
  """DeepSeek-VL2-Tiny's decoder (or its toy twin) with the trainer's LoRA:
  attention and shared experts (shared stream), l*'s routed experts."""
  config = models.deepseek.DeepseekConfig(
      **(VL2_QUICK if quick else VL2_TINY),
      lora_rank=8,
      attention_lora=True,
      shared_expert_lora=True,
      **options,
  )
  layer = config.sparse_layers[-1]
  return dataclasses.replace(
      config, expert_lora_layers=(layer,), unscanned_layers=(layer,)
  )


def vl2_build(config, seq_len: int, seed: int = 0):
  """(module, params): the decoder under a 5-letter bias-free head, last token."""
  module = models.SequenceClassifier(
      models.deepseek.DeepseekDecoder(config),
      num_labels=5,
      pooling='last',
      head_bias=False,
  )
  ids = jnp.zeros((1, seq_len), jnp.int32)
  params = models.init_params(
      module, jax.random.PRNGKey(seed), (ids, jnp.ones_like(ids))
  )
  return module, params


def measure(
    dtype: str,
    dispatch: str,
    kernels: str,
    *,
    quick: bool,
    microbatch: int,
    seq_len: int,
    repeats: int,
    family: str = 'switch',
) -> dict:
  """One row: both streams' times, memory and peak fraction (or `error`).

  `family`: 'switch' (switch-base-8's shape) or 'deepseek_vl2'
  (DeepSeek-VL2-Tiny's language model, `VL2_TINY`).
  """
  row = dict(dtype=dtype, dispatch=dispatch, kernels=kernels)
  try:
    if family == 'deepseek_vl2':
      row.update(model='deepseek-vl2-tiny', seq_len=seq_len)
      config = vl2_config(
          quick, dispatch=dispatch, kernels=kernels, dtype=dtype
      )
      module, params = vl2_build(config, seq_len)
      d_model, d_ff = config.hidden_size, config.moe_intermediate_size
    else:
      sizes = dict(QUICK if quick else SWITCH_BASE_8)
      config = benchmark.model_config(
          **sizes, dispatch=dispatch, kernels=kernels, dtype=dtype
      )
      module, params = benchmark.build(config, seq_len)
      d_model, d_ff = config.d_model, config.d_ff
    records, owners = benchmark.batch(
        microbatch, seq_len, config.vocab_size, config.num_experts
    )
    layer = config.sparse_layers[-1]
    phases = {
        'shared': benchmark.stream_phase('shared', float(EXPECTED_BATCH)),
        'expert': benchmark.stream_phase(
            'expert', EXPECTED_BATCH / config.num_experts, layer
        ),
    }
    peak = matmul_peak_tflops(4096, d_model, d_ff, jnp.dtype(dtype), repeats)
    row['matmul_tflops'] = peak
    microbatches = math.ceil(EXPECTED_BATCH / microbatch)
    for stream, (phase, extra) in phases.items():
      state, (accumulate, compiled, args), _, call = benchmark.dp_step(
          module,
          params,
          phase,
          records,
          owners,
          key=jax.random.key(0),
          **extra,
      )
      accumulate_s = _time(lambda: compiled.compiled(*args), repeats)
      step_s = _time(call, repeats)
      update_s = max(step_s - accumulate_s, 0.0)
      stats = profiling.memory_stats(compiled.compiled) or {}
      _, flops = profiling.loop_corrected_flops(
          accumulate, *args, compiled=compiled.compiled
      )
      row[stream] = dict(
          microbatch_ms=accumulate_s * 1e3,
          step_ms=(microbatches * accumulate_s + update_s) * 1e3,
          xla_mib=sum(stats.get(k, 0) for k in ('argument', 'output', 'temp'))
          / 2**20,
          peak_fraction=(
              flops / accumulate_s / 1e12 / peak if flops == flops else None
          ),
      )
      del state, accumulate
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, error=str(e).strip().splitlines()[0][:160])
  peak_bytes = _peak_bytes()
  row['peak_mib'] = None if peak_bytes is None else peak_bytes / 2**20
  return row


def _measure_in_child(spec: dict) -> dict:
  """`measure(**spec)` in a fresh process (its own device peak)."""
  done = subprocess.run(
      [
          sys.executable,
          '-m',
          'launch.bench.gpu_check',
          '--child=' + json.dumps(spec),
      ],
      capture_output=True,
      text=True,
      check=False,
      env=dict(os.environ),
  )
  for line in done.stdout.splitlines():
    if line.startswith('ROW '):
      return json.loads(line[4:])
  tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
  keys = ('dtype', 'dispatch', 'kernels')
  row = dict({k: spec[k] for k in keys}, error=tail[:160])
  if spec.get('family') == 'deepseek_vl2':
    row.update(model='deepseek-vl2-tiny', seq_len=spec['seq_len'])
  return row


def table(rows: list[dict], microbatch: int) -> str:
  header = [
      'dtype',
      'dispatch',
      'kernels',
      'stream',
      f'ms / microbatch (m={microbatch})',
      f'ms / step (B={EXPECTED_BATCH})',
      'XLA MiB',
      'device peak MiB',
      'matmul TF/s',
      'of peak',
  ]
  vl2 = any('model' in r for r in rows)
  if vl2:
    header = ['model', 'seq'] + header
  body = []
  for r in rows:
    cells = [r['dtype'], r['dispatch'], r['kernels']]
    if vl2:
      cells = [r.get('model', ''), str(r.get('seq_len', ''))] + cells
    if 'error' in r:
      body.append(cells + ['-', 'did not run: ' + r['error']] + [''] * 5)
      continue
    for stream in ('shared', 'expert'):
      s = r[stream]
      fraction = s['peak_fraction']
      body.append(
          cells
          + [
              stream,
              f"{s['microbatch_ms']:.1f}",
              f"{s['step_ms']:.0f}",
              f"{s['xla_mib']:.0f}",
              '-' if r['peak_mib'] is None else f"{r['peak_mib']:.0f}",
              f"{r['matmul_tflops']:.2f}",
              '-' if fraction is None else f'{fraction:.1%}',
          ]
      )
  return harness.format_table(header, body)


# --quick: one row per dispatch family of code paths (a smoke test).
QUICK_ROWS = (('float32', 'grouped', 'auto'), ('bfloat16', 'tokamax', 'auto'))


def run(*, quick: bool, microbatch: int, seq_len: int, repeats: int, isolate):
  rows = []
  for dtype, dispatch, kernels in QUICK_ROWS if quick else ROWS:
    spec = dict(
        dtype=dtype,
        dispatch=dispatch,
        kernels=kernels,
        quick=quick,
        microbatch=microbatch,
        seq_len=seq_len,
        repeats=repeats,
    )
    rows.append(_measure_in_child(spec) if isolate else measure(**spec))
    print('.', end='', flush=True, file=sys.stderr)
  print(file=sys.stderr)
  return rows


def run_vl2(*, quick: bool, repeats: int, isolate) -> list[dict]:
  """DeepSeek-VL2-Tiny rows at the image records' lengths (`VL2_ROWS`)."""
  rows = []
  for seq_len, microbatch in ((24, 2), (32, 2)) if quick else VL2_ROWS:
    spec = dict(
        dtype='bfloat16',
        dispatch='grouped',
        kernels='auto',
        quick=quick,
        microbatch=microbatch,
        seq_len=seq_len,
        repeats=repeats,
        family='deepseek_vl2',
    )
    rows.append(_measure_in_child(spec) if isolate else measure(**spec))
    print('.', end='', flush=True, file=sys.stderr)
  print(file=sys.stderr)
  return rows


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if FLAGS.child:
    spec = json.loads(FLAGS.child)
    print('ROW ' + json.dumps(measure(**spec)), flush=True)
    return
  quick = FLAGS.quick
  microbatch, seq_len = (2, 8) if quick else (FLAGS.microbatch, FLAGS.seq_len)
  device = jax.devices()[0]
  isolate = FLAGS.isolate == 'yes' or (
      FLAGS.isolate == 'auto' and _peak_bytes() is not None
  )
  print(
      f'{device.device_kind} ({device.platform}), jax {jax.__version__}; '
      f"{'toy sizes' if quick else 'switch-base-8 shape'}, m={microbatch}, "
      f'seq {seq_len}, B={EXPECTED_BATCH}; rows '
      f"{'in child processes' if isolate else 'in this process'}",
      flush=True,
  )
  rows = run(
      quick=quick,
      microbatch=microbatch,
      seq_len=seq_len,
      repeats=1 if quick else FLAGS.repeats,
      isolate=isolate,
  )
  print(table(rows, microbatch))
  vl2 = run_vl2(
      quick=quick, repeats=1 if quick else FLAGS.repeats, isolate=isolate
  )
  print(table(vl2, 'per row'))


if __name__ == '__main__':
  define_flags()
  app.run(main)
