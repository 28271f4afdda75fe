"""The controlled study's runs: every method on generated data, steps compiled once.

A cell of the study is (condition, method or ablation, epsilon, seed). Each
cell is built exactly as `run.build_run` builds a trainer run (frozen
pretrained backbone, public-corpus layer selection, `methods.build_plan`,
owner map, adapters and head seeded by `config.seed`), but from the
generator's data (`raptor_jax.studies.controlled_data`) instead of a task file, and
trained by `train`, which runs the trainer's cycle (`loop._train_cycle`'s
order: per phase one Poisson sample, fixed-size microbatches of clipped
sums, one noisy update) on the library's `step.PhaseFunctions`.

Why not `train_and_evaluate` per cell: it builds new jitted functions for
every run, i.e. one compilation per cell. Here `StepCache` keeps one
`PhaseFunctions` per (model, phase, optimiser settings) and reuses it for
every cell of the same shapes (conditions and seeds differ only in data and
initial values); each cell's noise key is put into the fresh optimiser
state (`_with_noise_keys`), which is exactly the state a `PhaseFunctions`
built with that key would start from. Checkpoints, resume and the privacy
ledger file are the trainer's business: a study cell is seconds, and an
interrupted cell is simply rerun.

Privacy. All data here is generated and public; the study's per-cell
samples and noise come from fixed seeds (`secrecy.cell_secret_seed`), which
is right for a reproducible experiment and wrong for a release. The owner
map is still computed from the frozen model only, and no update reads a
realised count.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import accounting, data, diagnostics, models, ownership
from raptor_jax import roles, sampling, transforms
from raptor_jax.models import hf
from raptor_jax.studies import controlled_data as gen
from raptor_jax.train import cycle, methods, metrics, parallel, plans, secrecy
from raptor_jax.train import setup, step
from raptor_jax.train.run import Run

# Seeds of the generated splits: train and the evaluation split are fixed;
# clip tuning uses its own held-out records and its own initialisation seed.
TRAIN_DATA_SEED, TUNE_DATA_SEED, DEV_DATA_SEED, PUBLIC_DATA_SEED = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Condition:
  """One point of the knobs: expert relevance and domain shares."""

  name: str
  relevance: float
  domain_shares: tuple[float, ...]


# The study's conditions (results/controlled/PROTOCOL.md): relevance levels
# x imbalance levels.
RELEVANCE = {"r0": 0.0, "r50": 0.5, "r100": 1.0}
IMBALANCE = {"bal": gen.BALANCED, "skew": gen.skewed_shares(0.75)}
CONDITIONS = tuple(
    Condition(f"{r}_{i}", rel, shares)
    for r, rel in RELEVANCE.items()
    for i, shares in IMBALANCE.items()
)


@dataclasses.dataclass(frozen=True)
class ConditionData:
  """A condition's tokenised splits (`setup.RunData`) and its generator truth."""

  run_data: setup.RunData
  train_domains: np.ndarray
  eval_domains: np.ndarray


def condition_data(
    config: ml_collections.ConfigDict,
    condition: Condition,
    tokenizer,
    *,
    eval_split: str,
) -> ConditionData:
  """Train records, the evaluation split ('dev' or 'tune') and the public corpus.

  The public corpus follows the condition's domain shares (what a user would
  route before training); none of its texts equals a record.
  """
  sc, ml = config.study, config.data.max_length
  kwargs = dict(
      relevance=condition.relevance,
      domain_shares=condition.domain_shares,
      label_noise=config.data.synthetic.label_noise,
  )
  train = gen.generate_records(TRAIN_DATA_SEED, sc.n_train, **kwargs)
  seed, size = (
      (DEV_DATA_SEED, sc.n_dev)
      if eval_split == "dev"
      else (TUNE_DATA_SEED, sc.n_tune)
  )
  held = gen.generate_records(seed, size, **kwargs)
  public = gen.generate_public_texts(
      PUBLIC_DATA_SEED,
      config.data.n_pub,
      domain_shares=condition.domain_shares,
      exclude=frozenset(train.texts) | frozenset(held.texts),
  )
  encode = functools.partial(data.encode, tokenizer, max_length=ml)
  run_data = setup.RunData(
      data.get_task("synthetic"),
      encode(train.texts, train.labels),
      encode(held.texts, held.labels),
      data.tokenize(tokenizer, public, max_length=ml),
      tokenizer,
      None,
  )
  return ConditionData(run_data, train.domains, held.domains)


