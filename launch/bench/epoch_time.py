r"""One epoch of real text: raptor_jax with and without length buckets
against PyTorch + Opacus with dynamic padding.

  python -m launch.bench.epoch_time --tokenizer=<model or tokenizer dir>
  python -m launch.bench.epoch_time --quick     # generated records, seconds

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

from __future__ import annotations

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  if '--serve=torch' in sys.argv:
    import os as _os

    from raptor_jax import host_memory as _host_memory

    _host_memory.keep_unless_disabled(sys.argv, default=False)
    # As vs_opacus's default: stable when other work shares the cores.
    _os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
  else:  # the parent and the raptor_jax worker: the trainer's set-up
    from raptor_jax import process as _process

    _process.setup(argv=sys.argv)

import dataclasses
import os
import pickle
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import builders
from launch.bench import epochs
from launch.bench import harness
from launch.bench import torch_side
from raptor_jax import compilation

STREAMS = ('nonprivate', 'shared', 'expert')


def define_flags() -> None:
  """Command-line flags (only when run as a script)."""
  flags.DEFINE_bool(
      'quick', False, 'Generated records, tiny model: a smoke test.'
  )
  flags.DEFINE_list('tasks', list(epochs.TASKS), 'Tasks, from: sst2, qnli.')
  flags.DEFINE_string('data_dir', '../shared/data', 'GLUE files are under it.')
  flags.DEFINE_string('tokenizer', '', 'A model or tokenizer directory.')
  flags.DEFINE_integer('batch_size', 500, 'Expected batch B (Poisson).')
  flags.DEFINE_integer('microbatch', 100, 'Records per microbatch m.')
  flags.DEFINE_integer('steps', 4, 'Timed steps of the epoch (evenly spaced).')
  flags.DEFINE_list('streams', list(STREAMS), f'Streams, from: {STREAMS}')
  flags.DEFINE_list('modes', ['hooks', 'ew'], 'Opacus grad_sample_modes.')
  flags.DEFINE_integer('threads', 2, 'torch.set_num_threads.')
  flags.DEFINE_float('tolerance', 1e-2, 'Largest relative update difference.')
  flags.DEFINE_string('out', '', 'Also write the tables to this file.')
  flags.DEFINE_enum('serve', '', ['', 'raptor', 'torch'], 'Internal: worker.')
  flags.DEFINE_string('workdir', '', 'Internal: the worker inputs.')
  flags.DEFINE_bool('keep_host_memory', True, 'Internal: see vs_opacus.')


def _raptor_calls(epoch, sizes, path, streams, steps, batch_size):
  """({column: call(r)}, warm-up) of raptor_jax, with the GEMM peak columns;
  the warm-up compiles every (stream, bucket) shape the timed steps use."""
  module, params = builders.raptor_model(path, sizes)
  calls, warm = {}, []
  for stream in streams:
    dp, state = builders.stream_step(
        module, params, sizes, stream, float(batch_size)
    )
    for layout in ('raptor', 'raptor unbucketed'):
      batches = [_host_batches(epoch, epoch.layout(layout, t)) for t in steps]
      calls[f'{layout} {stream}'] = _raptor_step(dp, state, batches)
      shapes = {b['input_ids'].shape: (b, m) for mbs in batches for b, m in mbs}
      warm.append((dp, state, list(shapes.values())))
  rows = epoch.microbatch * epoch.max_length
  for name, (k, n) in _gemms(sizes).items():
    x = jnp.ones((rows, k), jnp.float32)
    w = jnp.ones((k, n), jnp.float32) / k
    calls[name] = lambda r, x=x, w=w: _gemm(x, w)

  def warmup():
    for _ in range(2):
      for dp, state, shapes in warm:
        sums = _sums(dp, state, shapes)
        jax.block_until_ready(dp.update(state, sums).trainable)
      for name in _gemms(sizes):
        jax.block_until_ready(calls[name](0))

  return calls, warmup


_gemm = jax.jit(lambda x, w: x @ w)
# {column: (k, n)} of the feed-forward GEMMs timed for the peak.
_gemms = lambda s: {
    'gemm wi': (s.d_model, s.d_ff),
    'gemm wo': (s.d_ff, s.d_model),
}


def _sums(dp, state, microbatches):
  """The gradient sums of `microbatches` [(host batch, mask)]."""
  sums = dp.zero_sums(state)
  for batch, mask in microbatches:
    sums = dp.accumulate(state, sums, batch, mask)
  return sums


def _host_batches(epoch, layout):
  """[(host batch, mask)]: the trainer's microbatches of `layout`."""
  batch = lambda length, idx: builders.host_batch(
      *map(jnp.asarray, epoch.arrays(length, idx) + (epoch.owners[idx],))
  )
  return [(batch(n, i), jnp.asarray(m, jnp.float32)) for n, i, m in layout]


