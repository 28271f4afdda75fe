"""Shared pytest setup: offline Hugging Face, float32 JAX on CPU."""

import os
import pathlib

# Subprocesses (launch scripts, tests/parallel_worker.py) import this
# checkout's raptor_jax too, as pytest.ini's `pythonpath` does for the tests.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [_ROOT, os.environ.get("PYTHONPATH", "")])
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test programs are tiny: compile them fast rather than optimise them hard (this
# halves the suite's CPU time; it changes code generation, not results). XLA
# CPU's older elemental emitters compile the suite's fusions in about 3/4 of
# the CPU time of the default fusion emitters (measured on tests/test_switch.py).
# CPU runs only: under JAX_PLATFORMS=cuda (launch/bench/gpu_check.sh) the
# device's jaxlib need not know the CPU flags, and an unknown XLA flag aborts
# the process before pytest prints anything.
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] = " ".join(
      [
          os.environ.get("XLA_FLAGS", ""),
          "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true",
          "--xla_cpu_use_fusion_emitters=false",
      ]
  ).strip()

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Before JAX's backends start: raptor_jax adds its XLA:CPU workaround to
# XLA_FLAGS on import (raptor_jax.xla_workarounds).
import raptor_jax  # noqa: E402,F401  pylint: disable=unused-import

import jax  # noqa: E402

# Identical programs (e.g. the same training step in a resumed run) compile once
# per test session: a persistent cache keyed by the XLA program, one directory
# for the whole session (the pytest-xdist workers inherit it from the
# controller, which loads this file first).
# The trainer's default cache ('auto': $XDG_CACHE_HOME/raptor_jax/xla) is
# this session's directory too: tests never write the user's cache.
# The process that makes the directory (the controller, or a lone pytest)
# removes it at exit: about 100 MB of programs per session otherwise stays in
# the temporary directory.
if "RAPTOR_JAX_TEST_CACHE" not in os.environ:
  os.environ["RAPTOR_JAX_TEST_CACHE"] = tempfile.mkdtemp(
      prefix="raptor_jax_cache_"
  )
  atexit.register(
      shutil.rmtree, os.environ["RAPTOR_JAX_TEST_CACHE"], ignore_errors=True
  )
_ROOT_CACHE = os.environ["RAPTOR_JAX_TEST_CACHE"]
os.environ["XDG_CACHE_HOME"] = _ROOT_CACHE
_CACHE = os.path.join(_ROOT_CACHE, "raptor_jax", "xla")
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
  """Frees the session's end from full garbage collections of the heap.

  pytest's unraisableexception plugin runs gc.collect() twice once the
  session ends (here, after a worker of `pytest -n 2` has reported its
  results). Over this suite's heap (jax, torch, transformers, compiled
  programs) each pass takes seconds on busy cores; execnet interrupts a
  worker still running 5 s after the session ended with a SIGINT to itself
  (execnet.gateway_base.WorkerGateway._terminate_execution), which printed a
  KeyboardInterrupt traceback after pytest's summary line. Freezing the heap
  first keeps the objects alive until the process exits and makes those
  passes look at new objects only: measured on a two-file run on busy
  cores, the two passes took 3.6 s (5.2 s from the report to the worker's
  end) before, and milliseconds after.
  """
  del config
  gc.freeze()
