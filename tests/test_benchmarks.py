"""Smoke tests: the benchmark scripts and profiling helpers run at toy sizes.

Not timed tests (the numbers are machine- and load-dependent); they only keep
`launch/bench_dispatch.py` and `launch/benchmark.py` from rotting, and check
what the tables are made of (FLOP counts, memory analysis) where it is exact.
"""

import importlib.util
import math
import pathlib

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from raptor_jax import profiling

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
  spec = importlib.util.spec_from_file_location(f"raptor_launch_{name}",
                                                _ROOT / "launch" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _positive(value):
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_loop_corrected_flops_counts_every_scan_iteration():
  def scanned(xs, w):
    return jax.lax.scan(lambda c, x: (c, x @ w), None, xs)[1]

  xs, w = jnp.ones((7, 4, 16)), jnp.ones((16, 8))
  raw, corrected = profiling.loop_corrected_flops(scanned, xs, w)
  body = 2 * 4 * 16 * 8
  assert raw == pytest.approx(body, rel=0.01)  # XLA: the body once (+ loop counter)
  assert corrected == pytest.approx(7 * body, rel=0.01)


def test_interleaved_times_and_ratio():
  times = profiling.interleaved_times({"a": lambda: jnp.ones(3), "b": lambda: jnp.zeros(3)},
                                      repeats=3)
  assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
  assert profiling.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0


def test_memory_stats_and_largest_buffers():
  compiled = jax.jit(lambda x: jnp.sin(x @ x.T) @ x).lower(jnp.ones((64, 32))).compile()
  stats = profiling.memory_stats(compiled)
  assert stats["argument"] == 64 * 32 * 4 and stats["output"] == 64 * 32 * 4
  buffers = profiling.largest_buffers(compiled, 3)
  assert buffers and buffers[0].nbytes >= buffers[-1].nbytes > 0


@pytest.mark.slow
def test_bench_dispatch_toy():
  bench = _load("bench_dispatch")
  d_model, d_ff, seq, e, b = 16, 32, 8, 4, 2
  rows = bench.run(num_experts=(e,), batch_sizes=(b,), seq_len=seq, d_model=d_model,
                   d_ff=d_ff, repeats=1)
  assert [(r["E"], r["B"], r["pass"]) for r in rows] == [(e, b, p) for p in bench.PASSES]
  block, blocks = bench.grouped_blocks(b * seq, e)
  for i, r in enumerate(rows):
    for key in ("ideal_gflop", "grouped_xla_gflop", "grouped_gflop", "dense_gflop",
                "one_expert_ms", "grouped_ms", "dense_ms", "dense_over_grouped"):
      assert _positive(r[key]), (key, r[key])
    # The loop-corrected count covers every padded block of both expert matmuls
    # (twice with the input gradient), which XLA's raw count does not.
    assert r["grouped_gflop"] * 1e9 >= (i + 1) * blocks * block * 4 * d_model * d_ff
    assert r["grouped_xla_gflop"] < r["grouped_gflop"] < r["dense_gflop"]
    assert r["max_abs_diff"] < 1e-5  # same routing and capacity, same outputs
  text = bench.time_table(rows) + bench.flops_table(rows)
  assert "fwd+bwd" in text


@pytest.mark.slow
def test_benchmark_toy():
  bench = _load("benchmark")
  config = bench.model_config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                              sparse_step=1, num_heads=2, num_experts=4, lora_rank=2)
  shared = bench.run_shared(config, microbatch_sizes=(3,), seq_len=8, repeats=1)
  assert [r["m"] for r in shared] == [3]
  for r in shared:
    for key in ("nonprivate_ms", "dp_ms", "dp_over_nonprivate", "nonprivate_compile_s",
                "dp_compile_s", "trainable", "frozen"):
      assert _positive(r[key]), (key, r[key])
  expert, buffers = bench.run_expert(config, num_experts=(2, 4), microbatch=2, seq_len=8,
                                     repeats=1)
  assert [r["E"] for r in expert] == [2, 4] and set(buffers) == {2, 4}
  for r in expert:
    for key in ("temp_mb", "argument_mb", "output_mb", "step_ms", "compile_s",
                "per_record_grad_mb"):
      assert _positive(r[key]), (key, r[key])
  # A record's gradient is one expert slice: its size does not depend on E.
  assert expert[0]["per_record_grad_mb"] == expert[1]["per_record_grad_mb"]
  assert expert[1]["expert_lora_params"] == 2 * expert[0]["expert_lora_params"]
  assert "temp / first" in bench.expert_table(expert)
  assert "DP/non-private" in bench.shared_table(shared)


def test_scripts_define_flags_only_when_run():
  """Importing both scripts into one process (as these tests do) must not clash."""
  for name in ("bench_dispatch", "benchmark"):
    module = _load(name)
    assert callable(module.define_flags) and callable(module.main)
    assert "repeats" not in flags.FLAGS
