"""Trains with RAPTOR (or a baseline) per an ml_collections config.

python launch/main.py --config=configs/switch_sst2.py:tiny --workdir=/tmp/raptor_tiny

SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) checkpoint the last
completed cycle and exit with one line (status 128 + the signal's number);
rerunning the same command resumes (raptor_jax/train/preemption.py).

stderr is private operator output, like the workdir: its log lines carry
absl timestamps (how long cycles take depends on the realised Poisson sample
sizes), so keep it with the workdir and never publish it. What to publish is
launch/export.py's directory, which holds no timing.

python launch/main.py --help_config lists every config field with its default
and meaning, the config files with their presets, and the methods; --help
lists them briefly below.
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from raptor_jax import _validate, process  # pylint: disable=g-multiple-import

# First of all, before any library starts a thread: kept host memory and one
# XLA device per core (--cpu_devices), on CPU hosts (raptor_jax/process.py).
with _validate.errors_exit_in_one_line():
  process.setup(argv=sys.argv)

import difflib
import json
import logging
import os
import re
from pathlib import Path

# The record of a finished run's command (`_exit_if_finished`).
_COMMAND = "command.json"


def _flag_value(argv, name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _command(argv) -> dict:
  return dict(argv=list(argv[1:]), cwd=os.getcwd())


def _exit_if_finished(argv) -> None:
  """Rerunning the very command of a finished run: one line, at once.

  Before anything heavy is imported: the workdir's `command.json` (written
  when the run finished) names the same arguments and directory, its
  privacy report says finished, and its latest checkpoint is the last
  cycle. Anything else (another command that may name the same config)
  takes the full path, which checks the config and says the same.
  """
  workdir = _flag_value(argv[1:], "workdir")
  if not workdir or "--dry_run" in argv:
    return
  workdir = os.path.abspath(os.path.expanduser(workdir))
  try:
    with open(os.path.join(workdir, _COMMAND), encoding="utf-8") as f:
      if json.load(f) != _command(argv):
        return
    with open(
        os.path.join(workdir, "privacy_report.json"), encoding="utf-8"
    ) as f:
      report = json.load(f)
    steps = [
        int(name)
        for name in os.listdir(os.path.join(workdir, "checkpoints"))
        if name.isdigit()
    ]
  except (OSError, ValueError):
    return
  if not report.get("finished") or max(steps, default=-1) != report.get(
      "cycles"
  ):
    return
  print(
      f"already finished: {workdir} holds this command's finished run"
      f" ({report['cycles']} of {report.get('planned_cycles')} cycles);"
      f" results in {workdir}/results.json; export: python"
      f" {os.path.join(os.path.dirname(os.path.abspath(__file__)), 'export.py')}"
      f" --workdir={workdir} --out={workdir}_model"
  )
  sys.exit(0)


_exit_if_finished(sys.argv)

from absl import app, flags, logging as absl_logging  # pylint: disable=g-multiple-import

import jax
from raptor_jax import entry_flags
from raptor_jax.train import parallel, preemption, train_and_evaluate
from raptor_jax.train import workdir as workdir_lib
from raptor_jax.train.run import validate

_CONFIG, _WORKDIR = entry_flags.define_run_flags(
    "Training configuration file.",
    "Directory for checkpoints and reports; "
    "rerunning with the same workdir resumes.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    "",
    "Multi-host: host:port of " "process 0 (or JAX_COORDINATOR_ADDRESS).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    0,
    "Multi-host: number of processes " "(or JAX_NUM_PROCESSES).",
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", -1, "Multi-host: this process's id " "(or JAX_PROCESS_ID)."
)
_DIAGNOSTICS = flags.DEFINE_bool(
    "diagnostics",
    False,
    "After training, write the App. G "
    "diagnostics of the dev split to <workdir>/diagnostics.json.",
)
# Read from the command line by process.setup, before the imports.
flags.DEFINE_integer(
    "cpu_devices",
    0,
    "On CPU, split the host into this many XLA devices and the microbatches "
    "across them (0: one per core; 1: one device). See "
    "raptor_jax/host_devices.py; no effect on GPUs or TPUs.",
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Validate the config, check the workdir, load the data, calibrate the "
    "noise, print the run header and the resolved config, then exit without "
    "training or writing anything.",
)
flags.DEFINE_bool(
    "help_config",
    False,
    "Print every config field with its default and meaning, the config files"
    " with their presets, and the methods; then exit.",
)
flags.mark_flags_as_required(["config", "workdir"])

# ml_collections' "Did you mean" for an unknown config key.
_DID_YOU_MEAN = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"')


def _config_error(error: Exception, argv) -> str:
  """One line for a bad --config (an unknown key, a bad preset or value)."""
  text = str(error).replace("\\n", "\n").replace("\\'", "'")
  suggestion = _DID_YOU_MEAN.search(text)
  if suggestion:
    right, wrong = suggestion.groups()
    given = next(
        (a.split("=")[0] for a in argv if re.search(rf"\.{wrong}(=|$)", a)),
        f"--config...{wrong}",
    )
    return (
        f"{given}: no such config field; did you mean"
        f" {given[: -len(wrong)]}{right}?"
    )
  unknown = re.fullmatch(r"""["']*(\w+)["']*""", text.strip())
  if isinstance(error, (AttributeError, KeyError)) and unknown:
    given = next(
        (a.split("=")[0] for a in argv if a.split("=")[0].endswith(unknown[1])),
        unknown[1],
    )
    return (
        f"{given}: no such config field; --helpfull lists the flags, and"
        " the config file's docstring its fields"
    )
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  causes = [l for l in lines if re.match(r"\w*(Error|Exception): ", l)]
  line = (causes or lines or [type(error).__name__])[-1]
  return re.sub(r"^\w*(Error|Exception): ", "", line)


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")
_CONFIGS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "configs"
)


