"""Smoke tests: the benchmark scripts and measurement helpers run at toy sizes.

Not timed tests (the numbers are machine- and load-dependent); they only keep
`launch/bench/bench_dispatch.py`, `benchmark.py`, `vs_opacus.py` and the
others from rotting, and check what the tables are made of (FLOP counts, memory
analysis) where it is exact.
"""

import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.bench import harness
from raptor_jax.data import images

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
  return importlib.import_module(f"launch.bench.{name}")


def _positive(value):
  return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_loop_corrected_flops_counts_every_scan_iteration():
  def scanned(xs, w):
    return jax.lax.scan(lambda c, x: (c, x @ w), None, xs)[1]

  xs, w = jnp.ones((7, 4, 16)), jnp.ones((16, 8))
  raw, corrected = harness.loop_corrected_flops(scanned, xs, w)
  body = 2 * 4 * 16 * 8
  assert raw == pytest.approx(
      body, rel=0.01
  )  # XLA: the body once (+ loop counter)
  assert corrected == pytest.approx(7 * body, rel=0.01)


def test_interleaved_times_and_ratio():
  times = harness.interleaved_times(
      {"a": lambda: jnp.ones(3), "b": lambda: jnp.zeros(3)}, repeats=3
  )
  assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
  assert harness.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0


def test_memory_stats_and_largest_buffers():
  compiled = (
      jax.jit(lambda x: jnp.sin(x @ x.T) @ x)
      .lower(jnp.ones((64, 32)))
      .compile()
  )
  stats = harness.memory_stats(compiled)
  assert stats["argument"] == 64 * 32 * 4 and stats["output"] == 64 * 32 * 4
  buffers = harness.largest_buffers(compiled, 3)
  assert buffers and buffers[0].nbytes >= buffers[-1].nbytes > 0


@pytest.mark.slow
def test_bench_dispatch_toy():
  bench = _load("bench_dispatch")
  d_model, d_ff, seq, e, b = 16, 32, 8, 4, 2
  rows = bench.run(
      num_experts=(e,),
      batch_sizes=(b,),
      seq_len=seq,
      d_model=d_model,
      d_ff=d_ff,
      repeats=1,
  )
  assert [(r["E"], r["B"], r["pass"]) for r in rows] == [
      (e, b, p) for p in bench.PASSES
  ]
  block, blocks = bench.grouped_blocks(b * seq, e)
  for i, r in enumerate(rows):
    for key in (
        "ideal_gflop",
        "grouped_xla_gflop",
        "grouped_gflop",
        "dense_gflop",
        "ragged_gflop",
        "one_expert_ms",
        "grouped_ms",
        "dense_ms",
        "ragged_ms",
        "dense_over_grouped",
        "ragged_over_grouped",
    ):
      assert _positive(r[key]), (key, r[key])
    # The loop-corrected count covers every padded block of both expert matmuls
    # (twice with the input gradient), which XLA's raw count does not.
    assert (
        r["grouped_gflop"] * 1e9
        >= (i + 1) * blocks * block * 4 * d_model * d_ff
    )
    assert r["grouped_xla_gflop"] < r["grouped_gflop"] < r["dense_gflop"]
    # Same routing and capacity: grouped = ragged = dense.
    assert r["max_abs_diff"] < 1e-5
  text = bench.time_table(rows) + bench.flops_table(rows)
  assert "fwd+bwd" in text


