"""process.setup: the entry points' process set-up, public for users."""

import os
import subprocess
import sys
import textwrap

import pytest

from raptor_jax import process

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, **env) -> subprocess.CompletedProcess:
  environ = {
      k: v
      for k, v in os.environ.items()
      if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")
  }
  return subprocess.run(
      [sys.executable, "-c", textwrap.dedent(script)],
      capture_output=True,
      text=True,
      env=dict(environ, PYTHONPATH=_ROOT, **env),
      cwd=_ROOT,
  )


_REPORT = """
    import sys
    from raptor_jax import process
    done = process.setup(argv=sys.argv[1:] + {argv!r})
    import jax
    print(done.cpu_host, done.host_memory_kept, done.cpu_devices,
          len(jax.devices()), jax.devices()[0].platform)
"""


def _last_line(argv=(), **env) -> str:
  out = _run(_REPORT.format(argv=list(argv)), **env)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1]


def test_a_cpu_process_gets_one_device_per_core_and_kept_memory():
  cores = len(os.sched_getaffinity(0))
  assert _last_line(JAX_PLATFORMS="cpu") == f"True True {cores} {cores} cpu"


def test_the_command_line_flags_override_the_arguments():
  got = _last_line(
      ["--cpu_devices=3", "--nokeep_host_memory"], JAX_PLATFORMS="cpu"
  )
  assert got == "True False 3 3 cpu"
  got = _last_line(["--cpu_devices", "1"], JAX_PLATFORMS="cpu")
  assert got == "True True 1 1 cpu"


def test_a_count_the_user_chose_is_kept():
  got = _last_line(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="5")
  assert got.split()[2:4] == ["5", "5"]


def test_an_accelerator_host_gets_neither_setting():
  # JAX_PLATFORMS names an accelerator: nothing is changed, JAX not started.
  out = _run(
      """
      import sys
      from raptor_jax import process
      print(process.setup(), 'jax' in sys.modules)
  """,
      JAX_PLATFORMS="cuda",
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == (
      "ProcessSetup(cpu_host=False, host_memory_kept=False, cpu_devices=0)"
      " False"
  )


@pytest.mark.parametrize(
    "platforms, cpu",
    [("cpu", True), ("cpu,cuda", True), ("tpu", False), ("cuda,cpu", False)],
)
def test_jax_platforms_decides_the_host_kind(monkeypatch, platforms, cpu):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  assert process.on_cpu_host() is cpu


def test_bad_counts_are_refused_in_one_line():
  with pytest.raises(ValueError, match=r"--cpu_devices must be an integer"):
    process.setup(argv=["--cpu_devices=two"])
  with pytest.raises(ValueError, match=r"must be >= 0"):
    process.setup(cpu_devices=-1)


def test_too_late_after_jax_started_says_so():
  out = _run(
      """
      import jax; jax.devices()
      from raptor_jax import process
      try:
        process.setup(cpu_devices=3)
      except ValueError as e:
        print(e)
  """,
      JAX_PLATFORMS="cpu",
  )
  assert out.returncode == 0, out.stderr
  assert "already started" in out.stdout
