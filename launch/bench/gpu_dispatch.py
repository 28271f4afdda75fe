r"""Step time and memory of one sparse layer per expert dispatch, on an accelerator.

  python -m launch.bench.gpu_dispatch               # on the GPU machine
  python -m launch.bench.gpu_dispatch --ragged_lowerings=xla   # one lowering
  python -m launch.bench.gpu_dispatch --quick       # toy sizes, any backend
  python -m launch.bench.gpu_dispatch --compile_only --isolate=no   # CPU

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import bench_dispatch
from launch.bench import harness
from raptor_jax.data import images

# DeepSeek-VL2-Tiny's records: a 640 x 480 image tiles to 2 x 2 local tiles
# and the global view (candidates m x n tiles of 384 px, mn <= 9), 1,023
# positions, then 64 text tokens.
_TILINGS = [(m, n) for m in range(1, 10) for n in range(1, 10) if m * n <= 9]
VL2_TILES = images.TileSpec(tuple((384 * m, 384 * n) for m, n in _TILINGS))
_VL2_GRID = images.tile_grid((640, 480), VL2_TILES)
VL2_SEQ_LEN = images.num_image_tokens(*_VL2_GRID, VL2_TILES) + 64

# Per family: full-size layer and batch, and the --quick toy. Qwen3-30B-A3B,
# Mixtral-8x7B and DeepSeek-VL2-Tiny's routed experts run the decoder kit's
# layer (DeepSeek's shared experts are a dense MLP, outside any dispatch).
_KEYS = ('num_experts', 'd_model', 'd_ff', 'top_k', 'records')
SHAPES = {
    family: dict(full=dict(zip(_KEYS, full)), quick=dict(zip(_KEYS, quick)))
    for family, full, quick in (
        ('switch', (8, 768, 3072, 1, 32), (4, 16, 32, 1, 2)),
        ('olmoe', (64, 2048, 1024, 8, 8), (8, 16, 24, 2, 2)),
        ('qwen3_moe', (128, 2048, 768, 8, 8), (8, 16, 8, 4, 2)),
        ('mixtral', (8, 4096, 14336, 2, 4), (4, 16, 32, 2, 2)),
        ('deepseek_vl2', (64, 1280, 896, 6, 2), (8, 16, 8, 3, 2)),
    )
}
SHAPES['deepseek_vl2']['full']['seq_len'] = VL2_SEQ_LEN
MODES = ('lora', 'train')
VARIANTS = ('grouped', 'batched', 'ragged', 'tokamax', 'dense')
# The `dispatch` of each (mode, variant): frozen kernels for LoRA, trainable
# kernels otherwise ('dense' is differentiable in both).
DISPATCH = {
    (mode, v): v if mode == 'lora' or v == 'dense' else f'{v}_train'
    for mode in MODES
    for v in VARIANTS
}
LORA_RANK = 8
# ragged_dot's lowerings on a GPU: XLA's default (it may expand to a dense
# product), XLA's cuDNN grouped-GEMM fusion (an XLA flag: a child process),
# JAX's Pallas Triton kernel (a jax config option).
LOWERINGS = ('xla', 'cudnn', 'triton')
CUDNN_RAGGED_DOT_FLAG = '--xla_gpu_experimental_use_ragged_dot_fusion=true'


def define_flags() -> None:
  """Defines the flags; only when run as a script (tests import several)."""
  flags.DEFINE_bool('quick', False, 'Toy sizes (seconds on a CPU).')
  flags.DEFINE_list('families', list(SHAPES), 'Sparse layers to run.')
  flags.DEFINE_list('modes', list(MODES), 'lora (fine-tuning), train.')
  flags.DEFINE_list('variants', list(VARIANTS), 'Dispatches to run.')
  flags.DEFINE_integer('seq_len', None, 'Tokens per record (default 128).')
  flags.DEFINE_integer('repeats', 10, 'Timed calls per row (median).')
  flags.DEFINE_bool('compile_only', False, 'Compile each row, time nothing.')
  flags.DEFINE_list(
      'ragged_lowerings', None, f'From {list(LOWERINGS)} (GPU: all).'
  )
  flags.DEFINE_enum(
      'isolate', 'auto', ['auto', 'yes', 'no'], 'A child process per row.'
  )
  flags.DEFINE_string('child', '', 'Internal: run one row, print its JSON.')


def _step(family: str, mode: str, variant: str, quick: bool, seq_len: int):
  """(step function, its arguments, compiler options) of one row, in bfloat16."""
  shape = SHAPES[family]['quick' if quick else 'full']
  config = bench_dispatch.layer_config(
      'switch' if family == 'switch' else 'olmoe',  # the kit's top-k layer
      **{k: shape[k] for k in ('num_experts', 'd_model', 'd_ff', 'top_k')},
  )
  config = dataclasses.replace(
      config, dispatch=DISPATCH[mode, variant], dtype='bfloat16'
  )
  module = bench_dispatch.sparse_layer(config, LORA_RANK * (mode == 'lora'))
  # Host-side random data: no eager device computation besides the step.
  rng = np.random.default_rng(0)
  normal = lambda shape, std=1.0: jnp.asarray(
      std * rng.standard_normal(shape), jnp.bfloat16
  )
  x_shape = (shape['records'], seq_len, shape['d_model'])
  x, cotangent = normal(x_shape), normal(x_shape)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), x[:1])
  # Kernels at fan-in scale; LoRA B non-zero, as after a few steps.
  params = jax.tree.map(
      lambda s: normal(s.shape, s.shape[-2] ** -0.5), shapes['params']
  )

  def loss(p, x, ct):
    return jnp.vdot(module.apply({'params': p}, x)[0], ct).astype(jnp.float32)

  if mode == 'lora':
    adapters = {
        m: {k: v for k, v in leaves.items() if k.startswith('lora')}
        for m, leaves in params['experts'].items()
    }

    def record_loss(adapters, x, ct):
      experts = {m: {**params['experts'][m], **adapters[m]} for m in adapters}
      p = {**params, 'experts': experts}
      return loss(p, x[None], ct[None])

    step = jax.vmap(jax.grad(record_loss, argnums=(0, 1)), in_axes=(None, 0, 0))
    args = (adapters, x, cotangent)
  else:
    step = jax.grad(loss, argnums=(0, 1))
    args = (params, x, cotangent)
  # Toy sizes: skip XLA's LLVM optimisation, which dominates their compile.
  options = {'xla_backend_optimization_level': 0} if quick else None
  return step, args, options


def measure(family, mode, variant, *, lowering='xla', quick=False, **options):
  """One row: median step ms (None with `compile_only`), GFLOP, longest
  loop, XLA buffer MiB and device peak MiB (or None); a step that does not
  compile or run (e.g. out of memory) gives `error` instead. `lowering`:
  ragged_dot's ('xla', 'triton'; 'cudnn' is set by `_measure_in_child`).
  """
  row = dict(family=family, mode=mode, variant=variant, lowering=lowering)
  row['dispatch'] = _label(mode, variant, lowering)
  shape = SHAPES[family]['quick' if quick else 'full']
  seq_len = options.get('seq_len') or shape.get('seq_len')
  seq_len = seq_len or (8 if quick else 128)
  repeats = options.get('repeats', 10) * (not options.get('compile_only'))
  try:
    with _triton_lowering(lowering == 'triton'):
      step, args, compiler = _step(family, mode, variant, quick, seq_len)
      compiled = jax.jit(step, compiler_options=compiler).lower(*args).compile()
      _, flops = harness.loop_corrected_flops(step, *args, compiled=compiled)
    call = lambda: compiled(*args)
    times = harness.call_times(call, repeats) if repeats else []
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, error=harness.error_line(e))
  stats = harness.memory_stats(compiled) or {}
  xla = stats.get('argument', 0) + stats.get('output', 0) + stats.get('temp', 0)
  peak = harness.device_memory('peak_bytes_in_use')
  return dict(
      row,
      ms=harness.median(times) * 1e3 if times else None,
      gflop=flops / 1e9,
      trips=harness.max_while_trip_count(compiled.as_text()),
      xla_mib=xla / 2**20,
      peak_mib=None if peak is None else peak / 2**20,
  )


@contextlib.contextmanager
def _triton_lowering(enabled: bool):
  """JAX's Pallas Triton lowering of ragged_dot (GPU) while compiling."""
  name = 'jax_ragged_dot_use_gpu_pallas_triton_lowering'
  before = getattr(jax.config, name)
  jax.config.update(name, enabled)
  try:
    yield
  finally:
    jax.config.update(name, before)


