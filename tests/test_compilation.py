"""Ahead-of-time compilation and the persistent compilation cache."""

import logging
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import compilation, length_buckets
from raptor_jax.train import cycle, loop, parallel, train_and_evaluate
from raptor_jax.train.run import build_run, validate

from helpers import compiled_names, micro_config

BUCKETS = (8, 16, 32)  # the micro records hold 10 to 22 tokens: 8 stays empty


def test_cache_directory_rules(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation.cache_directory("auto") == tmp_path / "xdg/raptor_jax/xla"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert (
      compilation.cache_directory("auto")
      == tmp_path / "home/.cache/raptor_jax/xla"
  )
  assert compilation.cache_directory("off") is None
  assert compilation.cache_directory(str(tmp_path / "c")) == tmp_path / "c"
  assert compilation.cache_directory("~/x") == tmp_path / "home/x"


@pytest.mark.parametrize("bad", ["", "  ", None, 3])
def test_a_bad_setting_is_refused_in_one_line(bad):
  with pytest.raises(ValueError) as error:
    compilation.cache_directory(bad)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("compilation_cache: must be 'auto', 'off' or a")
  assert "--config.compilation_cache" in message
  if isinstance(bad, str):  # a config field holds a string
    config = micro_config()
    config.compilation_cache = bad
    with pytest.raises(ValueError, match="compilation_cache"):
      validate(config)  # before any data or model is loaded


@pytest.fixture
def restore_cache():
  before = jax.config.jax_compilation_cache_dir
  yield
  compilation.enable_cache(before)


def test_enable_cache_writes_entries_where_asked_and_off_stops(
    tmp_path, restore_cache
):
  directory = compilation.enable_cache(str(tmp_path / "cache"))
  assert directory == tmp_path / "cache"
  assert jax.config.jax_compilation_cache_dir == str(directory)
  # A program this process has not compiled before (a fresh constant).
  marker = float(time.time_ns() % 1_000_003)
  jax.jit(lambda x: x * marker + 1.0)(jnp.ones(3)).block_until_ready()
  assert any(p.is_file() for p in directory.rglob("*")), "no cache entry"
  written = sorted(directory.rglob("*"))
  assert compilation.enable_cache("off") is None
  assert jax.config.jax_compilation_cache_dir is None
  jax.jit(lambda x: x * (marker + 1.0))(jnp.ones(3)).block_until_ready()
  assert sorted(directory.rglob("*")) == written  # off: nothing more


def test_compile_ahead_reports_progress_and_fills_the_jit_cache():
  fns = [jax.jit(lambda x, k=k: x * k + 1) for k in range(3)]
  spec = jax.ShapeDtypeStruct((4,), jnp.float32)
  lines = []
  before = compilation.totals()
  report = compilation.compile_ahead(
      [compilation.Program(f"f{k}", f, (spec,)) for k, f in enumerate(fns)],
      threads=2,
      progress=lines.append,
  )
  assert report.programs == 3 and report.seconds > 0
  after = compilation.totals()
  assert after.programs - before.programs == 3
  assert after.seconds - before.seconds == pytest.approx(report.seconds)
  assert sorted(re.sub(r" \(f\d\)", "", l) for l in lines) == [
      f"compiling {k}/3" for k in (1, 2, 3)
  ]
  x = jnp.ones(4)
  with jax.log_compiles():
    with compiled_names() as compiled:
      for f in fns:
        f(x)
  assert not compiled, compiled


# The programs of the run: compiled ahead, never again.
PROGRAMS = {
    "_zero_sums",
    "_accumulate",
    "_packed_update",
    "_unpack",
    "logits_fn",
}


@pytest.mark.slow
def test_every_bucket_compiles_ahead_and_training_compiles_nothing(tmp_path):
  config = micro_config(
      **{"data.length_buckets": BUCKETS, "stop_after_cycles": 2}
  )
  run = build_run(config)
  lengths = length_buckets.record_lengths(run.data.train.attention_mask)
  filled = np.bincount(
      length_buckets.bucket_index(lengths, BUCKETS), minlength=3
  )
  assert filled[0] == 0 and filled[1] > 0 and filled[2] > 0
  mesh = parallel.make_mesh(1)
  session = loop._Session(run, mesh, tmp_path, time.time())
  lines = []
  report = cycle.compile_run(
      run,
      session.phase_fns,
      session.logits_fn,
      mesh,
      session.state,
      session.frozen,
      progress=lines.append,
  )
  # Per phase: zero, update, unpack and one accumulate per bucket; and one
  # evaluation per bucket: the empty bucket 8 too.
  phases = len(run.plan.phases)
  assert report.programs == phases * (3 + 3) + 3 == len(lines)
  names = {re.search(r"\((.*)\)", l).group(1) for l in lines}
  for width in BUCKETS:
    assert f"evaluate {width}" in names
    for phase in run.plan.phases:
      assert f"{phase.name} accumulate {width}" in names
  assert {re.search(r" (\d+)/", l).group(1) for l in lines} == {
      str(k) for k in range(1, report.programs + 1)
  }
  assert all(l.endswith(")") and f"/{report.programs} (" in l for l in lines)
  with jax.log_compiles():
    with compiled_names() as compiled:
      session.train()
      session.evaluate()
  assert session.state.cycle == 2
  assert not PROGRAMS & set(compiled), compiled


@pytest.mark.slow
def test_the_run_header_and_summary_give_the_seconds(tmp_path, caplog):
  config = micro_config(stop_after_cycles=1)
  with caplog.at_level(logging.INFO, logger="raptor_jax"):
    train_and_evaluate(config, str(tmp_path / "w"))
  text = caplog.text
  header = re.search(
      r"time: set-up [\d.]+ s, compile [\d.]+ s \((\d+) programs of the run;"
      r" cache (.*)\)",
      text,
  )
  assert header, text
  # 2 phases x (zero, accumulate, update, unpack) + evaluate, and the
  # two owner passes (layer selection, owner map).
  assert int(header.group(1)) == 2 * 4 + 1 + 2
  assert pathlib.Path(header.group(2)) == compilation.cache_directory("auto")
  assert re.search(
      r"time +set-up [\d.]+ s, compile [\d.]+ s, train [\d.]+ s, evaluate"
      r" [\d.]+ s",
      text,
  )
