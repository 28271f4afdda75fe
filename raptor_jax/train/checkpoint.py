"""Atomic orbax checkpoints of a run, tied to the config that produced them.

A checkpoint holds the trainable parameters, optimizer states (including the
noise transforms' PRNG keys and step counts), the cycle counter, the privacy
ledger and the run's secret seed (Poisson samples and noise derive from it:
keep checkpoints as private as the training data; release only the model). The owner map is NOT saved: it is recomputed on resume from
the frozen pretrained model (it is deterministic), so it never touches disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from raptor_jax.train.config import RESUME_INSENSITIVE

# Version of the checkpoint layout, saved in every checkpoint's meta. 2: each
# part's optimizer state is the state of `optax.chain(privatize_sums, adam)`
# (1, unversioned: a {"noise", "adam"} dict per part).
FORMAT_VERSION = 2


def fingerprint(
    config: ml_collections.ConfigDict,
    insensitive: Sequence[str] = RESUME_INSENSITIVE,
) -> str:
  """Hash of every config field that changes what the run computes."""
  values = config.to_dict()
  for key in insensitive:
    values.pop(key, None)
  return hashlib.sha256(
      json.dumps(values, sort_keys=True, default=str).encode()
  ).hexdigest()


class Checkpointer:
  """Saves and restores (state, meta) under `<workdir>/checkpoints`."""

  def __init__(
      self,
      workdir: str | Path,
      config: ml_collections.ConfigDict,
      max_to_keep: int = 2,
      insensitive: Sequence[str] = RESUME_INSENSITIVE,
      format_version: int | None = FORMAT_VERSION,
  ):
    """`format_version`: written to and required of every checkpoint's meta
    (None: neither, for layouts that never changed, e.g. pretraining's)."""
    self.format_version = format_version
    self.directory = Path(workdir).expanduser().resolve() / "checkpoints"
    self.fingerprint = fingerprint(config, insensitive)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True
        ),
    )

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def restore_meta(self) -> dict | None:
    """The latest checkpoint's metadata, or None for a fresh workdir.

    Raises:
      ValueError: the workdir holds a checkpoint of another format version
        or of a different config.
    """
    step = self.manager.latest_step()
    if step is None:
      return None
    meta = self.manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )["meta"]
    version = meta.get("format_version")
    if self.format_version is not None and version != self.format_version:
      raise ValueError(
          f"{self.directory / str(step)} is a checkpoint of format "
          f"{version or '1 (unversioned)'}, this raptor_jax reads format "
          f"{self.format_version}; train in a new --workdir, or resume with the raptor_jax "
          "version that wrote it"
      )
    if meta.get("fingerprint") != self.fingerprint:
      raise ValueError(
          f"{self.directory} holds a checkpoint of a different config; use another --workdir "
          "or restore the config it was written with (see config.json there)"
      )
    return meta

  def restore_state(self, abstract_state: Any) -> Any:
    """The latest state, placed like `abstract_state` (any device count)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    return self.manager.restore(
        self.manager.latest_step(),
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
    )["state"]

  def restore_subtree(self, abstract_subtree: Any) -> Any:
    """Only the leaves of `abstract_subtree` of the latest state, as numpy.

    `abstract_subtree` names a part of the saved state (e.g. {"trainable":
    ...}); nothing else is read from disk, so restoring the parameters does
    not load the optimizer states' secret noise keys.
    """
    path = self.directory / str(self.manager.latest_step()) / "state"
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_subtree
    )
    return ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=abstract_subtree,
            restore_args=restore_args,
            partial_restore=True,
        ),
    )

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Writes a checkpoint atomically (orbax commits a finished directory)."""
    meta = dict(meta, fingerprint=self.fingerprint)
    if self.format_version is not None:
      meta["format_version"] = self.format_version
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
