r"""Times the trainer's cycle with and without length buckets, side by side.

One run of `configs/switch_sst2.py:small` (the small pretrained Switch on
the real SST-2 files), built once by `train.run.build_run`; the same cycles
(same secret: the same samples and noise) run through the trainer's
`train.cycle.train_cycle` with `data.length_buckets` at its default and at
`()` (every record at max_length), interleaved cycle by cycle. Prints the
first (compiling) and the later cycles' times, their ratio, the largest
parameter difference between the two and dev evaluation both ways.

  python -m launch.bench.bench_buckets --model=<pretrain workdir>/model

For the operator: the times follow the realised sample sizes and the
records' lengths (private on private data, see `log_wall_time`).
"""

import dataclasses
import time

from absl import app
from absl import flags
import jax
import numpy as np

from launch.bench import harness
from raptor_jax import length_buckets
from raptor_jax.train import cycle, metrics, parallel, step
from raptor_jax.train.config import glue_config
from raptor_jax.train.run import build_run

_MODEL = flags.DEFINE_string(
    "model", "runs/pretrain_switch/model", "pretrained small Switch"
)
_DATA = flags.DEFINE_string(
    "data", "../shared/data", "directory with glue/sst2 and calib/imdb"
)
_CYCLES = flags.DEFINE_integer("cycles", 4, "cycles per variant (>= 2)")


def _config(buckets):
  config = glue_config(task="sst2", model="switch", preset="small")
  config.model.name = _MODEL.value
  config.data.train_path = f"{_DATA.value}/glue/sst2/train.tsv"
  config.data.dev_path = f"{_DATA.value}/glue/sst2/dev.tsv"
  config.data.public_path = f"{_DATA.value}/calib/imdb/unsup_sample5000.tsv"
  config.data.length_buckets = buckets
  config.privacy.secret_seed = 0
  config.progress_bar = False
  return config


def _unbucketed(run):
  """`run` with every record padded to max_length (`data.length_buckets=()`)."""
  config = run.config.copy_and_resolve_references()
  config.data.length_buckets = ()
  return dataclasses.replace(run, config=config)


def main(argv):
  del argv
  t0 = time.time()
  run = build_run(_config(None))
  print(
      f"build_run (owners and layer selection by bucket): {time.time() - t0:.1f} s"
  )
  buckets = length_buckets.from_config(run.config)
  lengths = length_buckets.record_lengths(run.data.train.attention_mask)
  print(
      f"train records: {run.n}, mean length {lengths.mean():.1f} tokens,"
      f" max_length {run.data.train.input_ids.shape[1]}, buckets {buckets}"
  )
  mesh = parallel.make_mesh(1)
  secret = bytes(32)
  phase_fns = cycle.phase_functions(run, mesh, secret)
  start, frozen = cycle.initial_state(run, phase_fns, mesh)
  variants = {"buckets": run, "max_length": _unbucketed(run)}
  states = {name: start for name in variants}

  def one_cycle(name):  # of variant `name`, from its last state
    states[name] = cycle.train_cycle(
        variants[name], phase_fns, mesh, states[name], frozen, secret
    )
    return states[name].trainable

  times = harness.interleaved_times(
      {name: lambda name=name: one_cycle(name) for name in variants},
      repeats=_CYCLES.value,
      warmup=0,  # the first cycle compiles: printed on its own
  )
  for name, ts in times.items():
    print(
        f"{name:>10}: first cycle (compiles) {ts[0]:.2f} s, later cycles"
        f" {np.mean(ts[1:]):.3f} s (each: {', '.join(f'{x:.3f}' for x in ts[1:])})"
    )
  ratio = np.mean(times["buckets"][1:]) / np.mean(times["max_length"][1:])
  print(f"per-cycle time, buckets / max_length: {ratio:.3f}")
  leaves = [jax.tree.leaves(states[v].trainable) for v in variants]
  diff = max(np.max(np.abs(np.subtract(a, b))) for a, b in zip(*leaves))
  print(
      f"largest parameter difference after {_CYCLES.value} cycles: {diff:.2e}"
  )
  logits_fn = step.make_eval_fn(run.model)
  trainable, dev = states["buckets"].trainable, run.data.dev
  logits = lambda *records: logits_fn(
      trainable, frozen, *parallel.replicate(records, mesh)
  )
  for name, b in (("buckets", buckets), ("max_length", ())):
    out = []
    for _ in range(2):  # the first compiles
      t = time.time()
      result = metrics.evaluate(
          logits,
          dev.input_ids,
          dev.attention_mask,
          dev.labels,
          ("accuracy",),
          run.config.eval_batch_size,
          buckets=b,
      )
      out.append(time.time() - t)
    print(
        f"{name:>10}: dev evaluation {out[0]:.2f} s first, {out[1]:.3f} s"
        f" again; accuracy {result['accuracy']:.4f}"
    )


if __name__ == "__main__":
  app.run(main)
