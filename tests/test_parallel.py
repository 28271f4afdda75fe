"""Data parallelism: 1 vs 4 devices, noise drawn once, restore across device counts,
two processes through jax.distributed (CPU collectives over loopback)."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import ROOT, latest_state

WORKER = str(ROOT / "tests" / "parallel_worker.py")


def _env(devices):
  """Fresh processes with N CPU devices, sharing this session's compilation cache."""
  return dict(
      os.environ,
      HF_HUB_OFFLINE="1",
      HF_DATASETS_OFFLINE="1",
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
      f"--xla_force_host_platform_device_count={devices}",
      JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )


def _runs(runs, devices=4, timeout=1200):
  """Several (workdir, overrides) runs in ONE process with `devices` CPU devices."""
  runs = [(str(w), {"microbatch_size": 8, **o}) for w, o in runs]
  proc = subprocess.run(
      [sys.executable, WORKER, "--runs", json.dumps(runs)],
      env=_env(devices),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(workdir, overrides, devices=4, process=None, timeout=900):
  env = _env(devices)
  overrides = {"microbatch_size": 8, **overrides}
  args = [sys.executable, WORKER, str(workdir), json.dumps(overrides)]
  if process is not None:
    args += [str(a) for a in process]
    return subprocess.Popen(
        args,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
  proc = subprocess.run(
      args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_same_state(a, b, rtol=1e-4, step_a=None):
  _, state_a, meta_a = latest_state(a, step_a)
  _, state_b, meta_b = latest_state(b)
  assert json.loads(meta_a["ledger"]) == json.loads(meta_b["ledger"])

  def close(x, y):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.kind in "iu":
      np.testing.assert_array_equal(x, y)
    else:
      np.testing.assert_allclose(
          x, y, rtol=rtol, atol=rtol * max(np.abs(y).max(), 1e-6)
      )

  jax.tree.map(close, state_a, state_b)


@pytest.mark.slow
def test_device_and_process_counts_give_the_same_parameters(tmp_path):
  """One and four devices agree (RAPTOR and monolithic); a checkpoint written on
  four devices restores and finishes on one, equal to one device throughout; two
  processes through jax.distributed (CPU collectives on loopback) agree with one.
  """
  one, four = {"num_devices": 1}, {"num_devices": 4}
  *_, resumed, _, _ = _runs(
      [
          (
              tmp_path / "raptor1",
              {**one, "stop_after_cycles": 2, "checkpoint_every_cycles": 1},
          ),
          (tmp_path / "split", {**four, "stop_after_cycles": 1}),
          (
              tmp_path / "split",
              {**one, "stop_after_cycles": 1},
          ),  # restored on one device
          (
              tmp_path / "mono1",
              {**one, "method": "monolithic", "stop_after_cycles": 1},
          ),
          (
              tmp_path / "mono4",
              {**four, "method": "monolithic", "stop_after_cycles": 1},
          ),
      ]
  )
  assert (
      json.loads((tmp_path / "split" / "config.json").read_text())[
          "num_devices"
      ]
      == 4
  )
  assert resumed["cycles"] == 2
  _assert_same_state(tmp_path / "raptor1", tmp_path / "split")
  _assert_same_state(tmp_path / "mono1", tmp_path / "mono4")

  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [
      _run(
          tmp_path / "multi",
          {"stop_after_cycles": 1},
          devices=1,
          process=(pid, 2, coordinator),
      )
      for pid in range(2)
  ]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  _assert_same_state(tmp_path / "raptor1", tmp_path / "multi", step_a=1)
  # Only process 0 writes the shared workdir (metrics, TensorBoard, reports);
  # every process returns the same results.
  assert results[0]["accuracy"] == results[1]["accuracy"]
  lines = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()
  assert lines and len(lines) == len(set(lines)), lines
  assert len(list((tmp_path / "multi" / "tensorboard").glob("events.*"))) == 1
  assert (
      json.loads((tmp_path / "multi" / "results.json").read_text())["cycles"]
      == 1
  )


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_noise_is_drawn_once_across_four_devices():
  """sigma*C/denominator, not sqrt(4) (noise per device) or 1/4 (noise divided)."""
  proc = subprocess.run(
      [sys.executable, WORKER, "--noise", "4"],
      env=_env(4),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  std, expected = json.loads(proc.stdout.strip().splitlines()[-1])
  assert abs(std / expected - 1) < 0.03, (std, expected)
