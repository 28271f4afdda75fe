"""A run on the user's own files, driven from several directories (issue 48.3):
resume and export from anywhere, `already finished` at once, a dry run that
writes nothing."""

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow

CLASSES = ("neg", "pos")


def _write(directory, name, n, seed):
  words = ("awful", "superb")
  rows = [
      f"the film was {words[(i * seed) % 2]} and long\t{CLASSES[(i * seed) % 2]}"
      for i in range(n)
  ]
  (directory / name).write_text("text\tlabel\n" + "\n".join(rows) + "\n")


def _data(home):
  """`home`/data: a two-class train, dev and public file."""
  (home / "data").mkdir(parents=True)
  _write(home / "data", "train.tsv", 120, 1)
  _write(home / "data", "dev.tsv", 20, 3)
  (home / "data" / "public.tsv").write_text(
      "text\n" + "\n".join(["the film was awful and superb and long"] * 40)
  )


def _command(workdir, *extra):
  return [
      sys.executable,
      str(ROOT / "launch" / "main.py"),
      f"--config={ROOT / 'configs' / 'custom.py'}:cpu",
      f"--workdir={workdir}",
      "--config.data.train_path=data/train.tsv",  # relative to the cwd
      "--config.data.dev_path=data/dev.tsv",
      "--config.data.public_path=data/public.tsv",
      "--config.data.public_corpus=",
      "--config.data.text_fields=text",
      "--config.data.label_field=label",
      "--config.data.label_names=neg,pos",
      "--config.data.max_length=16",
      "--config.data.n_pub=40",
      "--config.model.random.d_model=32",
      "--config.model.random.d_ff=32",
      "--config.model.random.num_layers=2",
      "--config.model.random.num_heads=2",
      "--config.model.random.d_kv=8",
      "--config.batch_size=30",
      "--config.epochs=1",
      "--config.checkpoint_every_cycles=1",
      "--config.progress_bar=False",
      *extra,
  ]


def _run(args, cwd):
  start = time.time()
  proc = subprocess.run(
      args, cwd=cwd, capture_output=True, text=True, timeout=600
  )
  return proc, time.time() - start


def test_resume_and_export_from_another_directory(tmp_path):
  home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
  _data(home)
  elsewhere.mkdir()
  workdir = tmp_path / "run"

  # A dry run writes nothing, not even the workdir.
  proc, _ = _run(_command(workdir, "--dry_run"), home)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert not workdir.exists()

  # Two cycles from home (relative data paths), the rest from elsewhere,
  # where data/train.tsv does not exist: the workdir resolves it.
  proc, _ = _run(_command(workdir, "--config.stop_after_cycles=2"), home)
  assert proc.returncode == 0, proc.stderr[-2000:]
  paths = json.loads((workdir / "data_paths.json").read_text())
  assert paths["train_path"] == dict(
      given="data/train.tsv", resolved=str(home / "data" / "train.tsv")
  )
  config = json.loads((workdir / "config.json").read_text())
  assert config["data"]["train_path"] == str(home / "data" / "train.tsv")
  proc, _ = _run(_command(workdir), elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "resumed from cycle 2 of 4" in proc.stderr
  assert (workdir / "curves.png").exists()  # a picture of every run (48.4)
  export_line = proc.stderr.strip().splitlines()[-1]
  assert export_line.startswith(f"export: python {ROOT}/launch/export.py")

  # The same command again: one line at once, nothing loaded.
  proc, seconds = _run(_command(workdir), elsewhere)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith(f"already finished: {workdir} holds"), (
      proc.stdout + proc.stderr
  )
  assert seconds < 5, seconds  # 2 s on an idle machine; 30 s before

  # Export from a third directory, with the command the run printed.
  proc, _ = _run([sys.executable, *export_line.split()[2:]], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (tmp_path / "run_model" / "privacy_card.json").exists()

  # Data gone: export's error names export's own flags, not --config.*.
  (home / "data" / "train.tsv").rename(home / "data" / "moved.tsv")
  proc, _ = _run(
      [
          sys.executable,
          str(ROOT / "launch" / "export.py"),
          f"--workdir={workdir}",
          f"--out={tmp_path / 'again'}",
      ],
      elsewhere,
  )
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode != 0 and last.startswith("error: data.train_path")
  assert "--config" not in last
  assert f"rerun launch/export.py --workdir={workdir}" in last


def test_an_unreadable_checkpoint_is_one_line(tmp_path):
  """44.5: a corrupt checkpoint printed its one line, then screenfuls of
  `RuntimeError: Event loop is closed` from the restore's reads in flight
  (measured: 14 tracebacks after the line)."""
  _data(tmp_path)
  workdir = tmp_path / "run"
  proc, _ = _run(_command(workdir, "--config.stop_after_cycles=2"), tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  for array in (workdir / "checkpoints" / "2" / "state" / "d").iterdir():
    array.write_bytes(b"garbage")
  proc, _ = _run(_command(workdir), tmp_path)
  assert proc.returncode == 1
  assert "Event loop is closed" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: checkpoint {workdir}/checkpoints/2 is")


def test_only_the_echoes_of_a_failed_restore_are_dropped(monkeypatch, caplog):
  """The flaky half of the test above, made deterministic: asyncio logs
  "Future exception was never retrieved" for each read that failed on the
  closed loop, and "Task exception was never retrieved" for each other read
  of the damaged checkpoint (both seen in CI, the second once in 12 runs
  here). The first is dropped always; the second only once a restore has
  failed; any other record is kept."""
  import logging  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  from raptor_jax.train import checkpoint  # pylint: disable=g-import-not-at-top

  for name in ("excepthook", "unraisablehook"):
    monkeypatch.setattr(sys, name, getattr(sys, name))
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  logger = logging.getLogger("asyncio")
  monkeypatch.setattr(logger, "filters", list(logger.filters))
  monkeypatch.setattr(checkpoint, "_QUIET", False)  # installed afresh
  monkeypatch.setattr(checkpoint, "_RESTORING", False)

  def unretrieved(kind, exc):
    try:
      raise exc
    except Exception as e:  # pylint: disable=broad-except
      exc_info = (type(e), e, e.__traceback__)
    logger.error(
        "%s exception was never retrieved\n%s: <%s finished exception=%r>",
        kind,
        kind.lower(),
        kind,
        exc,
        exc_info=exc_info,
    )

  def failing_restore():
    with checkpoint._reading(  # pylint: disable=protected-access
        lambda error: ValueError(f"damaged: {error}")
    ):
      raise ValueError("bad read")

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    with checkpoint._reading(ValueError):  # pylint: disable=protected-access
      pass  # a restore that succeeds: other errors are shown after it
    unretrieved("Future", RuntimeError("Event loop is closed"))
    unretrieved("Future", RuntimeError("disk on fire"))
    unretrieved("Task", ValueError("OUT_OF_RANGE: a read"))
    assert [str(r.exc_info[1]) for r in caplog.records] == [
        "disk on fire",
        "OUT_OF_RANGE: a read",
    ]
    caplog.clear()
    with pytest.raises(ValueError, match="^damaged: bad read$"):
      failing_restore()
    unretrieved("Future", RuntimeError("Event loop is closed"))
    unretrieved("Task", ValueError("OUT_OF_RANGE: another read"))
    assert not caplog.records
