"""Atomic orbax checkpoints of a run, tied to the config that produced them.

A checkpoint holds the trainable parameters, optimizer states (including the
noise transforms' PRNG keys and step counts), the cycle counter, the privacy
ledger, the run's 256-bit secret (Poisson samples and noise derive from it:
keep checkpoints as private as the training data; release only the model)
and the fingerprint of the training data. The owner map is NOT saved: it is
recomputed on resume from the frozen pretrained model (it is deterministic),
so it never touches disk.

A checkpoint that cannot be read stops the run with one line naming it; the
run never skips it silently, falls back on its own or starts from scratch
(README, "Interrupts and damaged checkpoints": why moving it aside is safe).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from raptor_jax.train.config import RESUME_INSENSITIVE

# Version of the checkpoint layout, saved in every checkpoint's meta. 4: each
# noise state's key is two threefry keys (uint32[2, 2], 128 bits). 3: the
# meta holds the 256-bit `secret` (hex) and the `data` fingerprint instead of
# a 31-bit `secret_seed`. 2: each part's optimizer state is the state of
# `optax.chain(privatize_sums, adam)` (1, unversioned: a {"noise", "adam"}
# dict per part).
FORMAT_VERSION = 4


def fingerprint(
    config: ml_collections.ConfigDict,
    insensitive: Sequence[str] = RESUME_INSENSITIVE,
) -> str:
  """Hash of every config field that changes what the run computes.

  `privacy.secret_seed` is left out: a resumed run takes its secret from the
  checkpoint, and the seed must not reach any file, not even hashed.
  """
  values = config.to_dict()
  for key in insensitive:  # a top-level field, or a dotted one
    *parents, leaf = key.split(".")
    section = values
    for parent in parents:
      section = section.get(parent) if isinstance(section, dict) else None
    if isinstance(section, dict):
      section.pop(leaf, None)
  values.get("privacy", {}).pop("secret_seed", None)
  return hashlib.sha256(
      json.dumps(values, sort_keys=True, default=str).encode()
  ).hexdigest()


def _closed_loop_error(exc_type, exc) -> bool:
  return exc_type is RuntimeError and str(exc) == "Event loop is closed"


_QUIET = False  # whether `_quiet_in_flight_reads` has run
_RESTORING = False  # whether a restore is running or has failed


def _quiet_in_flight_reads() -> None:
  """Drops the tracebacks of a failed restore's reads still in flight.

  When one array of a checkpoint cannot be read, orbax's restore fails and
  closes its event loop while tensorstore still completes the other reads;
  each completion then reports `RuntimeError('Event loop is closed')` from
  a tensorstore thread, and asyncio logs "Task exception was never
  retrieved" for each other read that failed on the same damage: a
  screenful of tracebacks after the one line that says what to do (issue
  44; the second kind failed CI once in 12 runs). The closed-loop errors
  are dropped from here on; the unretrieved-exception records only while a
  restore runs or after one failed (`_reading`), so a run that restored its
  checkpoint still shows any other. Installed before every restore (once
  per process): the reads in flight may fail before the restore returns.
  """
  global _QUIET
  if _QUIET:
    return
  _QUIET = True
  previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook
  previous_unraisable_hook = sys.unraisablehook

  def hook(exc_type, exc, tb):
    if not _closed_loop_error(exc_type, exc):
      previous_hook(exc_type, exc, tb)

  def thread_hook(args):
    if not _closed_loop_error(args.exc_type, args.exc_value):
      previous_thread_hook(args)

  def unraisable_hook(args):  # a callback's error, raised in a C++ thread
    if not _closed_loop_error(args.exc_type, args.exc_value):
      previous_unraisable_hook(args)

  def log_filter(record: logging.LogRecord) -> bool:
    # asyncio's "Future (or Task) exception was never retrieved", logged when
    # a read's future is collected: one that failed on the closed loop, or,
    # once a restore has failed, any other read of the same damaged
    # checkpoint (its error is the one the run's line already names).
    exc = record.exc_info[1] if record.exc_info else None
    message = record.getMessage()
    return not (
        _closed_loop_error(type(exc), exc)
        or "RuntimeError('Event loop is closed')" in message
        or (_RESTORING and "exception was never retrieved" in message)
    )

  sys.excepthook, threading.excepthook = hook, thread_hook
  sys.unraisablehook = unraisable_hook
  logging.getLogger("asyncio").addFilter(log_filter)


@contextlib.contextmanager
def _reading(error_line: Callable[[Exception], ValueError]):
  """Runs a restore; its failure becomes `error_line(error)`, and only that.

  The unretrieved errors of the other reads stay dropped after a failure
  (they are logged when their futures are collected, which may be after
  the run has printed its line); a restore that succeeds leaves nothing
  dropped but the closed-loop errors.
  """
  global _RESTORING
  _quiet_in_flight_reads()
  _RESTORING = True
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    raise error_line(error) from error
  _RESTORING = False


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

  def latest_path(self) -> Path:
    """The directory of the latest checkpoint (for messages)."""
    return self.directory / str(self.manager.latest_step())

  def _unreadable(self, step: int, error: Exception) -> ValueError:
    """One line naming the unreadable checkpoint and the ways forward.

    The run stops rather than fall back on its own: the latest checkpoint's
    ledger counts cycles that the earlier one does not. Moving the bad one
    aside resumes from the earlier checkpoint, whose cycles then rerun on the
    same Poisson samples with the same noise (both are functions of the
    secret, stream and cycle), so the final model still holds exactly the
    releases its ledger counts (README, "Randomness and secrecy").
    """
    earlier = [s for s in self.manager.all_steps() if s < step]
    fallback = (
        f"move it out of {self.directory} to resume from cycle {max(earlier)}"
        " (the same samples and noise are redrawn), or "
        if earlier
        else ""
    )
    reason = (str(error).splitlines() or [""])[0][:200]
    return ValueError(
        f"checkpoint {self.directory / str(step)} is unreadable"
        f" ({type(error).__name__}: {reason}); {fallback}train in a new"
        " --workdir"
    )

  def restore_meta(self) -> dict | None:
    """The latest checkpoint's metadata, or None for a fresh workdir.

    Raises:
      ValueError: the latest checkpoint is unreadable (never skipped
        silently), or of another format version or of a different config.
    """
    step = self.manager.latest_step()
    if step is None:
      return None
    with _reading(functools.partial(self._unreadable, step)):
      meta = self.manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      )["meta"]
      if not isinstance(meta, dict):
        raise TypeError(f"its meta is a {type(meta).__name__}, not a dict")
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
    step = self.manager.latest_step()
    with _reading(functools.partial(self._unreadable, step)):
      return self.manager.restore(
          step,
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
