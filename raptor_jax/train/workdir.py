"""The workdir: whose run it holds, and whether this config may continue it.

Error messages describe private data only by a digest keyed by the run's
secret (`_describe`).
"""

from __future__ import annotations

import json
from pathlib import Path

from flax.traverse_util import flatten_dict
import ml_collections

from raptor_jax.train import parallel, preemption, secrecy
from raptor_jax.train.config import RESUME_INSENSITIVE


def run_secret(
    config, meta: dict | None, data_fingerprint: dict, checkpointer
) -> bytes:
  """The run's secret: fresh (agreed by every process) or the checkpoint's.

  Raises:
    ValueError: the checkpoint was trained on other data than the config
      names now (resuming would mix two datasets under one ledger), or the
      workdir reports an earlier run but has no checkpoint (a fresh start
      would hide that run's releases).
  """
  if not meta:
    report = checkpointer.directory.parent / "privacy_report.json"
    if report.exists():  # never restart from scratch under an old ledger
      raise ValueError(
          f"{report} reports an earlier run but {checkpointer.directory} holds"
          " no checkpoint of it; train in a new --workdir"
      )
    return parallel.agree_bytes(secrecy.draw_secret(config))
  secret = bytes.fromhex(meta["secret"])
  if meta.get("data") != data_fingerprint:
    raise ValueError(
        f"the training data changed since {checkpointer.latest_path()} was"
        f" written (now {_describe(data_fingerprint, secret)}, then"
        f" {_describe(meta.get('data'), secret)}); restore the data the run"
        " started on, or train in a new --workdir"
    )
  return secret


def _describe(fingerprint: dict | None, secret: bytes) -> str:
  """A description of a data fingerprint safe for error messages.

  A file's size and plain sha256 are functions of every record (an
  adversary who knows all records but one could test candidates against
  them), so a file is described by its digest keyed by the run's secret
  (the `keyed_sha256` of privacy_report.json) only; a hub or generated
  source by its public name.
  """
  if not fingerprint:
    return "unknown"
  if fingerprint.get("source") != "file":
    return f"{fingerprint.get('source')} {fingerprint.get('task')}"
  return f"keyed sha256 {secrecy.keyed_digest(secret, fingerprint)}"


def check_workdir(config: ml_collections.ConfigDict, workdir: Path) -> None:
  """Refuses a workdir of another config before anything is loaded.

  The workdir's config.json (public) against `config`, every field that
  changes what the run computes; the checkpoint's fingerprint stays the
  authority (`Checkpointer.restore_meta`). A workdir without a checkpoint
  passes: `start_fresh` handles it.

  Raises:
    ValueError: one line naming the fields that differ.
  """
  saved = workdir / "config.json"
  if preemption.latest_checkpoint(workdir) is None or not saved.exists():
    return
  try:
    then = flatten_dict(json.loads(saved.read_text()), sep=".")
  except ValueError:
    return  # unreadable: the checkpoint's fingerprint decides
  now = flatten_dict(json.loads(secrecy.public_config(config)), sep=".")
  differ = sorted(
      key
      for key in set(then) | set(now)
      if then.get(key) != now.get(key)
      and key.split(".")[0] not in RESUME_INSENSITIVE
      and key not in RESUME_INSENSITIVE
  )
  if differ:
    shown = ", ".join(
        f"{key} (then {then.get(key)!r}, now {now.get(key)!r})"
        for key in differ[:5]
    )
    more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
    raise ValueError(
        f"{workdir} holds a run of another config: {shown}{more}; use another"
        " --workdir, or rerun with the config in its config.json"
    )


def start_fresh(workdir: Path) -> None:
  """A workdir with no checkpoint and no report: the outputs of a run that
  died before its first checkpoint (if any) are moved aside."""
  if (
      preemption.latest_checkpoint(workdir) is None
      and not (workdir / "privacy_report.json").exists()
  ):
    preemption.move_aside_unfinished_logs(workdir)


# Data files a config names; a run reads them by their resolved paths.
DATA_PATHS = ("train_path", "dev_path", "public_path")
# The workdir's record of them: {field: {"given": ..., "resolved": ...}}.
PATHS_FILE = "data_paths.json"


def stored_paths(workdir: str | Path) -> dict:
  """The workdir's data paths as given and as resolved ({} if none)."""
  try:
    stored = json.loads((Path(workdir) / PATHS_FILE).read_text())
  except (OSError, ValueError):
    return {}
  return stored if isinstance(stored, dict) else {}


def with_resolved_paths(
    config: ml_collections.ConfigDict, workdir: str | Path
) -> tuple[ml_collections.ConfigDict, dict]:
  """`config` with its data paths absolute, and what to store of them.

  A relative path is resolved against the current directory, or, where no
  such file exists there, taken from the workdir's `PATHS_FILE` when the run
  was started with that same relative path: rerunning the same command from
  another directory resumes the same run, and the workdir's config.json
  holds paths that export and resume read from any directory.

  Returns:
    (config, {field: {"given": as typed, "resolved": absolute path}}).
  """
  stored = stored_paths(workdir)
  record, resolved = {}, {}
  for field in DATA_PATHS:
    given = config.data.get(field) or ""
    path = Path(given).expanduser()
    if not given or path.is_absolute():
      continue
    earlier = stored.get(field) or {}
    if not path.exists() and earlier.get("given") == given:
      resolved[field] = str(earlier.get("resolved"))
    else:
      resolved[field] = str(path.resolve())
    record[field] = dict(given=given, resolved=resolved[field])
  if not resolved:
    return config, record
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for field, path in resolved.items():
      config.data[field] = path
  return config, record


def store_paths(workdir: Path, record: dict) -> None:
  """Writes `record` (`with_resolved_paths`) once, at a run's start."""
  path = workdir / PATHS_FILE
  if record and not path.exists():
    path.write_text(json.dumps(record, indent=2, sort_keys=True))


def finished_results(workdir: Path) -> dict | None:
  """results.json of the finished run in `workdir` (None: not finished).

  Finished: privacy_report.json says so and the latest checkpoint is its
  last cycle. Read before anything loads, so that rerunning the command of
  a finished run answers at once.
  """
  try:
    report = json.loads((workdir / "privacy_report.json").read_text())
    results = json.loads((workdir / "results.json").read_text())
  except (OSError, ValueError):
    return None
  if not (
      report.get("finished")
      and preemption.latest_checkpoint(workdir) == report.get("cycles")
  ):
    return None
  return results