@pytest.mark.slow
def test_bench_dispatch_olmoe_toy():
  """Top-k SwiGLU layer: grouped ~ k x tokens rows, all ~ E x tokens, dense ~ k x E x tokens."""
  bench = _load("bench_dispatch")
  d_model, d_ff, seq, e, b, k = 16, 32, 8, 4, 2, 2
  rows = bench.run(
      family="olmoe",
      num_experts=(e,),
      batch_sizes=(b,),
      top_k=k,
      seq_len=seq,
      d_model=d_model,
      d_ff=d_ff,
      repeats=1,
  )
  assert [(r["E"], r["B"], r["k"], r["pass"]) for r in rows] == [
      (e, b, k, p) for p in bench.PASSES
  ]
  tokens = b * seq
  block, blocks = bench.grouped_blocks(tokens * k, e)
  assert rows[0]["ideal_gflop"] * 1e9 == bench.ideal_flops(
      tokens, d_model, d_ff, e, k, 3
  )
  for i, r in enumerate(rows):
    for key in (
        "ideal_gflop",
        "grouped_gflop",
        "dense_gflop",
        "all_gflop",
        "one_expert_ms",
        "grouped_ms",
        "dense_ms",
        "all_ms",
        "ragged_ms",
        "dense_over_grouped",
        "all_over_grouped",
        "ragged_over_grouped",
    ):
      assert _positive(r[key]), (key, r[key])
    # Three expert matmuls (gate, up, down) over every padded block of the k x tokens rows.
    assert (
        r["grouped_gflop"] * 1e9
        >= (i + 1) * blocks * block * 6 * d_model * d_ff
    )
    assert r["grouped_gflop"] < r["all_gflop"] < r["dense_gflop"]
    assert (
        r["max_abs_diff"] < 1e-5
    )  # same router and top-k: grouped = ragged = dense = all
  assert rows[0]["all_gflop"] * 1e9 >= tokens * e * 6 * d_model * d_ff
  assert "all/grouped" in bench.time_table(
      rows
  ) and "all/ideal" in bench.flops_table(rows)


@pytest.mark.slow
def test_bench_dispatch_deepseek_toy():
  """Routed top-k in the grouped dispatch plus the shared experts as one dense
  MLP: work ~ tokens x (k + shared), never tokens x E; every dispatch agrees."""
  bench = _load("bench_dispatch")
  d_model, d_ff, seq, e, b, k, shared = 16, 32, 8, 8, 2, 2, 2
  rows = bench.run(
      family="deepseek",
      num_experts=(e,),
      batch_sizes=(b,),
      top_k=k,
      seq_len=seq,
      d_model=d_model,
      d_ff=d_ff,
      shared_experts=shared,
      repeats=1,
  )
  tokens = b * seq
  block, blocks = bench.grouped_blocks(tokens * k, e)
  # Independent count: (k routed + shared) SwiGLU MLPs per token + the router.
  assert rows[0]["ideal_gflop"] * 1e9 == (
      tokens * (k + shared) * 3 * 2 * d_model * d_ff + 2 * tokens * d_model * e
  )
  for i, r in enumerate(rows):
    shared_flops = (i + 1) * tokens * shared * 6 * d_model * d_ff
    assert (
        r["grouped_gflop"] * 1e9
        >= (i + 1) * blocks * block * 6 * d_model * d_ff + shared_flops
    )
    assert r["grouped_gflop"] < 1.5 * r["ideal_gflop"] < r["all_gflop"]
    assert r["all_gflop"] < r["dense_gflop"]
    assert r["max_abs_diff"] < 1e-5
  assert (
      rows[0]["all_gflop"] * 1e9 >= tokens * (e + shared) * 6 * d_model * d_ff
  )


@pytest.mark.slow
def test_gpu_dispatch_quick_runs_on_cpu():
  """Toy rows of the GPU script, in process and in a child process."""
  bench = _load("gpu_dispatch")
  assert "tokamax" in bench.VARIANTS
  variants = ("grouped", "ragged")
  rows = bench.run(
      families=("switch",), quick=True, repeats=1, variants=variants
  )
  assert [(r["mode"], r["variant"], r["lowering"]) for r in rows] == [
      (m, v, "xla") for m in bench.MODES for v in variants
  ]
  assert [r["dispatch"] for r in rows] == [
      "grouped",
      "ragged (xla)",
      "grouped_train",
      "ragged_train (xla)",
  ]
  for r in rows:
    assert "error" not in r, r
    assert _positive(r["ms"]) and _positive(r["xla_mib"]), r
    assert r["peak_mib"] is None  # the CPU reports no device peak
  text = bench.table(rows)
  assert "ragged_train" in text and "vs grouped" in text
  (child,) = bench.run(
      families=("olmoe",),
      modes=("train",),
      variants=("ragged",),
      quick=True,
      repeats=1,
      isolate=True,
  )
  assert _positive(child["ms"]), child
  assert child["dispatch"] == "ragged_train (xla)", child
  with pytest.raises(ValueError, match="cudnn"):
    bench.run(lowerings=("cudnn",), quick=True)