def _raptor_step(dp, state, batches):
  """call(r): step r's microbatches accumulated, then the one update."""
  holder = [state]

  def call(r):
    holder[0] = dp.update(holder[0], _sums(dp, holder[0], batches[r]))
    return holder[0].trainable

  return call


def _torch_calls(epoch, sizes, path, streams, steps, modes):
  """({column: call(r)}, {column: error}) of PyTorch and Opacus."""
  _, params = builders.raptor_model(path, sizes)
  batches = [_torch_batches(epoch, epoch.layout('torch', t)) for t in steps]
  calls, failed = {}, {}
  for stream in streams:
    if stream == 'nonprivate':
      model = torch_side.torch_model(path, sizes, params, 'shared')
      calls['torch nonprivate'] = torch_side.torch_step(model, batches)[0]
      continue
    for mode in modes:
      column = f'opacus {mode} {stream}'
      try:
        model = torch_side.torch_model(path, sizes, params, stream)
        private = torch_side.opacus_private(model, mode, len(epoch.samples[0]))
        calls[column] = torch_side.opacus_step(*private, batches)
      except Exception as e:  # pylint: disable=broad-except
        failed[column] = harness.error_line(e)
  return calls, failed


def _torch_batches(epoch, layout):
  return [torch_side.torch_batch(epoch.arrays(n, i)) for n, i, _ in layout]


def _raptor_sums(epoch, sizes, module, params, stream, layout, step, b):
  dp, state = builders.stream_step(module, params, sizes, stream, float(b))
  sums = _sums(dp, state, _host_batches(epoch, epoch.layout(layout, step)))
  (part,) = dp.phase.parts
  return {p: np.asarray(v) for p, v in sums[part.name].items()}


def _torch_sums(epoch, sizes, path, params, stream, step, batch_size):
  """Step `step`'s gradient sums on the torch side (noise off)."""
  model = torch_side.torch_model(
      path, sizes, params, 'expert' if stream == 'expert' else 'shared'
  )
  layout = epoch.layout('torch', step)
  if stream == 'nonprivate':
    torch_side.torch_step(model, [_torch_batches(epoch, layout)])[1](0)
    return torch_side.torch_grads(model)
  dp_model, dp_opt, criterion = torch_side.opacus_private(
      model, 'hooks', batch_size, noise_multiplier=0.0
  )
  if stream == 'expert':
    total = {}
    for length, idx, _ in layout:
      ref = torch_side.owner_reference(
          model, dp_model, epoch.arrays(length, idx), epoch.owners[idx], sizes
      )
      for p, v in ref.items():  # reference / (n / E) -> the owner sums
        total[p] = total.get(p, 0.0) + v * len(idx) / sizes.num_experts
    return total
  for ids, mask, labels in _torch_batches(epoch, layout):
    dp_opt.zero_grad(set_to_none=True)
    criterion(dp_model(ids, mask), labels).backward()
    dp_opt.signal_skip_step(do_skip=True)
    dp_opt.step()  # clip and accumulate into p.summed_grad only
  return torch_side.torch_grads(model, 'summed_grad')


def check(epoch, sizes, path, step, streams, batch_size, tolerance):
  """{pair: relative error} of step `step`'s sums (noise off); raises past
  `tolerance`."""
  module, params = builders.raptor_model(path, sizes)
  errors = {}
  for stream in streams:
    args = (epoch, sizes, module, params, stream)
    ours = _raptor_sums(*args, 'raptor', step, batch_size)
    plain = _raptor_sums(*args, 'raptor unbucketed', step, batch_size)
    theirs = _torch_sums(epoch, sizes, path, params, stream, step, batch_size)
    for name, other in (('unbucketed', plain), ('torch', theirs)):
      pair = f'{stream}: raptor vs {name}'
      torch_side.check(errors, pair, ours, other, tolerance)
  return errors


