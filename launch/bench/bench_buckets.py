r"""Times the trainer's cycle with and without length buckets, side by side.

One run of `configs/switch_sst2.py:small` (the small pretrained Switch on
the real SST-2 files, B = 500, microbatch 100, max length 64), built once
by `train.run.build_run` as the trainer builds it; the same cycles (same
secret, so the same Poisson samples and noise) are then run through
the trainer's cycle (`train.loop._train_cycle`, rebuilt here from its
public pieces: `sampling.poisson_sample`, `train.parallel`'s microbatches,
`train.step.PhaseFunctions`) with `data.length_buckets` at its default
((16, 32, 64)) and at `()` (every record padded to 64), variants
interleaved cycle by cycle. Prints the first cycle of each (it compiles:
once per (phase, bucket)) and the mean of the later ones, their ratio, the
largest parameter difference between the two (float summation order only)
and the evaluation time on dev both ways.

  python -m launch.bench.bench_buckets --model=<pretrain workdir>/model

A benchmark for the operator: the times follow the realised sample sizes
and the records' lengths (private on private data, see `log_wall_time`);
SST-2 here is public.
"""

import time

from absl import app
from absl import flags
import jax
import numpy as np

from raptor_jax import length_buckets, sampling
from raptor_jax.train import metrics, parallel, secrecy, step
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


def _phase_functions(run, mesh, secret):
  """Every phase's jitted step, as the trainer builds them."""
  config = run.config
  return [
      step.PhaseFunctions(
          run.model,
          phase,
          mesh=mesh,
          expert_layer=run.expert_layer,
          num_experts=run.num_experts,
          learning_rate=config.learning_rate,
          residual=config.raptor.residual,
          residual_gamma=config.raptor.residual_gamma,
          key=secrecy.noise_key(secret, i),
      )
      for i, phase in enumerate(run.plan.phases)
  ]


def _cycle(run, phase_fns, mesh, state, frozen, secret, cycle, buckets):
  """One cycle of every phase, as `train.loop._train_cycle` runs it."""
  trainable, opt_states = state
  train, size = run.data.train, run.config.microbatch_size
  lengths = length_buckets.record_lengths(train.attention_mask)
  for phase, fns in zip(run.plan.phases, phase_fns):
    sample = sampling.poisson_sample(
        run.n,
        run.plan.sample_rate,
        seed=secrecy.sampler_seed(secret),
        stream=phase.stream,
        step=cycle,
    )
    items = (
        parallel.local_bucketed_microbatches(sample, lengths, buckets, size)
        if buckets
        else [(None, mb) for mb in parallel.local_microbatches(sample, size)]
    )
    sums = fns.zero_sums(trainable)
    for length, mb in items:
      i = mb.indices
      batch = dict(
          input_ids=train.input_ids[i, :length],
          attention_mask=train.attention_mask[i, :length],
          labels=train.labels[i],
          owners=run.owners[i],
      )
      placed = parallel.shard_records((batch, mb.mask), mesh)
      sums = fns.accumulate(trainable, frozen, sums, *placed)
    trainable, opt_states = fns.update(trainable, opt_states, sums)
  return trainable, opt_states


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
  phase_fns = _phase_functions(run, mesh, secret)
  opt_states = {}
  for fns in phase_fns:
    opt_states.update(fns.init_opt_states(run.trainable))
  trainable, frozen, opt_states = parallel.replicate(
      (run.trainable, run.frozen, opt_states), mesh
  )
  variants = {"buckets": buckets, "max_length": ()}
  states = {name: (trainable, opt_states) for name in variants}
  times = {name: [] for name in variants}
  for cycle in range(_CYCLES.value):
    for name, b in variants.items():
      t = time.time()
      states[name] = _cycle(
          run, phase_fns, mesh, states[name], frozen, secret, cycle, b
      )
      jax.block_until_ready(states[name][0])
      times[name].append(time.time() - t)
  for name, ts in times.items():
    print(
        f"{name:>10}: first cycle (compiles) {ts[0]:.2f} s, later cycles"
        f" {np.mean(ts[1:]):.3f} s (each: {', '.join(f'{x:.3f}' for x in ts[1:])})"
    )
  ratio = np.mean(times["buckets"][1:]) / np.mean(times["max_length"][1:])
  print(f"per-cycle time, buckets / max_length: {ratio:.3f}")
  diff = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(
          jax.tree.leaves(states["buckets"][0]),
          jax.tree.leaves(states["max_length"][0]),
      )
  )
  print(
      f"largest parameter difference after {_CYCLES.value} cycles: {diff:.2e}"
  )
  logits_fn = step.make_eval_fn(run.model)
  dev = run.data.dev
  for name, b in (("buckets", buckets), ("max_length", ())):
    out = []
    for _ in range(2):  # the first compiles
      t = time.time()
      result = metrics.evaluate(
          lambda ids, mask: logits_fn(
              states["buckets"][0],
              frozen,
              *parallel.replicate((ids, mask), mesh),
          ),
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