@functools.lru_cache(maxsize=2)
def pretrained(model_dir: str):
  """(backbone, params, tokenizer) of the frozen pretrained model, loaded once."""
  backbone, params = models.from_pretrained(model_dir, dtype="float32")
  return backbone, params, data.load_tokenizer(model_dir)


def build(
    config: ml_collections.ConfigDict, cond: ConditionData, *, memo=None
) -> Run:
  """The cell's `Run`, assembled as `run.build_run` does, from `cond`.

  `memo` (a dict shared by the cells of a study) keeps what depends only
  on public inputs or on the frozen model: l* of each public corpus, the
  plan of each config (its noise calibration is a PLD bisection), and the
  owner map of each (train split, l*).
  """
  backbone, backbone_params, _ = pretrained(config.model.name)
  run_data = cond.run_data
  n = len(run_data.train)
  data.check_batch_size(config.batch_size, n)
  bc = backbone.config
  memo = {} if memo is None else memo
  layer_key = ("layer", _digest(run_data.public[0]), config.raptor.layer)
  if layer_key not in memo:  # public corpus only
    memo[layer_key] = ownership.select_expert_layer(
        config, backbone, backbone_params, run_data
    )
  expert_layer, table = memo[layer_key]
  # The plan is public and depends on the config, n and l* only; its noise
  # calibration (a PLD bisection) is the slow part, so it is kept.
  plan_key = ("plan", _plan_fields(config), n, expert_layer)
  if plan_key not in memo:
    memo[plan_key] = methods.build_plan(
        config,
        n=n,
        num_experts=bc.num_experts,
        sparse_layers=bc.sparse_layers,
        expert_layer=expert_layer,
        shared_experts=roles.has_shared_experts(backbone_params),
    )
  plan = memo[plan_key]
  key = ("owners", _digest(run_data.train.input_ids), expert_layer)
  if key not in memo:
    memo[key] = ownership.private_owner_map(
        config, backbone, backbone_params, run_data.train, expert_layer
    )
  owners = memo[key]
  pooling = config.model.pooling or setup.default_pooling(backbone)
  # The initial model depends on the options, the seed and the label count
  # only (never on data), so the cells of one seed share it: building it
  # traces the model twice, which costs more than a cached cell's training.
  model_key = (
      "model",
      config.model.name,
      repr(sorted(plan.model_options.items())),
      config.seed,
      config.model.dtype,
      run_data.task.num_labels,
      pooling,
  )
  if model_key not in memo:
    backbone, backbone_params = hf.with_options(
        backbone,
        backbone_params,
        seed=config.seed,
        dtype=config.model.dtype,
        **plan.model_options,
    )
    memo[model_key] = setup.classifier(
        backbone,
        backbone_params,
        run_data.task.num_labels,
        pooling,
        config.seed,
    )
  model, params = memo[model_key]
  trainable, frozen = setup.partition(params, plan.parts)
  return Run(
      config, run_data, n, plan, table, model, trainable, frozen, owners, bc
  )


def _digest(array: np.ndarray) -> str:
  """A content key of an array (ids of freed objects are reused)."""
  return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _plan_fields(config: ml_collections.ConfigDict) -> str:
  """Everything `methods.build_plan` reads from `config`, as a key."""
  return str(
      (
          config.method,
          config.batch_size,
          config.epochs,
          config.privacy.to_json(),
          config.raptor.to_json(),
          config.model.lora_rank,
          config.model.lora_alpha,
          config.model.get("dispatch"),
          config.model.get("kernels"),
      )
  )


