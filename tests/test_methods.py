"""Methods, baselines and ablations: what each trains, clips and accounts (docs/method.md §2)."""

import dataclasses
import functools

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import accounting, calibration, ownership, roles, sampling
from raptor_jax.models import hf
from raptor_jax.train import methods, plans, setup, step

import helpers

SPARSE, LAYER, E = (
    (1, 3),
    3,
    4,
)  # four blocks: sparse blocks 1 and 3, four experts
N = 300  # micro_config's records: B = 50, q = 1/6, 6 cycles
TWO_BLOCKS = {
    "model.random.num_layers": 2
}  # sparse block 1 only: the cheapest to compile
ABLATIONS = {
    "de_b": {"raptor.expert_denominator": "B"},
    "no_residual": {"raptor.residual": "none"},
    "no_alternation": {"raptor.alternate": False},
    "full_clip": {"raptor.joint_clip": True},
    "full_clip_one_sample": {
        "raptor.joint_clip": True,
        "raptor.alternate": False,
    },
    "first_layer": {"raptor.layer": "first"},
}


def micro_config(**overrides):
  """The shared micro config with four blocks (two sparse) unless overridden."""
  return helpers.micro_config(**{"model.random.num_layers": 4, **overrides})


@pytest.fixture(autouse=True, scope="module")
def _cached_calibration():
  """Calibration is a pure function of its arguments; compute each one once."""
  patch = pytest.MonkeyPatch()
  for name in ("calibrate_dpsgd", "calibrate_raptor"):
    patch.setattr(
        calibration, name, functools.cache(getattr(calibration, name))
    )
  yield
  patch.undo()


def _build_plan(config, layer=LAYER, **options):
  """`methods.build_plan` of the micro model (N records, E experts)."""
  return methods.build_plan(
      config,
      n=N,
      num_experts=E,
      sparse_layers=SPARSE,
      expert_layer=layer,
      **options,
  )


def _plan(method="raptor", layer=LAYER, **overrides):
  return _build_plan(micro_config(method=method, **overrides), layer)


def _micro_sigmas(plan, **options):
  """RAPTOR's (sigma_shared, sigma_expert) at epsilon 8 and rho 0.9 over the
  micro run's 6 cycles, as `calibration` finds them."""
  return calibration.calibrate_raptor(
      target_epsilon=8.0,
      delta=plan.delta,
      sample_rate=plan.sample_rate,
      steps=6,
      rho=0.9,
      **options,
  )


def _epsilon(plan):
  return accounting.epsilon(plan.event(), plan.delta)


# -- plans and accounting ---------------------------------------------------------


@pytest.mark.parametrize(
    "method,overrides",
    [(m, {}) for m in methods.METHODS]
    + [("raptor", o) for o in ABLATIONS.values()],
)
def test_given_noise_rebuilds_the_calibrated_plan(method, overrides):
  """build_plan(noise=...) (the planner's reverse mode) with the names of
  noise_fields and the calibrated sigmas gives the same phases and event."""
  config = micro_config(method=method, **overrides)
  calibrated = _plan(method, **overrides)
  fields = methods.noise_fields(config)
  summary = plans.noise_summary(calibrated)
  if method not in methods.PRIVATE_METHODS:
    assert fields == ()
    return
  if fields == ("sigma",):
    (sigma,) = {p["noise_multiplier"] for p in summary.values()}
    noise = {"sigma": sigma}
  else:
    assert fields == ("sigma_shared", "sigma_expert")
    noise = {f"sigma_{k}": summary[k]["noise_multiplier"] for k in summary}
  given = _build_plan(config, noise=noise)
  assert given.phases == calibrated.phases and given.target_epsilon is None
  with pytest.raises(ValueError, match=f"^{fields[0]}: needed by method"):
    _build_plan(config, noise={})


