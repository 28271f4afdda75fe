"""The flags the training entry points share: --config, --workdir, --keep_host_memory.

`launch/main.py`, `launch/pretrain.py` and `launch/audit.py` define them with
`define_run_flags`, after `process.setup` (absl and ml_collections are the
`[train]` extra's). The flags belong to the calling entry point, as if it
defined them itself: its `--help` lists them.
"""

from absl import flags
from ml_collections import config_flags

from raptor_jax import host_memory

# The DEFINE calls below name their caller's module as the flags' owner.
flags.disclaim_key_flags()


def define_run_flags(
    config_help: str, workdir_help: str
) -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """Defines --config (a locked config file), --workdir and --keep_host_memory.

  Args:
    config_help: the help of --config (what the file configures).
    workdir_help: the help of --workdir (what the run keeps there).

  Returns:
    The --config and --workdir flag holders (--keep_host_memory is read from
    the command line by `process.setup`).
  """
  config = config_flags.DEFINE_config_file(
      "config", None, config_help, lock_config=True
  )
  workdir = flags.DEFINE_string("workdir", None, workdir_help)
  flags.DEFINE_bool("keep_host_memory", True, host_memory.FLAG_HELP)
  return config, workdir