class StepCache:
  """One `step.PhaseFunctions` per (model, phase, optimiser settings).

  Phases and models are frozen dataclasses (hashable, equal when their
  fields are), so two cells with the same method, clip and sigma share the
  compiled steps whatever their data, seed or condition.
  """

  def __init__(self):
    self._fns: dict[Any, step.PhaseFunctions] = {}
    self._eval: dict[Any, Any] = {}
    self.mesh = parallel.make_mesh(1)

  def phase_functions(self, run: Run) -> list[step.PhaseFunctions]:
    config = run.config
    out = []
    for phase in run.plan.phases:
      key = (
          run.model,
          phase,
          run.expert_layer,
          config.learning_rate,
          config.raptor.residual,
          config.raptor.residual_gamma,
      )
      if key not in self._fns:
        self._fns[key] = step.PhaseFunctions(
            run.model,
            phase,
            mesh=self.mesh,
            expert_layer=run.expert_layer,
            num_experts=run.num_experts,
            learning_rate=config.learning_rate,
            residual=config.raptor.residual,
            residual_gamma=config.raptor.residual_gamma,
            key=jax.random.PRNGKey(0),  # replaced per cell
        )
      out.append(self._fns[key])
    return out

  def eval_fn(self, model):
    if model not in self._eval:
      self._eval[model] = step.make_eval_fn(model)
    return self._eval[model]

  def statistics_fn(self, fns, expert_layer: int, num_experts: int):
    """The jitted `diagnostics.phase_statistics` of `fns`, compiled once."""
    key = ("stats", id(fns))
    if key not in self._eval:
      self._eval[key] = jax.jit(
          functools.partial(
              diagnostics.phase_statistics, fns, expert_layer, num_experts
          )
      )
    return self._eval[key]


def _with_noise_keys(opt_state: dict, phase: plans.Phase, key) -> dict:
  """`opt_state` with part i's noise key set to fold_in(key, i), as
  `PhaseFunctions(key=key)` would have initialised it."""
  out = dict(opt_state)
  for i, part in enumerate(phase.parts):
    part_key = transforms.fold_in(key, i)
    out[part.name] = jax.tree.map(
        lambda s: (
            s._replace(rng_key=part_key)
            if isinstance(s, transforms.DpAggregateState)
            else s
        ),
        opt_state[part.name],
        is_leaf=lambda s: isinstance(s, transforms.DpAggregateState),
    )
  return out


def train(run: Run, phase_fns, secret: bytes, mesh=None) -> dict:
  """Trains `run` for its plan's cycles; returns the final trainable parameters.

  The trainer's cycle (`train.cycle.train_cycle`) on a one-device mesh:
  every cycle runs each phase in order, its own Poisson sample, clipped
  sums over fixed-size microbatches, one noisy update. Samples and noise
  derive from `secret` (`secrecy.sampler_seed`, `secrecy.noise_key`) as in
  the trainer; the cached `phase_fns` get the cell's noise keys through
  their optimiser states (`_with_noise_keys`).
  """
  mesh = parallel.make_mesh(1) if mesh is None else mesh
  state, frozen = cycle.initial_state(run, phase_fns, mesh)
  opt_states = state.opt_states
  for i, phase in enumerate(run.plan.phases):
    opt_states = _with_noise_keys(
        opt_states, phase, secrecy.noise_key(secret, i)
    )
  state = dataclasses.replace(state, opt_states=opt_states)
  for _ in range(run.plan.cycles):
    state = cycle.train_cycle(run, phase_fns, mesh, state, frozen, secret)
  return state.trainable


def evaluate(cache: StepCache, run: Run, trainable) -> float:
  """Accuracy on the run's evaluation split (`run.data.dev`)."""
  dev = run.data.dev
  return metrics.evaluate(
      functools.partial(cache.eval_fn(run.model), trainable, run.frozen),
      dev.input_ids,
      dev.attention_mask,
      dev.labels,
      ("accuracy",),
      run.config.eval_batch_size,
  )["accuracy"]


def epsilon_spent(plan: plans.Plan) -> float | None:
  """Epsilon of the mechanism run: every planned release was made (None if
  non-private)."""
  event = plan.event()
  return None if event is None else accounting.epsilon(event, plan.delta)