@pytest.mark.parametrize(
    "method,overrides",
    [(m, {}) for m in methods.PRIVATE_METHODS]
    + [("raptor", o) for o in ABLATIONS.values()],
)
def test_every_private_method_is_calibrated_to_the_same_budget(
    method, overrides
):
  plan = _plan(method, **overrides)
  reference = _plan()
  assert (plan.cycles, plan.sample_rate, plan.delta) == (
      reference.cycles,
      reference.sample_rate,
      reference.delta,
  )
  assert plan.cycles == 6 and plan.delta == accounting.default_delta(N)
  target = plan.target_epsilon
  assert target == 8.0
  assert (
      (1 - accounting.CALIBRATION_RTOL) * target - 1e-9
      <= _epsilon(plan)
      <= target
  )
  # Every phase is one Poisson-sampled Gaussian per cycle, on its own stream.
  streams = [phase.stream for phase in plan.phases]
  assert len(set(streams)) == len(streams)
  assert all(phase.private for phase in plan.phases)


@pytest.mark.parametrize("method", ["nonprivate_lora", "nonprivate_full"])
def test_nonprivate_methods_have_no_epsilon(method):
  plan = _plan(method)
  assert (
      plan.event() is None
      and plan.target_epsilon is None
      and not plans.is_private(plan)
  )
  (phase,) = plan.phases
  assert not phase.private and phase.parts[0].noise_multiplier == 0.0


def test_raptor_alternates_two_independent_streams():
  plan = _plan()
  shared_phase, expert_phase = plan.phases
  assert (shared_phase.stream, expert_phase.stream) == (
      sampling.SHARED_STREAM,
      sampling.EXPERT_STREAM,
  )
  (shared,), (expert,) = shared_phase.parts, expert_phase.parts
  assert shared.roles == ("attention_adapter", "shared_expert_adapter", "head")
  assert shared.blocks is None
  assert not shared.owner and shared.denominator == 50 and not shared.residual
  assert expert.roles == ("expert_adapter",) and expert.blocks == (LAYER,)
  assert expert.owner and expert.denominator == 50 / E and expert.residual
  s_sh, s_ex = _micro_sigmas(plan)
  assert (shared.noise_multiplier, expert.noise_multiplier) == (s_sh, s_ex)
  assert plan.event() == accounting.raptor_event(
      sigma_shared=s_sh,
      sigma_expert=s_ex,
      sample_rate=plan.sample_rate,
      steps_shared=6,
      steps_expert=6,
  )


def test_no_alternation_is_one_gaussian_with_sigma_eff():
  plan = _plan(**ABLATIONS["no_alternation"])
  (phase,) = plan.phases
  shared, expert = phase.parts
  assert not phase.joint_clip and expert.owner and expert.denominator == 50 / E
  s_sh, s_ex = _micro_sigmas(plan, joint=True)
  assert (shared.noise_multiplier, expert.noise_multiplier) == (s_sh, s_ex)
  sigma_eff = (s_sh**-2 + s_ex**-2) ** -0.5
  assert phase.noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)
  (event,) = plan.event().events
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          plan.sample_rate,
          dp_accounting.GaussianDpEvent(phase.noise_multiplier),
      ),
      6,
  )
  # Accounting this one-sample run as two independently sampled streams (the
  # reference code's shortcut) would understate its epsilon.
  separate = accounting.raptor_epsilon(
      sigma_shared=s_sh,
      sigma_expert=s_ex,
      sample_rate=plan.sample_rate,
      steps_shared=6,
      steps_expert=6,
      delta=plan.delta,
  )
  assert separate < 0.99 * _epsilon(plan)


def test_full_model_clip_is_raptors_plan_and_accounting_with_one_c():
  """The one-change ablation: RAPTOR's phases, sigmas and event with C_s = C_e = C."""
  plan = _plan(**ABLATIONS["full_clip"], **{"privacy.clip_expert": 5.0})
  reference = _plan(**{"privacy.clip_shared": 1.0, "privacy.clip_expert": 1.0})
  shared_phase, expert_phase = plan.phases
  assert shared_phase.joint_clip and expert_phase.joint_clip
  assert shared_phase.clip_with == expert_phase.parts
  assert expert_phase.clip_with == shared_phase.parts
  assert shared_phase.parts[0].l2_clip == expert_phase.parts[0].l2_clip == 1.0
  assert [
      dataclasses.replace(phase, joint_clip=False, clip_with=())
      for phase in plan.phases
  ] == list(reference.phases)
  assert plan.event() == reference.event()
  assert plan.parts == reference.parts  # clip_with parts are not released twice


def test_phase_clip_with_needs_a_joint_clip():
  part = _plan().phases[0].parts[0]
  with pytest.raises(ValueError, match="joint_clip=True"):
    plans.Phase("shared", 0, (part,), clip_with=(part,))


