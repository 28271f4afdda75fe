r"""Times one training phase step on a 1-device mesh vs a 4-device mesh.

  python -m launch.bench.bench_parallel
  python -m launch.bench.bench_parallel --num_devices=1,2,4,8

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

import os
import sys

from absl import app
from absl import flags
import jax
import numpy as np

from launch.bench import harness
from raptor_jax.train import config as train_config
from raptor_jax.train import methods, parallel, step
from raptor_jax.train import run as run_lib

DEVICE_FLAG = '--xla_force_host_platform_device_count'
# README.md, "Several GPUs and several hosts" (tests check it is still there).
MULTI_HOST_COMMAND = (
    'python launch/main.py --config=configs/switch_sst2.py --workdir=/shared/raptor_sst2 \\\n'
    '  --coordinator_address=10.0.0.1:1234 --num_processes=N --process_id=I'
)


def define_flags() -> None:
  """Defines the command-line flags; only when run as a script, so that tests can
  import several scripts into one process."""
  flags.DEFINE_list(
      'num_devices', ['1', '4'], 'Mesh sizes; the first is the reference.'
  )
  flags.DEFINE_enum(
      'method', 'raptor', list(methods.METHODS), 'Method whose phases run.'
  )
  flags.DEFINE_integer(
      'microbatch',
      64,
      'Records per accumulate call over ALL devices (a multiple of each '
      'mesh size).',
  )
  flags.DEFINE_integer(
      'microbatches', 4, 'Microbatches accumulated per phase step.'
  )
  flags.DEFINE_integer('seq_len', 32, 'Tokens per record.')
  flags.DEFINE_integer('d_model', 64, 'Model width (tiny preset: 64).')
  flags.DEFINE_integer('d_ff', 128, 'Feed-forward width (tiny preset: 128).')
  flags.DEFINE_integer('num_layers', 4, 'Blocks (every 2nd sparse).')
  flags.DEFINE_integer('num_heads', 4, 'Attention heads.')
  flags.DEFINE_integer('d_kv', 16, 'Width of one head.')
  flags.DEFINE_integer('num_experts', 4, 'Experts per sparse block.')
  flags.DEFINE_integer('repeats', 5, 'Timed rounds per variant.')


def run_config(*, method='raptor', records=256, seq_len=32, **random):
  """The tiny preset (random Switch, synthetic task) with `records` training records
  and the model sizes in `random` (fields of config.model.random)."""
  config = train_config.with_preset(train_config.base_config(), 'tiny')
  config.method = method
  config.data.max_length = seq_len
  config.data.synthetic.n_train = records
  config.data.synthetic.n_dev = 8
  config.data.n_pub = 8
  config.batch_size = max(1, records // 4)
  config.epochs = 1
  config.model.random.update(random)
  return config


def build(config):
  """(run data, backbone config, plan, classifier, params), by `build_run` as the
  trainer builds them (l* = the last sparse block)."""
  config = config.copy_and_resolve_references()
  config.raptor.layer = 'last'
  r = run_lib.build_run(config)
  return (
      r.data,
      r.backbone_config,
      r.plan,
      r.model,
      step.merged_params(r.frozen, r.trainable),
  )


def _phase_step(dp: step.PhaseStep, state: step.StepState, batches):
  """A zero-argument call running one phase step: zero sums, accumulate, update."""

  def call():
    sums = dp.zero_sums(state)
    for batch, mask in batches:
      sums = dp.accumulate(state, sums, batch, mask)
    return dp.update(state, sums)

  return call


def run(
    *,
    num_devices=(1, 4),
    method='raptor',
    microbatch=64,
    microbatches=4,
    seq_len=32,
    repeats=5,
    seed=0,
    **random,
) -> list[dict]:
  """Times every (phase, mesh size); one dict per row.

  Row keys: phase, devices, microbatch (global), per_device, microbatches,
  step_ms, over_first (median per-round ratio to the first mesh size),
  max_param_diff (largest |updated param - first mesh's|).
  """
  for d in num_devices:
    if microbatch % d:
      raise ValueError(
          f'microbatch={microbatch} is not a multiple of num_devices={d}'
      )
  if max(num_devices) > len(jax.devices()):
    raise ValueError(
        f'{max(num_devices)} devices asked for, {len(jax.devices())} visible; '
        f'set XLA_FLAGS={DEVICE_FLAG}={max(num_devices)}'
    )
  records = microbatch * microbatches
  config = run_config(method=method, records=records, seq_len=seq_len, **random)
  run_data, bc, plan, model, params = build(config)
  rng = np.random.default_rng(seed)
  owners = rng.integers(0, bc.num_experts, records, dtype=np.int32)
  host_batches = [
      (
          {
              'input_ids': run_data.train.input_ids[rows],
              'attention_mask': run_data.train.attention_mask[rows],
              'labels': run_data.train.labels[rows],
              'owners': owners[rows],
          },
          np.ones(microbatch, np.float32),
      )
      for rows in np.arange(records).reshape(microbatches, microbatch)
  ]
  calls = {}
  for d in num_devices:
    mesh = parallel.make_mesh(d)
    for i, phase in enumerate(plan.phases):
      dp = step.PhaseStep(
          model,
          phase,
          key=jax.random.key(i),
          mesh=mesh,
          learning_rate=config.learning_rate,
          expert_layer=plan.expert_layer,
          residual=config.raptor.residual,
          residual_gamma=config.raptor.residual_gamma,
      )
      calls[f'{phase.name}/{d}'] = _phase_step(
          dp, dp.init(params), host_batches
      )
  times = harness.interleaved_times(calls, repeats=repeats)
  rows = []
  for phase in plan.phases:
    first = f'{phase.name}/{num_devices[0]}'
    reference = jax.tree.map(np.asarray, calls[first]().trainable)
    for d in num_devices:
      name = f'{phase.name}/{d}'
      updated = jax.tree.map(np.asarray, calls[name]().trainable)
      diff = max(
          float(np.max(np.abs(a - b)))
          for a, b in zip(jax.tree.leaves(updated), jax.tree.leaves(reference))
      )
      rows.append(
          {
              'phase': phase.name,
              'devices': d,
              'microbatch': microbatch,
              'per_device': microbatch // d,
              'microbatches': microbatches,
              'step_ms': harness.median(times[name]) * 1e3,
              'over_first': harness.paired_ratio(times[name], times[first]),
              'max_param_diff': diff,
          }
      )
  return rows


def table(rows: list[dict]) -> str:
  header = [
      'phase',
      'devices',
      'records/device',
      'ms / step',
      f'/ {rows[0]["devices"]} device',
      'max|params - first|',
  ]
  body = [
      [
          r['phase'],
          r['devices'],
          f"{r['per_device']} x {r['microbatches']}",
          f"{r['step_ms']:.1f}",
          f"{r['over_first']:.2f}",
          f"{r['max_param_diff']:.1e}",
      ]
      for r in rows
  ]
  return harness.format_table(header, body)


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  num_devices = [int(d) for d in FLAGS.num_devices]
  print(
      f'{FLAGS.method}: random Switch d_model={FLAGS.d_model} d_ff={FLAGS.d_ff} '
      f'layers={FLAGS.num_layers} E={FLAGS.num_experts} S={FLAGS.seq_len}; one phase step = '
      f'{FLAGS.microbatches} microbatches of {FLAGS.microbatch} records (global) + update; '
      f'{len(jax.devices())} {jax.devices()[0].platform} devices, jax {jax.__version__}; '
      f'medians of {FLAGS.repeats} interleaved rounds',
      flush=True,
  )
  rows = run(
      num_devices=num_devices,
      method=FLAGS.method,
      microbatch=FLAGS.microbatch,
      microbatches=FLAGS.microbatches,
      seq_len=FLAGS.seq_len,
      repeats=FLAGS.repeats,
      d_model=FLAGS.d_model,
      d_ff=FLAGS.d_ff,
      num_layers=FLAGS.num_layers,
      num_heads=FLAGS.num_heads,
      d_kv=FLAGS.d_kv,
      num_experts=FLAGS.num_experts,
  )
  print(table(rows))
  print(
      '\nSeveral hosts (README.md): the same command on every host I = 0..N-1, host 0 '
      'at 10.0.0.1:\n'
  )
  print(MULTI_HOST_COMMAND)


if __name__ == '__main__':
  if DEVICE_FLAG not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (
        f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_FLAG}=4".strip()
    )
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    # Run again the same way: `python -m launch.bench.bench_parallel` from the repository root.
    os.execv(
        sys.executable, [sys.executable, '-m', __spec__.name, *sys.argv[1:]]
    )
  define_flags()
  app.run(main)
