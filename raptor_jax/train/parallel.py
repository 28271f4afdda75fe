"""Data parallelism over local devices and hosts with JAX's own machinery.

One 1-D device mesh, axis 'data'. Parameters and optimizer states are
replicated; each microbatch is split across the devices (records are the
sharded axis). Every device computes the clipped per-record gradient sums of
its records, the sums are combined with `psum` inside `shard_map`, and the
noisy update runs replicated from one PRNG state, so the noise is drawn once
per step and every device holds identical parameters.

Across hosts (`jax.distributed`), record i belongs to host i % P: a host
tokenises and reads only its own records. The Poisson sample of a step is
drawn over the whole dataset with the same generator on every host (it is a
public function of the seed), each host keeps its own records, and every host
runs the same number of microbatches (the largest host share, padded). The
privacy analysis is unchanged: sampling is still Poisson over all n records,
one Gaussian release per step.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from raptor_jax import _validate, length_buckets, sampling

AXIS = "data"


def initialize_distributed(
    coordinator_address: str = "", num_processes: int = 0, process_id: int = -1
) -> None:
  """Starts `jax.distributed` when several processes are configured.

  Arguments left empty come from the usual environment (JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster JAX detects: SLURM, ...).
  With neither arguments nor such environment, this is a single-process run.
  """
  coordinator_address = coordinator_address or os.environ.get(
      "JAX_COORDINATOR_ADDRESS", ""
  )
  num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  if process_id < 0:
    process_id = int(os.environ.get("JAX_PROCESS_ID", "-1"))
  if not coordinator_address and num_processes <= 1:
    return
  if not coordinator_address or num_processes < 1 or process_id < 0:
    raise ValueError(
        "multi-host runs need the coordinator address, the number of processes "
        "and this process's id (--coordinator_address, --num_processes, "
        "--process_id or JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID)"
    )
  # CPU hosts need a collectives backend for cross-process psum (GPUs use NCCL).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
  )


def agree(value: int) -> int:
  """Process 0's value on every process (e.g. the run's secret seed)."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def agree_bytes(value: bytes) -> bytes:
  """Process 0's bytes on every process (the run's 256-bit secret).

  Sent as uint8 (no integer width limit), so wide secrets survive intact.
  """
  return value if jax.process_count() == 1 else broadcast_bytes(value)


def broadcast_bytes(value: bytes) -> bytes:
  """`multihost_utils.broadcast_one_to_all` of `value` as a uint8 array."""
  sent = np.frombuffer(value, np.uint8)
  return np.asarray(
      multihost_utils.broadcast_one_to_all(sent), np.uint8
  ).tobytes()


def host_shard() -> tuple[int, int]:
  """(this process's index, process count): the records this host loads
  (i % count == index; `setup.load_run_data(config, host=...)`)."""
  return jax.process_index(), jax.process_count()


def global_count(local: int) -> int:
  """The sum of `local` over every process (e.g. n from the hosts' shares)."""
  if jax.process_count() == 1:
    return local
  return int(np.sum(multihost_utils.process_allgather(np.int32(local))))


def make_mesh(num_devices: int = 0) -> Mesh:
  """A 1-D 'data' mesh: all devices of every process, or the first `num_devices` (1 process)."""
  devices = jax.devices()
  if num_devices:
    _validate.check(
        jax.process_count() == 1 or num_devices == len(devices),
        "num_devices",
        "0 (all devices) with several processes",
        num_devices,
        _validate.config_fix("num_devices", 0),
    )
    _validate.check(
        1 <= num_devices <= len(devices),
        "num_devices",
        f"in [0, {len(devices)}] ({len(devices)} devices are visible)",
        num_devices,
        _validate.config_fix("num_devices", 0) + " for all of them",
    )
    devices = devices[:num_devices]
  return Mesh(np.asarray(devices), (AXIS,))


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places identical host values on every device of the mesh.

  Typed PRNG keys (`jax.random.key`) stay typed keys (their key data is
  replicated); raw `PRNGKey` arrays are ordinary uint32 arrays.
  """
  sharding = NamedSharding(mesh, PartitionSpec())

  def put(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    ):
      return jax.random.wrap_key_data(
          put(jax.random.key_data(x)), impl=jax.random.key_impl(x)
      )
    x = np.asarray(x)
    return jax.make_array_from_callback(
        x.shape, sharding, lambda index: x[index]
    )

  return jax.tree.map(put, tree)


def shard_records(tree: Any, mesh: Mesh) -> Any:
  """A global array, sharded over records, from this process's records."""
  sharding = NamedSharding(mesh, PartitionSpec(AXIS))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
      tree,
  )


def local_microbatches(
    sample: np.ndarray, local_size: int
) -> list[sampling.Microbatch]:
  """This host's microbatches of `local_size` records (per-device size x
  local devices) of a global Poisson sample (sorted indices, the same on
  every host): LOCAL indices (into this host's records), as many on every
  host (the largest host share decides; the rest is padding)."""
  processes, me = jax.process_count(), jax.process_index()
  shares = [sample[sample % processes == p] for p in range(processes)]
  count = max(math.ceil(len(share) / local_size) for share in shares)
  mine = sampling.microbatches(shares[me] // processes, local_size)
  padding = sampling.Microbatch(
      np.zeros(local_size, np.int64), np.zeros(local_size, np.float32)
  )
  return mine + [padding] * (count - len(mine))


def local_bucketed_microbatches(
    sample: np.ndarray,
    local_lengths: np.ndarray,
    buckets: tuple[int, ...],
    local_size: int,
) -> list[length_buckets.BucketMicrobatch]:
  """This host's fixed-shape microbatches of a global sample, by length bucket.

  As `local_microbatches`, but each record runs in the smallest bucket that
  holds it (`length_buckets`): `BucketMicrobatch(length, microbatch)`
  items, shortest bucket first, the same sequence of lengths on every host.
  `local_lengths`: this host's records' lengths.

  Privacy: a host only knows its own records' lengths, so with several
  processes the hosts agree on the microbatches per bucket (the maximum)
  through one allgather inside the job; those counts are private and only
  decide the layout (never logged or saved, see `length_buckets`).
  """
  processes, me = jax.process_count(), jax.process_index()
  mine = sample[sample % processes == me] // processes
  counts = length_buckets.bucket_counts(
      mine, local_lengths, buckets, local_size
  )
  if processes > 1:
    counts = np.max(
        np.asarray(multihost_utils.process_allgather(counts.astype(np.int32))),
        axis=0,
    )
  return length_buckets.host_bucketed_microbatches(
      mine, local_lengths, buckets, local_size, counts
  )