def test_a_joint_clip_over_parts_of_unequal_clip_or_sigma_is_refused():
  """A joint clip is one mechanism of sensitivity C accounted with one sigma:
  a part with a smaller sigma * C would be noised below its sensitivity."""
  shared, expert = _plan(**ABLATIONS["no_alternation"]).phases[0].parts
  assert shared.noise_multiplier != expert.noise_multiplier
  for other in (
      dataclasses.replace(expert, l2_clip=shared.l2_clip),  # sigmas differ
      dataclasses.replace(
          expert, noise_multiplier=shared.noise_multiplier, l2_clip=13.0
      ),
  ):
    with pytest.raises(ValueError, match="one Gaussian mechanism") as e:
      plans.Phase("joint", 0, (shared, other), joint_clip=True)
    assert "\n" not in str(e.value)
  # A clip_with part joins the clip norm: its l2_clip must agree too.
  with pytest.raises(ValueError, match="same l2_clip"):
    plans.Phase(
        "shared",
        0,
        (shared,),
        joint_clip=True,
        clip_with=(dataclasses.replace(expert, l2_clip=13.0),),
    )
  same = dataclasses.replace(
      expert, l2_clip=shared.l2_clip, noise_multiplier=shared.noise_multiplier
  )
  assert plans.Phase("joint", 0, (shared, same), joint_clip=True)


def test_a_plan_whose_phases_share_a_poisson_stream_is_refused():
  """The ledger composes phases as independent samples; one stream is one."""
  plan = _plan()
  assert [p.stream for p in plan.phases] == [
      sampling.SHARED_STREAM,
      sampling.EXPERT_STREAM,
  ]
  shared, expert = plan.phases
  same = dataclasses.replace(expert, stream=shared.stream)
  with pytest.raises(ValueError, match="share a Poisson stream") as e:
    dataclasses.replace(plan, phases=(shared, same))
  assert "\n" not in str(e.value)


def test_full_model_clip_one_sample_is_one_clip_and_one_sigma():
  """The older two-change variant: no alternation, one clip C_s, one sigma."""
  plan = _plan(
      **ABLATIONS["full_clip_one_sample"], **{"privacy.clip_expert": 5.0}
  )
  (phase,) = plan.phases
  shared, expert = phase.parts
  sigma = calibration.calibrate_dpsgd(
      target_epsilon=8.0,
      delta=plan.delta,
      sample_rate=plan.sample_rate,
      steps=6,
  )
  assert (
      phase.joint_clip and shared.l2_clip == expert.l2_clip == 1.0
  )  # C_s, not C_e
  assert (
      shared.noise_multiplier
      == expert.noise_multiplier
      == phase.noise_multiplier
      == sigma
  )
  assert expert.owner and expert.denominator == 50 / E and expert.residual


def test_denominator_and_residual_ablations_change_only_their_component():
  base = _plan().phases[1].parts[0]
  de_b = _plan(**ABLATIONS["de_b"]).phases[1].parts[0]
  no_res = _plan(**ABLATIONS["no_residual"]).phases[1].parts[0]
  assert de_b == dataclasses.replace(base, denominator=50.0)
  assert no_res == dataclasses.replace(base, residual=False)


def test_baseline_a_is_raptors_scope_with_one_clip_sigma_and_denominator():
  plan = _plan("baseline_a", **{"privacy.clip_expert": 5.0})
  (phase,) = plan.phases
  shared, expert = phase.parts
  assert phase.joint_clip
  assert shared.roles == ("attention_adapter", "shared_expert_adapter", "head")
  assert expert.roles == ("expert_adapter",) and expert.blocks == (LAYER,)
  assert (
      not expert.owner and not expert.residual
  )  # every expert of l*, plain loss
  assert shared.l2_clip == expert.l2_clip == 1.0
  assert shared.denominator == expert.denominator == 50.0
  assert (
      shared.noise_multiplier
      == expert.noise_multiplier
      == phase.noise_multiplier
  )
  assert plan.model_options["expert_lora_layers"] == (LAYER,)


