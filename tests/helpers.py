"""Shared test helpers: a seconds-scale training config and checkpoint reading."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config_module(name):
  spec = importlib.util.spec_from_file_location(
      name, ROOT / "configs" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def micro_config(**overrides):
  """The tiny preset shrunk to seconds: 300 records, B=50 -> 6 cycles per epoch.

  Overrides use dotted keys: micro_config(**{"privacy.epsilon": 1.0}).
  """
  config = load_config_module("switch_sst2").get_config("tiny")
  config.data.synthetic.n_train = 300
  config.data.synthetic.n_dev = 64
  config.data.n_pub = 128
  config.model.random.update(
      d_model=32, d_ff=32, num_heads=2, d_kv=8, num_layers=2
  )
  config.batch_size = 50
  config.microbatch_size = 32
  config.epochs = 1
  config.eval_batch_size = 64
  config.progress_bar = False
  config.checkpoint_every_cycles = 2
  config.privacy.secret_seed = (
      0  # reproducible Poisson samples and noise across runs
  )
  config.update_from_flattened_dict(overrides)
  return config


def micro_vl_config(**overrides):
  """The DeepSeek-VL2 :tiny preset (image task) shrunk to seconds."""
  config = load_config_module("deepseek_vl2_scienceqa").get_config("tiny")
  config.vision.n_train = 300
  config.vision.n_dev = 64
  config.vision.random.update(width=16, layers=1, heads=2, mlp_dim=32)
  config.model.random.update(d_model=32, d_ff=32, num_heads=2, d_kv=16)
  config.batch_size = 50
  config.microbatch_size = 32
  config.epochs = 1
  config.eval_batch_size = 64
  config.progress_bar = False
  config.checkpoint_every_cycles = 2
  config.privacy.secret_seed = 0
  config.update_from_flattened_dict(overrides)
  return config


def latest_state(workdir, step=None):
  """(step, state as numpy, meta) of a checkpoint (default: the latest), whatever
  devices wrote it."""
  manager = ocp.CheckpointManager(pathlib.Path(workdir) / "checkpoints")
  step = manager.latest_step() if step is None else step
  meta = manager.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
  )["meta"]
  manager.close()
  path = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree
  )
  state = checkpointer.restore(
      path, args=ocp.args.PyTreeRestore(restore_args=restore_args)
  )
  return step, state, meta


def micro_model(config=None):
  """(config, run_data, plan, classifier, params, backbone config) of a micro run,
  built by `build_run` as the trainer builds it, with l* = the last sparse block.
  """
  from raptor_jax.train import step  # pylint: disable=g-import-not-at-top
  from raptor_jax.train.run import build_run  # pylint: disable=g-import-not-at-top

  config = config or micro_config()
  run = build_run(_with_layer(config, "last"))
  params = step.merged_params(run.frozen, run.trainable)
  return config, run.data, run.plan, run.model, params, run.backbone_config


def _with_layer(config, layer):
  config = config.copy_and_resolve_references()
  config.raptor.layer = layer
  return config


def launch_main(tmp_path, config, *flags, fast_compile=False):
  """`launch/main.py` in a subprocess, as the README runs it; returns results.json.

  By default with XLA's default optimisation, as a user runs it;
  `fast_compile` keeps the suite's compile-fast flags (conftest.py), which
  change code generation, not results, and pay off only for short runs.
  """
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  if not fast_compile:
    env["XLA_FLAGS"] = ""
  proc = subprocess.run(
      [
          sys.executable,
          "launch/main.py",
          f"--config={config}",
          f"--workdir={tmp_path}",
          "--config.progress_bar=False",
          "--config.privacy.secret_seed=0",
          *flags,
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((tmp_path / "privacy_report.json").read_text())
  results = json.loads((tmp_path / "results.json").read_text())
  assert (
      report["finished"]
      and report["epsilon"] <= report["target_epsilon"] == 8.0
  )
  return results


def fresh_compiles(fn, *args, times=3):
  """`jax.jit(fn)(*args)` compiled afresh `times` times (host numpy outputs).

  Nothing is reused between the compiles: `jax.clear_caches()` drops the
  in-memory executables and the persistent compilation cache is off meanwhile,
  so each is a new XLA compile of the same program. XLA:CPU's YNNPACK reduce
  fusion miscompile (raptor_jax.xla_workarounds) read uninitialised memory,
  so its error changed from one compile to the next; one compile could pass.
  """
  outputs = []
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    for _ in range(times):
      jax.clear_caches()
      outputs.append(jax.tree.map(np.asarray, jax.jit(fn)(*args)))
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
  return outputs


def max_rel_err(got, want):
  """max |got - want| / max |want| over every leaf pair of two pytrees (inf on NaN)."""
  errs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b), initial=0.0) / max(
        np.max(np.abs(b), initial=0.0), 1e-30
    )
    errs.append(float(err) if np.isfinite(err) else float("inf"))
  return max(errs, default=0.0)


# The paper's three families; the decoder kit's others share OLMoE's modules,
# so the slow checks that are about a module's code run on these only.
PAPER_FAMILIES = ("switch", "olmoe", "deepseek")
# The micro task's model of each family (`micro_config(**MICRO_FAMILIES[f])`).
# OLMoE is wide enough (d_model 64, d_ff 128, E = 8) for XLA:CPU's YNNPACK
# fusion to take the expert products (raptor_jax.xla_workarounds); narrower
# layers stay below its cost model.
MICRO_FAMILIES = {
    "switch": {},
    "olmoe": {
        "model.random.family": "olmoe",
        "model.random.num_experts": 8,
        "model.random.top_k": 2,
        "model.random.num_kv_heads": 1,
        "model.random.d_model": 64,
        "model.random.d_ff": 128,
    },
    "deepseek": {
        "model.random.family": "deepseek",
        "model.random.num_experts": 4,
        "model.random.top_k": 2,
        "model.random.num_layers": 2,
        "model.random.first_k_dense": 1,
        "model.random.num_shared_experts": 2,
        "model.random.kv_lora_rank": 16,
    },
    # The decoder kit's other families: what differs from OLMoE's micro
    # model (per-head q/k norms; q/k/v bias and a gated shared expert;
    # always renormalised top-k).
    **{
        family: {
            "model.random.family": family,
            "model.random.num_experts": 4,
            "model.random.top_k": 2,
            "model.random.num_kv_heads": 2,
            "model.random.num_layers": 2,
        }
        for family in ("qwen3_moe", "qwen2_moe", "mixtral")
    },
}