def diagnose(
    cache: StepCache, run: Run, trainable, phase_fns, eval_owners
) -> dict[str, Any]:
  """App. G diagnostics of the trained cell on its (public, generated) dev split.

  lambda_+ per role (Eq. 40), M_role (Eq. 37) and the per-expert SNR of the
  part that trains l*'s experts (None for non-private methods and methods
  that do not train them), with the library's formulas in `diagnostics`.
  """
  config, sc = run.config, run.config.study
  n = min(sc.diagnostic_records, len(run.data.dev))
  dev = run.data.dev
  records = (dev.input_ids[:n], dev.attention_mask[:n], dev.labels[:n])
  param_counts = diagnostics.role_param_counts(trainable)
  _, sensitivity = diagnostics.sensitivities(
      config,
      run.model,
      trainable,
      run.frozen,
      records,
      noise_std=sc.sensitivity_std,
      draws=sc.sensitivity_draws,
      logits_fn=cache.eval_fn(run.model),
  )
  squared, signals = diagnostics.gradient_statistics(
      phase_fns,
      trainable,
      run.frozen,
      records,
      eval_owners[:n],
      expert_layer=run.expert_layer,
      num_experts=run.num_experts,
      microbatch_size=config.microbatch_size,
      statistics_fn=lambda fns: cache.statistics_fn(
          fns, run.expert_layer, run.num_experts
      ),
  )
  snr = None
  if plans.is_private(run.plan):
    snr = diagnostics.snr_of_plan(
        run.plan,
        signals,
        trainable,
        num_records=n,
        batch_size=float(config.batch_size),
        num_experts=run.num_experts,
    )
  lam = {r: v["lambda_plus"] for r, v in sensitivity.items()}
  return dict(
      lambda_e=lam.get("experts", 0.0),
      lambda_s=lam.get("shared", 0.0),
      delta_loss={r: v["delta_loss"] for r, v in sensitivity.items()},
      M_role=diagnostics.role_mismatch(squared, param_counts)["M_role"],
      snr=None if snr is None else snr["per_expert"],
  )


def run_cell(
    config: ml_collections.ConfigDict,
    cond: ConditionData,
    cache: StepCache,
    *,
    secret_key: str,
    memo: dict,
    eval_owners: np.ndarray | None = None,
    with_diagnostics: bool = True,
) -> dict[str, Any]:
  """Builds, trains and measures one cell; returns its row (public numbers)."""
  start = time.perf_counter()
  run = build(config, cond, memo=memo)
  phase_fns = cache.phase_functions(run)
  secret = secrecy.fixed_secret(secrecy.cell_secret_seed(0, secret_key))
  trainable = train(run, phase_fns, secret, cache.mesh)
  row = dict(
      accuracy=evaluate(cache, run, trainable),
      epsilon_spent=epsilon_spent(run.plan),
      expert_layer=run.expert_layer,
      noise=plans.noise_summary(run.plan),
  )
  if with_diagnostics:
    if eval_owners is None:
      backbone, params, _ = pretrained(config.model.name)
      eval_owners = ownership.private_owner_map(
          config, backbone, params, run.data.dev, run.expert_layer
      )
    row.update(diagnose(cache, run, trainable, phase_fns, eval_owners))
  row["seconds"] = time.perf_counter() - start
  return row


def owner_measurements(
    config: ml_collections.ConfigDict, cond: ConditionData, layer: int
) -> dict[str, Any]:
  """Owner purity per domain, owner shares and H/log E of the train records,
  and H/log E of the public corpus's owners (what a user can measure)."""
  backbone, params, _ = pretrained(config.model.name)
  owners = ownership.private_owner_map(
      config, backbone, params, cond.run_data.train, layer
  )
  E = backbone.config.num_experts
  ids, mask = cond.run_data.public
  public_owners = ownership.private_owner_map(
      config,
      backbone,
      params,
      data.TextClassificationData(ids, mask, np.zeros(len(ids), np.int32)),
      layer,
  )
  shares = gen.owner_shares(owners, E)
  return dict(
      purity=gen.owner_purity(cond.train_domains, owners).tolist(),
      owner_shares=shares.tolist(),
      owner_entropy=gen.normalized_entropy(shares),
      public_owner_entropy=gen.normalized_entropy(
          gen.owner_shares(public_owners, E)
      ),
  )
