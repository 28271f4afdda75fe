r"""raptor_jax against PyTorch + Opacus on the same model, weights and DP step.

  python -m launch.bench.vs_opacus                      # the full table
  python -m launch.bench.vs_opacus --omp=default        # torch's own threading
  python -m launch.bench.vs_opacus --quick              # tiny sizes, a few s
  python -m launch.bench.vs_opacus --kernels --microbatch_sizes=32

`--kernels` times raptor_jax's steps with `model.kernels='fast'` (custom
VJPs, record folding, layout barriers) against `'reference'` (plain `jnp`
and autodiff) in this process, in interleaved rounds, after checking both
updates (noise off) against the same float64 PyTorch references.

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

from __future__ import annotations

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  if '--serve=raptor' in sys.argv:  # the public set-up call, as a user's
    from raptor_jax import process as _process  # program makes it

    _process.setup(argv=sys.argv)
  else:  # --kernels: host memory kept, as the trainer runs
    from raptor_jax import host_memory as _host_memory

    _host_memory.keep_unless_disabled(sys.argv, default='--kernels' in sys.argv)

import os
import tempfile

from absl import app
from absl import flags
import jax

from launch.bench import builders
from launch.bench import harness
from launch.bench import torch_side
from raptor_jax import compilation
from raptor_jax import host_devices
from raptor_jax.models import hf

MODES = ('hooks', 'functorch', 'ew', 'ghost')
RAPTOR_COLUMNS = {'raptor': 'nonprivate', 'raptor DP': 'shared'}
RAPTOR_COLUMNS['raptor expert'] = 'expert'


def define_flags() -> None:
  """Command-line flags (only when run as a script); docs/performance.md
  describes the process, memory and threading settings."""
  flags.DEFINE_bool('quick', False, 'Tiny sizes, one round: a smoke test.')
  flags.DEFINE_list('microbatch_sizes', ['8', '32', '128'], 'Microbatch sizes.')
  flags.DEFINE_list('modes', list(MODES), 'Opacus grad_sample_modes to time.')
  flags.DEFINE_integer('repeats', 5, 'Timed interleaved rounds.')
  flags.DEFINE_integer('threads', 2, 'torch.set_num_threads.')
  flags.DEFINE_enum('omp', 'passive', ['passive', 'default'], 'torch OpenMP.')
  flags.DEFINE_bool('isolate', True, 'Each side in its own worker processes.')
  flags.DEFINE_list(
      'torch_host_memory', ['glibc', 'keep'], 'One torch worker per setting.'
  )
  flags.DEFINE_bool(
      'keep_host_memory', False, '--noisolate: keep_freed_memory.'
  )
  flags.DEFINE_integer('cpu_devices', 0, 'XLA CPU devices (0: one per core).')
  flags.DEFINE_enum('serve', '', ['', 'raptor', 'torch'], 'Internal: worker.')
  flags.DEFINE_string('model_path', '', "Internal: the worker's checkpoint.")
  flags.DEFINE_float('tolerance', 1e-3, 'Against torch in float64.')
  flags.DEFINE_float('fp32_tolerance', 1e-2, 'Against torch in float32.')
  flags.DEFINE_bool('kernels', False, "raptor_jax's fast vs reference kernels.")


def side_steps(side, path, sizes, module, params, m, modes, updates=False):
  """({column: step}, {column: update, noise off}, {column: error line}) of
  one side on `compare`'s records: 'raptor', the trainer's non-private,
  shared DP and expert steps; 'torch', torch's non-private step and Opacus's
  shared and expert steps per mode (a mode that fails is reported, not
  timed; with `updates` each mode's shared update)."""
  batch, owners = builders.records(sizes, m, seed=m)
  if side == 'raptor':
    steps = {
        column: builders.raptor_dp(module, params, batch, owners, sizes, stream)
        for column, stream in RAPTOR_COLUMNS.items()
    }
    return (
        {c: s[0] for c, s in steps.items()},
        {c: s[1] for c, s in steps.items()},
        {},
    )
  calls, out, failed = {}, {}, {}
  calls['torch'], out['torch'] = torch_side.torch_nonprivate(
      torch_side.torch_model(path, sizes, params, 'shared'), batch
  )
  for mode in modes:
    for stream in ('shared', 'expert'):
      column = f'opacus {mode}' + (' expert' if stream == 'expert' else '')
      try:
        model = torch_side.torch_model(path, sizes, params, stream)
        calls[column], no_noise, _ = torch_side.opacus_dp(
            model, batch, mode, builders.NOISE_MULTIPLIER
        )
        if updates and stream == 'shared':
          out[column] = no_noise()
      except Exception as e:  # pylint: disable=broad-except
        failed[column] = harness.error_line(e)
        calls.pop(column, None)
  return calls, out, failed


def serve(side: str, path: str, sizes: builders.Sizes, m: int, modes):
  """Worker loop (`harness.serve`) of one side's `side_steps`."""
  module, params = builders.raptor_model(path, sizes)
  calls, _, failed = side_steps(side, path, sizes, module, params, m, modes)
  harness.serve({c: (lambda r, f=f: f()) for c, f in calls.items()}, failed)


def tagged(column: str, tag: str) -> str:
  """'opacus ew expert', 'keep' -> 'opacus+keep ew expert' (tag '' keeps it)."""
  first, space, rest = column.partition(' ')
  return f'{first}+{tag}{space}{rest}' if tag else column


def worker_times(path: str, m: int, workers, *, repeats: int, flag_args):
  """`harness.worker_times` of this script's `--serve` workers, each
  building its side from the checkpoint at `path` (`flag_args`: sizes,
  modes, threading): `workers` are (side, 'keep' or 'glibc') pairs; torch
  workers' columns are `tagged` 'keep'; raptor_jax's always keeps memory."""
  commands = []
  for side, memory in workers:
    keep = side == 'raptor' or memory == 'keep'
    argv = harness.worker_command(
        'launch.bench.vs_opacus',
        side,
        keep,
        f'--model_path={path}',
        f'--microbatch_sizes={m}',
        *flag_args,
    )
    tag = 'keep' if side == 'torch' and keep else ''
    commands.append((argv, lambda c, tag=tag: tagged(c, tag)))
  return harness.worker_times(commands, repeats=repeats)


def compare(path, sizes, module, params, m, *, modes=MODES, **options):
  """One row {'m', 'errors': {pair: relative error}, 'ms': {column: median
  ms}, 'times': {column: [s per round]}, 'failed': {column: error line}}.

  raptor_jax (float32) is checked against torch in float64 (the non-private
  gradient, Opacus hooks' clipped mean, the owner sums from its per-sample
  gradients) to `tolerance` (1e-3), and against each float32 torch step to
  `fp32_tolerance` (1e-2; torch's own float32 error is the yardstick). Then
  `repeats` (5; 0: none) interleaved rounds time the steps here, or, given
  `workers` ((side, host memory) pairs), in worker processes
  (`worker_times`, with `flag_args`).
  """
  tolerance = options.get('tolerance', 1e-3)
  fp32_tolerance = options.get('fp32_tolerance', 1e-2)
  repeats, workers = options.get('repeats', 5), options.get('workers')
  batch, owners = builders.records(sizes, m, seed=m)
  calls, ours, _ = side_steps('raptor', path, sizes, module, params, m, modes)
  torch_calls, theirs, failed = side_steps(
      'torch', path, sizes, module, params, m, modes, updates=True
  )
  calls.update(torch_calls)
  ref = torch_side.float64_references(path, sizes, params, batch, owners)
  yardstick = torch_side.relative_error(theirs['torch'], ref['nonprivate'])
  errors = {'torch float32 vs float64': yardstick}
  checks = [  # (pair, raptor_jax's column, the other update, tolerance)
      ('non-private vs torch64', 'raptor', ref['nonprivate'], tolerance),
      ('non-private vs torch', 'raptor', theirs['torch'], fp32_tolerance),
      ('DP vs opacus64', 'raptor DP', ref['shared'], tolerance),
      ('expert vs opacus64', 'raptor expert', ref['expert'], tolerance),
  ] + [
      (f'DP vs {c}', 'raptor DP', update, fp32_tolerance)
      for c, update in theirs.items()
      if c.startswith('opacus')
  ]
  for pair, column, update, limit in checks:
    torch_side.check(errors, pair, ours[column], update, limit)
  times = {}  # repeats=0: the checks only (no step is compiled or timed)
  if repeats and workers:
    del calls  # timed in the workers; free this process's buffers first
    flag_args = options.get('flag_args', ())
    times, failed = worker_times(
        path, m, workers, repeats=repeats, flag_args=flag_args
    )
  elif repeats:
    times = harness.interleaved_times(calls, repeats=repeats)
  ms = {c: harness.median(t) * 1e3 for c, t in times.items()}
  return dict(m=m, errors=errors, ms=ms, times=times, failed=failed)


def _fastest(row, framework: str, expert: bool = False) -> str:
  """The fastest column '<framework>[+keep] [<mode>][ expert]' (`tagged`)
  of `framework` ('torch', 'opacus'), any mode and tag."""
  columns = [
      c
      for c in row['ms']
      if c.split()[0].split('+')[0] == framework
      and c.endswith(' expert') == expert
  ]
  return min(columns, key=row['ms'].get)


def _label(column: str) -> str:
  """'opacus+keep ew expert' -> 'ew, keep'; 'torch' -> ''."""
  first, *rest = column.split()
  words = [w for w in rest if w != 'expert'] + first.split('+')[1:]
  return ', '.join(words)


def summary(row) -> dict:
  """The table's columns and paired ratios of one row."""
  t, ms = row['times'], row['ms']
  torch = _fastest(row, 'torch')
  shared, expert = _fastest(row, 'opacus'), _fastest(row, 'opacus', True)
  ratio = harness.paired_ratio
  return {
      'm': row['m'],
      'torch': ms[torch],
      'torch mode': _label(torch),
      'opacus': ms[shared],
      'opacus mode': _label(shared),
      'raptor': ms['raptor'],
      'raptor DP': ms['raptor DP'],
      'opacus expert': ms[expert],
      'opacus expert mode': _label(expert),
      'raptor expert': ms['raptor expert'],
      'raptor/torch': ratio(t['raptor'], t[torch]),
      'opacus/raptor DP': ratio(t[shared], t['raptor DP']),
      'opacus expert/raptor expert': ratio(t[expert], t['raptor expert']),
      'raptor DP/raptor': ratio(t['raptor DP'], t['raptor']),
  }


MAIN_COLUMNS = (  # (header, key(s), format) of `summary`'s columns
    ('microbatch', 'm', ''),
    ('torch non-private (setting)', 'torch text', ''),
    ('Opacus shared DP (mode)', 'opacus text', ''),
    ('raptor_jax non-private', 'raptor', '.0f'),
    ('raptor_jax shared DP', 'raptor DP', '.0f'),
    ('Opacus expert stream (mode)', 'opacus expert text', ''),
    ('raptor_jax expert stream', 'raptor expert', '.0f'),
)
RATIOS = ('raptor/torch', 'opacus/raptor DP', 'opacus expert/raptor expert')
RATIOS += ('raptor DP/raptor',)


def tables(rows) -> str:
  """The main table, the ratios, every Opacus mode and the update checks."""
  s = [summary(r) for r in rows]
  for r in s:
    for c in ('torch', 'opacus', 'opacus expert'):
      mode = f" ({r[f'{c} mode']})" * bool(r[f'{c} mode'])
      r[f'{c} text'] = f'{r[c]:.0f}{mode}'
  ratios = [('microbatch', 'm', '')] + [(n, n, '.2f') for n in RATIOS]
  columns = sorted(
      {c for r in rows for c in r['ms'] if not c.startswith('raptor')}
  )
  by_column = [
      dict({f"m={r['m']}": r['ms'].get(c) for r in rows}, column=c)
      for c in columns
  ]
  m_columns = [(f"m={r['m']}", f"m={r['m']}", '.0f') for r in rows]
  pairs = sorted(rows[0]['errors'])
  failed = [
      f"  m={r['m']} {c}: {e}" for r in rows for c, e in r['failed'].items()
  ]
  return '\n'.join(
      [
          'Median step ms (interleaved rounds)',
          harness.dict_table(MAIN_COLUMNS, s),
          '\nPaired ratios (median over rounds of a / b)',
          harness.dict_table(ratios, s),
          '\nEvery torch-side step, by Opacus grad_sample_mode and host memory'
          ' (+keep: keep_freed_memory) (median ms)',
          harness.dict_table([('column', 'column', '')] + m_columns, by_column),
          '\nUpdate checks, noise off: ||a - b|| / ||b|| (64: torch in float64)',
          harness.dict_table(
              [('microbatch', 'm', '')] + [(k, k, '.1e') for k in pairs],
              [dict(r['errors'], m=r['m']) for r in rows],
          ),
      ]
      + (['\nModes that failed:'] + failed if failed else [])
  )


def run(sizes, microbatch_sizes, *, threads=2, verbose=False, **options):
  """Saves the model, loads it into both sides, one `compare` row per m
  (`options`: `compare`'s keyword arguments)."""
  import torch  # pylint: disable=import-outside-toplevel

  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory() as tmp:
    path = builders.save_switch(os.path.join(tmp, 'switch'), sizes)
    module, params = builders.raptor_model(path, sizes)
    rows = []
    for m in microbatch_sizes:
      rows.append(compare(path, sizes, module, params, m, **options))
      if verbose:  # a long run shows each row as it finishes
        print(f'm={m}:', {c: round(t) for c, t in rows[-1]['ms'].items()})
        print(f'm={m} checks:', rows[-1]['errors'], flush=True)
    return rows


# ---------------------------------------------------------------------------
# --kernels: raptor_jax's fast kernels against their plain twins.


def kernel_rows(sizes, microbatch_sizes, repeats: int) -> list[dict]:
  """One row per (microbatch, stream): both settings' medians, the paired
  ratio fast / reference and the updates' relative distances (to each
  other and to `torch_side.float64_references`, `tolerance` at most)."""
  rows, kinds = [], ('fast', 'reference')
  with tempfile.TemporaryDirectory() as tmp:
    path = builders.save_switch(os.path.join(tmp, 'switch'), sizes)
    module, params = builders.raptor_model(path, sizes)
    for m in microbatch_sizes:
      batch, owners = builders.records(sizes, m, seed=m)
      calls, errors = {}, {}
      ref = torch_side.float64_references(path, sizes, params, batch, owners)
      for kind in kinds:
        backbone = hf.with_options(
            module.backbone, params['backbone'], kernels=kind
        )[0]
        classifier = module.clone(backbone=backbone)
        for column, stream in RAPTOR_COLUMNS.items():
          calls[kind, stream] = builders.raptor_dp(
              classifier, params, batch, owners, sizes, stream
          )
          pair = f'm={m} {stream}: {kind} vs torch64'
          torch_side.check(
              errors, pair, calls[kind, stream][1], ref[stream], 1e-3
          )
      steps = {key: step for key, (step, _) in calls.items()}
      times = harness.interleaved_times(steps, repeats=repeats)
      for stream in RAPTOR_COLUMNS.values():
        fast, reference = (times[k, stream] for k in kinds)
        row = dict(
            m=m, stream=stream, ratio=harness.paired_ratio(fast, reference)
        )
        row.update(fast_ms=harness.median(fast) * 1e3)
        row.update(reference_ms=harness.median(reference) * 1e3)
        updates = [calls[k, stream][1] for k in kinds]
        row['between'] = torch_side.relative_error(*updates)
        for k in kinds:
          row[f'{k}_error'] = errors[f'm={m} {stream}: {k} vs torch64']
        rows.append(row)
  return rows


def kernel_table(rows) -> str:
  lines = [
      '| m | step | fast ms | reference ms | fast / reference (median of'
      ' paired rounds) | fast vs reference | fast vs torch64 | reference vs'
      ' torch64 |',
      '|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
        f"| {r['m']} | {r['stream']} | {r['fast_ms']:.1f} |"
        f" {r['reference_ms']:.1f} | {r['ratio']:.2f} | {r['between']:.1e} |"
        f" {r['fast_error']:.1e} | {r['reference_error']:.1e} |"
    )
  return '\n'.join(lines)


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  bad = sorted(set(FLAGS.torch_host_memory) - {'glibc', 'keep'})
  if bad or not FLAGS.torch_host_memory:
    got = bad or 'nothing'
    sys.exit(f'error: --torch_host_memory takes glibc and/or keep, got {got}')
  worker = bool(FLAGS.serve)
  if FLAGS.omp == 'passive':
    os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'  # before torch's OpenMP starts
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  sizes = builders.QUICK if FLAGS.quick else builders.Sizes()
  sizes_m = [int(m) for m in FLAGS.microbatch_sizes]
  devices = host_devices.one_device_per_core(
      FLAGS.cpu_devices
      or host_devices.dividing_count([2] if FLAGS.quick else sizes_m)
  )
  if FLAGS.kernels:
    print(
        f'Switch d_model={sizes.d_model} blocks={sizes.num_layers} '
        f'E={sizes.num_experts} seq={sizes.seq_len} LoRA r={sizes.lora_rank}; '
        f'jax {jax.__version__} {jax.devices()[0].platform} x {devices} '
        f'devices; {1 if FLAGS.quick else FLAGS.repeats} interleaved rounds',
        flush=True,
    )
    repeats = 1 if FLAGS.quick else FLAGS.repeats
    print(
        kernel_table(
            kernel_rows(sizes, [2] if FLAGS.quick else sizes_m, repeats)
        )
    )
    return
  if FLAGS.quick and not worker:
    sizes_m = [2 * devices]
  # Steps are timed after a warm-up (compile time is not measured): the
  # user's persistent cache lets the raptor worker load what the checks
  # compiled, and a rerun load everything.
  compilation.enable_cache('auto')
  if worker:
    torch.set_num_threads(FLAGS.threads)
    serve(FLAGS.serve, FLAGS.model_path, sizes, sizes_m[0], FLAGS.modes)
    return
  workers, flag_args = (), ()
  if FLAGS.isolate:
    workers = (('raptor', 'keep'),) + tuple(
        ('torch', memory) for memory in FLAGS.torch_host_memory
    )
    flag_args = (f'--modes={",".join(FLAGS.modes)}', f'--omp={FLAGS.omp}')
    flag_args += (f'--threads={FLAGS.threads}', f'--cpu_devices={devices}')
    flag_args += ('--quick',) * FLAGS.quick
    memory = 'raptor_jax worker: host memory kept (as launch/main.py); '
    memory += f'torch workers: {", ".join(FLAGS.torch_host_memory)}'
  else:
    kept = FLAGS.keep_host_memory  # set before the imports, see the top
    memory = 'kept' if kept else 'returned each step'
    memory = f'one process; host memory {memory}'
  print(
      f'Switch d_model={sizes.d_model} blocks={sizes.num_layers} (sparse every '
      f'2nd, l*={sizes.expert_layer}) E={sizes.num_experts} d_ff={sizes.d_ff} '
      f'seq={sizes.seq_len} LoRA r={sizes.lora_rank}; torch {torch.__version__} '
      f'{FLAGS.threads} threads, OMP_WAIT_POLICY='
      f"{os.environ.get('OMP_WAIT_POLICY', '(default)')}; jax {jax.__version__} "
      f'{jax.devices()[0].platform} x {devices} devices, '
      f'{host_devices.host_cores()} cores; clip {builders.HF_L2_CLIP}, sigma '
      f'{builders.NOISE_MULTIPLIER}; {memory}',
      flush=True,
  )
  names = ('modes', 'tolerance', 'fp32_tolerance', 'threads')
  options = {n: FLAGS[n].value for n in names}
  options.update(repeats=1 if FLAGS.quick else FLAGS.repeats, verbose=True)
  rows = run(sizes, sizes_m, workers=workers, flag_args=flag_args, **options)
  print(tables(rows))


if __name__ == '__main__':
  define_flags()
  app.run(main)