def test_the_vl2_row_has_an_image_records_length():
  """DeepSeek-VL2-Tiny's row runs records as long as a tiled image's."""
  bench = _load("gpu_dispatch")
  spec = bench.VL2_TILES
  # A 640 x 480 image: 2 x 2 local tiles + the global view, 14 tokens a side.
  assert images.tile_grid((640, 480), spec) == (2, 2)
  assert bench.VL2_SEQ_LEN == 14 * 15 + 1 + 28 * 29 + 64 == 1087
  assert bench.SHAPES["deepseek_vl2"]["full"]["seq_len"] == bench.VL2_SEQ_LEN


def test_gpu_dispatch_table_shows_ratios_and_rows_that_did_not_run():
  bench = _load("gpu_dispatch")
  row = dict(family="olmoe", mode="train", xla_mib=2.0, peak_mib=None)
  rows = [
      dict(row, variant="grouped", dispatch="grouped_train", ms=4.0),
      dict(row, variant="ragged", dispatch="ragged_train (xla)", ms=1.0),
      dict(row, variant="dense", dispatch="dense", error="RESOURCE_EXHAUSTED"),
  ]
  lines = bench.table(rows).splitlines()
  assert lines[3].split()[4:6] == ["1.00", "0.25"]  # ms, vs grouped
  assert "did not run: RESOURCE_EXHAUSTED" in lines[4]


def test_bench_dispatch_switch_is_top1():
  bench = _load("bench_dispatch")
  with pytest.raises(ValueError, match="top-1"):
    bench.layer_config("switch", num_experts=4, d_model=8, d_ff=8, top_k=2)


@pytest.mark.slow
def test_benchmark_toy():
  bench = _load("benchmark")
  config = _load("builders").model_config(
      vocab_size=50,
      d_model=16,
      d_kv=8,
      d_ff=32,
      num_layers=1,
      sparse_step=1,
      num_heads=2,
      num_experts=4,
      lora_rank=2,
  )
  shared = bench.run_shared(config, microbatch_sizes=(3,), seq_len=8, repeats=1)
  assert [r["m"] for r in shared] == [3]
  for r in shared:
    for key in (
        "nonprivate_ms",
        "dp_ms",
        "dp_over_nonprivate",
        "nonprivate_compile_s",
        "dp_compile_s",
        "trainable",
        "frozen",
    ):
      assert _positive(r[key]), (key, r[key])
  expert, buffers = bench.run_expert(
      config, num_experts=(2, 4), microbatch=2, seq_len=8, repeats=1
  )
  assert [r["E"] for r in expert] == [2, 4] and set(buffers) == {2, 4}
  for r in expert:
    for key in (
        "temp_mb",
        "argument_mb",
        "output_mb",
        "step_ms",
        "compile_s",
        "per_record_grad_mb",
    ):
      assert _positive(r[key]), (key, r[key])
  # A record's gradient is one expert slice: its size does not depend on E.
  assert expert[0]["per_record_grad_mb"] == expert[1]["per_record_grad_mb"]
  assert expert[1]["expert_lora_params"] == 2 * expert[0]["expert_lora_params"]
  assert "temp / first" in bench.expert_table(expert)
  assert "DP/non-private" in bench.shared_table(shared)


