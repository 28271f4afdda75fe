r"""Step time of the fast kernels against their plain twins, in one process.

`model.kernels='fast'` (custom VJPs, record folding, layout barriers) and
`'reference'` (plain `jnp` and autodiff) compute the same steps; this script
times the trainer's three steps (non-private, shared DP, expert DP:
`PhaseStep`, as `vs_opacus` builds them) of the `vs_opacus` Switch with
each setting, in interleaved rounds, after checking that both give the same
update with the noise off. It prints the median milliseconds per step and
the ratio fast / reference measured side by side:

  python -m launch.bench.kernels                        # microbatch 32
  python -m launch.bench.kernels --microbatch_sizes=32,128 --repeats=7
  python -m launch.bench.kernels --quick                # toy sizes (tests)
"""

import sys

from raptor_jax import host_memory

host_memory.keep_unless_disabled(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from launch.bench import vs_opacus
from raptor_jax import host_devices
from raptor_jax.models import hf

KINDS = ('fast', 'reference')
STREAMS = ('nonprivate', 'shared', 'expert')


def define_flags() -> None:
  flags.DEFINE_bool('quick', False, 'Tiny sizes, one round: a smoke test.')
  flags.DEFINE_list('microbatch_sizes', ['32'], 'Microbatch sizes.')
  flags.DEFINE_integer('repeats', 5, 'Timed interleaved rounds.')
  flags.DEFINE_integer(
      'cpu_devices',
      0,
      'XLA CPU devices (0 = one per core that divides every microbatch).',
  )
  flags.DEFINE_bool(
      'keep_host_memory', True, host_memory.FLAG_HELP, short_name=None
  )


def steps(path: str, sizes: vs_opacus.Sizes, m: int) -> dict:
  """{(kind, stream): (step, update with noise off)} for both settings."""
  module, params = vs_opacus.raptor_model(path, sizes)
  batch, owners = vs_opacus.records(sizes, m, seed=m)
  out = {}
  for kind in KINDS:
    backbone = module.backbone
    new_backbone, _ = hf.with_options(
        backbone, params['backbone'], kernels=kind
    )
    classifier = module.clone(backbone=new_backbone)
    for stream in STREAMS:
      out[kind, stream] = vs_opacus.raptor_dp(
          classifier, params, batch, owners, sizes, stream
      )
  return out


def _time(step) -> float:
  start = time.perf_counter()
  jax.block_until_ready(step())
  return time.perf_counter() - start


def run(sizes, microbatch_sizes, repeats: int) -> list[dict]:
  """One row per (microbatch, stream): medians of both settings, the ratio."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    path = vs_opacus.save_switch(tmp + '/switch', sizes)
    for m in microbatch_sizes:
      calls = steps(path, sizes, m)
      for stream in STREAMS:
        fast = calls['fast', stream][1]
        reference = calls['reference', stream][1]
        error = vs_opacus.relative_error(fast, reference)
        if error > 1e-4:
          raise SystemExit(
              f'error: m={m} {stream}: fast and reference updates differ by '
              f'{error:.2e} relative (noise off); the kernels disagree'
          )
      for step, _ in calls.values():
        _time(step)  # compile and warm up
      times = {key: [] for key in calls}
      for _ in range(repeats):
        for key, (step, _) in calls.items():
          times[key].append(_time(step))
      for stream in STREAMS:
        fast = statistics.median(times['fast', stream]) * 1e3
        reference = statistics.median(times['reference', stream]) * 1e3
        paired = [
            f / r
            for f, r in zip(times['fast', stream], times['reference', stream])
        ]
        rows.append(
            dict(
                m=m,
                stream=stream,
                fast_ms=fast,
                reference_ms=reference,
                ratio=float(np.median(paired)),
                error=vs_opacus.relative_error(
                    calls['fast', stream][1], calls['reference', stream][1]
                ),
            )
        )
  return rows


def table(rows) -> str:
  lines = [
      '| m | step | fast ms | reference ms | fast / reference (median of'
      ' paired rounds) | update rel. diff (noise off) |',
      '|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
        f"| {r['m']} | {r['stream']} | {r['fast_ms']:.1f} |"
        f" {r['reference_ms']:.1f} | {r['ratio']:.2f} | {r['error']:.1e} |"
    )
  return '\n'.join(lines)


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  sizes = vs_opacus.QUICK if FLAGS.quick else vs_opacus.Sizes()
  sizes_m = [int(m) for m in FLAGS.microbatch_sizes]
  if FLAGS.quick:
    sizes_m = [2]
  devices = host_devices.one_device_per_core(
      FLAGS.cpu_devices or host_devices.dividing_count(sizes_m)
  )
  print(
      f'Switch d_model={sizes.d_model} blocks={sizes.num_layers} '
      f'E={sizes.num_experts} seq={sizes.seq_len} LoRA r={sizes.lora_rank}; '
      f'jax {jax.__version__} {jax.devices()[0].platform} x {devices} devices; '
      f'{1 if FLAGS.quick else FLAGS.repeats} interleaved rounds',
      flush=True,
  )
  print(table(run(sizes, sizes_m, 1 if FLAGS.quick else FLAGS.repeats)))


if __name__ == '__main__':
  define_flags()
  app.run(main)
