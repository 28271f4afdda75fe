"""Host memory: keep freed pages for the next step (XLA:CPU, glibc).

XLA:CPU gives every execution of a compiled step one temporary buffer for all
its intermediates (368 MB for the Switch DP benchmark's non-private step at
microbatch 32) and frees it when the step ends. glibc serves a request that
large with a fresh ``mmap`` and returns it with ``munmap``, so each step
touches all of it again as new pages: ~95,000 minor page faults per step
there, every page zeroed by the kernel. ``keep_freed_memory`` makes glibc
serve large requests from its heap and keep the freed memory, so the next
step reuses the same pages (0 faults; 10-16% of the step on the 2-core CPU,
see results/vs_opacus/README.md).

The price is the usual one of a cache: the process keeps its peak host memory
instead of returning it to the system between steps. Device memory (GPU, TPU)
is not affected: XLA's device allocators already reuse their memory.

Call it first, before importing anything that starts threads: glibc gives
each thread that allocates before the call an arena of its own, and XLA's
threads, started later, may share such an arena, from which large requests
are always mapped afresh. pyarrow (imported by `datasets`, so by
`raptor_jax.train`) is one: imported before the call, the DP step of the
fixed-shape Switch benchmark (launch/bench/vs_opacus.py) at microbatch 32 took 38,838 faults per step and 1.17x
the time (0 faults when the call comes first). Entry points therefore call
`keep_unless_disabled(sys.argv)` before their other imports.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Sequence

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
  """Makes this process reuse freed host memory instead of unmapping it.

  Sets three glibc ``mallopt`` parameters: one malloc arena for all threads
  (a thread's own arena cannot hold a request over 64 MB and would ``mmap``
  it), no ``mmap`` for large requests (they come from the heap), and no
  trimming of the heap's free top. Idempotent.

  Returns:
    True if set; False on a C library that is not glibc (macOS, musl), where
    nothing is changed.
  """
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return False
  try:
    mallopt = ctypes.CDLL('libc.so.6').mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  return all(
      mallopt(param, value) == 1
      for param, value in (
          (_M_ARENA_MAX, 1),
          (_M_MMAP_MAX, 0),
          (_M_TRIM_THRESHOLD, _INT_MAX),
      )
  )


def flag_value(argv: Sequence[str], name: str, default: bool) -> bool:
  """A boolean absl flag's value read from raw `argv` (the last one wins).

  For settings needed before absl parses the flags: `--name`,
  `--name=true|1`, `--noname`, `--name=false|0`.
  """
  value = default
  for arg in argv:
    if arg in (f'--{name}', f'--{name}=true', f'--{name}=True', f'--{name}=1'):
      value = True
    elif arg in (
        f'--no{name}',
        f'--{name}=false',
        f'--{name}=False',
        f'--{name}=0',
    ):
      value = False
  return value


FLAG_HELP = (
    'Let glibc keep freed host memory for the next step instead of mapping '
    "XLA:CPU's per-step buffer afresh (see raptor_jax/host_memory.py; read "
    'from the command line before anything is imported); '
    '--nokeep_host_memory returns it to the system between steps.'
)
"""Help text of the entry points' `--keep_host_memory` flag."""


def keep_unless_disabled(
    argv: Sequence[str], name: str = 'keep_host_memory', default: bool = True
) -> bool:
  """`keep_freed_memory()` unless `argv` turns the flag `--name` off.

  For the first lines of an entry point, before its other imports (see the
  module docstring); the entry point also defines the absl flag, so that
  `--help` shows it and absl accepts it.

  Returns:
    True if host memory is now kept.
  """
  return flag_value(argv, name, default) and keep_freed_memory()