def serve(side: str, workdir: str) -> None:
  """A timing worker: one task's epoch and model from `workdir`."""
  with open(os.path.join(workdir, 'spec.pkl'), 'rb') as f:
    spec = pickle.load(f)
  epoch = epochs.Epoch(**spec['epoch'])
  sizes = builders.Sizes(**spec['sizes'])
  args = (epoch, sizes, spec['model'], spec['streams'], spec['steps'])
  if side == 'raptor':
    calls, warmup = _raptor_calls(*args, spec['batch_size'])
    harness.serve(calls, warmup=warmup)
  else:
    import torch  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(spec['threads'])
    calls, failed = _torch_calls(*args, spec['modes'])
    harness.serve(calls, failed, warmup=lambda: [c(0) for c in calls.values()])


def time_task(task, data, workdir, *, vocab, quick, **spec):
  """One task's row: token counts, the check, the interleaved timings.

  `spec`: batch_size, microbatch, steps (timed), streams, modes, tolerance
  and threads, as the flags."""
  sizes = epochs.model_sizes(np.shape(data[0])[1], vocab, quick)
  batch_size, streams = spec['batch_size'], spec['streams']
  epoch = epochs.make_epoch(
      task,
      data,
      batch_size=batch_size,
      microbatch=spec['microbatch'],
      num_experts=sizes.num_experts,
  )
  model = builders.save_switch(os.path.join(workdir, 'model'), sizes)
  timed = epoch.timed_steps(spec['steps'])
  errors = check(
      epoch, sizes, model, timed[0], streams, batch_size, spec['tolerance']
  )
  worker_spec = dict(model=model, streams=list(streams), steps=timed)
  worker_spec.update(epoch=dataclasses.asdict(epoch), modes=list(spec['modes']))
  worker_spec.update(sizes=dataclasses.asdict(sizes), batch_size=batch_size)
  with open(os.path.join(workdir, 'spec.pkl'), 'wb') as f:
    pickle.dump(dict(worker_spec, threads=spec['threads']), f)
  worker = lambda side, keep: harness.worker_command(
      'launch.bench.epoch_time', side, keep, f'--workdir={workdir}'
  )
  times, failed = harness.worker_times(
      [(worker('raptor', True), str), (worker('torch', False), str)],
      repeats=len(timed),
  )
  row = dict(task=task, epoch=epoch, sizes=sizes, timed=timed, times=times)
  row.update(
      failed=failed, errors=errors, useful=epochs.useful_flops(epoch, sizes)
  )
  columns = ('raptor', 'raptor unbucketed', 'torch')
  return dict(row, tokens={c: epoch.tokens(c) for c in columns})


EPOCH_COLUMNS = (  # (header, key, format) of `tables`' main rows
    ('task', 'task', ''),
    ('stream', 'stream', ''),
    ('column', 'column', ''),
    ('s/epoch', 'seconds', '.1f'),
    ('real tokens', 'real', ','),
    ('processed tokens', 'processed', ','),
    ('padding', 'padding', '.0%'),
    ('useful FLOPs / peak', 'useful', '.1%'),
)
RATIO_COLUMNS = (
    ('task', 'task', ''),
    ('stream', 'stream', ''),
    ('unbucketed / buckets', 'unbucketed', '.2f'),
    ('torch or Opacus / buckets', 'theirs', '.2f'),
)


def _best(times, prefix: str, stream: str) -> str | None:
  """The fastest column '<prefix>* <stream>' (summed over the timed steps)."""
  columns = [
      c
      for c in times
      if c.startswith(prefix)
      and c.endswith(f' {stream}')
      and 'unbucketed' not in c
  ]
  return min(columns, key=lambda c: sum(times[c])) if columns else None


