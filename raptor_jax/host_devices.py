"""On CPU, one XLA device per core: data parallelism over the cores.

XLA:CPU runs one operation at a time and parallelises inside it. The large
matrix products of a training step use every core that way, but many of the
step's operations do not: the per-head batched products of attention (128
products of 128 x 64 x 128 at microbatch 32 of the issue-16 benchmark) run
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
"""

from __future__ import annotations

import os

import jax


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


def one_device_per_core(count: int = 0) -> int:
  """Splits JAX's CPU backend into `count` devices (default: one per core).

  Call it before the first JAX computation: JAX fixes its devices when its
  backends start. A count already chosen by the user (`JAX_NUM_CPU_DEVICES`,
  or `--xla_force_host_platform_device_count` in `XLA_FLAGS`) is kept.

  Args:
    count: devices to create; 0 means `host_cores()`.

  Returns:
    The CPU device count JAX will use.

  Raises:
    ValueError: for a negative count, or when JAX's backends have already
      started (too late to change the device count).
  """
  if count < 0:
    raise ValueError(f"cpu devices must be >= 0 (0: one per core), got {count}")
  configured = jax.config.jax_num_cpu_devices
  if configured > 0:
    return configured
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in flags.split():
    if flag.startswith("--xla_force_host_platform_device_count="):
      return int(flag.split("=", 1)[1])
  count = count or host_cores()
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:
    raise ValueError(
        "JAX's backends have already started, so the CPU device count is "
        "fixed; call host_devices.one_device_per_core() before the first JAX "
        "computation"
    ) from e
  return count
