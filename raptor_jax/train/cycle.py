"""One training cycle (Alg. 1) and the programs a run compiles ahead.

Per cycle, every phase of the plan draws its own Poisson sample
(`numpy.random.default_rng((seed, stream, cycle))`, the seed a KDF of the
run's secret: `secrecy`), accumulates clipped per-record gradient sums over
fixed-size microbatches, and makes ONE noisy DP-Adam update; the ledger
records the release in the same immutable `TrainState`. The realised sample
size only decides how many microbatches run; nothing reads, branches on or
logs it.

Length buckets (`data.length_buckets`, `raptor_jax.length_buckets`): a
sample's records run in fixed-shape microbatches of the smallest bucket that
holds them (one compile per bucket), and every bucket's clipped sums add into
the phase's one noisy update: the same function of the sample as unbucketed
(up to float summation order). A record's bucket follows its private length,
so it changes the layout and the wall time only; no bucket, count of records
per bucket or microbatches per bucket reaches a log, metric, progress bar or
file.

Ahead-of-time compilation (`programs`, `compile_run`): before the first
cycle, every program the run calls is compiled, for EVERY bucket. The list is
a function of the public config alone, never of which buckets the private
data fills, so the compile time and the persistent cache
(`raptor_jax.compilation`) reveal nothing about the data. The trainer
(`train.loop`), the controlled study and `bench_buckets` run this cycle.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from raptor_jax import compilation, data, length_buckets, sampling
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.train import metrics, outputs, parallel, secrecy, step
from raptor_jax.train.outputs import TrainState
from raptor_jax.train.parallel import AXIS
from raptor_jax.train.run import Run

log = logging.getLogger("raptor_jax")


def phase_functions(run: Run, mesh, secret: bytes) -> list[step.PhaseFunctions]:
  """The jitted step of every phase; phase i's noise key is the KDF 'noise/i'."""
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


def initial_state(run: Run, phase_fns, mesh) -> tuple[TrainState, Any]:
  """(fresh state at cycle 0, frozen parameters), replicated on the mesh."""
  opt_states = {}
  for fns in phase_fns:
    opt_states.update(fns.init_opt_states(run.trainable))
  trainable, frozen, opt_states = parallel.replicate(
      (run.trainable, run.frozen, opt_states), mesh
  )
  return TrainState(trainable, opt_states, PrivacyLedger(), 0), frozen


def batch(
    train: data.TextClassificationData,
    owners: np.ndarray,
    indices: np.ndarray,
    length: int | None = None,
) -> dict[str, np.ndarray]:
  """The records `indices`, their tokens cut to `length` (None: max_length).

  Records are right padded, so cutting a record to a bucket that holds it
  drops padding only (a padding row, mask 0, may lose tokens: its weight is
  zero whatever it holds).
  """
  return dict(
      input_ids=train.input_ids[indices, :length],
      attention_mask=train.attention_mask[indices, :length],
      labels=train.labels[indices],
      owners=owners[indices],
  )


def microbatches(sample, local_size, buckets, lengths):
  """[(length or None, Microbatch)]: this host's microbatches of `sample`,
  bucket by bucket where there are buckets. The layout is private (it
  follows the records' lengths and the realised sample); it is iterated
  over, never logged or counted anywhere public."""
  if not buckets:
    return [
        (None, mb) for mb in parallel.local_microbatches(sample, local_size)
    ]
  return list(
      parallel.local_bucketed_microbatches(sample, lengths, buckets, local_size)
  )


def record_lengths(run: Run) -> np.ndarray | None:
  """This host's record lengths when the config buckets by length, else
  None. PRIVATE: they decide each cycle's microbatch layout only."""
  if not length_buckets.from_config(run.config):
    return None
  return length_buckets.record_lengths(run.data.train.attention_mask)


def train_cycle(
    run: Run,
    phase_fns,
    mesh,
    state: TrainState,
    frozen,
    secret: bytes,
    writer: metrics.MetricWriter | None = None,
    lengths: np.ndarray | None = None,
) -> TrainState:
  """Runs every phase of one cycle and returns the committed next state.

  `lengths`: this host's record lengths (computed here when None). The new
  state (and the ledger entry of every private phase) only exists once all
  phases ran, so an interruption leaves the previous state consistent.
  `writer` gets the private training loss when the config opts in
  (`log_private_stats`, warned).
  """
  config, plan, cycle = run.config, run.plan, state.cycle
  local_microbatch = config.microbatch_size * len(mesh.local_devices)
  buckets = length_buckets.from_config(config)
  if buckets and lengths is None:
    lengths = record_lengths(run)
  trainable, opt_states = state.trainable, state.opt_states
  seed = secrecy.sampler_seed(secret)
  for phase, fns in zip(plan.phases, phase_fns):
    sample = sampling.poisson_sample(
        run.n, plan.sample_rate, seed=seed, stream=phase.stream, step=cycle
    )
    # Ready before the first accumulate is launched: XLA:CPU with several
    # devices deadlocked when a step's launch on one device ran ahead of the
    # launch that computes its input (warm-cache runs).
    sums, loss_sum = jax.block_until_ready(fns.zero_sums(trainable)), 0.0
    for length, mb in microbatches(sample, local_microbatch, buckets, lengths):
      records, mask = parallel.shard_records(
          (batch(run.data.train, run.owners, mb.indices, length), mb.mask),
          mesh,
      )
      if config.log_private_stats:
        loss_sum += float(fns.loss_sum(trainable, frozen, records, mask))
      sums = fns.accumulate(trainable, frozen, sums, records, mask)
    trainable, opt_states = fns.update(trainable, opt_states, sums)
    if config.log_private_stats and writer is not None:  # opted in, warned
      writer.write(
          cycle,
          {f"private/{phase.name}_train_loss": loss_sum / max(len(sample), 1)},
      )
  return TrainState(
      trainable, opt_states, outputs.accounted(plan, state.ledger), cycle + 1
  )


