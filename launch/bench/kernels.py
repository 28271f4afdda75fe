r"""Step time of the fast kernels against their plain twins, in one process.

`model.kernels='fast'` (custom VJPs, record folding, layout barriers) and
`'reference'` (plain `jnp` and autodiff) compute the same steps: the
trainer's non-private, shared DP and expert DP `PhaseStep`s on the
`vs_opacus` Switch, timed in interleaved rounds after both updates (noise
off) are checked against `vs_opacus`'s float64 PyTorch references. Prints
the median ms per step, the paired ratio fast / reference and the updates'
relative distances.

  python -m launch.bench.kernels                        # microbatch 32
  python -m launch.bench.kernels --microbatch_sizes=32,128 --repeats=7
  python -m launch.bench.kernels --quick                # toy sizes (tests)
"""

import sys

from raptor_jax import host_memory

host_memory.keep_unless_disabled(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
import tempfile

from absl import app
from absl import flags
import jax

from launch.bench import harness
from launch.bench import raptor_side
from launch.bench import torch_side
from raptor_jax import host_devices
from raptor_jax.models import hf

KINDS = ('fast', 'reference')
TOLERANCE = 1e-3  # vs_opacus's float32-against-float64 tolerance
STREAMS = ('nonprivate', 'shared', 'expert')


def define_flags() -> None:
  flags.DEFINE_bool('quick', False, 'Tiny sizes, one round: a smoke test.')
  flags.DEFINE_list('microbatch_sizes', ['32'], 'Microbatch sizes.')
  flags.DEFINE_integer('repeats', 5, 'Timed interleaved rounds.')
  flags.DEFINE_integer('cpu_devices', 0, 'XLA CPU devices (0: one per core).')
  flags.DEFINE_bool(
      'keep_host_memory', True, host_memory.FLAG_HELP, short_name=None
  )


def steps(path: str, sizes: raptor_side.Sizes, m: int):
  """({(kind, stream): (step, noiseless update)}, {stream: float64 torch
  update}: `torch_side.float64_references`, the yardstick)."""
  module, params = raptor_side.raptor_model(path, sizes)
  batch, owners = raptor_side.records(sizes, m, seed=m)
  out = {}
  for kind in KINDS:
    new_backbone, _ = hf.with_options(
        module.backbone, params['backbone'], kernels=kind
    )
    classifier = module.clone(backbone=new_backbone)
    for stream in STREAMS:
      out[kind, stream] = raptor_side.raptor_dp(
          classifier, params, batch, owners, sizes, stream
      )
  float64 = torch_side.float64_references(path, sizes, params, batch, owners)
  return out, float64


def run(sizes, microbatch_sizes, repeats: int) -> list[dict]:
  """One row per (microbatch, stream): medians of both settings, the ratio."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    path = raptor_side.save_switch(tmp + '/switch', sizes)
    for m in microbatch_sizes:
      calls, float64 = steps(path, sizes, m)
      errors = {
          key: torch_side.relative_error(update, float64[key[1]])
          for key, (_, update) in calls.items()
      }
      for (kind, stream), error in errors.items():
        if error > TOLERANCE:
          raise SystemExit(
              f"error: m={m} {stream}: the {kind} kernels' update is "
              f'{error:.2e} relative from torch float64 (noise off; at most '
              f'{TOLERANCE:g}); the kernels are wrong'
          )
      times = harness.interleaved_times(
          {key: step for key, (step, _) in calls.items()}, repeats=repeats
      )
      for stream in STREAMS:
        fast, reference = times['fast', stream], times['reference', stream]
        rows.append(
            dict(
                m=m,
                stream=stream,
                fast_ms=harness.median(fast) * 1e3,
                reference_ms=harness.median(reference) * 1e3,
                ratio=harness.paired_ratio(fast, reference),
                between=torch_side.relative_error(
                    calls['fast', stream][1], calls['reference', stream][1]
                ),
                fast_error=errors['fast', stream],
                reference_error=errors['reference', stream],
            )
        )
  return rows


def table(rows) -> str:
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
  sizes = raptor_side.QUICK if FLAGS.quick else raptor_side.Sizes()
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