def test_baselines_b_and_c_are_one_raptor_stream_with_the_whole_budget():
  raptor = _plan()
  (b,) = _plan("baseline_b").phases
  (c,) = _plan("baseline_c").phases
  sigma = calibration.calibrate_dpsgd(
      target_epsilon=8.0,
      delta=raptor.delta,
      sample_rate=raptor.sample_rate,
      steps=6,
  )
  assert b.parts == (
      dataclasses.replace(raptor.phases[0].parts[0], noise_multiplier=sigma),
  )
  assert c.parts == (
      dataclasses.replace(raptor.phases[1].parts[0], noise_multiplier=sigma),
  )
  assert (b.stream, c.stream) == (
      sampling.SHARED_STREAM,
      sampling.EXPERT_STREAM,
  )


def test_monolithic_variants():
  full = _plan("monolithic")
  (part,) = full.phases[0].parts
  assert set(part.roles) == set(roles.ROLES) - {
      "attention_adapter",
      "shared_expert_adapter",
      "expert_adapter",
  }
  assert part.blocks is None and not part.owner and part.denominator == 50.0
  assert (
      full.model_options["lora_rank"] == 0
      and full.model_options["dispatch"] == "dense"
  )
  lora = _plan("monolithic_lora", **{"raptor.shared_full_weights": True})
  assert lora.model_options[
      "attention_lora"
  ]  # RAPTOR's switches do not leak in
  assert lora.model_options["expert_lora_layers"] == SPARSE
  assert lora.phases[0].parts[0].roles == (
      "attention_adapter",
      "shared_expert_adapter",
      "head",
      "expert_adapter",
  )


def test_model_dispatch_comes_from_the_config_unless_expert_kernels_train():
  assert _plan("raptor").model_options["dispatch"] == "auto"
  forced = {"model.dispatch": "ragged"}
  assert _plan("raptor", **forced).model_options["dispatch"] == "ragged"
  assert (
      _plan("monolithic_lora", **forced).model_options["dispatch"] == "ragged"
  )
  assert _plan("monolithic", **forced).model_options["dispatch"] == "dense"
  with pytest.raises(
      ValueError,
      match=(
          r"^model.dispatch: must be one of 'auto', 'grouped', 'batched', "
          r"'ragged', 'tokamax', 'dense', got 'ragged_train'; set "
          r"--config.model.dispatch"
      ),
  ):
    methods.check_config(micro_config(**{"model.dispatch": "ragged_train"}))


def test_model_kernels_come_from_the_config_and_bad_values_get_one_line():
  assert _plan("raptor").model_options["kernels"] == "auto"
  for kind in ("fast", "reference"):
    plan = _plan("monolithic", **{"model.kernels": kind})
    assert plan.model_options["kernels"] == kind
  with pytest.raises(ValueError, match=r"^model.kernels: must be one of"):
    methods.check_config(micro_config(**{"model.kernels": "quick"}))


@pytest.mark.parametrize(
    "method,overrides,expected",
    [
        ("raptor", {}, True),
        ("raptor", {"raptor.shared_full_weights": True}, False),
        ("baseline_c", {}, True),
        ("monolithic_lora", {}, True),
        ("nonprivate_lora", {}, True),
        ("monolithic", {}, False),
    ],
)
def test_shared_expert_adapters_follow_the_shared_streams_lora(
    method, overrides, expected
):
  """Shared experts (DeepSeek-MoE) get adapters exactly when attention does."""
  config = micro_config(method=method, **overrides)
  plan = _build_plan(config, shared_experts=True)
  assert plan.model_options["shared_expert_lora"] is expected
  assert plan.model_options["attention_lora"] is expected
  assert "shared_expert_lora" not in _plan(method, **overrides).model_options


@pytest.mark.parametrize(
    "how,expected", [("first", 1), ("last", 3), ("1", 1), ("3", 3)]
)
def test_layer_choice(how, expected, micro_model):
  config = micro_config(**{"raptor.layer": how})
  run_data, backbone, params, _ = micro_model
  layer, _ = ownership.select_expert_layer(config, backbone, params, run_data)
  assert layer == expected
  plan = _build_plan(config, layer)
  assert plan.expert_layer == expected and plan.phases[1].parts[0].blocks == (
      expected,
  )
  assert plan.model_options["expert_lora_layers"] == (expected,)


# -- what each method trains, on the micro model -------------------------------------


