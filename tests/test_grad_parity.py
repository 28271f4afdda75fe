"""Gradient parity with PyTorch for every family, and per-record gradients.

test_switch.py, test_olmoe.py and test_deepseek.py check the forward passes
against Hugging Face; this file checks the backward passes. The reference is
PyTorch autodiff of the Hugging Face models themselves (transformers' own
modules in eval mode, eager attention, eager per-expert loops; DeepSeek with
plain attention is `DeepseekV2Model` with `LlamaAttention` swapped in, as in
test_deepseek.py, since transformers has no such variant). It shares no code
with raptor_jax: none of its custom VJPs, custom_vmap rules, optimisation
barriers or grouped expert dispatch. The reference runs in float64 (Hugging
Face still computes its RMS-norm statistics, the OLMoE router softmax and the
whole DeepSeek router in float32, a 1e-7 effect), so the tolerance measures
raptor_jax's float32 error, not torch's.

Both sides differentiate the same scalar, a fixed random projection of the
real (non-padding) tokens' final hidden states,
    loss = sum_{b, s, d} mask[b, s] * hidden[b, s, d] * R[b, s, d],
on a right-padded batch, with respect to every base parameter: the Flax side
is loaded with `dispatch='auto_train'` (expert kernels differentiable) and no
adapters, and `jax.grad` takes the whole tree, routers and the Switch position
bias included (frozen in fine-tuning, trained in pretraining). Torch's
gradients, keyed by transformers' parameter names, go through the family's
own checkpoint converter (`Family.params_from_hf`, a linear re-layout:
transposes, expert stacking, gate/up splits), which puts them in the Flax
layout; every Flax leaf must be covered, and every torch parameter with a
gradient must be one the loader reads (the Switch decoder and the lm_heads
are excluded by the family's ignored prefix; tied embeddings count once). Each tensor must satisfy ||g_jax - g_torch|| / ||g_torch|| <=
1e-4, for both kernel settings (`kernels='fast'`: custom VJPs and vmap rules;
`'reference'`: plain jnp and autodiff).

Per-record gradients (what DP training clips) are checked separately, on the
LoRA path DP training uses: adapters on attention and one sparse block's
experts (and DeepSeek's shared experts), frozen base weights,
`jax.vmap(jax.grad(...))` over a batch with padded records; 'fast' must equal
'reference' and a Python loop over single records.

`python -m tests.test_grad_parity [fast|reference|default ...]` prints the
parity table ('default': no `kernels=` option, the library's default).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import tempfile
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.switch_transformers import modeling_switch_transformers

from raptor_jax import models, roles

import hf_references
from raptor_jax.models import family as family_lib
from raptor_jax.models import hf as hf_lib
from raptor_jax.models import loading, moe

KERNELS = ("fast", "reference")
TOLERANCE = 1e-4  # relative, per tensor: float32 raptor_jax vs float64 torch
# Relative, per record and leaf: float32 vs float32. Batched (vmap) and
# one-record GEMMs round differently, and how much depends on the CPU's
# kernels: on an AVX2-only AMD EPYC, DeepSeek's worst leaf (a one-token
# record's v/lora_a) differs by 2.4e-5 between the two, while each is within
# 1.7e-5 and 8e-6 of the same model in float64. On another such machine
# (2026-12-06) Switch's block_0 q/k adapters differed by 8e-5: the batched
# gradients were within 2.3e-5 of float64, the one-record program's within
# 8.2e-5. A record mixing into another would be off by order 1.
PER_RECORD_TOLERANCE = 2e-4
VOCAB, SEQ, BATCH, WIDTH = 50, 10, 4, 32  # WIDTH: every family's d_model
REAL_TOKENS = (SEQ, 7, 3, 1)  # right padding: records 1-3 are padded

# ---------------------------------------------------------------------------
# Tiny random Hugging Face models (the torch references) and their checkpoints.

_SWITCH = dict(
    hf_references.SWITCH_BASE,
    vocab_size=VOCAB,
    # Odd blocks sparse, blocks 1-4 scanned; 4 experts x 2 < 10 tokens: every
    # full record drops.
    **hf_references.row(
        hf_references.SWITCH_FIELDS, (WIDTH, 8, 4, 24, 6, 4, 2, 3)
    ),
)
# top-2 renormalised, grouped-query attention, clip_qkv 2; initializer_range
# 0.2 (DECODER_BASE): decisive routing, visible attention and experts
_OLMOE = dict(
    hf_references.OLMOE_BASE,
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    num_hidden_layers=3,
    **hf_references.OLMOE_CONFIGS["e8k2_norm_clip"],
)
# DeepSeek's sizes of tests/hf_references.py, 4 blocks.
_DEEPSEEK = dict(
    hf_references.DEEPSEEK_BASE,
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    num_hidden_layers=4,
)
# 8 experts, top-2, block 0 dense, blocks 1-3 sparse, q_lora, 2 shared
# experts, 2 groups.
_DEEPSEEK_MLA = dict(
    _DEEPSEEK,
    **hf_references.row(hf_references.DEEPSEEK_FIELDS, (8, 2, 12, 1, 2, False)),
    **hf_references.group_limited(2, 1, routed_scaling_factor=2.5),
)
# Plain attention: no MLA sizes (DeepSeek's `use_mla: false`), 1 shared
# expert, 4 groups.
_DEEPSEEK_MHA = dict(
    {k: v for k, v in _DEEPSEEK.items() if k not in hf_references.MLA_SIZES},
    **hf_references.row(
        hf_references.DEEPSEEK_FIELDS, (8, 2, None, 1, 1, False)
    ),
    **hf_references.group_limited(4, 2),
)
_MHA_KV_HEADS = 2  # grouped-query plain attention


@dataclasses.dataclass(frozen=True)
class Reference:
  """A saved checkpoint and the float64 torch model that wrote it."""

  path: pathlib.Path
  model: torch.nn.Module
  # (model, input_ids, attention_mask) -> final hidden states [B, S, D]
  hidden: Callable[..., torch.Tensor]


def _float64_eval(model):
  """The model in float64, eval mode (no dropout or router jitter), eager."""
  model.set_attn_implementation("eager")
  model.set_experts_implementation("eager")
  model = model.double().eval()
  for module in model.modules():
    # The Switch router casts itself to `router_dtype` (float32) every call.
    if isinstance(
        module, modeling_switch_transformers.SwitchTransformersTop1Router
    ):
      module.dtype = torch.float64
  return model


def _switch(path, seed):
  torch.manual_seed(seed)
  model = transformers.SwitchTransformersForConditionalGeneration(
      transformers.SwitchTransformersConfig(**_SWITCH)
  )
  model.save_pretrained(path)
  return Reference(
      path,
      _float64_eval(model),
      lambda m, ids, mask: m.encoder(
          input_ids=ids, attention_mask=mask
      ).last_hidden_state,
  )


def _decoder_hidden(m, ids, mask):
  return m.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _olmoe(path, seed):
  torch.manual_seed(seed)
  model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**_OLMOE))
  model.save_pretrained(path)
  return Reference(path, _float64_eval(model), _decoder_hidden)


def _deepseek_mla(path, seed):
  torch.manual_seed(seed)
  model = transformers.DeepseekV2ForCausalLM(
      transformers.DeepseekV2Config(**_DEEPSEEK_MLA)
  )
  model.save_pretrained(path)
  return Reference(path, _float64_eval(model), _decoder_hidden)


def _deepseek_mha(path, seed):
  """DeepSeek-MoE with `LlamaAttention` (DeepSeek's `use_mla: false`), saved as
  DeepSeek's code would (q/k/v/o_proj, `use_mla: false`): test_deepseek.py's
  reference, with sizes of this file."""
  torch.manual_seed(seed)
  config = transformers.DeepseekV2Config(**_DEEPSEEK_MHA)
  model = hf_references.deepseek_with_llama_attention(config, _MHA_KV_HEADS)
  hf_references.write_deepseek_mha(path, model, config, _MHA_KV_HEADS)
  return Reference(
      path,
      _float64_eval(model),
      lambda m, ids, mask: m(
          input_ids=ids, attention_mask=mask
      ).last_hidden_state,
  )


def _kit(family, name):
  """A decoder-kit family's reference: tests/hf_references.py's config."""
  prefix, configs = hf_references.KIT_CONFIGS[family]

  def build(path, seed):
    torch.manual_seed(seed)
    config = hf_references.kit_hf_config(family, **configs[name])
    model = getattr(transformers, prefix + "ForCausalLM")(config)
    model.save_pretrained(path)
    return Reference(path, _float64_eval(model), _decoder_hidden)

  return build


BUILDERS = {
    "switch": _switch,  # capacity drops, dense and sparse blocks, position bias
    "olmoe": _olmoe,  # top-2 renormalised, GQA, q/k norms, clip_qkv
    "deepseek_mla": _deepseek_mla,  # MLA, q_lora, dense block, 2 shared, groups
    "deepseek_mha": _deepseek_mha,  # plain GQA attention, dense block, groups
    # per-head q/k norms, head_dim 12 (not 32 / 4), a dense third block
    "qwen3_moe": _kit("qwen3_moe", "e8k2_norm_dense2"),
    # q/k/v bias, a sigmoid-gated shared expert, a dense first block
    "qwen2_moe": _kit("qwen2_moe", "e4k2_norm_dense0"),
    # No sliding window here: in float64, transformers' eager attention
    # gives a padding query whose window holds only padding NaN, which the
    # next block's values carry into the real tokens (0 * NaN); the window
    # is checked by the forward parity (tests/test_backbones.py).
    "mixtral": _kit("mixtral", "e4k2"),
}


def build_references(root: pathlib.Path) -> dict[str, Reference]:
  return {
      name: build(root / name, seed)
      for seed, (name, build) in enumerate(BUILDERS.items())
  }


def batch(seed: int = 0):
  """(input_ids, attention_mask, R): a right-padded batch and the projection."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, VOCAB, (BATCH, SEQ))
  mask = (np.arange(SEQ)[None] < np.array(REAL_TOKENS)[:, None]).astype(
      np.int64
  )
  ids[mask == 0] = 0
  proj = rng.normal(size=(BATCH, SEQ, WIDTH)).astype(np.float32)
  return ids, mask, proj


# ---------------------------------------------------------------------------
# Gradients on both sides.


def load(path, kernels: str | None, **options):
  """`from_pretrained` with `kernels=` (None: the library's default)."""
  if kernels is not None:
    options["kernels"] = kernels
  return models.from_pretrained(path, **options)


def _family(path) -> family_lib.Family:
  return hf_lib.FAMILIES[loading.read_config(pathlib.Path(path))["model_type"]]


def _flat(tree) -> dict[str, np.ndarray]:
  return {
      p: np.asarray(v, np.float64)
      for p, v in flax.traverse_util.flatten_dict(
          flax.core.unfreeze(tree), sep="/"
      ).items()
  }


def flax_grads(
    path, kernels, ids, mask, proj, scan=True, dispatch="auto_train"
):
  """(loss, flat per-layer gradient of every parameter, router logits, config)."""
  module, params = load(path, kernels, dispatch=dispatch, scan_layers=scan)
  weights = jnp.asarray(mask[..., None] * proj, jnp.float32)

  def loss(p):
    out = module.apply({"params": p}, jnp.asarray(ids), jnp.asarray(mask))
    return jnp.sum(out.hidden_states * weights), out.router_logits

  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      params
  )
  grads = models.unstack_layers(grads, module.config)
  return float(value), _flat(grads), logits, module.config