def _label(mode: str, variant: str, lowering: str) -> str:
  dispatch = DISPATCH[mode, variant]
  return dispatch if variant != 'ragged' else f'{dispatch} ({lowering})'


def _measure_in_child(spec: dict) -> dict:
  """`measure(**spec)` in a fresh process, so the device peak is this row's.

  The 'cudnn' lowering sets XLA's cuDNN ragged-dot fusion flag, which XLA
  reads once per process.
  """
  command = [sys.executable, '-m', 'launch.bench.gpu_dispatch']
  command += ['--child', json.dumps(spec)]
  env = dict(os.environ)
  if spec['lowering'] == 'cudnn':
    env['XLA_FLAGS'] = (
        env.get('XLA_FLAGS', '') + ' ' + CUDNN_RAGGED_DOT_FLAG
    ).strip()
  done = subprocess.run(
      command, capture_output=True, text=True, check=False, env=env
  )
  for line in done.stdout.splitlines():
    if line.startswith('ROW '):
      return json.loads(line[4:])
  tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
  row = {k: spec[k] for k in ('family', 'mode', 'variant', 'lowering')}
  label = _label(row['mode'], row['variant'], row['lowering'])
  return dict(row, dispatch=label, error=tail[:120])


def table(rows: list[dict]) -> str:
  """The printed table; ratios are to the grouped row of the same layer and mode."""
  return harness.format_table(HEADER, [_cells(r, rows) for r in rows])


