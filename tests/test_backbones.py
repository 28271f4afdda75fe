"""Every family's backbone against its Hugging Face PyTorch model.

One parametrized set for Switch, DeepSeek-MoE and the decoder kit's
families (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral): forward parity
with transformers (hidden states and router logits, on padded batches), a
batch of one equal to its row of a larger batch, padding that changes no
real token, and the grouped expert dispatch equal to the dense one. Each
family's own tests (capacity, RoPE, MLA, LoRA, owners) stay in
tests/test_<family>.py; the references are tests/hf_references.py.

Every check runs twice: with the blocks scanned (`scan_layers=True`, the
default; `models.stack`) and with the unrolled twin (`scan_layers=False`); the
kit's newer families run scanned only (their unrolled twin is OLMoE's).

Padding: right padding everywhere. Decoders' eager mask is "causal AND key
not padding", so a padding query still attends to the real tokens before it
and its state is well defined; parity is checked on every position, padding
included.
"""

import ast
import dataclasses
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import models

import hf_references as refs


@dataclasses.dataclass(frozen=True)
class Spec:
  """How the tests reach one family's references."""

  configs: tuple[str, ...]
  save: Callable  # (dir, name) -> (checkpoint dir, reference)
  outputs: Callable  # (reference, ids, mask) -> (hidden, router logits)
  low: int = 1  # smallest token id of the test batches
  ragged: tuple[str, ...] = ()  # configs also checked with dispatch='ragged'
  batch_of_one: tuple[str, ...] = ()
  dispatch: tuple[str, ...] = ()  # configs of the grouped-equals-dense check


def _save_by_seed(configs, save):
  def save_named(path, name):
    return path, save(path, list(configs).index(name), **configs[name])

  return save_named


SPECS = {
    "switch": Spec(
        tuple(refs.SWITCH_CONFIGS),
        _save_by_seed(refs.SWITCH_CONFIGS, refs.save_switch),
        refs.switch_outputs,
        low=2,
        ragged=("e4_step1_drop", "e8_step2_drop"),
        batch_of_one=("e4_step1_drop",),
        dispatch=("e8_step2_drop",),
    ),
    "olmoe": Spec(
        tuple(refs.OLMOE_CONFIGS),
        _save_by_seed(refs.OLMOE_CONFIGS, refs.save_olmoe),
        refs.olmoe_outputs,
        ragged=("e8k2_norm_clip", "e16k4_mqa"),
        batch_of_one=("e8k2_norm_clip",),
        dispatch=("e16k4_mqa",),
    ),
    "deepseek": Spec(
        tuple(refs.DEEPSEEK_CONFIGS) + tuple(refs.DEEPSEEK_MHA_CONFIGS),
        refs.save_deepseek,
        refs.deepseek_outputs,
        batch_of_one=("group_qlora_dense0_s2_norm", "mha_dense1_s2"),
        dispatch=("group_q_dense0_s1",),
    ),
    # The decoder kit's families: first config batch of one, second grouped
    # against dense.
    **{
        family: Spec(
            tuple(configs),
            refs.save_kit(family),
            refs.kit_outputs(family),
            batch_of_one=tuple(configs)[:1],
            dispatch=tuple(configs)[1:2],
        )
        for family, (_, configs) in refs.KIT_CONFIGS.items()
    },
}


def _cases(field):
  return [
      (family, name)
      for family, spec in SPECS.items()
      for name in getattr(spec, field)
  ]


PARITY = [
    (family, name, dispatch)
    for family, spec in SPECS.items()
    for dispatch, names in (("auto", spec.configs), ("ragged", spec.ragged))
    for name in names
] + [
    # The GPU's 'auto' (tests/test_moe.py checks it against the scan fast).
    pytest.param(family, name, "batched", marks=pytest.mark.slow)
    for family, spec in SPECS.items()
    for name in spec.dispatch
]
# The kit's newer families run scanned only: their unrolled twin is the
# kit's stack, checked unrolled on OLMoE (suite time, not coverage).
SCANNED_ONLY = tuple(refs.KIT_CONFIGS)


def _scans(cases):
  """Each case with scan=True and, except for SCANNED_ONLY, scan=False."""
  out = []
  for case in cases:
    values, marks = (
        (case.values, case.marks)
        if hasattr(case, "marks")
        else (
            tuple(case),
            (),
        )
    )
    for scan in (True,) if values[0] in SCANNED_ONLY else (True, False):
      tag = "scan" if scan else "unrolled"
      out.append(
          pytest.param(*values, scan, marks=marks, id="-".join((*values, tag)))
      )
  return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  """(family, name) -> (checkpoint dir, reference), each written once, when first used."""
  cache = {}

  def reference(family, name):
    if (family, name) not in cache:
      path = tmp_path_factory.mktemp(family) / name
      cache[family, name] = SPECS[family].save(path, name)
    return cache[family, name]

  return reference