def torch_grads(ref: Reference, config, ids, mask, proj):
  """(loss, torch's gradients in the Flax layout), via the family's converter.

  Every torch parameter outside the family's ignored prefix goes through the
  loader's own name table (which also reads transformers' in-memory layouts,
  e.g. fused experts). A parameter under the ignored prefix must have no
  gradient unless it is tied to a loaded one (Switch's decoder embedding is
  `shared.weight`), and the converter must carry all of the
  gradient over (a re-layout keeps the squared norm; tied tensors count
  once): nothing that trains in torch is silently skipped.
  """
  family = _family(ref.path)
  model = ref.model
  model.zero_grad(set_to_none=True)
  hidden = ref.hidden(model, torch.tensor(ids), torch.tensor(mask))
  weights = torch.tensor(mask[..., None] * proj, dtype=torch.float64)
  loss = torch.sum(hidden * weights)
  loss.backward()
  params = dict(model.named_parameters(remove_duplicate=False))
  read = [
      n
      for n in params
      if n.startswith(family.prefix) and not n.startswith(family.ignored_prefix)
  ]
  grad = lambda p: (
      np.zeros(p.shape) if p.grad is None else p.grad.detach().numpy()
  )
  loaded = {id(params[n]) for n in read}
  unloaded = [
      n for n, p in params.items() if id(p) not in loaded and np.any(grad(p))
  ]
  assert not unloaded, f"torch parameters with gradients not loaded: {unloaded}"
  tensors = {n: grad(params[n]) for n in read}
  converted = _flat(family.params_from_hf(tensors, config))
  unique = {id(params[n]): tensors[n] for n in read}  # tied tensors count once
  total = sum(np.sum(g**2) for g in unique.values())
  carried = sum(np.sum(g**2) for g in converted.values())
  assert abs(carried - total) <= 1e-12 * total, (carried, total)
  return float(loss.detach()), converted


