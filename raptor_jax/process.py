"""The process set-up of raptor_jax's entry points, public for your own program.

    from raptor_jax import process
    process.setup()          # first lines of the program, before other imports
    import jax, optax, ...   # then as usual

Two settings, applied only on a CPU host, where they were measured to help
(an accelerator host gets neither; see `on_cpu_host`):

* **host memory** (`raptor_jax.host_memory.keep_freed_memory`): glibc keeps
  the pages of XLA:CPU's per-step temporary buffer for the next step instead
  of unmapping and zeroing them again (10-16% of a DP step on 2 cores).
  It must come before any library starts a thread, hence "first lines".
* **one XLA device per core** (`raptor_jax.host_devices.one_device_per_core`):
  the trainer's data parallelism then runs the halves of a microbatch on both
  cores at once, with XLA:CPU's collective timeouts raised so that a loaded
  host does not abort the process. It must come before the first JAX
  computation (JAX fixes its devices when its backends start).

Neither setting changes a computed value: the update on D devices equals the
one-device update up to float summation order (the clipped sums are combined
with `psum` and the noise is drawn once), and host memory only changes who
zeroes pages. They change no privacy property.

`launch/main.py`, `launch/pretrain.py`, `launch/sweep.py` and
`launch/audit.py` call `setup(argv=sys.argv)`, so their `--keep_host_memory`
and `--cpu_devices` flags are read from the command line before anything
heavy is imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple, Sequence

from raptor_jax import host_memory

_ACCELERATOR_PLATFORMS = ("cuda", "gpu", "rocm", "tpu", "metal")


class ProcessSetup(NamedTuple):
  """What `setup` did.

  Attributes:
    cpu_host: whether the process was taken to compute on CPU.
    host_memory_kept: whether freed host memory is kept (glibc, CPU host).
    cpu_devices: the CPU device count JAX will use (0: not set by `setup`,
      on an accelerator host).
  """

  cpu_host: bool
  host_memory_kept: bool
  cpu_devices: int


def on_cpu_host() -> bool:
  """Whether JAX will compute on CPU, decided without starting JAX.

  `JAX_PLATFORMS` decides when set (its first entry); otherwise the host is
  an accelerator host when a JAX accelerator plugin (`jax_plugins`, e.g.
  jax-cuda12-plugin) or libtpu is installed.
  """
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() not in _ACCELERATOR_PLATFORMS
  for module in ("jax_plugins", "libtpu", "jax_cuda12_plugin"):
    try:
      if importlib.util.find_spec(module) is not None:
        return False
    except (ImportError, ValueError):
      continue
  return True


def _int_flag(argv: Sequence[str], name: str, default: int) -> int:
  value = default
  args = list(argv)
  for i, arg in enumerate(args):
    text = None
    if arg.startswith(f"--{name}="):
      text = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(args):
      text = args[i + 1]
    if text is not None:
      try:
        value = int(text)
      except ValueError as e:
        raise ValueError(
            f"--{name} must be an integer (0: one device per core), got"
            f" {text!r}"
        ) from e
  return value


def setup(
    *,
    keep_host_memory: bool = True,
    cpu_devices: int = 0,
    argv: Sequence[str] | None = None,
) -> ProcessSetup:
  """Gives this process the set-up the trainer has. Call it first.

  Args:
    keep_host_memory: keep freed host memory for the next step (CPU hosts).
    cpu_devices: XLA CPU devices to create (0: one per core; 1: one
      device). A count the user already chose (`JAX_NUM_CPU_DEVICES`, or
      `--xla_force_host_platform_device_count` in `XLA_FLAGS`) is kept.
    argv: a command line whose `--keep_host_memory` / `--nokeep_host_memory`
      and `--cpu_devices=N` override the two arguments (entry points pass
      `sys.argv`: these flags are needed before absl parses them).

  Returns:
    A `ProcessSetup` saying what was applied.

  Raises:
    ValueError: a negative or non-integer device count, or JAX's backends
      already started (too late to choose the CPU device count).
  """
  if argv is not None:
    keep_host_memory = host_memory.flag_value(
        argv, "keep_host_memory", keep_host_memory
    )
    cpu_devices = _int_flag(argv, "cpu_devices", cpu_devices)
  if cpu_devices < 0:
    raise ValueError(
        f"cpu devices must be >= 0 (0: one per core), got {cpu_devices}"
    )
  if not on_cpu_host():
    return ProcessSetup(False, False, 0)
  # Host memory first: before anything imported below starts a thread.
  kept = keep_host_memory and host_memory.keep_freed_memory()
  from raptor_jax import host_devices  # pylint: disable=g-import-not-at-top

  return ProcessSetup(True, kept, host_devices.one_device_per_core(cpu_devices))