def _model_builder(config):
  """(run_data, backbone, params, build): build(plan) -> (classifier, params), cached."""
  run_data = setup.load_run_data(config)
  backbone, params = setup.load_backbone(config, run_data)
  models = {}

  def build(plan):
    key = tuple(sorted(plan.model_options.items()))
    if key not in models:
      b, p = hf.with_options(backbone, params, **plan.model_options)
      models[key] = setup.classifier(b, p, 2, "mean", 0)
    return models[key]

  return run_data, backbone, params, build


@pytest.fixture(scope="module")
def micro_model():
  return _model_builder(micro_config())


@pytest.fixture(scope="module")
def two_block_model():
  return _model_builder(micro_config(**TWO_BLOCKS))


def _trainable_roles(method, micro_model):
  build = micro_model[-1]
  plan = _plan(method)
  _, params = build(plan)
  trainable, frozen = setup.partition(params, plan.parts)
  paths = {p for part in trainable.values() for p in part}
  scope = {
      (roles.role_of(p), block)
      for p in paths
      for block in (roles.blocks_of(p) or [None])
  }
  return scope, frozen, params


RAPTOR_SCOPE = (
    {("attention_adapter", b) for b in range(4)}
    | {("head", None)}
    | {("expert_adapter", LAYER)}
)
EXPECTED = {
    "raptor": RAPTOR_SCOPE,
    "baseline_a": RAPTOR_SCOPE,
    "baseline_b": RAPTOR_SCOPE - {("expert_adapter", LAYER)},
    "baseline_c": {("expert_adapter", LAYER)},
    "monolithic_lora": RAPTOR_SCOPE | {("expert_adapter", 1)},
    "nonprivate_lora": RAPTOR_SCOPE | {("expert_adapter", 1)},
}


@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_each_method_trains_exactly_its_roles(method, micro_model):
  trainable, frozen, _ = _trainable_roles(method, micro_model)
  assert trainable == EXPECTED[method]
  assert {roles.role_of(p) for p in frozen} >= {
      "router",
      "base",
  }  # routers never train


@pytest.mark.parametrize("method", ["monolithic", "nonprivate_full"])
def test_full_monolithic_trains_every_weight_routers_included(
    method, micro_model
):
  trainable, frozen, params = _trainable_roles(method, micro_model)
  assert (
      not frozen
  )  # nothing left frozen: embeddings, norms, routers, experts, head
  assert {role for role, _ in trainable} == {
      "attention_kernel",
      "head",
      "expert_kernel",
      "router",
      "base",
  }
  assert not any(
      p.endswith(("lora_a", "lora_b")) for p in roles.flatten(params)
  )


def _phase_functions(plan, model):
  return [
      helpers.phase_functions(model, phase, plan.expert_layer, E, i)
      for i, phase in enumerate(plan.phases)
  ]


def _norm(tree):
  return float(
      jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))
  )


CLIPS = {"privacy.clip_shared": 1e-4, "privacy.clip_expert": 2e-4}


@pytest.mark.parametrize(
    "method,overrides",
    [(m, {}) for m in methods.PRIVATE_METHODS]
    + [
        ("raptor", ABLATIONS["no_alternation"]),
        ("raptor", ABLATIONS["full_clip_one_sample"]),
    ],
)
def test_each_phase_clips_a_record_as_its_method_says(method, overrides):
  """One record with large gradients in every part: what norm does each part's sum get?"""
  plan = _plan(method, **overrides, **CLIPS)
  for phase in plan.phases:
    fns = helpers.phase_functions(None, phase, LAYER, E)
    per_record = {p.name: {"leaf": jnp.full((1, 3), 5.0)} for p in phase.parts}
    sums = fns._clip_and_sum(  # pylint: disable=protected-access
        per_record, jnp.ones((1,)), jnp.array([2])
    )
    for part in phase.parts:
      assert sums[part.name]["leaf"].shape == ((E, 3) if part.owner else (3,))
      if part.owner:  # everything in the owner's row
        assert (
            float(jnp.abs(sums[part.name]["leaf"][np.arange(E) != 2]).max())
            == 0.0
        )
    norms = {name: _norm(s) for name, s in sums.items()}
    if phase.joint_clip or len(phase.parts) == 1:
      # One clip over the record's whole gradient (monolithic: every trainable weight).
      assert _norm(sums) == pytest.approx(
          phase.parts[0].l2_clip, rel=1e-5
      ), norms
      # C_e for RAPTOR's expert stream on its own, else the one global C = C_s.
      expected = 2e-4 if not phase.joint_clip and phase.parts[0].owner else 1e-4
      assert {p.l2_clip for p in phase.parts} == {expected}
    else:  # separately clipped streams from one sample: C_s and C_e
      assert norms == pytest.approx(
          {p.name: p.l2_clip for p in phase.parts}, rel=1e-5
      )