def _rel(got, want, floor: float = 0.0) -> float:
  """||got - want|| / max(||want||, floor); 0 when both are exactly zero."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = np.linalg.norm(got - want)
  norm = max(np.linalg.norm(want), floor)
  if norm == 0:
    return 0.0 if diff == 0 else float("inf")
  return float(diff / norm)


@dataclasses.dataclass
class Parity:
  name: str
  kernels: str
  errors: dict[str, float]  # Flax path -> relative error
  torch_norms: dict[str, float]
  loss_error: float
  dropped: int  # real tokens dropped by capacity (Switch)

  @property
  def worst(self) -> tuple[str, float]:
    return max(self.errors.items(), key=lambda kv: kv[1])


def parity(
    ref: Reference,
    name: str,
    kernels: str | None,
    scan: bool = True,
    dispatch: str = "auto_train",
) -> Parity:
  """Every parameter's gradient in raptor_jax against torch's, per layer."""
  ids, mask, proj = batch()
  value, got, logits, config = flax_grads(
      ref.path, kernels, ids, mask, proj, scan, dispatch
  )
  want_value, want = torch_grads(ref, config, ids, mask, proj)
  assert set(got) == set(want), set(got) ^ set(want)
  for path in got:
    assert got[path].shape == want[path].shape, path
  dropped = 0
  if isinstance(config, models.SwitchConfig):
    for layer_logits in logits:
      routing = moe.route_top1(layer_logits, config.expert_capacity)
      is_dropped = np.asarray(routing.experts[..., 0]) == config.num_experts
      dropped += int(np.sum(is_dropped & (mask > 0)))
  return Parity(
      name,
      kernels or "default",
      {p: _rel(got[p], want[p]) for p in sorted(got)},
      {p: float(np.linalg.norm(want[p])) for p in sorted(want)},
      abs(value - want_value) / abs(want_value),
      dropped,
  )


def table(rows) -> str:
  """Per family and kernel setting: the worst tensor, and the worst router."""
  lines = [
      f"{'family':<14}{'kernels':<11}{'leaves':>7}{'worst rel err':>15}"
      f"  {'tensor':<53}{'routers':>9}"
  ]
  for row in rows:
    path, err = row.worst
    router = max(e for p, e in row.errors.items() if "/router/" in p)
    lines.append(
        f"{row.name:<14}{row.kernels:<11}{len(row.errors):>7}{err:>15.2e}"
        f"  {path:<53}{router:>9.2e}"
    )
  return "\n".join(lines)


# ---------------------------------------------------------------------------
# Tests.

_ROWS = []


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  refs = build_references(tmp_path_factory.mktemp("grad_parity"))
  yield refs
  if _ROWS:
    print("\ngradient parity with float64 torch:\n" + table(_ROWS))


# The kit's newer families run scanned with the CPU's dispatch only: their
# unrolled twin and the GPU's dispatch are the kit's, checked on OLMoE.
KIT_NEW = tuple(hf_references.KIT_CONFIGS)


@pytest.mark.parametrize(
    "name, kernels, scan",
    [
        pytest.param(n, k, s, id=f"{n}-{k}-{'scan' if s else 'unrolled'}")
        for n in BUILDERS
        for k in KERNELS
        for s in ((True,) if n in KIT_NEW else (True, False))
    ],
)
def test_every_parameter_gradient_matches_torch(
    references, name, kernels, scan
):
  row = parity(references[name], name, kernels, scan)
  _ROWS.append(row)
  path, err = row.worst
  print(f"{name} kernels={kernels} scan={scan}: worst {err:.2e} at {path}")
  assert row.loss_error < 1e-5  # the same function (forward parity)
  # Every parameter is exercised (routers and the position bias included).
  assert any("/router/" in p for p in row.errors)
  assert all(norm > 0 for norm in row.torch_norms.values()), row.torch_norms
  if name == "switch":
    assert row.dropped > 0  # capacity drops real tokens
    assert "block_0/attention/relative_attention_bias/embedding" in row.errors
  bad = {p: e for p, e in row.errors.items() if not e <= TOLERANCE}
  assert not bad, f"gradients differ from torch's beyond {TOLERANCE}: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BUILDERS if n not in KIT_NEW])
def test_gpu_default_dispatch_gradients_match_torch(references, name):
  """The GPU's default expert dispatch ('batched', no loop) differentiated
  in every parameter, expert kernels included, against torch."""
  row = parity(references[name], name, "fast", dispatch="batched_train")
  assert row.loss_error < 1e-5
  assert any("/experts/" in p for p in row.errors)
  bad = {p: e for p, e in row.errors.items() if not e <= TOLERANCE}
  assert not bad, f"gradients differ from torch's beyond {TOLERANCE}: {bad}"


# ---------------------------------------------------------------------------
# Per-record gradients of the adapters (the DP training path).


def _lora_options(path, dispatch="auto") -> dict[str, Any]:
  """Adapters on attention and the last sparse block's experts (and on
  DeepSeek's shared experts); base weights frozen, the default dispatch
  unless told. The blocks before it that are alike are one scanned segment."""
  family = _family(path)
  config = family.config_from_hf(loading.read_config(pathlib.Path(path)))
  options = dict(
      lora_rank=4,
      attention_lora=True,
      expert_lora_layers=(config.sparse_layers[-1],),
      dispatch=dispatch,
  )
  if "shared_expert_lora" in family.extra_options:
    options["shared_expert_lora"] = True
  return options


def per_record_setup(path, scan=True, dispatch="auto"):
  """(module with the adapters, adapter leaves, frozen leaves, records).

  B factors are set non-zero so that every A factor has a gradient; the
  records are a right-padded batch as in `batch`.
  """
  module, params = load(
      path, "fast", scan_layers=scan, **_lora_options(path, dispatch)
  )
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  key = jax.random.PRNGKey(3)
  for i, p in enumerate(sorted(p for p in flat if p.endswith("lora_b"))):
    flat[p] = 0.3 * jax.random.normal(jax.random.fold_in(key, i), flat[p].shape)
  adapters = {p: v for p, v in flat.items() if roles.is_adapter(p)}
  frozen = {p: v for p, v in flat.items() if not roles.is_adapter(p)}
  records = tuple(jnp.asarray(x) for x in batch(seed=1))
  return module, adapters, frozen, records


def record_grad(module):
  """The adapters' gradient of one record's loss (ids [S], mask [S], R [S, D])."""

  def loss(adapters, frozen, ids, mask, proj):
    tree = flax.traverse_util.unflatten_dict({**frozen, **adapters}, sep="/")
    out = module.apply({"params": tree}, ids[None], mask[None])
    return jnp.sum(out.hidden_states[0] * (mask[:, None] * proj))

  return jax.grad(loss)


def per_record_grads(module, adapters, frozen, records):
  """`jax.vmap` over the records: each leaf [B, ...]."""
  batched = jax.vmap(record_grad(module), in_axes=(None, None, 0, 0, 0))
  return jax.jit(batched)(adapters, frozen, *records)


def _per_layer(flat, config, leading=0):
  """Flat leaves of stacked segments split per layer (`leading` batch axes)."""
  unstack = lambda tree: models.unstack_layers(tree, config)
  for _ in range(leading):
    unstack = jax.vmap(unstack)
  tree = unstack(flax.traverse_util.unflatten_dict(flat, sep="/"))
  return flax.traverse_util.flatten_dict(tree, sep="/")


@pytest.mark.parametrize(
    "name, scan, dispatch",
    [pytest.param(n, True, "auto", id=f"{n}-scan") for n in BUILDERS]
    + [  # the unrolled twin (model.scan_layers=False): in the slow run
        pytest.param(
            n, False, "auto", marks=pytest.mark.slow, id=f"{n}-unrolled"
        )
        for n in BUILDERS
        if n not in KIT_NEW
    ]
    + [  # the GPU's 'auto'; tests/test_kernels.py checks it fast
        pytest.param(
            n, True, "batched", marks=pytest.mark.slow, id=f"{n}-scan-batched"
        )
        for n in BUILDERS
        if n not in KIT_NEW
    ],
)
def test_per_record_adapter_gradients_fast_equal_reference_and_a_loop(
    references, name, scan, dispatch
):
  """Compared per layer: a stacked leaf's error is its layers' worst."""
  module, adapters, frozen, records = per_record_setup(
      references[name].path, scan, dispatch
  )
  # The same model and parameters with the other kernels (no new adapters).
  reference = type(module)(
      dataclasses.replace(module.config, kernels="reference")
  )
  config = module.config
  fast = per_record_grads(module, adapters, frozen, records)
  want = per_record_grads(reference, adapters, frozen, records)
  single = jax.jit(record_grad(module))
  assert set(fast) == set(want) == set(adapters)
  assert any("/mlp/experts/" in p for p in fast)
  assert scan == any(len(roles.blocks_of(p)) > 1 for p in fast)  # stacked
  fast, want = _per_layer(fast, config, 1), _per_layer(want, config, 1)
  worst = {"reference": (0.0, ""), "loop": (0.0, "")}
  for row in range(BATCH):
    one = _per_layer(
        single(adapters, frozen, *(r[row] for r in records)), config
    )
    assert any(np.any(fast[p][row]) for p in fast)  # padded records train
    for p, g in fast.items():
      assert row or np.any(g[row]), p  # the full record trains every leaf
      # A leaf with (nearly) no gradient in this record, e.g. the keys of a
      # one-token record, is measured against the leaf's scale in the batch.
      floor = 1e-3 * np.linalg.norm(want[p]) / BATCH
      for against, other in (("reference", want[p][row]), ("loop", one[p])):
        err = _rel(g[row], other, floor)
        worst[against] = max(worst[against], (err, f"record {row} {p}"))
  print(f"{name} per-record: fast vs {worst}")
  for against, (err, where) in worst.items():
    assert err <= PER_RECORD_TOLERANCE, (against, where, err)


def main(argv: list[str]) -> None:
  """Prints the parity table; argv: kernel settings ('default': no option)."""
  settings = [None if k == "default" else k for k in (argv or KERNELS)]
  with tempfile.TemporaryDirectory() as root:
    refs = build_references(pathlib.Path(root))
    rows = [parity(refs[n], n, k) for n in refs for k in settings]
  print(table(rows))


if __name__ == "__main__":
  main(sys.argv[1:])
