"""Ahead-of-time compilation and the persistent compilation cache.

A run compiles every program it needs before its first cycle
(`compile_ahead`): each program is lowered in order, then the lowered
programs compile in a thread pool (XLA compiles in parallel from threads).
`jax.jit` keeps what `.lower(...).compile()` built, so the run's later
calls with the same shapes and placements find it and never compile again.

The persistent cache (`enable_cache`) keeps the compiled programs on disk,
by default in the user's cache directory (`$XDG_CACHE_HOME/raptor_jax/xla`,
else `~/.cache/raptor_jax/xla`), not in a run's workdir: a second run of the
same shapes on the same machine loads them instead of compiling.

Privacy. A cache entry is keyed by its program, so the cache directory
records which program shapes this machine compiled. The trainer compiles
the same programs for a config whatever the private data holds: every
(phase, length bucket) step, the evaluation and owner-map passes of every
bucket, at the public microbatch and batch sizes (`train.cycle`), so the
shapes, the entries and the compile time are functions of the public config
alone. A program compiled on demand for a shape the data chose would not be.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax

from raptor_jax import _validate, accounting  # pylint: disable=g-multiple-import

_FIX = (
    "set --config.compilation_cache to 'auto' (the user's cache directory),"
    " 'off', or a directory"
)


def cache_directory(setting: str | os.PathLike | None) -> Path | None:
  """The persistent cache's directory for a `compilation_cache` setting.

  Args:
    setting: 'auto' (`$XDG_CACHE_HOME/raptor_jax/xla`, else
      `~/.cache/raptor_jax/xla`), 'off' (None: no persistent cache) or a
      directory (`~` expanded).

  Raises:
    ValueError: anything else (one line).
  """
  _validate.check(
      isinstance(setting, (str, os.PathLike)) and str(setting).strip() != "",
      "compilation_cache",
      "'auto', 'off' or a directory",
      setting,
      _FIX,
  )
  setting = str(setting).strip()
  if setting == "off":
    return None
  if setting == "auto":
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(root) / "raptor_jax" / "xla"
  return Path(setting).expanduser().resolve()


def enable_cache(setting: str | os.PathLike | None) -> Path | None:
  """Points JAX's persistent compilation cache at `cache_directory(setting)`.

  Every program is cached, however fast it compiled (a run builds many
  small ones). Its `accounting/` folder keeps the noise calibrations and
  logged epsilons (`accounting.set_cache_directory`). 'off'
  turns both off. Moving it between runs of one process works: JAX's cache
  object is reset when the directory changes.

  Returns:
    The directory (created), or None when off.
  """
  directory = cache_directory(setting)
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top

  accounting.set_cache_directory(
      None if directory is None else directory / "accounting"
  )

  current = jax.config.jax_compilation_cache_dir
  wanted = None if directory is None else str(directory)
  if directory is not None:
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if current != wanted:
    jax.config.update("jax_compilation_cache_dir", wanted)
    compilation_cache.reset_cache()
  return directory


class Program(NamedTuple):
  """One program to compile ahead: a jitted function and its arguments.

  `args` are arrays or `jax.ShapeDtypeStruct`s (`abstract`): the shapes,
  dtypes and placements the run will call `fn` with.
  """

  name: str
  fn: Any  # a jax.jit-wrapped function
  args: tuple


def _abstract_leaf(x):
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array) and getattr(x, "committed", False):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  # Uncommitted (or host) values: no sharding, as a call with them has none.
  return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))


def abstract(tree: Any) -> Any:
  """`jax.ShapeDtypeStruct`s of `tree`'s leaves, with the placement of the
  committed arrays (those `jax.device_put` or `parallel.replicate` placed):
  a call with the same arrays then finds the program compiled ahead."""
  return jax.tree.map(_abstract_leaf, tree)


class CompileReport(NamedTuple):
  """What one `compile_ahead` did: programs compiled, wall seconds."""

  programs: int
  seconds: float


_lock = threading.Lock()
_totals = [0, 0.0]  # programs, seconds


def totals() -> CompileReport:
  """Programs compiled ahead and wall seconds spent in `compile_ahead` by
  this process so far (subtract two readings to time a stretch)."""
  with _lock:
    return CompileReport(*_totals)


def compile_ahead(
    programs: Sequence[Program],
    *,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    what: str = "",
) -> CompileReport:
  """Lowers `programs` in order, then compiles them in `threads` threads.

  Each program's executable lands in its jitted function's cache, so the
  calls that follow with the same argument shapes and placements run it.
  `progress` gets one line per program done, "compiling <what> k/N (name)";
  with the persistent cache on, a program compiled before on this machine
  is loaded rather than compiled.

  Args:
    programs: the programs, e.g. `train.cycle.programs`.
    threads: compile threads (default: the CPU count, at most 8).
    progress: where progress lines go (e.g. `logging.info`); None: nowhere.
    what: what the progress lines name the programs by ("": nothing).

  Returns:
    `CompileReport(programs, seconds)`; both also add to `totals()`.
  """
  start = time.perf_counter()
  total = len(programs)
  threads = threads or min(8, os.cpu_count() or 1)
  done = [0]

  def compile_one(name, lowered):
    lowered.compile()
    with _lock:
      done[0] += 1
      k = done[0]
    if progress is not None:
      progress(f"compiling {what + ' ' if what else ''}{k}/{total} ({name})")

  try:
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
      futures = [
          pool.submit(compile_one, p.name, p.fn.lower(*p.args))
          for p in programs
      ]
      for future in futures:
        future.result()
  finally:
    seconds = time.perf_counter() - start
    with _lock:
      _totals[0] += total
      _totals[1] += seconds
  return CompileReport(total, seconds)
