"""host_memory.keep_freed_memory: XLA:CPU's per-step buffer stops faulting."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from raptor_jax import host_memory


def _count_faults(calls: int) -> str:
  """Script lines: `calls` calls of `step`, then their page faults as JSON."""
  return textwrap.dedent(f"""
      faults = []
      for _ in range({calls}):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x, w, v).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
      print(json.dumps(faults))
  """)


def _fresh_calls(faults: list[int], pages: int) -> int:
  """How many calls touched more than half of a `pages`-page buffer afresh."""
  return sum(fault > pages // 2 for fault in faults)


# A step whose intermediate h (8192 x 4096 float32, 128 MB) lives in XLA's
# temporary buffer; prints the minor page faults of each repeated call.
# (An allocation pattern, not a timing: deterministic enough for a test.)
_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    if sys.argv[1] == 'keep':
      from raptor_jax import host_memory
      assert host_memory.keep_freed_memory()
    import jax, jax.numpy as jnp
    x = jnp.ones((8192, 16)); w = jnp.ones((16, 4096)); v = jnp.ones((4096, 4))
    step = jax.jit(lambda x, w, v: jnp.tanh(x @ w) @ v)
    step(x, w, v).block_until_ready()
""") + _count_faults(40)


def _faults(mode: str) -> list[int]:
  out = subprocess.run(
      [sys.executable, '-c', _SCRIPT, mode],
      capture_output=True,
      text=True,
      check=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh processes, 80 steps of a 128 MB buffer (~45 s)
@pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='glibc only',
)
def test_keep_freed_memory_stops_per_step_page_faults():
  pages = 8192 * 4096 * 4 // os.sysconf('SC_PAGE_SIZE')
  default = _faults('default')
  kept = _faults('keep')
  # Without it every call maps the 128 MB buffer afresh. With it, the heap
  # grows on a few calls (XLA frees a step's buffer asynchronously, so several
  # can be live at once, more when the CPU is busy: 0-5 of 40 seen with six
  # copies on two cores) and is then reused.
  assert _fresh_calls(default, pages) >= 36, default
  assert _fresh_calls(kept, pages) <= 10, kept


def test_keep_freed_memory_is_a_no_op_off_glibc(monkeypatch):
  monkeypatch.setattr(platform, 'libc_ver', lambda: ('musl', '1.2'))
  assert host_memory.keep_freed_memory() is False


# A step on two CPU devices (so it runs on XLA's device threads), with a 64 MB
# intermediate per device; prints the page faults of each repeated call.
_DEVICE_THREADS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import importlib
    # The entry point, whose first lines call keep_unless_disabled(sys.argv).
    importlib.import_module(sys.argv.pop(1))
    import pyarrow  # starts threads (also imported by launch.main's imports)
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    jax.config.update('jax_num_cpu_devices', 2)
    mesh = jax.make_mesh((2,), ('d',))
    x = jax.device_put(
        jnp.ones((8192, 16)), NamedSharding(mesh, PartitionSpec('d')))
    w = jnp.ones((16, 4096)); v = jnp.ones((4096, 4))
    step = jax.jit(lambda x, w, v: jnp.tanh(x @ w) @ v)
""") + _count_faults(32)


@pytest.mark.slow  # each a fresh process importing an entry point (~20 s)
@pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='glibc only',
)
@pytest.mark.parametrize(
    'entry, argv',
    [
        ('launch.main', []),
        ('launch.main', ['--nokeep_host_memory']),
        ('launch.pretrain', []),
        ('launch.sweep', []),
        ('launch.audit', []),
    ],
)
def test_entry_points_keep_memory_before_their_imports_start_threads(
    entry, argv
):
  """An entry point's first lines, then threads (pyarrow) and a 2-device step.

  Kept before pyarrow's threads exist, the steady state has no faults; with
  the setting applied after them, XLA's device threads shared their arena
  and mapped the buffer afresh every step (see host_memory's docstring).
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, '-c', _DEVICE_THREADS_SCRIPT, entry, *argv],
      capture_output=True,
      text=True,
      check=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=root),
      cwd=root,
  )
  faults = json.loads(out.stdout.strip().splitlines()[-1])
  pages = 4096 * 4096 * 4 // os.sysconf('SC_PAGE_SIZE')  # one device's share
  # Turned off, every call maps the buffers afresh; kept, the heap grows on a
  # few calls only (XLA frees a step's buffers asynchronously, so several can
  # be live at once) and is then reused.
  if argv:
    assert _fresh_calls(faults, pages) >= 28, faults
  else:
    assert _fresh_calls(faults, pages) <= 8, faults


@pytest.mark.parametrize(
    'argv, default, want',
    [
        ([], True, True),
        ([], False, False),
        (['--keep_host_memory'], False, True),
        (['--keep_host_memory=true'], False, True),
        (['--nokeep_host_memory'], True, False),
        (['--keep_host_memory=false'], True, False),
        (['--keep_host_memory=0', '--keep_host_memory'], False, True),
        (['--keep_host_memory_other'], True, True),
    ],
)
def test_flag_value_reads_absl_booleans_from_raw_argv(argv, default, want):
  assert host_memory.flag_value(argv, 'keep_host_memory', default) is want


def test_keep_unless_disabled_does_nothing_when_turned_off(monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, 'keep_freed_memory', lambda: calls.append(1))
  assert host_memory.keep_unless_disabled(['--nokeep_host_memory']) is False
  assert not calls