def test_one_monolithic_update_moves_every_weight_routers_included(
    two_block_model,
):
  """Real gradients, one record, tiny clip: one clip bounds the whole gradient by C."""
  run_data, _, _, build = two_block_model
  config = micro_config(method="monolithic", **TWO_BLOCKS, **CLIPS)
  plan = methods.build_plan(
      config, n=N, num_experts=E, sparse_layers=(1,), expert_layer=1
  )
  model, params = build(plan)
  trainable, frozen = setup.partition(params, plan.parts)
  assert not frozen
  (fns,) = _phase_functions(plan, model)
  rows = np.zeros((4,), np.int64)
  batch = helpers.train_batch(run_data.train, rows, np.zeros((4,), np.int32))
  mask = jnp.array([1.0, 0.0, 0.0, 0.0])
  sums = fns.accumulate(
      trainable, frozen, fns.zero_sums(trainable), batch, mask
  )
  assert _norm(sums) == pytest.approx(1e-4, rel=1e-3)
  grad_roles = {
      roles.role_of(p)
      for p, g in sums["all"].items()
      if float(jnp.abs(g).max()) > 0
  }
  assert grad_roles == {
      "attention_kernel",
      "head",
      "expert_kernel",
      "router",
      "base",
  }
  new, _ = fns.update(trainable, fns.init_opt_states(trainable), sums)
  assert all(
      not np.array_equal(np.asarray(new["all"][p]), np.asarray(v))
      for p, v in trainable["all"].items()
  )


def _joint_clip_reference(model, flat, batch, mask, layer, clip):
  """Record by record: the joint (shared, w_i * owner-expert) gradient, clipped to C.

  Independent of the step: plain `model.apply` on the full tree (no owner
  override, no vmap), the expert gradient taken on the stacked [E, ...]
  leaves and its owner row kept, w_i from logits with l*'s expert LoRA B
  factors zeroed. Returns ({'shared': ..., 'expert': ...}, joint norms).
  """
  prefix = roles.expert_prefix(layer)
  ex_paths = [p for p in flat if p.startswith(prefix) and "lora" in p]
  sh_paths = roles.select(roles.unflatten(flat), roles.SHARED_ROLES, None)
  base = {p: v for p, v in flat.items() if p not in ex_paths + sh_paths}

  @jax.jit
  def one_record(sh, ex, ids, att, label):
    def loss(sh, ex):
      logits, _ = model.apply(
          {"params": roles.unflatten({**base, **sh, **ex})}, ids, att
      )
      return step.cross_entropy(logits[0], label)

    off = {p: v * (0.0 if p.endswith("lora_b") else 1.0) for p, v in ex.items()}
    logits, _ = model.apply(
        {"params": roles.unflatten({**base, **sh, **off})}, ids, att
    )
    return jax.grad(loss, argnums=(0, 1))(sh, ex), jax.nn.softmax(logits[0])

  sh = {p: flat[p] for p in sh_paths}
  ex = {p: flat[p] for p in ex_paths}
  out = {
      "shared": {p: [] for p in sh_paths},
      "expert": {p: [] for p in ex_paths},
  }
  norms = []
  for i in range(len(batch["labels"])):
    label, owner = batch["labels"][i], int(batch["owners"][i])
    (g_sh, g_ex), probs = one_record(
        sh,
        ex,
        batch["input_ids"][i : i + 1],
        batch["attention_mask"][i : i + 1],
        label,
    )
    g_ex = {p: (1.0 - probs[label]) * g[owner] for p, g in g_ex.items()}
    norms.append(_norm((g_sh, g_ex)))
    factor = float(mask[i]) * min(1.0, clip / norms[-1])
    for name, g in (("shared", g_sh), ("expert", g_ex)):
      for p, v in g.items():
        out[name][p].append(factor * np.asarray(v))
  return {
      name: {p: np.stack(v) for p, v in part.items()}
      for name, part in out.items()
  }, np.array(norms)


