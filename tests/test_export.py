"""Releasing the model, not the run: launch/export.py.

The export must load in transformers and compute what the Flax model
computes, carry the run's privacy accounting, and hold no byte of the secret,
the noise keys or a private statistic.
"""

import base64
import json
import re
import shutil
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import torch
import transformers
from safetensors.numpy import load_file

from raptor_jax import data, models, release
from raptor_jax.ledger import PrivacyLedger
from raptor_jax.models import hf, initializers, lora
from raptor_jax.train import methods, step, train_and_evaluate
from raptor_jax.train.run import build_run

from helpers import MICRO_FAMILIES, ROOT, SMALL_FAMILIES, finished_report, latest_state, micro_config

# Distinctive: the scan looks for its bytes, and a seed like 0 would match
# every run of zero bytes in a weight file.
_SECRET_SEED = 1_987_654_321
_CARD_KEYS = {
    "method",
    "private",
    "guarantee",
    "epsilon",
    "delta",
    "target_epsilon",
    "accountant",
    "sampling",
    "sample_rate",
    "steps",
    "rho",
    "sigma_shared",
    "sigma_expert",
    "streams",
    "expert_layer",
    "record_count",
}


def _export_cli(workdir, out):
  return subprocess.run(
      [
          sys.executable,
          "launch/export.py",
          f"--workdir={workdir}",
          f"--out={out}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config, workdir, out, run): a finished micro RAPTOR run and its export."""
  config = micro_config(**{"privacy.secret_seed": _SECRET_SEED})
  workdir = tmp_path_factory.mktemp("run")
  train_and_evaluate(config, str(workdir))
  out = release.export(workdir, tmp_path_factory.mktemp("release") / "model")
  # The run as the trainer builds it (with the training records' owner map).
  return config, workdir, out, build_run(config)


def test_merge_folds_adapters_into_kernels_without_changing_outputs():
  """lora.merge against the modules' own forward (dense and per-expert)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 5))
  experts = jnp.array([0, 2, 1, 3, 2, 0], jnp.int32)  # 3 = dropped row
  for module, plain, args in (
      (lora.LoRADense(4, rank=2, alpha=8.0), lora.LoRADense(4), (x,)),
      (
          lora.ExpertLinear(3, 4, rank=2, alpha=8.0, dispatch="dense"),
          lora.ExpertLinear(3, 4, dispatch="dense"),
          (x, experts),
      ),
  ):
    params = module.init(jax.random.PRNGKey(1), *args)["params"]
    # Fresh adapters have B = 0; give them a value so the merge matters.
    params = dict(params, lora_b=jnp.ones_like(params["lora_b"]) * 0.3)
    merged = lora.merge(params, alpha=8.0, rank=2)
    assert set(merged) == {"kernel"}
    expected = module.apply({"params": params}, *args)
    got = plain.apply({"params": merged}, *args)
    unmerged = plain.apply({"params": {"kernel": params["kernel"]}}, *args)
    assert np.abs(np.asarray(expected - unmerged)).max() > 0.1
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def _torch_outputs(model, ids, mask):
  """A transformers model's outputs (eval mode, no gradients) of a batch."""
  with torch.no_grad():
    return model.eval()(
        input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
        attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
    )


@pytest.mark.slow
def test_olmoe_classifier_export_agrees_with_transformers(tmp_path):
  """The decoder family: OlmoeModel + last-token pooling + the head file,
  attention and expert adapters merged."""
  backbone = models.OlmoeDecoder(
      models.OlmoeConfig(
          vocab_size=64,
          hidden_size=16,
          intermediate_size=8,
          num_hidden_layers=2,
          num_attention_heads=2,
          num_key_value_heads=1,
          num_experts=4,
          num_experts_per_tok=2,
          lora_rank=2,
          attention_lora=True,
          expert_lora_layers=(1,),
      )
  )
  params = backbone.init(jax.random.PRNGKey(0), *initializers.example_inputs())
  model, params = hf.with_head(backbone, params["params"], 3)
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  keys = iter(jax.random.split(jax.random.PRNGKey(1), len(flat)))
  params = flax.traverse_util.unflatten_dict(
      {  # "trained" adapters: non-zero B factors
          p: 0.3 * jax.random.normal(next(keys), v.shape)
          if p.endswith("lora_b")
          else v
          for p, v in flat.items()
      },
      sep="/",
  )
  out = release.write_model(tmp_path / "m", model, params, None, "abc")
  ids = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 1, 64)
  mask = (jnp.arange(8)[None] < jnp.array([[8], [5], [3]])).astype(jnp.int32)
  flax_logits, _ = model.apply({"params": params}, ids, mask)
  hf_model, info = transformers.OlmoeModel.from_pretrained(
      out, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  hidden = _torch_outputs(hf_model, ids, mask).last_hidden_state.float().numpy()
  with safetensors.safe_open(out / release.HEAD, "np") as f:
    assert f.metadata()["pooling"] == "last"
  head = load_file(out / release.HEAD)
  pooled = hidden[np.arange(3), np.asarray(mask).sum(1) - 1]
  hf_logits = pooled @ head["weight"].T + head["bias"]
  np.testing.assert_allclose(hf_logits, flax_logits, atol=1e-4, rtol=1e-4)


def _sequence_classifier_backbones(vocab):
  """A small backbone of each family with a transformers classifier class,
  adapters on attention and the last block's experts."""
  lora = dict(lora_rank=2, attention_lora=True, expert_lora_layers=(1,))
  kit = dict(
      vocab_size=vocab,
      hidden_size=16,
      intermediate_size=24,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=1,
      num_experts=4,
      num_experts_per_tok=2,
      **lora,
  )
  return {
      "deepseek": models.DeepseekDecoder(
          models.DeepseekConfig(
              vocab_size=vocab,
              hidden_size=16,
              intermediate_size=24,
              moe_intermediate_size=8,
              num_hidden_layers=2,
              num_attention_heads=2,
              num_key_value_heads=2,
              kv_lora_rank=8,
              qk_nope_head_dim=8,
              qk_rope_head_dim=4,
              v_head_dim=8,
              n_routed_experts=4,
              n_shared_experts=1,
              num_experts_per_tok=2,
              **lora,
          )
      ),
      "qwen3_moe": models.Qwen3MoeDecoder(
          models.Qwen3MoeConfig(**kit, moe_intermediate_size=8, head_dim=4)
      ),
      "qwen2_moe": models.Qwen2MoeDecoder(
          models.Qwen2MoeConfig(
              **kit,
              moe_intermediate_size=8,
              shared_expert_intermediate_size=12,
              shared_expert_lora=True,
          )
      ),
      "mixtral": models.MixtralDecoder(models.MixtralConfig(**kit)),
  }


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, arch",
    [
        ("deepseek", "DeepseekV2ForSequenceClassification"),
        ("qwen3_moe", "Qwen3MoeForSequenceClassification"),
        ("qwen2_moe", "Qwen2MoeForSequenceClassification"),
        ("mixtral", "MixtralForSequenceClassification"),
    ],
)
def test_exports_as_transformers_sequence_classifier(family, arch, tmp_path):
  """A family with a transformers classifier class: the export is that
  class (head as its bias-free `score`, last non-padding token) that
  AutoModelForSequenceClassification and pipeline('text-classification')
  load, with the Flax model's logits."""
  from raptor_jax.data import synthetic

  tokenizer = synthetic.build_tokenizer(16)
  backbone = _sequence_classifier_backbones(len(tokenizer))[family]
  params = backbone.init(jax.random.PRNGKey(0), *initializers.example_inputs())
  model, params = hf.with_head(backbone, params["params"], 3)
  assert model.pooling == "last" and set(params["head"]) == {"kernel"}
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  keys = iter(jax.random.split(jax.random.PRNGKey(1), len(flat)))
  params = flax.traverse_util.unflatten_dict(
      {  # "trained" adapters and head
          p: 0.3 * jax.random.normal(next(keys), v.shape)
          if p.endswith("lora_b") or p.startswith("head/")
          else v
          for p, v in flat.items()
      },
      sep="/",
  )
  out = release.write_model(tmp_path / "m", model, params, tokenizer, "abc")
  assert not (out / release.HEAD).exists()
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == [arch]
  assert config["pad_token_id"] == tokenizer.pad_token_id
  texts = [
      "the movie was great",
      "a bad dull film",
      "great acting and a fine plot that we liked a lot",
  ]
  ids, mask = data.tokenize(tokenizer, texts, max_length=16)
  assert len(set(np.asarray(mask).sum(1))) > 1  # padded to different lengths
  flax_logits, _ = model.apply({"params": params}, ids, mask)
  hf_model, info = (
      transformers.AutoModelForSequenceClassification.from_pretrained(
          out, output_loading_info=True
      )
  )
  assert type(hf_model).__name__ == arch
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  hf_logits = _torch_outputs(hf_model, ids, mask).logits.numpy()
  np.testing.assert_allclose(hf_logits, flax_logits, atol=1e-4, rtol=1e-4)
  classify = transformers.pipeline("text-classification", model=str(out))
  scored = classify(texts, function_to_apply="none", top_k=None)
  by_label = np.array(
      [
          [{s["label"]: s["score"] for s in row}[l] for l in "abc"]
          for row in scored
      ]
  )
  np.testing.assert_allclose(by_label, flax_logits, atol=1e-4, rtol=1e-4)
  # The model card's snippet for such an export predicts the same labels.
  code = release.INFERENCE_CLASSIFIER.format(
      directory=str(out), max_length=16, examples=texts
  )
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  want = ["abc"[i] for i in np.argmax(flax_logits, -1)]
  assert namespace["predict"](texts) == want
  # raptor_jax reads the backbone back (the score is the head's, not its).
  _, loaded = hf.from_pretrained(out)
  assert "score" not in loaded
  # Mean pooling has no transformers class: backbone + head file, bias kept.
  mean_model, mean_params = hf.with_head(
      backbone, params["backbone"], 3, pooling="mean"
  )
  assert set(mean_params["head"]) == {"kernel", "bias"}
  mean_out = release.write_model(
      tmp_path / "mean", mean_model, mean_params, tokenizer, "abc"
  )
  assert (mean_out / release.HEAD).exists()
  assert json.loads((mean_out / "config.json").read_text())[
      "architectures"
  ] == [arch.replace("ForSequenceClassification", "Model")]


@pytest.mark.slow
def test_transformers_loads_the_export_and_agrees_with_flax(trained):
  _, workdir, out, run = trained
  _, state, _ = latest_state(workdir)
  trained_params = step.merged_params(run.frozen, state["trainable"])
  ids = run.data.dev.input_ids[:16]
  mask = run.data.dev.attention_mask[:16]
  flax_logits, _ = run.model.apply({"params": trained_params}, ids, mask)
  # The trained adapters matter: without them the logits move.
  flat = flax.traverse_util.flatten_dict(trained_params, sep="/")
  no_adapters = flax.traverse_util.unflatten_dict(
      {
          p: np.zeros_like(v) if p.endswith("lora_b") else v
          for p, v in flat.items()
      },
      sep="/",
  )
  base_logits, _ = run.model.apply({"params": no_adapters}, ids, mask)
  assert np.abs(np.asarray(base_logits - flax_logits)).max() > 1e-3

  model, info = transformers.SwitchTransformersEncoderModel.from_pretrained(
      out, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  model.eval()
  hidden = _torch_outputs(model, ids, mask).last_hidden_state.numpy()
  with safetensors.safe_open(out / release.HEAD, "np") as f:
    assert f.metadata()["pooling"] == "mean"
  head = load_file(out / release.HEAD)
  m = np.asarray(mask, np.float32)[..., None]
  pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1.0)
  hf_logits = pooled @ head["weight"].T + head["bias"]
  np.testing.assert_allclose(hf_logits, flax_logits, atol=1e-4, rtol=1e-4)
  assert model.config.id2label == {0: "negative", 1: "positive"}

  # The exported tokenizer turns the dev texts into the ids the run trained on.
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  texts = run.data.tokenizer.batch_decode(ids, skip_special_tokens=True)
  encoded = tokenizer(
      texts,
      padding="max_length",
      truncation=True,
      max_length=ids.shape[1],
      return_tensors="np",
  )
  np.testing.assert_array_equal(encoded["input_ids"], ids)


def _secret_needles(value) -> list[bytes]:
  """Every byte form a secret value could take in a file: decimal, hex, the
  decoded hex or base64 of a string, and big- and little-endian integers of
  its own width and of 4, 8, 16 bytes."""
  if isinstance(value, dict):
    return [n for v in value.values() for n in _secret_needles(v)]
  if isinstance(value, (list, tuple)):
    return [n for v in value for n in _secret_needles(v)]
  if isinstance(value, str):
    needles = [value.encode()]
    if re.fullmatch(r"[0-9]+", value):
      needles += _secret_needles(int(value))
    elif re.fullmatch(r"(0x)?[0-9a-fA-F]+", value):
      needles += _secret_needles(int(value, 16))
    elif re.fullmatch(r"[A-Za-z0-9+/_-]+=*", value) and len(value) % 4 != 1:
      needles.append(base64.b64decode(value + "==", altchars=b"-_"))  # base64
    return needles
  if isinstance(value, int) and not isinstance(value, bool):
    assert value.bit_length() >= 24, "too small a secret to scan for"
    needles = [str(value).encode(), f"{value:x}".encode()]
    own = (value.bit_length() + 7) // 8
    for width in sorted({own, 4, 8, 16}):
      if width >= own:
        needles += [value.to_bytes(width, o) for o in ("little", "big")]
    return needles
  return []


def _key_needles(opt_state) -> list[bytes]:
  """The raw data of every PRNG key of the optimizer states, and of the
  per-step keys fold_in(key, t) that drew the noise."""
  needles = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if "key" not in jax.tree_util.keystr(path):
      continue
    data = np.asarray(leaf, np.uint32).reshape(-1, 2)  # one or more keys
    keys = [data] + [
        np.asarray(
            jax.random.key_data(
                jax.random.fold_in(jax.random.wrap_key_data(one), t)
            )
        )
        for one in data
        for t in range(16)
    ]
    keys += list(data)  # each 64-bit half on its own
    for k in keys:
      needles += [
          k.astype("<u4").tobytes(),
          k.astype(">u4").tobytes(),
          json.dumps(k.tolist()).encode(),
          " ".join(map(str, k.tolist())).encode(),
      ]
  return needles


def _private_statistic_needles(run) -> list[bytes]:
  """The owner map of the training records and the per-expert counts."""
  owners = run.owners
  assert len(set(owners.tolist())) > 1  # a non-trivial map
  counts = np.bincount(owners, minlength=run.num_experts)
  return [
      owners.astype(np.int32).tobytes(),
      owners.astype(np.int64).tobytes(),
      json.dumps(owners.tolist()).encode(),
      " ".join(map(str, owners.tolist())).encode(),
      counts.astype(np.int32).tobytes(),
      counts.astype(np.int64).tobytes(),
      json.dumps(counts.tolist()).encode(),
  ]


@pytest.mark.slow
def test_no_secret_noise_key_or_private_statistic_in_the_export(trained):
  _, workdir, out, run = trained
  _, state, meta = latest_state(workdir)
  # Whatever field(s) of the checkpoint metadata hold the secret.
  secret_fields = {
      k: v
      for k, v in meta.items()
      if re.search(r"secret|seed|salt|key", k, re.IGNORECASE)
  }
  assert secret_fields, sorted(meta)
  needles = {
      "secret": [n for v in secret_fields.values() for n in _secret_needles(v)],
      "noise key": _key_needles(state["opt"]),
      "private statistic": _private_statistic_needles(run),
      # No timing in the files meant for release: no wall time field and no
      # Unix time of these days (its first 6 digits change every ~12 days).
      "timing": [b"wall_time", str(int(time.time()))[:6].encode()],
  }
  assert all(needles.values()), {k: len(v) for k, v in needles.items()}
  files = sorted(p for p in out.rglob("*") if p.is_file())
  names = {p.name for p in files}
  assert names >= {
      "config.json",
      "model.safetensors",
      "tokenizer.json",
      release.HEAD,
      release.CARD,
      release.MODEL_CARD,
  }
  assert all(
      n.endswith((".json", ".safetensors", ".txt", ".model", ".md"))
      for n in names
  ), names
  for path in files:
    content = path.read_bytes()
    for what, group in needles.items():
      for needle in group:
        assert needle not in content, f"{what} found in {path}"
  # Only model weights, no adapter or optimizer leaf.
  tensors = load_file(out / "model.safetensors")
  assert not [n for n in tensors if re.search(r"lora|mu|nu|rng|count", n)]


def _keys(tree):
  if isinstance(tree, dict):
    return set(tree) | {k for v in tree.values() for k in _keys(v)}
  return set()


@pytest.mark.slow
def test_privacy_card_is_the_run_accounting_and_nothing_else(trained):
  config, workdir, out, _ = trained
  card = json.loads((out / release.CARD).read_text())
  report = json.loads((workdir / "privacy_report.json").read_text())
  _, _, meta = latest_state(workdir)
  assert set(card) == _CARD_KEYS
  assert not _keys(card) & {
      "n",
      "batch_size",
      "wall_time_s",
      "ledger",
      "denominator",
      "secret_seed",
      "owners",
  }
  # Epsilon recomputed from the checkpoint's ledger, independently of the report.
  ledger = PrivacyLedger.from_json(meta["ledger"])
  assert card["private"] and card["method"] == "raptor"
  assert card["epsilon"] == pytest.approx(ledger.epsilon(card["delta"]))
  assert 0 < card["epsilon"] <= card["target_epsilon"] == 8.0
  assert card["delta"] == report["delta"]
  assert card["sample_rate"] == pytest.approx(50 / 300)
  assert card["accountant"] == report["accountant"]
  assert set(card["streams"]) == {"shared", "expert"}
  sigmas = {e.stream: e.noise_multiplier for e in ledger.entries}
  for name, stream in card["streams"].items():
    assert stream["steps"] == ledger.steps(name) == 6
    assert stream["noise_multiplier"] == pytest.approx(sigmas[name])
    assert stream["l2_clip"] == config.privacy[f"clip_{name}"]
  assert card["sigma_shared"] == pytest.approx(sigmas["shared"])
  assert card["sigma_expert"] == pytest.approx(sigmas["expert"])


def _planned_report(method):
  """privacy_report.json of a finished run of `method`'s real plan."""
  config = micro_config(method=method)
  plan = methods.build_plan(
      config, n=300, num_experts=4, sparse_layers=(1,), expert_layer=1
  )
  return finished_report(config, plan)


@pytest.mark.parametrize("method", methods.METHODS)
def test_every_methods_privacy_card_holds_the_fields_its_report_has(method):
  """A field that does not apply to a method is absent from its report, so
  the card copies what is there (it used to fail on every method but RAPTOR)."""
  report = _planned_report(method)
  card = release.privacy_card(report)
  optional = {"target_epsilon", "rho", "sigma_shared", "sigma_expert"}
  assert set(card) == (_CARD_KEYS - optional) | (optional & set(report))
  assert set(card["streams"]) == set(report["parts"])
  for name, part in report["parts"].items():
    assert card["streams"][name]["noise_multiplier"] == part["noise_multiplier"]
    assert card["streams"][name]["l2_clip"] == part["l2_clip"]
  assert card["private"] == (method in methods.PRIVATE_METHODS)
  assert card["epsilon"] == report["epsilon"]
  assert card["record_count"].startswith("treated as public")
  assert not _keys(card) & {"n", "batch_size", "ledger", "denominator"}


def _transformers_logits(out, ids, mask):
  """Logits of the export as transformers computes them, from its files."""
  arch = json.loads((out / "config.json").read_text())["architectures"][0]
  model, info = getattr(transformers, arch).from_pretrained(
      out, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  if arch.endswith("ForSequenceClassification"):  # the head is in the model
    assert not (out / release.HEAD).exists()
    logits = _torch_outputs(model, ids, mask).logits
    return arch, logits.float().numpy()
  hidden = _torch_outputs(model, ids, mask).last_hidden_state.float().numpy()
  with safetensors.safe_open(out / release.HEAD, "np") as f:
    pooling = f.metadata()["pooling"]
  m = np.asarray(mask, np.float32)
  if pooling == "mean":
    pooled = (hidden * m[..., None]).sum(1) / np.maximum(m.sum(1), 1.0)[:, None]
  else:
    pooled = hidden[np.arange(len(m)), m.sum(1).astype(int) - 1]
  head = load_file(out / release.HEAD)
  return arch, pooled @ head["weight"].T + head["bias"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, method",
    [
        ("switch", "monolithic_lora"),
        ("olmoe", "baseline_a"),
        ("deepseek", "nonprivate_lora"),
        # The kit's newer families: a RAPTOR run end to end, then the export.
        ("qwen3_moe", "raptor"),
        ("qwen2_moe", "raptor"),
        ("mixtral", "raptor"),
    ],
)
def test_every_family_exports_and_loads_in_transformers(
    family, method, tmp_path
):
  """release.export end to end, outside RAPTOR on Switch: the card of a
  method without RAPTOR's fields, and each family's transformers class
  computing what the trained Flax classifier computes."""
  config = micro_config(
      method=method, **{**MICRO_FAMILIES, **SMALL_FAMILIES}[family]
  )
  workdir = tmp_path / "run"
  train_and_evaluate(config, str(workdir))
  out = release.export(workdir, tmp_path / "model")
  card = json.loads((out / release.CARD).read_text())
  assert card["method"] == method and ("rho" in card) == (method == "raptor")
  results = json.loads((workdir / "results.json").read_text())
  if method == "raptor":  # both streams trained, the budget spent
    assert results["trainable_parameters"]["expert"] > 0
    report = json.loads((workdir / "privacy_report.json").read_text())
    assert 0.99 * report["target_epsilon"] < report["epsilon"] <= 8.0
    shared_experts = results["parameters_by_role"]["shared_expert_adapter"]
    assert (shared_experts > 0) == (family == "qwen2_moe")
  run, params, _ = release.trained_model(workdir)
  ids = run.data.dev.input_ids[:8]
  mask = run.data.dev.attention_mask[:8]
  flax_logits, _ = run.model.apply({"params": params}, ids, mask)
  arch, hf_logits = _transformers_logits(out, ids, mask)
  assert (
      arch
      == {
          "switch": "SwitchTransformersEncoderModel",
          "olmoe": "OlmoeModel",
          "deepseek": "DeepseekV2ForSequenceClassification",
          "qwen3_moe": "Qwen3MoeForSequenceClassification",
          "qwen2_moe": "Qwen2MoeForSequenceClassification",
          "mixtral": "MixtralForSequenceClassification",
      }[family]
  )
  np.testing.assert_allclose(hf_logits, flax_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_export_refuses_a_used_out_dir_and_an_unfinished_run(trained, tmp_path):
  _, workdir, out, _ = trained
  # The CLI: one line, non-zero exit, nothing written.
  before = sorted(p.name for p in out.iterdir())
  proc = _export_cli(workdir, out)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and "not an empty directory" in last
  assert sorted(p.name for p in out.iterdir()) == before
  with pytest.raises(FileNotFoundError, match="holds no trained run"):
    release.export(tmp_path / "nothing", tmp_path / "a")
  # A run stopped before its last cycle: drop the last checkpoint, and
  # report the one before as a run stopped there reports it.
  partial = tmp_path / "partial"
  shutil.copytree(workdir, partial)
  steps = sorted(
      int(p.name)
      for p in (partial / "checkpoints").iterdir()
      if p.name.isdigit()
  )
  assert len(steps) >= 2, steps
  shutil.rmtree(partial / "checkpoints" / str(steps[-1]))
  report = json.loads((partial / "privacy_report.json").read_text())
  report.update(finished=False, cycles=steps[-2])
  (partial / "privacy_report.json").write_text(json.dumps(report))
  with pytest.raises(ValueError, match="not the end of a finished run"):
    release.export(partial, tmp_path / "b")
  assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_the_model_card_states_the_guarantee_and_its_snippet_predicts(
    trained, capsys, monkeypatch
):
  _, workdir, out, run = trained
  card_text = (out / release.MODEL_CARD).read_text()
  card = json.loads((out / release.CARD).read_text())
  assert card_text.startswith(
      "# synthetic classifier, fine-tuned with differential privacy"
  )
  assert f"({card['epsilon']:.3g}, {card['delta']:.3g})-differential" in (
      card_text
  )
  assert "**Privacy unit:** one training record" in card_text
  assert "labels: 0 `negative`, 1 `positive`" in card_text
  assert "raptor_jax 0.1.0" in card_text
  code = re.search(r"```python\n(.*?)```", card_text, flags=re.S).group(1)
  # The card names the directory, never the path it was exported to.
  assert str(out.parent) not in card_text
  assert f"DIR = {out.name!r}" in code
  monkeypatch.chdir(out.parent)
  namespace = {}
  exec(compile(code, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert capsys.readouterr().out.startswith("['")  # the example's labels
  # The snippet's predictions are the trained Flax model's.
  _, state, _ = latest_state(workdir)
  params = step.merged_params(run.frozen, state["trainable"])
  ids = run.data.dev.input_ids[:32]
  mask = run.data.dev.attention_mask[:32]
  texts = run.data.tokenizer.batch_decode(ids, skip_special_tokens=True)
  logits, _ = run.model.apply({"params": params}, ids, mask)
  want = [("negative", "positive")[i] for i in np.argmax(logits, -1)]
  assert namespace["predict"](texts) == want