@pytest.mark.slow
def test_benchmark_olmoe_expert_toy():
  """OLMoE expert stream: owner slices of gate, up and down; one slice per record."""
  bench = _load("benchmark")
  d_model, d_ff, rank = 16, 32, 2
  config = _load("builders").olmoe_config(
      vocab_size=50,
      hidden_size=d_model,
      intermediate_size=d_ff,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=2,
      num_experts_per_tok=2,
      lora_rank=rank,
  )
  expert, _ = bench.run_expert(
      config, num_experts=(2, 4), microbatch=2, seq_len=8, repeats=1
  )
  one_expert = (
      3 * rank * (d_model + d_ff)
  )  # A and B of gate, up (d->f), down (f->d)
  assert [r["expert_lora_params"] for r in expert] == [
      2 * one_expert,
      4 * one_expert,
  ]
  assert expert[0]["per_record_grad_mb"] == expert[1]["per_record_grad_mb"] > 0
  for r in expert:
    assert _positive(r["temp_mb"]) and _positive(r["step_ms"]), r


def test_scripts_define_flags_only_when_run():
  """Importing the scripts into one process (as these tests do) must not clash."""
  for name in (
      "bench_dispatch",
      "benchmark",
      "compile_time",
      "gpu_dispatch",
      "vs_opacus",
  ):
    module = _load(name)
    assert callable(module.define_flags) and callable(module.main)
    assert "repeats" not in flags.FLAGS


def test_update_check_rejects_a_different_update():
  torch_side = _load("torch_side")
  ours = {"a": np.array([1.0, 0.0]), "b": np.array([2.0])}
  assert torch_side.relative_error(ours, ours) == 0.0
  errors = {}
  theirs = {"a": np.array([1.0, 0.1]), "b": np.array([2.0])}
  with pytest.raises(AssertionError, match="differ"):
    torch_side.check(errors, "x", ours, theirs, 1e-3)
  assert errors["x"] == pytest.approx(0.1 / np.sqrt(5.0 + 0.01))
  with pytest.raises(ValueError, match="different leaves"):
    torch_side.relative_error(ours, {"a": ours["a"]})


