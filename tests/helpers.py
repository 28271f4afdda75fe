"""Shared test helpers: a seconds-scale training config and checkpoint reading.

Imports beyond jax and numpy (flax, orbax) stay inside the helpers that need
them: .ci/run runs the DP core's tests, this module included, in a venv with the
core dependencies only.
"""

import functools
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def row(fields, values, **own):
  """Config keywords: `fields` (space-separated names) paired with the tuple
  `values`, and the keywords `own` to this config alone."""
  return dict(zip(fields.split(), values, strict=True), **own)


def grid(fields, **rows):
  """{name: config keywords}: a table of configs, `fields` its columns, each
  keyword a row of values; a row may end with one dict more, the keywords of
  that row alone."""
  n = len(fields.split())
  return {name: row(fields, r[:n], **dict(*r[n:])) for name, r in rows.items()}


def raptor_kwargs(
    sigma_shared, sigma_expert, q, steps, steps_expert=None, **kw
):
  """`accounting.raptor_event`'s (or `raptor_epsilon`'s, with `delta=`)
  arguments: both streams sampled at rate q, `steps` long unless
  `steps_expert` says otherwise."""
  return dict(
      sigma_shared=sigma_shared,
      sigma_expert=sigma_expert,
      sample_rate=q,
      steps_shared=steps,
      steps_expert=steps if steps_expert is None else steps_expert,
      **kw,
  )


