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
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        "--xla_cpu_use_fusion_emitters=false",
    ]
).strip()

import tempfile  # noqa: E402

# Before JAX's backends start: raptor_jax adds its XLA:CPU workaround to
# XLA_FLAGS on import (raptor_jax.xla_workarounds).
import raptor_jax  # noqa: E402,F401  pylint: disable=unused-import

import jax  # noqa: E402

# Identical programs (e.g. the same training step in a resumed run) compile once
# per test session: a persistent cache keyed by the XLA program, one directory
# for the whole session (the pytest-xdist workers inherit it from the
# controller, which loads this file first).
_CACHE = os.environ.setdefault(
    "RAPTOR_JAX_TEST_CACHE", tempfile.mkdtemp(prefix="raptor_jax_cache_")
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