def _run_module(module, *flags_, own_xla_flags=False):
  """`python -m module flags_` from the repository root; its output."""
  env = dict(os.environ, PYTHONPATH=str(_ROOT), TRANSFORMERS_VERBOSITY="error")
  if own_xla_flags:  # the script's own settings, as a user runs it
    env.pop("XLA_FLAGS", None)
  return subprocess.run(
      [sys.executable, "-m", module, *flags_],
      cwd=_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _vs_opacus(*flags_):
  return _run_module("launch.bench.vs_opacus", *flags_, own_xla_flags=True)


def _m_row(lines, checks):
  """The dict printed on vs_opacus' first `m=...:` line of timings (or, with
  `checks`, of update checks)."""
  row = next(
      l for l in lines if l.startswith("m=") and ("checks" in l) == checks
  )
  return eval(row.split(":", 1)[1])  # pylint: disable=eval-used


@pytest.mark.slow
def test_vs_opacus_quick_checks_both_sides_and_times_each_in_its_worker():
  """The README's --quick command (one torch worker): the checks here, the
  timings from the workers. Tiny Switch saved by transformers: raptor_jax
  agrees with torch's non-private gradients, Opacus's clipped mean (noise
  off) and the owner sums rebuilt from Opacus's per-sample gradients, in
  float64, and with the float32 Opacus step."""
  out = _vs_opacus("--quick", "--modes=ew", "--torch_host_memory=keep")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert "raptor_jax worker: host memory kept" in lines[0]
  columns = _m_row(lines, checks=False)
  assert set(columns) == {
      "raptor",
      "raptor DP",
      "raptor expert",
      "torch+keep",
      "opacus+keep ew",
      "opacus+keep ew expert",
  }
  assert all(_positive(v) for v in columns.values()), columns
  errors = _m_row(lines, checks=True)
  assert set(errors) == {
      "torch float32 vs float64",
      "non-private vs torch64",
      "non-private vs torch",
      "DP vs opacus64",
      "expert vs opacus64",
      "DP vs opacus ew",
  }
  assert all(err < 5e-5 for err in errors.values()), errors
  assert "Paired ratios" in out.stdout and "opacus/raptor DP" in out.stdout


def test_vs_opacus_rejects_an_unknown_host_memory_setting_in_one_line():
  out = _vs_opacus("--quick", "--torch_host_memory=glibc,bogus")
  assert out.returncode != 0
  assert "--torch_host_memory takes glibc and/or keep" in out.stderr


def test_vs_opacus_columns_take_the_fastest_mode_and_setting():
  bench = _load("vs_opacus")
  assert bench.tagged("opacus ew expert", "keep") == "opacus+keep ew expert"
  assert bench.tagged("torch", "keep") == "torch+keep"
  assert bench.tagged("torch", "") == "torch"
  ms = {
      "torch": 5.0,
      "torch+keep": 4.0,
      "opacus ew": 3.0,
      "opacus+keep hooks": 2.0,
      "opacus ew expert": 7.0,
      "opacus+keep ew expert": 8.0,
      "raptor": 1.0,
      "raptor DP": 1.0,
      "raptor expert": 1.0,
  }
  row = {"m": 4, "ms": ms, "times": {c: [v / 1e3] for c, v in ms.items()}}
  summary = bench.summary(row)
  assert (summary["torch"], summary["torch mode"]) == (4.0, "keep")
  assert (summary["opacus"], summary["opacus mode"]) == (2.0, "hooks, keep")
  assert (summary["opacus expert"], summary["opacus expert mode"]) == (
      7.0,
      "ew",
  )
  assert summary["opacus/raptor DP"] == 2.0


def _ab_commits(*flags_):
  return _run_module("launch.bench.ab_commits", *flags_)


def test_ab_commits_rejects_an_unknown_step_in_one_line():
  out = _ab_commits("--steps=raptor,bogus")
  assert out.returncode != 0
  assert out.stderr.strip().splitlines() == [
      "error: unknown --steps ['bogus']; choose from "
      "['raptor', 'raptor_dp', 'raptor_expert']"
  ]


def test_ab_commits_rejects_back_to_back_below_one_in_one_line():
  out = _ab_commits("--back_to_back=0")
  assert out.returncode != 0
  assert out.stderr.strip().splitlines() == [
      "error: --back_to_back must be >= 1, got 0"
  ]


@pytest.mark.slow
def test_ab_commits_quick_times_a_commit_against_itself():
  """Two workers (temporary worktrees of HEAD) serve every step in turns."""
  if not (_ROOT / ".git").exists():
    pytest.skip("not a git checkout")
  worktrees = lambda: subprocess.check_output(
      ["git", "worktree", "list"], cwd=_ROOT, text=True
  )
  before = worktrees()
  out = _ab_commits(
      "--quick",
      "--base=HEAD",
      "--head=HEAD",
      "--microbatch_size=3",
      "--steps=raptor,raptor_dp,raptor_expert",
      "--repeats=2",
      "--back_to_back=2",
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert json.loads(lines[0])["back_to_back"] == 2
  rows = {line.split()[0]: line.split() for line in lines[1:]}
  assert set(rows) == {"raptor", "raptor_dp", "raptor_expert"}, out.stdout
  for row in rows.values():  # '<step> base T ms head T ms head/base R'
    assert float(row[2]) > 0 and float(row[5]) > 0
    assert 0.0 < float(row[-1]) < 100.0
  assert worktrees() == before  # its temporary worktrees are removed


@pytest.mark.slow
def test_kernels_benchmark_quick_checks_both_settings_and_prints_ratios():
  """`launch.bench.vs_opacus --kernels --quick`: fast and reference give
  the same update with the noise off, and each step gets a measured ratio."""
  out = _vs_opacus("--kernels", "--quick")
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [l for l in out.stdout.splitlines() if l.startswith("| 2 |")]
  assert [r.split("|")[2].strip() for r in rows] == [
      "nonprivate",
      "shared",
      "expert",
  ]
  for row in rows:
    ratio, *errors = (float(c) for c in row.split("|")[5:9])
    assert ratio > 0 and max(errors) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(1500)  # five parts, each a fresh process, on 2 cores
def test_gpu_check_script_quick_runs_on_cpu(tmp_path):
  """`launch/bench/gpu_check.sh --quick`: the five parts in order, each
  finished within its budget (exit 0) and printing what it measures (the
  dispatch rows of every family from one process: on the GPU, three)."""
  env = dict(
      os.environ,
      PYTHON=sys.executable,
      TRANSFORMERS_VERBOSITY="error",
      GPU_CHECK_WHEELS=str(tmp_path),  # no carried wheels here
  )
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_PLATFORMS", None)
  out = subprocess.run(
      ["bash", "launch/bench/gpu_check.sh", "--quick"],
      cwd=_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=1500,
  )
  text = out.stdout
  assert out.returncode == 0, out.stderr[-3000:]
  lines = text.splitlines()
  heads = [l.split()[1] for l in lines if l.startswith("== ")]
  assert heads == ["1/5", "2/5", "3/5", "4/5", "5/5"], text[-3000:]
  ends = [l for l in lines if l.startswith("-- ")]
  assert [l.split(": exit ")[0] for l in ends] == [
      "-- toolchain",
      "-- README tiny run",
      "-- gpu_check",
      "-- pytest",
      "-- gpu_dispatch switch, olmoe, deepseek_vl2, qwen3_moe, mixtral",
  ]
  assert all(": exit 0 in " in l for l in ends), "\n".join(ends)
  assert any("jax.jit(lambda x: x + 1): lower + compile" in l for l in lines)
  assert any("parallel compilation" in l for l in lines)
  assert "results.json" in text  # the tiny run's header and end
  for stream in ("shared", "expert"):
    assert any(l.startswith(f"{stream}: compile ") for l in lines)
    assert any(l.startswith(f"{stream}: step B=1000: ") for l in lines)
  assert re.search(r"^\d+ passed", text, re.M), text[-3000:]
  rows = [l.split()[:3] for l in lines if l.startswith(("switch ", "olmoe "))]
  assert rows[:2] == [
      ["switch", "lora", "grouped"],
      ["switch", "lora", "batched"],
  ]
  assert ["olmoe", "lora", "batched"] in rows
  assert ["deepseek_vl2", "lora", "batched"] in [l.split()[:3] for l in lines]
  assert rows.index(["olmoe", "lora", "grouped"]) > rows.index(
      ["switch", "lora", "batched"]
  )
  assert "did not run" not in text


def test_gpu_check_chooses_the_microbatch_from_the_memory_plan():
  bench = _load("gpu_check")
  gib = 2**30
  plan = {"argument": 1 * gib, "output": 0, "temp": 16 * gib}  # 1 GiB a record
  assert bench.choose_microbatch(plan, 16, 100 * gib) == 32  # 59 fit
  assert bench.choose_microbatch(plan, 16, None) == 16  # no device memory
  assert bench.choose_microbatch(plan, 16, gib) == 1
  small = {"argument": 0, "output": 0, "temp": 16 * 2**20}
  assert bench.choose_microbatch(small, 16, 100 * gib) == bench.MAX_MICROBATCH


def _wheel(path, name, *requires):
  """A minimal wheel: its METADATA with `Requires-Dist` lines."""
  import zipfile  # pylint: disable=g-import-not-at-top

  meta = [f"Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
  meta += [f"Requires-Dist: {r}" for r in requires]
  with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as z:
    z.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(meta) + "\n")


def test_gpu_wheels_carry_every_dependency_the_image_lacks(tmp_path):
  """The closure the script downloads next: requirements of the carried
  wheels, for Python 3.12 on Linux without extras, minus the image's
  packages and the wheels already carried (names normalised)."""
  wheels = _load("gpu_wheels")
  _wheel(
      tmp_path,
      "tokamax",
      "pydantic>=2.11",
      "jax>=0.8",
      "Typing_Inspection>=0.4; python_version >= '3.9'",
      "old-backport; python_version < '3.10'",
      "pytest; extra == 'test'",
      "pywin; sys_platform == 'win32'",
  )
  _wheel(tmp_path, "pydantic", "annotated-types>=0.6", "typing-extensions")
  image = wheels.image_packages(_ROOT / "launch/bench/gpu_image_packages.txt")
  assert {"jax", "flax", "optax", "transformers", "torch"} <= image
  assert "typing-inspection" not in image and "pydantic" not in image
  assert wheels.missing(tmp_path, image) == [
      "annotated-types>=0.6",
      "typing-inspection>=0.4",
  ]
  _wheel(tmp_path, "typing_inspection")
  _wheel(tmp_path, "annotated_types")
  assert wheels.missing(tmp_path, image) == []


def test_gpu_check_names_missing_modules_in_one_line(tmp_path):
  """A GPU image without a needed module: one line, before anything runs."""
  fake = tmp_path / "python"
  fake.write_text(
      "#!/bin/sh\n"
      'if [ "$1" = "-" ]; then echo ml_collections; exit 0; fi\n'
      "exit 3\n"
  )
  fake.chmod(0o755)
  out = subprocess.run(
      ["bash", "launch/bench/gpu_check.sh"],
      cwd=_ROOT,
      env=dict(os.environ, PYTHON=str(fake), GPU_CHECK_WHEELS=str(tmp_path)),
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert out.returncode == 1
  assert out.stdout.strip().splitlines() == [
      "error: missing Python modules: ml_collections; carry their wheels in"
      " .whl/ (see the device notes) and rerun"
  ]


def _epoch(n=300, max_length=32, batch_size=60, microbatch=10):
  bench = _load("epochs")
  data = bench.generated_records(n, max_length, 50, seed=1)
  return bench, bench.make_epoch(
      "generated",
      data,
      batch_size=batch_size,
      microbatch=microbatch,
      num_experts=4,
  )


def test_epoch_time_layouts_hold_every_sampled_record_once():
  """Every column's microbatches of a step hold exactly its Poisson sample:
  raptor's buckets in fixed [m, b] shapes (b holds each record), the
  unbucketed column at max_length, torch padded to each chunk's longest."""
  bench, epoch = _epoch()
  assert len(epoch.samples) == 5 and epoch.buckets == (16, 32)
  for step in range(len(epoch.samples)):
    sample = np.sort(epoch.samples[step])
    for column in ("raptor", "raptor unbucketed", "torch"):
      layout = epoch.layout(column, step)
      real = np.concatenate([i[m > 0] for _, i, m in layout])
      np.testing.assert_array_equal(np.sort(real), sample)
      for length, idx, mask in layout:
        assert epoch.lengths[idx[mask > 0]].max(initial=0) <= length
        if column == "torch":
          assert length == epoch.lengths[idx].max()
        else:
          assert len(idx) == epoch.microbatch
          assert length == 32 or column == "raptor"
  real, padded = epoch.tokens("raptor")
  assert real == sum(int(epoch.lengths[s].sum()) for s in epoch.samples)
  assert real < padded < epoch.tokens("raptor unbucketed")[1]
  assert epoch.timed_steps(2) == [0, 4]


def test_epoch_time_useful_flops_count_real_tokens_only():
  """2 x the forward matmul FLOPs, brute force per record: a padded token
  adds nothing, attention grows with each record's own length."""
  bench, epoch = _epoch()
  sizes = bench.model_sizes(32, 50, quick=True)
  d, h, f = sizes.d_model, sizes.num_heads * sizes.d_kv, sizes.d_ff
  expected = 0.0
  for s in epoch.samples:
    for length in epoch.lengths[s]:
      per_block = length * (8 * d * h + 4 * d * f) + 4 * h * length**2
      routers = (sizes.num_layers // 2) * 2 * d * sizes.num_experts * length
      expected += 2 * (sizes.num_layers * per_block + routers)
  assert bench.useful_flops(epoch, sizes) == pytest.approx(expected)


@pytest.mark.slow
def test_epoch_time_quick_checks_the_updates_and_times_every_column():
  """--quick: generated records, the noise-off checks against torch and
  Opacus, then every column timed in its worker."""
  out = _run_module(
      "launch.bench.epoch_time",
      "--quick",
      "--modes=hooks",
      own_xla_flags=True,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout
  for stream, theirs in (
      ("nonprivate", "torch"),
      ("shared", "opacus hooks"),
      ("expert", "opacus hooks"),
  ):
    for column in ("raptor", "raptor unbucketed", theirs):
      row = re.search(rf"^generated +{stream} +{column} +[0-9.]+ ", text, re.M)
      assert row, (stream, column, text)
    assert f"{stream}: raptor vs torch" in text
  assert "measured matmul peak" in text and "useful FLOPs / peak" in text


def test_epoch_time_without_a_tokenizer_is_one_line():
  out = _run_module("launch.bench.epoch_time", "--tasks=sst2")
  assert out.returncode != 0
  assert (
      out.stderr.strip()
      .splitlines()[-1]
      .startswith("error: --tokenizer is required")
  )


def test_hlo_trip_counts_and_instructions():
  xs, w = jnp.ones((7, 4, 16)), jnp.ones((16, 8))
  body = lambda c, x: (jnp.tanh(c + x @ w), None)
  scanned = jax.jit(lambda xs: jax.lax.scan(body, xs[0] @ w, xs)[0])
  text = scanned.lower(xs).compile().as_text()
  assert harness.max_while_trip_count(text) == 7
  assert harness.max_while_trip_count("ROOT %x = f32[] constant(0)") == 0
  assert 0 < harness.hlo_instructions(text) <= text.count(" = ")


def test_compile_time_lowers_against_the_shapes_of_the_trainer_s_state():
  """The bench lowers against shapes (full-depth shapes larger than memory
  compile too): those of `PhaseStep.init`'s state, leaf for leaf, with its
  placement, and a set-up over the draw limit is NaN, not drawn."""
  bench = _load("compile_time")
  from launch.bench import builders
  from raptor_jax import models

  module, config = bench.model(
      "olmoe", 2, shapes=bench.QUICK, vocab_size=64, dtype="float32", scan=True
  )
  shapes, example = bench.param_shapes(module, 16)
  params = models.init_params(module, jax.random.key(0), example)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
      lambda a: (a.shape, a.dtype), shapes
  )
  assert bench.gigabytes(shapes) == pytest.approx(
      sum(a.nbytes for a in jax.tree.leaves(params)) / 1e9
  )
  layer = config.sparse_layers[-1]
  for stream in ("shared", "expert"):
    phase, extra = builders.stream_phase(stream, 2.0, layer)
    dp = builders.phase_step(module, phase, key=jax.random.key(1), **extra)
    described = lambda a: (a.shape, a.dtype, a.sharding)
    expected = jax.tree.map(described, dp.init(params))
    assert jax.tree.map(described, bench.abstract_state(dp, shapes)) == expected
  assert math.isnan(bench.setup_seconds(module, example, shapes, 0.0))
  assert _positive(bench.setup_seconds(module, example, shapes, 1.0))


@pytest.mark.slow
def test_compile_time_quick_times_every_program_of_the_trainer():
  bench = _load("compile_time")
  out = []
  (row,) = bench.run(
      ["switch"],
      ["2"],
      [2],
      [True],
      quick=True,
      seq_len=16,
      vocab_size=64,
      echo=out.append,
  )
  assert row["blocks"] == 2
  programs = re.findall(r"switch +\d+ +2 +True +(\w+(?: \w+)?) ", out[0])
  assert programs == [
      "owner pass",
      *(
          f"{s} {p}"
          for s in ("shared", "expert")
          for p in ("zero", "accumulate", "update", "unpack")
      ),
      "evaluate",
  ]
  for key in ("setup_s", "shared_s", "expert_s", "shared_update_s", "all_s"):
    assert _positive(row[key]), (key, row)
  assert row["max_hlo"] > 0 and row["max_trip"] >= 0