def load_config_module(name):
  spec = importlib.util.spec_from_file_location(
      name, ROOT / "configs" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# What shrinks a preset's run to seconds, in both micro configs.
_MICRO_BATCHES = {
    "batch_size": 50,
    "microbatch_size": 32,
    "eval_batch_size": 64,
    "progress_bar": False,
}
# One epoch, a checkpoint every 2 cycles, and reproducible Poisson samples and
# noise across runs.
_MICRO_RUN = {
    "epochs": 1,
    "checkpoint_every_cycles": 2,
    "privacy.secret_seed": 0,
}
# micro_config's overrides of switch_sst2:tiny but for _MICRO_RUN (dotted keys).
MICRO_SHRINK = {
    "data.synthetic.n_train": 300,
    "data.synthetic.n_dev": 64,
    "data.n_pub": 128,
    "model.random.d_model": 32,
    "model.random.d_ff": 32,
    "model.random.num_heads": 2,
    "model.random.d_kv": 8,
    "model.random.num_layers": 2,
    **_MICRO_BATCHES,
}


def config_flags(overrides):
  """Dotted-key overrides as `launch/*.py` command-line flags, in order."""
  return [f"--config.{key}={value}" for key, value in overrides.items()]


def micro_flags(**changes):
  """`micro_config`'s overrides of the tiny preset, updated by `changes`, as
  command-line flags."""
  return config_flags({**MICRO_SHRINK, **_MICRO_RUN, **changes})


def micro_config(**overrides):
  """The tiny preset shrunk to seconds: 300 records, B=50 -> 6 cycles per epoch.

  Overrides use dotted keys: micro_config(**{"privacy.epsilon": 1.0}).
  """
  config = load_config_module("switch_sst2").get_config("tiny")
  config.update_from_flattened_dict({**MICRO_SHRINK, **_MICRO_RUN})
  config.update_from_flattened_dict(overrides)
  return config


def micro_vl_config(**overrides):
  """The DeepSeek-VL2 :tiny preset (image task) shrunk to seconds."""
  config = load_config_module("deepseek_vl2_scienceqa").get_config("tiny")
  config.vision.n_train = 300
  config.vision.n_dev = 64
  config.vision.random.update(width=16, layers=1, heads=2, mlp_dim=32)
  config.model.random.update(d_model=32, d_ff=32, num_heads=2, d_kv=16)
  config.update_from_flattened_dict({**_MICRO_BATCHES, **_MICRO_RUN})
  config.update_from_flattened_dict(overrides)
  return config


def latest_state(workdir, step=None):
  """(step, state as numpy, meta) of a checkpoint (default: the latest), whatever
  devices wrote it."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

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


def finished_report(config, plan):
  """privacy_report of a run of `plan` that finished (its ledger holds every
  private phase's `plan.cycles` steps), built by hand: nothing trains."""
  # pylint: disable=g-import-not-at-top
  from raptor_jax.ledger import PrivacyLedger
  from raptor_jax.train import loop, outputs

  ledger = PrivacyLedger()
  for _ in range(plan.cycles):  # as the trainer accounts each cycle
    ledger = outputs.accounted(plan, ledger)
  run = types.SimpleNamespace(config=config, plan=plan, expert_layer=1, n=300)
  state = loop.TrainState({}, {}, ledger, plan.cycles)
  return outputs.privacy_report(run, state, dict(source="generated"))


def run_python(*args, env=None, timeout=600):
  """`python *args` in the repository root, as a user runs it there; the
  CompletedProcess with its output as text."""
  return subprocess.run(
      [sys.executable, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def launch_main(tmp_path, config, *flags, fast_compile=False):
  """`launch/main.py` in a subprocess, as the README runs it; returns results.json.

  By default with XLA's default optimisation, as a user runs it;
  `fast_compile` keeps the suite's compile-fast flags (conftest.py), which
  change code generation, not results, and pay off only for short runs.
  """
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  if not fast_compile:
    env["XLA_FLAGS"] = ""
  proc = run_python(
      "launch/main.py",
      f"--config={config}",
      f"--workdir={tmp_path}",
      "--config.progress_bar=False",
      "--config.privacy.secret_seed=0",
      *flags,
      env=env,
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


def lora_from_pretrained(path, **options):
  """`models.from_pretrained` with LoRA rank 2 (alpha 4) on every block's
  attention and on block 1's experts; `options` add to or replace these."""
  from raptor_jax import models  # pylint: disable=g-import-not-at-top

  lora = dict(
      lora_rank=2, lora_alpha=4.0, attention_lora=True, expert_lora_layers=(1,)
  )
  return models.from_pretrained(path, **{**lora, **options})


def assert_fused_and_base_layouts_load(hf_model, path, want, tmp_path, fused):
  """`hf_model` (a *ForCausalLM read from checkpoint `path`) saved in
  transformers v5's fused in-memory layout (tensor name `fused` among them)
  and as its base model (prefix-free names): `models.from_pretrained` reads
  `want` from both."""
  # pylint: disable=g-import-not-at-top
  import safetensors.torch
  from raptor_jax import models

  fused_dir = tmp_path / "fused"
  fused_dir.mkdir()
  shutil.copy(path / "config.json", fused_dir / "config.json")
  state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
  assert fused in state
  safetensors.torch.save_file(state, str(fused_dir / "model.safetensors"))
  hf_model.model.save_pretrained(tmp_path / "base")
  for layout in (fused_dir, tmp_path / "base"):
    _, got = models.from_pretrained(layout)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def probe_loss(hidden):
  """A loss with a non-trivial gradient (sum of squares is constant after RMS norm)."""
  weights = jax.random.normal(jax.random.PRNGKey(7), hidden.shape[-2:])
  return jnp.sum(jnp.tanh(hidden) * weights)


def set_nonzero_lora_b(params, key):
  """`params` with every LoRA B drawn at 0.3 N(0, 1) (they start at zero)."""
  import flax  # pylint: disable=import-outside-toplevel

  flat = flax.traverse_util.flatten_dict(params, sep="/")
  for i, path in enumerate(sorted(p for p in flat if p.endswith("lora_b"))):
    flat[path] = 0.3 * jax.random.normal(
        jax.random.fold_in(key, i), flat[path].shape
    )
  return flax.traverse_util.unflatten_dict(flat, sep="/")


# Tiny shapes: XLA's LLVM backend optimisation dominates the test time and
# buys nothing here, so skip it (HLO-level semantics are unchanged).
fast_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0}
)


def phase_functions(
    model, phase, expert_layer, num_experts, seed=0, residual="shared"
):
  """`step.PhaseFunctions` of one phase on one device, as the unit tests run
  it: learning rate 1e-2, residual_gamma 1, key PRNGKey(seed)."""
  from raptor_jax.train import parallel, step  # pylint: disable=g-import-not-at-top

  return step.PhaseFunctions(
      model,
      phase,
      mesh=parallel.make_mesh(1),
      expert_layer=expert_layer,
      num_experts=num_experts,
      learning_rate=1e-2,
      residual=residual,
      residual_gamma=1.0,
      key=jax.random.PRNGKey(seed),
  )


def train_batch(train, rows, owners):
  """The training records `rows` of `train` (run_data.train) as a device
  batch, each with its owner from `owners` [len(rows)]."""
  return jax.tree.map(
      jnp.asarray,
      dict(
          input_ids=train.input_ids[rows],
          attention_mask=train.attention_mask[rows],
          labels=train.labels[rows],
          owners=owners,
      ),
  )


def vmapped_owner_grads(module, params, ids, mask):
  """`probe_loss` of every (record, owner) pair, record-major, under one vmap
  as the trainer runs them: each pair's loss with `owner` overriding block 1's
  routing, and its gradient with respect to that owner's slice of block 1's
  expert adapters. Returns (values [R * E], grads {gate, up, down}: {lora_a,
  lora_b} [R * E, ...])."""
  from raptor_jax import models  # pylint: disable=g-import-not-at-top

  num_experts = module.config.num_experts
  experts = params["block_1"]["mlp"]["experts"]
  lora = {
      m: {k: experts[m][k] for k in ("lora_a", "lora_b")}
      for m in ("gate", "up", "down")
  }

  def owner_value_and_grad(owner, x, m):
    def loss(s):
      override = models.OwnerOverride(1, owner, s)
      return probe_loss(
          module.apply(
              {"params": params}, x[None], m[None], owner_override=override
          ).hidden_states
      )

    return jax.value_and_grad(loss)(jax.tree.map(lambda p: p[owner], lora))

  rows = np.repeat(np.arange(len(ids)), num_experts)
  owners = np.tile(np.arange(num_experts, dtype=np.int32), len(ids))
  return fast_jit(jax.vmap(owner_value_and_grad))(
      jnp.asarray(owners), jnp.asarray(ids[rows]), jnp.asarray(mask[rows])
  )


def small_glue_on_files(tmp_path):
  """glue:preset=small on a random model, reading empty train and dev TSV
  files under `tmp_path`."""
  files = {}
  for name in ("train", "dev"):
    files[f"data.{name}_path"] = str(tmp_path / f"{name}.tsv")
    (tmp_path / f"{name}.tsv").write_text("sentence\tlabel\n")
  config = load_config_module("glue").get_config("preset=small")
  config.update_from_flattened_dict({"model.name": "random", **files})
  return config


def attention_inputs(batch=3, heads=2, seq=7, dim=5, seed=0):
  """(q, k, v, position bias, padding bias, probe) of attention with records
  of `seq`, 4 and 1 real tokens; `probe` weighs the output in a test loss."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q, k, v = (jax.random.normal(kk, (batch, heads, seq, dim)) for kk in keys[:3])
  position = jax.random.normal(keys[3], (1, heads, seq, seq))
  lengths = jnp.array([seq, 4, 1])[:batch]
  padding = jnp.where(
      jnp.arange(seq)[None, :] < lengths[:, None],
      0.0,
      jnp.finfo(jnp.float32).min,
  )[:, None, None, :]
  probe = jax.random.normal(keys[4], (batch, heads, seq, dim))
  return q, k, v, position, padding, probe


def expert_inputs(rng, num_experts, rows, records):
  """(x [records, rows, 5], experts, w [E, 5, 7], LoRA a [E, 5, 3] and
  b [E, 3, 7]) drawn from the numpy `rng`; expert E marks a dropped row (a
  capacity overflow), about one row in E + 1."""
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  x = normal(records, rows, 5)
  w = normal(num_experts, 5, 7)
  a = normal(num_experts, 5, 3)
  b = normal(num_experts, 3, 7)
  experts = jnp.asarray(
      rng.randint(0, num_experts + 1, (records, rows)), jnp.int32
  )
  return x, experts, w, a, b


# The paper's three families; the decoder kit's others share OLMoE's modules,
# so the slow checks that are about a module's code run on these only.
PAPER_FAMILIES = ("switch", "olmoe", "deepseek")
# The paper's families as their training tests size them: the micro task's
# widths, OLMoE and DeepSeek with E = 4.
SMALL_FAMILIES = {
    "switch": {},
    "olmoe": {
        "model.random.family": "olmoe",
        "model.random.num_experts": 4,
        "model.random.top_k": 2,
        "model.random.num_kv_heads": 1,
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
}
# The micro task's model of each family (`micro_config(**MICRO_FAMILIES[f])`).
# OLMoE is wide enough (d_model 64, d_ff 128, E = 8) for XLA:CPU's YNNPACK
# fusion to take the expert products (raptor_jax.xla_workarounds); narrower
# layers stay below its cost model.
MICRO_FAMILIES = {
    **SMALL_FAMILIES,
    "olmoe": {
        **SMALL_FAMILIES["olmoe"],
        "model.random.num_experts": 8,
        "model.random.d_model": 64,
        "model.random.d_ff": 128,
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


class compiled_names:
  """Names of the jitted functions compiled inside the block (from
  `jax.log_compiles`'s 'Compiling <name>' lines)."""

  def __enter__(self):
    self.names = []
    self.handler = logging.Handler()
    self.handler.emit = lambda record: self._seen(record.getMessage())
    self.logger = logging.getLogger("jax")
    self.logger.addHandler(self.handler)
    self.level = self.logger.level
    self.logger.setLevel(logging.WARNING)
    return self.names

  def _seen(self, message):
    match = re.match(r"Compiling (?:jit\()?([\w<>]+)", message)
    if match:
      self.names.append(match.group(1))

  def __exit__(self, *exc):
    self.logger.removeHandler(self.handler)
    self.logger.setLevel(self.level)


def tensorboard_events(path):
  """The events of a TensorBoard event file (TFRecord framing), read with
  tensorboardX's protocol buffers."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  data, events, at = pathlib.Path(path).read_bytes(), [], 0
  while at < len(data):
    size = int.from_bytes(data[at : at + 8], "little")
    events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + size]))
    at += 12 + size + 4
  return events