@pytest.mark.slow
def test_full_model_clip_step_equals_a_record_by_record_reference(
    two_block_model,
):
  """Each phase releases its own piece of the record's jointly clipped gradient."""
  run_data, _, _, build = two_block_model
  clip = 1e-3
  config = micro_config(
      **TWO_BLOCKS, **ABLATIONS["full_clip"], **{"privacy.clip_shared": clip}
  )
  plan = methods.build_plan(
      config, n=N, num_experts=E, sparse_layers=(1,), expert_layer=1
  )
  model, params = build(plan)
  # Non-zero LoRA B factors, so every adapter leaf has a gradient.
  flat = roles.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(flat))
  flat = {
      p: (0.3 * jax.random.normal(k, v.shape) if p.endswith("lora_b") else v)
      for (p, v), k in zip(flat.items(), keys)
  }
  rows = np.array([0, 1, 2, 3])
  ids = jnp.asarray(run_data.train.input_ids[rows])
  attention = jnp.asarray(run_data.train.attention_mask[rows])
  # Each record's owner from its own routing at l* (Eq. 5, as the trainer's
  # owner map): a fixed owner that none of a record's tokens reach gives
  # that record an expert gradient of exactly 0, whatever the step.
  (router_logits,) = model.apply(
      {"params": roles.unflatten(flat)}, ids, attention
  )[1].router_logits
  batch = dict(
      input_ids=ids,
      attention_mask=attention,
      labels=jnp.asarray(run_data.train.labels[rows]),
      owners=ownership.owners(router_logits, attention),
  )
  mask = jnp.array([1.0, 1.0, 1.0, 0.0])
  expected, norms = _joint_clip_reference(model, flat, batch, mask, 1, clip)
  assert (norms[:3] > clip).all()  # every real record is clipped
  trainable, frozen = setup.partition(roles.unflatten(flat), plan.parts)
  pieces = []
  for phase, fns in zip(plan.phases, _phase_functions(plan, model)):
    released = jax.jit(fns.released_per_record)(trainable, frozen, batch, mask)
    (part,) = phase.parts
    assert set(released) == {part.name}
    assert set(released[part.name]) == set(expected[part.name])
    for path, value in released[part.name].items():
      np.testing.assert_allclose(
          value, expected[part.name][path], rtol=2e-4, atol=1e-9
      )
    pieces.append(
        [
            _norm({p: v[i] for p, v in released[part.name].items()})
            for i in range(4)
        ]
    )
  shared_piece, expert_piece = np.array(pieces)
  # The two released pieces of a clipped record make up one vector of norm C.
  np.testing.assert_allclose(
      np.hypot(shared_piece, expert_piece)[:3], clip, rtol=1e-4
  )
  assert (expert_piece[:3] > 0).all() and shared_piece[3] == expert_piece[
      3
  ] == 0


def test_shared_only_residual_refuses_full_weight_experts(two_block_model):
  """Zeroing LoRA B cannot switch a full-weight expert off: refuse, never mislabel."""
  with pytest.raises(ValueError, match="raptor.expert_full_weights"):
    _plan(**{"raptor.expert_full_weights": True})
  _plan(**{"raptor.expert_full_weights": True, "raptor.residual": "full"})
  run_data, _, _, build = two_block_model
  plan = methods.build_plan(
      micro_config(**TWO_BLOCKS),
      n=N,
      num_experts=E,
      sparse_layers=(1,),
      expert_layer=1,
  )
  model, params = build(plan)
  (fns,) = _phase_functions(plan, model)[1:]
  # l*'s experts without adapters, as with raptor.expert_full_weights=True.
  prefix = roles.expert_prefix(1)
  full_weight = {
      p: v
      for p, v in roles.flatten(params).items()
      if not (p.startswith(prefix) and "lora" in p)
  }
  batch = dict(
      input_ids=jnp.asarray(run_data.train.input_ids[:2]),
      attention_mask=jnp.asarray(run_data.train.attention_mask[:2]),
      labels=jnp.asarray(run_data.train.labels[:2]),
  )
  with pytest.raises(ValueError, match="residual='full' or 'none'"):
    fns._residual_weights(full_weight, batch)  # pylint: disable=protected-access
