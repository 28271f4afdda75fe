r"""What a change bought: raptor_jax's steps at two commits, timed side by side.

  python -m launch.bench.ab_commits --base=HEAD~1 --head=HEAD \
      --microbatch_size=32 --steps=raptor,raptor_dp --repeats=5
  python -m launch.bench.ab_commits --base=HEAD --head=HEAD \
      --base_cpu_devices=1 --head_cpu_devices=2      # a setting, one commit

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

STEPS = ('raptor', 'raptor_dp', 'raptor_expert')


def _model():
  """This commit's module of the `vs_opacus` model and raptor_jax's steps:
  `builders`, or in older commits `raptor_side`, before it `vs_opacus`."""
  for name in ('builders', 'raptor_side', 'vs_opacus'):
    if importlib.util.find_spec(f'launch.bench.{name}'):
      model = importlib.import_module(f'launch.bench.{name}')
      if hasattr(model, 'raptor_model'):
        return model
  raise ImportError('no launch.bench module has raptor_model')


def _sizes(quick: bool):
  return _model().QUICK if quick else _model().Sizes()


def _worker(tree, model_path, m, steps, quick, cpu_devices, back_to_back):
  """Serves timings of the steps at the commit checked out in `tree`, in
  `harness.serve`'s protocol (a sample: the mean of `back_to_back` calls)
  but its own code, as old commits lack the harness; set up as
  launch/main.py would at that commit (host memory kept, one CPU device
  per core, where the commit has them)."""
  os.chdir(tree)  # `tree` leads PYTHONPATH (set by `compare`)
  # What the commit has of launch/main.py's set-up (older ones lack it).
  if importlib.util.find_spec('raptor_jax.host_memory'):
    importlib.import_module('raptor_jax.host_memory').keep_freed_memory()
  if importlib.util.find_spec('raptor_jax.host_devices'):
    host_devices = importlib.import_module('raptor_jax.host_devices')
    count = cpu_devices or host_devices.dividing_count([m])
    host_devices.one_device_per_core(count)
  import jax  # pylint: disable=import-outside-toplevel
  import raptor_jax  # pylint: disable=import-outside-toplevel

  model = _model()
  for module in (raptor_jax, model):  # this commit's code, not main's
    if not os.path.abspath(module.__file__).startswith(tree + os.sep):
      raise RuntimeError(f'worker imported {module.__file__}, not {tree}')
  sizes = _sizes(quick)
  module, params = model.raptor_model(model_path, sizes)
  batch, owners = model.records(sizes, m, seed=m)
  streams = dict(raptor_dp='shared', raptor_expert='expert')
  calls = {
      step: model.raptor_dp(module, params, batch, owners, sizes, streams[step])
      if step in streams
      else model.raptor_nonprivate(module, params, batch)
      for step in steps
  }
  calls = {step: step_and_update[0] for step, step_and_update in calls.items()}
  for call in calls.values():  # compile and warm up
    jax.block_until_ready(call())
  print(json.dumps({'ready': list(calls), 'failed': {}}), flush=True)
  for line in sys.stdin:
    step = line.partition('\t')[0]
    start = time.perf_counter()
    for _ in range(back_to_back):
      jax.block_until_ready(calls[step]())
    print((time.perf_counter() - start) / back_to_back, flush=True)


def compare(base, head, m, steps, repeats, quick=False, **options):
  """{step: (base times, head times)}: each round times every step in
  both workers in turns (`harness.worker_times`, by column); a sample is
  the mean of `back_to_back` (1) calls. `cpu_devices`: the base and head
  workers' CPU device counts ((0, 0): one per core, as launch/main.py)."""
  back_to_back = options.get('back_to_back', 1)
  cpu_devices = options.get('cpu_devices', (0, 0))
  from launch.bench import harness  # pylint: disable=import-outside-toplevel

  repo = subprocess.check_output(
      ['git', 'rev-parse', '--show-toplevel'], text=True
  ).strip()
  with tempfile.TemporaryDirectory() as tmp:
    model_path = _model().save_switch(
        os.path.join(tmp, 'switch'), _sizes(quick)
    )
    workers, trees = [], []
    try:
      for name, rev, count in zip(('base', 'head'), (base, head), cpu_devices):
        tree = os.path.join(tmp, name)
        subprocess.check_call(
            ['git', '-C', repo, 'worktree', 'add', '--detach', '-q', tree, rev]
        )
        trees.append(tree)
        # This commit's raptor_jax before the installed one: PYTHONPATH.
        argv = ['env', f'PYTHONPATH={tree}', sys.executable]
        argv += [os.path.abspath(__file__), '--worker', tree]
        argv += [model_path, str(m), ','.join(steps), str(int(quick))]
        argv += [str(count), str(back_to_back)]
        workers.append((argv, lambda step, name=name: (step, name)))
      times, _ = harness.worker_times(workers, repeats=repeats, by_column=True)
      return {s: (times[s, 'base'], times[s, 'head']) for s in steps}
    finally:
      for tree in trees:
        subprocess.call(
            ['git', '-C', repo, 'worktree', 'remove', '--force', tree]
        )


def main() -> None:
  from absl import flags  # pylint: disable=import-outside-toplevel

  flags.DEFINE_string('base', 'HEAD~1', 'The commit before the change.')
  flags.DEFINE_string('head', 'HEAD', 'The commit with the change.')
  flags.DEFINE_integer('microbatch_size', 32, 'Records per step.')
  flags.DEFINE_list('steps', ['raptor', 'raptor_dp'], f'Any of {STEPS}.')
  flags.DEFINE_integer('repeats', 5, 'Alternating rounds.')
  flags.DEFINE_integer('back_to_back', 1, 'Calls per sample (their mean).')
  flags.DEFINE_bool('quick', False, 'Tiny sizes: a smoke test.')
  flags.DEFINE_integer('base_cpu_devices', 0, 'Base worker (0: one per core).')
  flags.DEFINE_integer('head_cpu_devices', 0, 'Head worker (0: one per core).')
  flags.FLAGS(sys.argv)
  f = flags.FLAGS
  bad = [s for s in f.steps if s not in STEPS]
  if bad:
    sys.exit(f'error: unknown --steps {bad}; choose from {list(STEPS)}')
  from launch.bench import harness  # pylint: disable=import-outside-toplevel

  if f.back_to_back < 1:
    sys.exit(f'error: --back_to_back must be >= 1, got {f.back_to_back}')
  devices = [f.base_cpu_devices, f.head_cpu_devices]
  options = dict(quick=f.quick, back_to_back=f.back_to_back)
  options.update(cpu_devices=tuple(devices))
  times = compare(
      f.base, f.head, f.microbatch_size, f.steps, f.repeats, **options
  )
  setting = dict(base=f.base, head=f.head, m=f.microbatch_size)
  setting.update(back_to_back=f.back_to_back, cpu_devices=devices)
  print(json.dumps(setting))
  for step, (base, head) in times.items():
    print(
        f'{step:14s} base {harness.median(base) * 1e3:7.0f} ms  head '
        f'{harness.median(head) * 1e3:7.0f} ms  head/base '
        f'{harness.paired_ratio(head, base):.2f}'
    )


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--worker':
    tree, path, m, steps, quick, devices, count = sys.argv[2:9]
    numbers = (int(m), steps.split(','), quick == '1', int(devices))
    _worker(tree, path, *numbers, int(count))
  else:
    main()
