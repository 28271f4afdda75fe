"""DeepSeek-MoE through the training loop: shared experts join the shared stream.

A micro DeepSeek-MoE (MLA, a dense block 0, a sparse block 1 with four routed
experts, top-2, and two shared experts). RAPTOR's shared stream holds
the attention adapters, the shared experts' adapters of every sparse block
and the head; its expert stream holds only the routed experts of l*.
`launch/main.py --config=configs/deepseek_sst2.py:tiny` (tests/test_launch.py)
runs the same end to end from the command line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import diagnostics, ownership, roles
from raptor_jax.models import deepseek
from raptor_jax.train import step, train_and_evaluate
from raptor_jax.train.run import build_run

from helpers import MICRO_FAMILIES, latest_state, micro_config, phase_functions, train_batch

DEEPSEEK = MICRO_FAMILIES["deepseek"]
LAYER = 1  # l*: the sparse block
ADAPTERS = ("lora_a", "lora_b")


def _build(method):
  """The run `build_run` assembles, as the trainer does."""
  run = build_run(micro_config(method=method, **DEEPSEEK))
  assert run.backbone_config.sparse_layers == (LAYER,)
  assert run.plan.expert_layer == LAYER
  assert run.plan.model_options["shared_expert_lora"]
  return run


@pytest.fixture(scope="module")
def raptor_model():
  return _build("raptor")


def _adapters(*prefixes):
  return {
      f"backbone/{prefix}/{leaf}" for prefix in prefixes for leaf in ADAPTERS
  }


ATTENTION = [
    f"block_{i}/attention/{m}"
    for i in range(2)
    for m in ("q", "kv_a", "kv_b", "o")
]
SHARED_EXPERTS = [
    f"block_1/mlp/shared_experts/{m}" for m in ("gate", "up", "down")
]


@pytest.mark.slow
def test_shared_experts_join_the_shared_stream_and_only_routed_experts_have_owners(
    raptor_model,
):
  plan, trainable, frozen = (
      raptor_model.plan,
      raptor_model.trainable,
      raptor_model.frozen,
  )
  # No head bias: transformers' DeepseekV2ForSequenceClassification has none.
  assert set(trainable["shared"]) == _adapters(*ATTENTION, *SHARED_EXPERTS) | {
      "head/kernel",
  }
  assert set(trainable["expert"]) == _adapters(
      *[f"block_{LAYER}/mlp/experts/{m}" for m in ("gate", "up", "down")]
  )
  assert {roles.role_of(p) for p in trainable["shared"]} == {
      "attention_adapter",
      "shared_expert_adapter",
      "head",
  }
  shared_phase, expert_phase = plan.phases
  assert (
      shared_phase.parts[0].l2_clip == 1.0 and not shared_phase.parts[0].owner
  )  # C_s
  assert (
      expert_phase.parts[0].owner
      and expert_phase.parts[0].denominator == 50 / 4
  )  # B/E
  # Everything else stays frozen: routers, every kernel, the dense block's MLP.
  assert {roles.role_of(p) for p in frozen} == {
      "attention_kernel",
      "shared_expert_kernel",
      "expert_kernel",
      "router",
      "base",
  }
  assert "backbone/block_0/mlp/gate/kernel" in frozen


@pytest.mark.slow
def test_monolithic_lora_covers_shared_and_routed_experts():
  trainable = _build("monolithic_lora").trainable
  routed = [f"block_1/mlp/experts/{m}" for m in ("gate", "up", "down")]
  assert set(trainable["all"]) == _adapters(
      *ATTENTION, *SHARED_EXPERTS, *routed
  ) | {"head/kernel"}


@pytest.mark.slow
def test_each_stream_step_changes_only_its_own_parameters(raptor_model):
  """A shared step moves every shared-stream parameter (shared experts included) and no
  routed expert; an expert step moves l*'s routed adapters and no shared expert.
  """
  run = raptor_model
  run_data, owners, model, plan = run.data, run.owners, run.model, run.plan
  trainable, frozen = run.trainable, run.frozen
  rows = np.arange(6)
  batch = train_batch(run_data.train, rows, owners[rows])
  mask = jnp.ones((6,), jnp.float32)
  before = roles.flatten(step.merged_params(frozen, trainable))
  for phase in plan.phases:
    fns = phase_functions(model, phase, LAYER, 4)
    sums = fns.accumulate(
        trainable, frozen, fns.zero_sums(trainable), batch, mask
    )
    new, _ = fns.update(trainable, fns.init_opt_states(trainable), sums)
    after = roles.flatten(step.merged_params(frozen, new))
    moved = {
        p
        for p in before
        if not np.array_equal(np.asarray(before[p]), np.asarray(after[p]))
    }
    assert moved == set(trainable[phase.name]), phase.name
    if phase.name == "shared":
      assert any(roles.role_of(p) == "shared_expert_adapter" for p in moved)
    assert all(
        roles.role_of(p)
        != (
            "expert_adapter"
            if phase.name == "shared"
            else "shared_expert_adapter"
        )
        for p in moved
    )


def test_owner_rule_reads_group_limited_routed_gates():
  # The micro task's DeepSeek (4 experts, top-2), routing in 2 groups.
  sizes = micro_config(**MICRO_FAMILIES["deepseek"]).model.random
  config = deepseek.from_sizes(
      sizes, 50, topk_method="group_limited_greedy", n_group=2, topk_group=1
  ).config
  assert ownership.owner_rule(config, "count") == dict(
      top_k=2, weighting="prob", normalize=False, groups=(2, 1)
  )
  # Groups {0, 1} and {2, 3}. The first token's greedy top-2 is {0, 2}, but group {0, 1}
  # holds its best expert, so the model routes it to {0, 1}: expert 2 loses 0.33 votes.
  logits = jnp.log(
      jnp.array([[[0.36, 0.01, 0.33, 0.30], [0.01, 0.01, 0.45, 0.53]]])
  )
  limited = ownership.owners(
      logits, jnp.ones((1, 2)), **ownership.owner_rule(config, "count")
  )
  greedy = ownership.owners(logits, jnp.ones((1, 2)), 2, "prob")
  assert (int(limited[0]), int(greedy[0])) == (3, 2)


@pytest.fixture(scope="module")
def raptor_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("deepseek_raptor")
  config = micro_config(**DEEPSEEK)
  return config, workdir, train_and_evaluate(config, str(workdir))


@pytest.mark.slow
def test_raptor_trains_deepseek_end_to_end(raptor_run):
  _, workdir, results = raptor_run
  report = json.loads((workdir / "privacy_report.json").read_text())
  assert results["finished"] and report["epsilon"] <= report["target_epsilon"]
  assert report["epsilon"] > 0.99 * report["target_epsilon"]
  selection = json.loads((workdir / "layer_selection.json").read_text())
  assert [row["layer"] for row in selection["public_corpus"]] == [
      1
  ]  # sparse blocks only
  assert results["parameters_by_role"]["shared_expert_adapter"] > 0
  _, state, _ = latest_state(workdir)
  for part, role in (
      ("shared", "shared_expert_adapter"),
      ("expert", "expert_adapter"),
  ):
    moved = [
        np.abs(v).max()
        for p, v in roles.flatten(state["trainable"][part]).items()
        if roles.role_of(p) == role and p.endswith("lora_b")
    ]
    assert moved and min(moved) > 0, role


@pytest.mark.slow
def test_diagnostics_report_the_shared_expert_role(raptor_run):
  """M_role, its shares and the noise sensitivity have a `shared_expert` role of their own."""
  config, workdir, _ = raptor_run
  out = diagnostics.compute(config, workdir, max_records=32, draws=1)
  shares = out["role_mismatch"]["norm_share"]
  assert set(shares) == {"shared", "shared_expert", "head", "experts"}
  assert (
      shares["shared_expert"] > 0
      and out["role_mismatch"]["param_share"]["shared_expert"] > 0
  )
  assert "shared_expert" in out["noise_sensitivity"]["roles"]
