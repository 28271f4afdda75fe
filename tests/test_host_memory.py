"""host_memory.keep_freed_memory: XLA:CPU's per-step buffer stops faulting."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from raptor_jax import host_memory

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
    faults = []
    for _ in range(9):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      step(x, w, v).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
""")


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


@pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='glibc only',
)
def test_keep_freed_memory_stops_per_step_page_faults():
  pages = 8192 * 4096 * 4 // os.sysconf('SC_PAGE_SIZE')
  default = _faults('default')
  kept = _faults('keep')
  # Without it every call maps the 128 MB buffer afresh; with it, the heap
  # grows for the first few calls (XLA frees a step's buffer asynchronously,
  # so two can be live at once) and is then reused.
  median = lambda faults: sorted(faults)[len(faults) // 2]
  assert median(default) > pages // 2, default
  assert median(kept) < pages // 20, kept


def test_keep_freed_memory_is_a_no_op_off_glibc(monkeypatch):
  monkeypatch.setattr(platform, 'libc_ver', lambda: ('musl', '1.2'))
  assert host_memory.keep_freed_memory() is False