def tables(rows) -> str:
  """Seconds per epoch, tokens, peak fractions and ratios of every row."""
  main, ratios, checks, lines = [], [], [], []
  for row in rows:
    t, epoch, task = row['times'], row['epoch'], row['task']
    n_steps, rows_mm = len(epoch.samples), epoch.microbatch * epoch.max_length
    peak = max(
        2 * rows_mm * k * n / harness.median(t[name])
        for name, (k, n) in _gemms(row['sizes']).items()
    )
    lines.append(
        f'{task}: {len(epoch.lengths)} records, {n_steps} steps of'
        f' B={len(epoch.samples[0])} (expected), m={epoch.microbatch},'
        f' buckets {epoch.buckets}, timed steps {row["timed"]};'
        f' measured matmul peak {peak / 1e9:.1f} GFLOP/s'
    )
    streams = {c.split()[-1] for c in t if not c.startswith('gemm')}
    for stream in sorted(streams, key=STREAMS.index):
      theirs = _best(t, 'torch' if stream == 'nonprivate' else 'opacus', stream)
      columns = [f'raptor {stream}', f'raptor unbucketed {stream}', theirs]
      for c in filter(None, columns):
        seconds = np.mean(t[c]) * n_steps
        layout = 'torch' if c == theirs else c.rsplit(' ', 1)[0]
        real, processed = row['tokens'][layout]
        main.append(
            dict(task=task, stream=stream, column=c.rsplit(' ', 1)[0])
            | dict(seconds=seconds, real=real, processed=processed)
            | dict(padding=1 - real / processed)
            | dict(useful=row['useful'] / (seconds * peak))
        )
      mine = sum(t[f'raptor {stream}'])
      ratios.append(
          dict(task=task, stream=stream, theirs=None)
          | dict(unbucketed=sum(t[f'raptor unbucketed {stream}']) / mine)
          | (dict(theirs=sum(t[theirs]) / mine) if theirs else {})
      )
    checks += [
        dict(task=task, pair=k, error=v) for k, v in row['errors'].items()
    ]
    lines += [f'  {task} {c}: {e}' for c, e in row['failed'].items()]
  return '\n'.join(
      [
          *lines,
          '\nOne epoch (seconds = mean timed step x steps per epoch)',
          harness.dict_table(EPOCH_COLUMNS, main),
          '\nEpoch-time ratios over raptor_jax with buckets (same steps)',
          harness.dict_table(RATIO_COLUMNS, ratios),
          '\nUpdate checks, noise off, first timed step: ||a - b|| / ||b||',
          harness.dict_table(
              [
                  ('task', 'task', ''),
                  ('pair', 'pair', ''),
                  ('error', 'error', '.1e'),
              ],
              checks,
          ),
      ]
  )


def main(argv) -> None:
  del argv
  f = flags.FLAGS
  # The timed steps follow a warm-up, so compile time is not measured: the
  # user's persistent cache lets the raptor worker load what the check
  # compiled, and a rerun load everything.
  compilation.enable_cache('auto')
  if f.serve:
    serve(f.serve, f.workdir)
    return
  if not f.quick and not f.tokenizer:
    sys.exit(
        'error: --tokenizer is required (a model or tokenizer directory, '
        'e.g. results/glue_small/model), or run --quick'
    )
  names = ('batch_size', 'microbatch', 'steps', 'streams', 'modes')
  options = {k: f[k].value for k in names + ('tolerance', 'threads')}
  if f.quick:
    options.update(batch_size=60, microbatch=10, steps=2)
  rows = []
  for task in f.tasks if not f.quick else ['generated']:
    with tempfile.TemporaryDirectory() as workdir:
      vocab = 0
      if f.quick:
        vocab_size = builders.QUICK.vocab_size
        data = epochs.generated_records(180, 24, vocab_size)
      else:
        from raptor_jax.data import encoding  # pylint: disable=import-outside-toplevel

        vocab = len(encoding.load_tokenizer(f.tokenizer))
        data = epochs.load_records(task, f.data_dir, f.tokenizer)
      row = time_task(
          task, data, workdir, vocab=vocab, quick=f.quick, **options
      )
      rows.append(row)
      print(tables(rows[-1:]), flush=True)  # each task as it finishes
  out = tables(rows)
  print('\nAll tasks\n' + out)
  if f.out:
    with open(f.out, 'w') as fh:
      fh.write(out + '\n')


if __name__ == '__main__':
  define_flags()
  app.run(main)