@pytest.fixture(scope="module")
def loaded(references):
  """(family, name, dispatch, scan) -> (module, params, jitted apply), loaded once."""
  cache = {}

  def load(family, name, dispatch="auto", scan=True):
    key = family, name, dispatch, scan
    if key not in cache:
      path = references(family, name)[0]
      module, params = models.from_pretrained(
          path, dispatch=dispatch, scan_layers=scan
      )
      cache[key] = module, params, jax.jit(module.apply)
    return cache[key]

  return load


def _run(apply, params, ids, mask):
  return apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask))


@pytest.mark.parametrize("family,name,dispatch,scan", _scans(PARITY))
def test_parity_with_hugging_face(
    references, loaded, family, name, dispatch, scan
):
  """Hidden states and router logits match transformers (float32, 1e-4)."""
  spec = SPECS[family]
  ids, mask = refs.batch(low=spec.low)
  module, params, apply = loaded(family, name, dispatch, scan)
  want_h, want_logits = spec.outputs(references(family, name)[1], ids, mask)
  out = _run(apply, params, ids, mask)
  sparse = module.config.sparse_layers
  assert len(out.router_logits) == len(want_logits) == len(sparse)
  errors = [refs.rel_err(out.hidden_states, want_h)]
  for got, want in zip(out.router_logits, want_logits):
    assert got.dtype == jnp.float32 and got.shape == want.shape
    errors.append(refs.rel_err(got, want))
  print(
      f"{family}/{name}: hidden {errors[0]:.2e}, logits {max(errors[1:]):.2e}"
  )
  assert max(errors) < 1e-4


@pytest.mark.parametrize("family,name,scan", _scans(_cases("batch_of_one")))
def test_batch_of_one_equals_its_row(loaded, family, name, scan):
  """Routing and capacity are per record: a record alone = its row."""
  ids, mask = refs.batch(low=SPECS[family].low)
  _, params, apply = loaded(family, name, scan=scan)
  full = _run(apply, params, ids, mask)
  for row in range(ids.shape[0]):
    one = _run(apply, params, ids[row : row + 1], mask[row : row + 1])
    np.testing.assert_allclose(
        one.hidden_states[0], full.hidden_states[row], rtol=1e-5, atol=1e-5
    )
    for a, b in zip(one.router_logits, full.router_logits):
      np.testing.assert_allclose(a[0], b[row], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,name,scan", _scans(_cases("batch_of_one")))
def test_padding_changes_no_real_token(loaded, family, name, scan):
  """Other ids in the padding, and more of it: the real tokens' hidden
  states and router logits do not change (right padding is masked, and
  capacity sees the real tokens first)."""
  ids, mask = refs.batch(low=SPECS[family].low)
  _, params, apply = loaded(family, name, scan=scan)
  want = _run(apply, params, ids, mask)
  extra = 5
  noisy = np.pad(ids, ((0, 0), (0, extra)))
  noisy = np.where(np.pad(mask, ((0, 0), (0, extra))) == 1, noisy, 7)
  got = _run(apply, params, noisy, np.pad(mask, ((0, 0), (0, extra))))
  real = mask == 1
  np.testing.assert_allclose(
      np.asarray(got.hidden_states)[:, : ids.shape[1]][real],
      np.asarray(want.hidden_states)[real],
      rtol=1e-5,
      atol=1e-5,
  )
  for a, b in zip(got.router_logits, want.router_logits):
    np.testing.assert_allclose(
        np.asarray(a)[:, : ids.shape[1]][real],
        np.asarray(b)[real],
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("family,name,scan", _scans(_cases("dispatch")))
def test_grouped_dispatch_equals_dense(loaded, family, name, scan):
  ids, mask = refs.batch(low=SPECS[family].low)
  _, params, grouped = loaded(family, name, scan=scan)
  _, _, dense = loaded(family, name, "dense", scan)
  a = _run(grouped, params, ids, mask).hidden_states
  b = _run(dense, params, ids, mask).hidden_states
  refs.assert_close(a, b, tol=1e-5)


def _models_imported(path: pathlib.Path) -> set[str]:
  """The `raptor_jax.models` modules a file imports (first name below it)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "raptor_jax.models":
        names |= {a.name for a in node.names}
      elif node.module.startswith("raptor_jax.models."):
        names.add(node.module.split(".")[2])
  return names


def test_families_import_shared_layers_only():
  """A family never imports another; a shared layer never imports a family
  (only the front door, the export and the package itself see them all)."""
  root = pathlib.Path(models.__file__).parent
  families = set(models.hf.FAMILY_MODULES)
  assert families == set(SPECS)  # every family has its backbone tests
  for path in sorted(root.rglob("*.py")):
    owner = path.relative_to(root).parts[0].removesuffix(".py")
    if owner in ("__init__", "hf", "export"):
      continue
    # DeepSeek-VL2 wraps the DeepSeek language model as it is (issue 46):
    # the one composite, and it may import only that family.
    allowed = {owner} | ({"deepseek"} if owner == "deepseek_vl2" else set())
    wrong = (_models_imported(path) & families) - allowed
    assert not wrong, f"{path.relative_to(root)} imports {sorted(wrong)}"
