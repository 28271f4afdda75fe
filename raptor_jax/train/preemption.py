"""Runs that survive preemption: stop signals, the workdir lock, stale logs.

SIGTERM (what SLURM and Kubernetes send before they kill a job) and SIGINT
(Ctrl-C) take ONE path: the signal raises `Stopped` in the main thread, the
trainer's error handler checkpoints the last completed cycle (a cycle's
state is one value, `outputs.TrainState`, so that checkpoint holds exactly the
noisy updates its ledger counts), and `launch/main.py` exits with one line.
Rerunning the same command resumes on the same Poisson samples and noise,
so the resumed run ends in the uninterrupted run's state, bit for bit.

A save is never cut by a second signal: `deferred_signals` holds signals
back while a checkpoint is written and raises once it is committed.

One process per workdir: `WorkdirLock` holds an exclusive `flock` on
`<workdir>/.lock` for the whole run. The kernel releases it when its
process dies however it dies, so the lock of a killed process is free and
the next run takes it over (and says so); a live holder stops the second
run with one line naming its pid and host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("raptor_jax")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
  """A stop signal (SIGINT or SIGTERM) raised in the main thread.

  A `KeyboardInterrupt`, so whatever already handles Ctrl-C handles SIGTERM
  the same way. The trainer sets `cycle` (the cycle its checkpoint holds,
  None when nothing could be saved) before re-raising it.
  """

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.cycle: int | None = None

  def one_line(self) -> str:
    """What `launch/main.py` prints: where the run stopped, how to resume."""
    if self.cycle is None:
      return (
          f"stopped by {self.args[0]} before the first cycle completed; no"
          " checkpoint yet; rerun the same command to start"
      )
    return (
        f"stopped by {self.args[0]} after cycle {self.cycle}; checkpoint saved;"
        " rerun the same command to resume"
    )


def _raise_stopped(signum, frame):
  del frame
  raise Stopped(signum)


@contextlib.contextmanager
def _handled_by(handler) -> Iterator[None]:
  """Inside the block, SIGINT and SIGTERM go to `handler`; the previous
  handlers are restored on exit. Outside the main thread (where Python
  cannot install handlers) the block runs unchanged."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
  try:
    yield
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)


def stop_on_signals() -> contextlib.AbstractContextManager[None]:
  """Inside the block, SIGINT and SIGTERM raise `Stopped` (main thread only)."""
  return _handled_by(_raise_stopped)


@contextlib.contextmanager
def deferred_signals(raise_after: bool = True) -> Iterator[None]:
  """Holds SIGINT and SIGTERM back until the block ends, then raises `Stopped`.

  For writing a checkpoint: a signal that lands during the save lets it
  commit, then stops the run as it would have (`raise_after=False`, for the
  save of a run that already stops: it is dropped).
  """
  received = []
  with _handled_by(lambda signum, frame: received.append(signum)):
    yield
  if received and raise_after:
    raise Stopped(received[0])


def _holder(path: Path) -> dict:
  """The pid and host written into a lock file ({} if unreadable)."""
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return {}


class WorkdirLock:
  """An exclusive lock on a workdir, held by one process while it trains
  (`with WorkdirLock(workdir): ...`; module docstring)."""

  def __init__(self, workdir: Path):
    self.path = Path(workdir) / ".lock"
    self._file = None

  def __enter__(self) -> "WorkdirLock":
    """Takes the lock.

    Raises:
      ValueError: another live process holds it (one line: its pid, host and
        what to do).
    """
    file = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
      file.close()
      if error.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      holder = _holder(self.path)
      raise ValueError(
          f"{self.path.parent} is in use by process {holder.get('pid', '?')}"
          f" on {holder.get('host', '?')} (lock {self.path}); wait for it to"
          " end, or train in another --workdir"
      ) from None
    earlier = _holder(self.path)
    if earlier:
      log.warning(
          "took over %s from process %s on %s, which no longer runs",
          self.path,
          earlier.get("pid"),
          earlier.get("host"),
      )
    file.seek(0)
    file.truncate()
    file.write(json.dumps(dict(pid=os.getpid(), host=socket.gethostname())))
    file.flush()
    self._file = file
    return self

  def __exit__(self, *exc_info) -> None:
    # Emptied first: a lock file that names a process means a run that did
    # not end normally.
    self._file.seek(0)
    self._file.truncate()
    self._file.flush()
    fcntl.flock(self._file, fcntl.LOCK_UN)
    self._file.close()
    self._file = None


# What a run writes before its first checkpoint (metrics, TensorBoard events,
# its config and layer selection): left by a run that died before it, they
# belong to a run whose state is lost.
UNCHECKPOINTED_OUTPUTS = (
    "metrics.jsonl",
    "tensorboard",
    "config.json",
    "layer_selection.json",
)


def latest_checkpoint(workdir: Path) -> int | None:
  """The cycle of the latest committed checkpoint in `workdir`, or None.

  Read from the directory names (orbax commits `checkpoints/<step>`; a save
  in progress has another name), without opening anything.
  """
  directory = Path(workdir) / "checkpoints"
  if not directory.is_dir():
    return None
  steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
  return max(steps, default=None)


def move_aside_unfinished_logs(workdir: Path) -> Path | None:
  """Moves the outputs of a run that died before its first checkpoint aside.

  Call it on a fresh start only (no checkpoint in `workdir`). A fresh run
  draws a new secret, so it is another run: appending to the dead run's
  metrics would mix two runs in one file. They go to
  `<workdir>/stopped_before_checkpoint.<k>/`, kept (not deleted): whatever
  they show was released by that run, outside this run's ledger.

  Returns:
    The directory they were moved to, or None when there were none.
  """
  found = [workdir / name for name in UNCHECKPOINTED_OUTPUTS]
  found = [path for path in found if path.exists()]
  if not found:
    return None
  k = 0
  while (workdir / f"stopped_before_checkpoint.{k}").exists():
    k += 1
  aside = workdir / f"stopped_before_checkpoint.{k}"
  aside.mkdir()
  for path in found:
    path.rename(aside / path.name)
  log.warning(
      "%s held the logs of a run that stopped before its first checkpoint;"
      " moved them to %s (that run's releases are not in this run's ledger)",
      workdir,
      aside,
  )
  return aside


class CheckpointClock:
  """When to checkpoint: every `cycles` cycles, and every `minutes` minutes.

  Time-based saves bound the work a crash that Python cannot handle (a
  `kill -9`, an out-of-memory kill) loses, whatever a cycle costs. When a
  checkpoint is written does not change what the run computes (a cycle's
  state is the same whenever it is saved), so both periods are
  resume-insensitive.
  """

  def __init__(
      self, cycles: int, minutes: float, clock=time.monotonic, saved_cycle=0
  ):
    self.cycles, self.seconds, self.clock = cycles, 60.0 * minutes, clock
    self.saved_cycle, self.saved_at = saved_cycle, clock()

  def due(self, cycle: int) -> bool:
    """Whether to save after `cycle`."""
    if cycle - self.saved_cycle >= self.cycles:
      return True
    return bool(self.seconds) and self.clock() - self.saved_at >= self.seconds

  def saved(self, cycle: int) -> None:
    self.saved_cycle, self.saved_at = cycle, self.clock()
