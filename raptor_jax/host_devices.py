"""On CPU, one XLA device per core: data parallelism over the cores.

XLA:CPU runs one operation at a time and parallelises inside it. The large
matrix products of a training step use every core that way, but many of the
step's operations do not: the per-head batched products of attention (128
products of 128 x 64 x 128 at microbatch 32 of the fixed-shape Switch benchmark (launch/bench/vs_opacus.py)) run
on one core at the same speed as on two, and so do most small elementwise
fusions. Splitting the host into one XLA device per core and the microbatch
across them (the trainer's data parallelism, `raptor_jax.train.parallel`)
runs two such halves at once: the non-private, shared DP and expert steps
of that benchmark took 0.89x, 0.93x and 0.88x the one-device time at
microbatch 32, 0.93x, 0.90x and 0.94x at 128 (2 cores, paired `ab_commits`
runs; results/vs_opacus/ab_commits.txt). The update is the same as on one
device: the devices' clipped sums are combined with `psum` and the
noise is drawn once, replicated (`parallel`, tested 1 against 4 devices).

The price: every device holds its own copy of the parameters and of the
optimizer state, so host memory for them grows with the device count.
Accelerators (GPU, TPU) are not affected: this only splits JAX's CPU backend.

Collectives on a loaded host. Each device runs its part of the step on its
own thread, and the `psum` of the clipped sums waits for every device. XLA:CPU
aborts the whole process (`rendezvous.cc ... Termination timeout`, a C++ stack
dump and no Python handler, so no checkpoint) when one device arrives more
than `--xla_cpu_collective_call_warn_stuck_timeout_seconds` plus
`--xla_cpu_collective_call_terminate_timeout_seconds` (20 + 40 s in jaxlib
0.10.2) after another. On a machine whose cores other processes keep busy a
device's thread can be descheduled that long, so a split host waits
`COLLECTIVE_TIMEOUT_S` instead (the flags a user set in `XLA_FLAGS` are kept).
"""

from __future__ import annotations

import os

import jax

# Seconds a device may wait for the others at a collective before XLA:CPU
# aborts the process: a day (no host is that overloaded; a real deadlock
# still ends). XLA logs a "may be stuck" line after at most 10 minutes.
COLLECTIVE_TIMEOUT_S = 24 * 3600
_WARN_FLAG = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
_TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def host_cores() -> int:
  """The cores this process may run on (its CPU affinity, e.g. `taskset`)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def dividing_count(sizes, cores: int = 0) -> int:
  """The most devices, up to `cores` (0: `host_cores()`), dividing every size.

  For callers that split fixed batches evenly over the devices, e.g. the
  benchmarks' microbatch sizes (a step on a mesh needs a multiple of its
  devices).
  """
  cores = cores or host_cores()
  return max(
      d for d in range(1, cores + 1) if all(size % d == 0 for size in sizes)
  )


def with_collective_timeout(xla_flags: str, seconds: int) -> str:
  """`xla_flags` plus XLA:CPU's collective timeouts totalling `seconds`.

  XLA aborts after the warning timeout plus the termination timeout; the
  warning comes after half the time, at most 10 minutes. A timeout flag
  already in `xla_flags` (the user's choice) is kept as it is.
  """
  warn = max(1, min(600, seconds // 2))
  flags = xla_flags.split()
  for name, value in ((_WARN_FLAG, warn), (_TERMINATE_FLAG, seconds - warn)):
    if not any(flag.startswith(name + "=") for flag in flags):
      flags.append(f"{name}={max(1, value)}")
  return " ".join(flags)


def one_device_per_core(
    count: int = 0, collective_timeout_s: int = COLLECTIVE_TIMEOUT_S
) -> int:
  """Splits JAX's CPU backend into `count` devices (default: one per core).

  Call it before the first JAX computation: JAX fixes its devices when its
  backends start. A count already chosen by the user (`JAX_NUM_CPU_DEVICES`,
  or `--xla_force_host_platform_device_count` in `XLA_FLAGS`) is kept.

  With more than one device, XLA:CPU's collectives wait
  `collective_timeout_s` for a late device instead of aborting after a
  minute (module docstring), unless `XLA_FLAGS` sets those timeouts.

  Args:
    count: devices to create; 0 means `host_cores()`.
    collective_timeout_s: seconds a device may wait for the others at a
      collective before XLA aborts the process.

  Returns:
    The CPU device count JAX will use.

  Raises:
    ValueError: for a negative count, or when JAX's backends have already
      started (too late to change the device count).
  """
  if count < 0:
    raise ValueError(f"cpu devices must be >= 0 (0: one per core), got {count}")
  configured = jax.config.jax_num_cpu_devices
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in flags.split():
    if flag.startswith("--xla_force_host_platform_device_count="):
      configured = int(flag.split("=", 1)[1])
  if configured <= 0:
    configured = count or host_cores()
    try:
      jax.config.update("jax_num_cpu_devices", configured)
    except RuntimeError as e:
      raise ValueError(
          "JAX's backends have already started, so the CPU device count is "
          "fixed; call host_devices.one_device_per_core() before the first "
          "JAX computation"
      ) from e
  if configured > 1:  # read by XLA when the CPU backend starts
    os.environ["XLA_FLAGS"] = with_collective_timeout(
        flags, collective_timeout_s
    )
  return configured