HEADER = 'layer|mode|dispatch|step ms|vs grouped|GFLOP|longest loop|XLA MiB|'
HEADER = (HEADER + 'device peak MiB').split('|')


def _cells(r: dict, rows: list[dict]) -> list[str]:
  """One row of `table`; the ratio is to `rows`' grouped row of its layer."""
  cells = [r['family'], r['mode'], r['dispatch']]
  if 'error' in r:
    return cells + ['did not run: ' + r['error']] + [''] * 5
  layer = lambda g: (g['family'], g['mode'], g['variant'])
  base = [g.get('ms') for g in rows if layer(g) == layer(r)[:2] + ('grouped',)]
  ms, gflop = r.get('ms'), r.get('gflop', float('nan'))
  return cells + [
      harness.fmt(ms, '.2f'),
      harness.fmt(ms / base[0] if ms and base and base[0] else None, '.2f'),
      format(gflop, '.1f' if gflop >= 1 else '.3g'),
      str(r.get('trips', '-')),
      harness.fmt(r['xla_mib'], '.1f'),
      harness.fmt(r['peak_mib'], '.1f'),
  ]


def run(
    *, families=tuple(SHAPES), modes=MODES, variants=VARIANTS, **options
) -> list[dict]:
  """Every (family, mode, variant) row, ragged once per `lowerings`, in order.

  `options`: lowerings (('xla',)), isolate (each row in a child process,
  `--child`; the 'cudnn' lowering needs one), report (`report(row, rows)`
  as each row is done) and `measure`'s keyword arguments.
  """
  lowerings = options.pop('lowerings', ('xla',))
  isolate, report = options.pop('isolate', False), options.pop('report', None)
  if 'cudnn' in lowerings and not isolate:
    raise ValueError("the 'cudnn' lowering needs isolate=True (an XLA flag)")
  rows = []
  for family in families:
    for mode in modes:
      for variant in variants:
        for lowering in lowerings if variant == 'ragged' else ('xla',):
          spec = dict(family=family, mode=mode, variant=variant)
          spec.update(lowering=lowering, **options)
          rows.append(_measure_in_child(spec) if isolate else measure(**spec))
          if report is not None:
            report(rows[-1], rows)
  return rows


def print_row(row: dict, rows: list[dict]) -> None:
  """Prints one row as soon as it is measured (the header before the first)."""
  if len(rows) == 1:
    print('  '.join(HEADER), flush=True)
  print('  '.join(_cells(row, rows)), flush=True)


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if FLAGS.child:
    print('ROW ' + json.dumps(measure(**json.loads(FLAGS.child))), flush=True)
    return
  device = jax.devices()[0]
  lowerings = FLAGS.ragged_lowerings or (
      list(LOWERINGS) if device.platform == 'gpu' else ['xla']
  )
  bad = sorted(
      set(FLAGS.families) - set(SHAPES)
      | set(FLAGS.modes) - set(MODES)
      | set(FLAGS.variants) - set(VARIANTS)
      | set(lowerings) - set(LOWERINGS)
  )
  if bad:
    raise app.UsageError(
        f'unknown {bad}; families {list(SHAPES)}, modes {list(MODES)}, '
        f'variants {list(VARIANTS)}, ragged lowerings {list(LOWERINGS)}'
    )
  isolate = FLAGS.isolate == 'yes' or (
      FLAGS.isolate == 'auto'
      and harness.device_memory('peak_bytes_in_use') is not None
  )
  sizes = 'quick toy sizes' if FLAGS.quick else 'full-size layers'
  processes = 'one process per row' if isolate else 'one process'
  print(
      f'{device.platform} ({device.device_kind}), jax {jax.__version__}; '
      f'bfloat16; median of {FLAGS.repeats} steps; LoRA rank {LORA_RANK}; '
      f'{sizes}; {processes}',
      flush=True,
  )
  names = ('families', 'modes', 'variants', 'quick', 'seq_len', 'repeats')
  rows = run(
      **{name: FLAGS[name].value for name in names + ('compile_only',)},
      lowerings=lowerings,
      isolate=isolate,
      report=print_row,
  )
  print(table(rows), flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