def _with_config_help(argv) -> None:
  """--help_config prints the config reference and exits; --help gets the
  short one (methods, presets, fields) after this module's docstring."""
  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import config_help

  if "--help_config" in argv[1:]:
    print(config_help.reference(_CONFIGS), end="")
    sys.exit(0)
  if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
    sys.modules["__main__"].__doc__ = (__doc__ or "") + config_help.summary(
        _CONFIGS
    )


def _check_config_file(argv) -> None:
  """A --config file that does not exist: ONE line listing the config files
  (ml_collections would print its loader's traceback, whatever else is set)."""
  given = next(
      (a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None
  )
  if given is None:
    return
  path = given.split(":", 1)[0]
  if os.path.isfile(path):
    return
  files = sorted(f for f in os.listdir(_CONFIGS) if f.endswith(".py"))
  close = difflib.get_close_matches(os.path.basename(path), files, n=1)
  hint = f"did you mean configs/{close[0]}? " if close else ""
  sys.exit(
      f"error: --config={path}: no such config file; {hint}the config files"
      f" are configs/{{{','.join(f[:-3] for f in files)}}}.py (run from the"
      " repository root, or give the file's path)"
  )


def _parse_flags(argv):
  """absl's flag parsing, with a bad --config as ONE line, not a traceback."""
  _with_config_help(argv)
  _check_config_file(argv)
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    if os.environ.get(_validate.TRACEBACK_VARIABLE):
      raise
    sys.exit(
        f"error: {_config_error(e, argv)}  ({_validate.TRACEBACK_VARIABLE}=1"
        " shows the traceback)"
    )


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax chatter
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  with _validate.errors_exit_in_one_line():
    parallel.initialize_distributed(
        _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    )
    # Data paths as typed and as resolved: config.json holds resolved ones,
    # so export and a resume work from any directory (workdir.PATHS_FILE).
    config, paths = workdir_lib.with_resolved_paths(
        _CONFIG.value, _WORKDIR.value
    )
    if paths and not _DRY_RUN.value and jax.process_index() == 0:
      validate(config)  # a bad config leaves no workdir behind
      os.makedirs(_WORKDIR.value, exist_ok=True)
      workdir_lib.store_paths(Path(_WORKDIR.value), paths)
    try:
      results = train_and_evaluate(
          config, _WORKDIR.value, dry_run=_DRY_RUN.value
      )
    except preemption.Stopped as stopped:  # SIGINT or SIGTERM, checkpointed
      print(stopped.one_line(), file=sys.stderr)
      sys.exit(128 + stopped.signum)
    if results.get("finished") and jax.process_index() == 0:
      Path(_WORKDIR.value, _COMMAND).write_text(json.dumps(_command(sys.argv)))
    if _DIAGNOSTICS.value:
      from raptor_jax import diagnostics  # pylint: disable=g-import-not-at-top

      diagnostics.write_for_run(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
