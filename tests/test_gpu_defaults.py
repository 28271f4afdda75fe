"""No long host-driven loop in a GPU step, checked on CPU (issue 43.4).

XLA:GPU drives every while loop from the host, one round trip per
iteration, so a step's loops must stay short there. With the GPU's defaults
forced (`kernels.defaults_of('gpu')`: 'auto' resolves as on a GPU when
traced), the compiled programs are read back as optimised HLO and every
while loop's static trip count (`harness.while_loops`) must be at most 64.
The CPU keeps its own defaults (the grouped block scan), whose loops the
same reading finds, so the check can fail.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.bench import harness
from raptor_jax.models import kernels
from raptor_jax.models import lora as lora_lib
from raptor_jax.train import parallel, step

from helpers import micro_config, micro_model

MAX_TRIPS = 64
# XLA:CPU's default emitters keep a scatter one op, as XLA:GPU does; the
# older ones the suite compiles with (conftest.py) expand it into a loop over
# its indices, a CPU artefact that no GPU program has.
GPU_LIKE = {"xla_cpu_use_fusion_emitters": True}


def _compiled_text(lowered) -> str:
  return lowered.compile(GPU_LIKE).as_text()


def _hlo(fn, *args) -> str:
  return _compiled_text(jax.jit(fn).lower(*args))


def test_while_loops_reads_static_trip_counts_and_their_nesting():
  def nested(x):
    def outer(c, _):
      inner = lambda c, _: (2.0 * c, None)
      return jax.lax.scan(inner, c, None, length=3)[0] + 1.0, None

    return jax.lax.scan(outer, x, None, length=100)[0]

  def branch(x):
    loop = lambda: jax.lax.fori_loop(0, 7, lambda i, c: 1.5 * c, x)
    return jax.lax.cond(x[0] > 0, loop, lambda: x)

  def data_dependent(x):
    return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: 2.0 * c, x)

  x = jnp.ones(3)
  loops = harness.while_loops(_hlo(lambda x: nested(x) + branch(x), x))
  assert sorted((l["trip_count"], l["per_call"]) for l in loops) == [
      (3, 300),  # the inner scan runs 3 steps in each of the outer's 100
      (7, 7),  # inside a conditional's branch
      (100, 100),
  ]
  assert harness.max_while_trip_count(_hlo(nested, x)) == 100
  assert harness.max_while_trip_count(_hlo(data_dependent, x)) == math.inf
  assert harness.max_while_trip_count(_hlo(jnp.sin, x)) == 0


def _expert_layer_hlo(dispatch: str) -> str:
  """Per-record adapter gradients of one OLMoE-sized expert layer (E = 64)."""
  layer = lora_lib.ExpertLinear(64, 16, rank=2, dispatch=dispatch)
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.normal(size=(4, 256, 8)), jnp.float32)  # 4 records
  experts = jnp.asarray(rng.randint(0, 65, (4, 256)), jnp.int32)
  params = jax.eval_shape(layer.init, jax.random.key(0), x[0], experts[0])
  loss = lambda p, x, e: jnp.sum(jnp.tanh(layer.apply(p, x, e)))
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))
  return _compiled_text(jax.jit(grads).lower(params, x, experts))


def test_gpu_default_expert_dispatch_has_no_long_loop():
  """The CPU's scan runs rows // block + E = 1088 steps here; the GPU's
  default ('batched') none."""
  assert harness.max_while_trip_count(_expert_layer_hlo("grouped")) > 1000
  with kernels.defaults_of("gpu"):
    gpu = _expert_layer_hlo("auto")
  assert harness.max_while_trip_count(gpu) <= MAX_TRIPS
  assert harness.max_while_trip_count(_expert_layer_hlo("auto")) > 1000


# Micro runs at the real models' expert counts (Switch-base-8: E = 8 top-1;
# OLMoE-1B-7B: E = 64 top-8), where the CPU's block scan runs 72 and 1088
# steps per product.
FAMILIES = {
    "switch": ({"model.random.num_experts": 8}, 32),
    "olmoe": (
        {
            "model.random.family": "olmoe",
            "model.random.num_experts": 64,
            "model.random.top_k": 8,
            "model.random.num_kv_heads": 1,
        },
        4,
    ),
}


def training_programs_hlo(overrides, microbatch):
  """{'<phase>/accumulate' | '<phase>/update': optimised HLO} of a micro run.

  Every phase's two programs (shared and expert streams), built by
  `PhaseStep` exactly as the trainer builds them, lowered at the run's
  padded length and compiled (`GPU_LIKE`).
  """
  config, _, plan, model, params, _ = micro_model(micro_config(**overrides))
  mesh = parallel.make_mesh()
  m, length = microbatch, config.data.max_length
  batch = {
      "input_ids": np.ones((m, length), np.int32),
      "attention_mask": np.ones((m, length), np.int32),
      "labels": np.zeros((m,), np.int32),
      "owners": np.zeros((m,), np.int32),
  }
  placed = parallel.shard_records((batch, np.ones(m, np.float32)), mesh)
  texts = {}
  for phase in plan.phases:
    dp = step.PhaseStep(model, phase, key=jax.random.key(0), mesh=mesh)
    state = dp.init(params)
    sums = dp.zero_sums(state)
    fns = dp.functions
    texts[f"{phase.name}/accumulate"] = _compiled_text(
        fns.accumulate.lower(state.trainable, state.frozen, sums, *placed)
    )
    texts[f"{phase.name}/update"] = _compiled_text(
        fns.packed_update.lower(state.trainable, state.opt_state, sums)
    )
  return texts


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_default_training_programs_have_no_long_loop(family):
  overrides, microbatch = FAMILIES[family]
  with kernels.defaults_of("gpu"):
    texts = training_programs_hlo(overrides, microbatch)
  assert {name.split("/")[0] for name in texts} >= {"shared", "expert"}
  trips = {name: harness.max_while_trip_count(t) for name, t in texts.items()}
  print(family, trips)
  assert all(n <= MAX_TRIPS for n in trips.values()), trips