def evaluate(
    run: Run, logits_fn: Callable, state: TrainState, frozen, mesh
) -> dict[str, float]:
  """Metrics of `state`'s parameters on the run's evaluation split
  (batches of `eval_batch_size`, by length bucket)."""
  dev = run.data.dev
  logits = lambda ids, mask: logits_fn(
      state.trainable, frozen, *parallel.replicate((ids, mask), mesh)
  )
  return metrics.evaluate(
      logits,
      dev.input_ids,
      dev.attention_mask,
      dev.labels,
      run.data.task.metrics,
      run.config.eval_batch_size,
      buckets=length_buckets.from_config(run.config),
  )


def _widths(run: Run) -> tuple[int, ...]:
  """Every sequence length a step or evaluation batch can have: each bucket
  (`data.length_buckets`), or max_length alone. Public: the config's."""
  buckets = length_buckets.from_config(run.config)
  return buckets or (int(run.data.train.input_ids.shape[1]),)


def _records(run: Run, mesh, rows: int, width: int, sharding) -> tuple:
  """Abstract (batch, mask) of `rows` records of `width` tokens."""
  train = run.data.train
  dtype = lambda a: jax.dtypes.canonicalize_dtype(np.asarray(a).dtype)
  spec = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  records = dict(
      input_ids=spec((rows, width), dtype(train.input_ids)),
      attention_mask=spec((rows, width), dtype(train.attention_mask)),
      labels=spec((rows,), dtype(train.labels)),
      owners=spec((rows,), dtype(run.owners)),
  )
  return records, spec((rows,), np.dtype(np.float32))


def _replicated(shapes, sharding):
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
      shapes,
  )


def programs(
    run: Run, phase_fns, logits_fn: Callable, mesh, state: TrainState, frozen
) -> list[compilation.Program]:
  """Every program the run's cycles and evaluations call, for every bucket.

  The shapes are the config's (microbatch and evaluation batch sizes, bucket
  lengths, max_length) and the placements those of `state` and `frozen`:
  the list is the same whatever the private data holds.
  """
  config = run.config
  replicated = NamedSharding(mesh, PartitionSpec())
  sharded = NamedSharding(mesh, PartitionSpec(AXIS))
  rows = config.microbatch_size * mesh.size
  trainable, frozen_ = compilation.abstract((state.trainable, frozen))
  out = []

  def add(name: str, fn: Callable, *args) -> None:
    out.append(compilation.Program(name, fn, args))

  for fns in phase_fns:
    name = fns.phase.name
    sums = _replicated(jax.eval_shape(fns.zero_sums, trainable), replicated)
    add(f"{name} zero", fns.zero_sums, trainable)
    for width in _widths(run):
      records = _records(run, mesh, rows, width, sharded)
      step_args = (trainable, frozen_, sums, *records)
      add(f"{name} accumulate {width}", fns.accumulate, *step_args)
      if config.log_private_stats:
        add(f"{name} loss {width}", fns.loss_sum, trainable, frozen_, *records)
    update_args = (trainable, compilation.abstract(state.opt_states), sums)
    add(f"{name} update", fns.packed_update, *update_args)
    layouts = fns.layouts(trainable)
    vectors = jax.eval_shape(fns.packed_update, *update_args)[0]
    add(
        f"{name} unpack",
        fns.unpack,
        tuple(sorted(layouts.items())),
        {n: _replicated(vectors[n], replicated) for n in layouts},
    )
  for width in _widths(run):
    records, _ = _records(run, mesh, config.eval_batch_size, width, replicated)
    ids, mask = records["input_ids"], records["attention_mask"]
    add(f"evaluate {width}", logits_fn, trainable, frozen_, ids, mask)
  return out


def compile_run(
    run: Run,
    phase_fns,
    logits_fn: Callable,
    mesh,
    state: TrainState,
    frozen,
    progress: Callable[[str], None] | None = None,
) -> compilation.CompileReport:
  """`compilation.compile_ahead` of `programs`: the run then compiles nothing
  more (a program already in the persistent cache is loaded)."""
  return compilation.compile_ahead(
      programs(run, phase_fns, logits_fn, mesh, state, frozen),
      progress=progress,
  )
