"""Image multiple-choice tasks in the trainer (raptor_jax.vision).

Hand-computed ids and table rows, the per-record isolation the privacy
argument rests on (a record's output never reads another record's rows),
text-only ids unchanged by the table, the refusals, and (slow) the :tiny
preset training above chance.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from raptor_jax import data, roles
from raptor_jax.data import images
from raptor_jax.data import multiple_choice as mc
from raptor_jax.models import deepseek, initializers
from raptor_jax.train import run as run_lib
from raptor_jax import vision

from helpers import load_config_module, micro_vl_config

SPEC = images.TileSpec(((28, 28), (56, 28)), tile=28, patch_size=7)
WORDS = ["question", "answer", "red", "blue", "a", "b", ":", "?", "."]


def _fake_encoder(pixels_BxTxCxSxS):
  """Table [B, 2 + T * 4, 3]: row r of record b holds (b, r, T)."""
  b, t = pixels_BxTxCxSxS.shape[:2]
  k = 2 + t * SPEC.side**2
  out = np.zeros((b, k, 3), np.float32)
  out[:, :, 0] = np.arange(b)[:, None]
  out[:, :, 1] = np.arange(k)[None]
  out[:, :, 2] = t
  return out


def test_encode_records_by_hand():
  tok = data.build_word_tokenizer(WORDS)
  recs = [
      mc.ChoiceRecord("red?", ("red", "blue"), 0, Image.new("RGB", (56, 28))),
      mc.ChoiceRecord("blue?", ("red", "blue"), 1, None),
      mc.ChoiceRecord("red?", ("red", "blue"), 0, Image.new("RGB", (20, 20))),
  ]
  enc, table = vision.encode_records(
      recs,
      tok,
      _fake_encoder,
      SPEC,
      max_length=40,
      vocab_size=len(tok),
      first_row=5,
      where="train",
  )
  v = len(tok)
  wide = images.num_image_tokens(2, 1, SPEC)  # 17
  square = images.num_image_tokens(1, 1, SPEC)  # 13
  # [CLS] + image + "Question: red? A. red B. blue Answer:" (12 tokens)
  assert enc.attention_mask.sum(1).tolist() == [
      1 + wide + 12,
      13,
      1 + square + 12,
  ]
  np.testing.assert_array_equal(
      enc.input_ids[0, 1 : 1 + wide],
      v + 5 + images.image_token_index(2, 1, SPEC),
  )
  # Record 3's rows follow record 1's 2 + 3 * 4 = 14 rows.
  np.testing.assert_array_equal(
      enc.input_ids[2, 1 : 1 + square],
      v + 5 + 14 + images.image_token_index(1, 1, SPEC),
  )
  assert table.shape == (14 + 10, 3)
  assert (
      table[:14, 2].tolist() == [3] * 14 and table[14:, 2].tolist() == [2] * 10
  )
  assert (enc.input_ids[1] < v).all() and enc.labels.tolist() == [0, 1, 0]
  with pytest.raises(ValueError, match="train, record 1: 30 tokens"):
    vision.encode_records(
        recs[:1],
        tok,
        _fake_encoder,
        SPEC,
        max_length=20,
        vocab_size=v,
        first_row=0,
        where="train",
    )


@functools.cache
def _decoder(table_rows):
  config = deepseek.sized_config(
      vocab_size=20,
      d_model=16,
      d_ff=16,
      num_layers=2,
      num_heads=2,
      d_kv=8,
      num_experts=4,
      top_k=2,
      num_shared_experts=1,
      first_k_dense=1,
      kv_lora_rank=0,
  )
  module = deepseek.DeepseekDecoder(config)
  params = initializers.init_params(module, jax.random.PRNGKey(0))
  table = np.random.RandomState(1).randn(table_rows, 16).astype(np.float32)
  return (module, params) + vision.with_image_table(module, params, table)


def test_a_record_reads_only_its_own_rows():
  """Changing rows no id of a record points at leaves its outputs unchanged."""
  _, _, module, params = _decoder(10)
  ids = jnp.array([[1, 20 + 2, 20 + 3, 5, 6]])  # rows 2 and 3
  run = jax.jit(module.apply)
  base = run({"params": params}, ids).hidden_states
  other = jax.tree.map(lambda x: x, params)
  table = np.asarray(params["image_table"]["embedding"]).copy()
  table[[0, 1, 4, 9]] += 100.0
  other["image_table"] = {"embedding": jnp.asarray(table)}
  np.testing.assert_array_equal(run({"params": other}, ids).hidden_states, base)
  table[2] += 1.0
  other["image_table"] = {"embedding": jnp.asarray(table)}
  assert not np.allclose(run({"params": other}, ids).hidden_states, base)


def test_text_ids_unchanged_by_the_table():
  plain, plain_params, module, params = _decoder(10)
  ids = jnp.array([[1, 7, 3, 19, 5]])
  np.testing.assert_array_equal(
      module.apply({"params": params}, ids).hidden_states,
      plain.apply({"params": plain_params}, ids).hidden_states,
  )


def test_no_method_trains_the_table():
  """Every weight (`monolithic`'s roles) is selected, but not the image table."""
  _, _, _, params = _decoder(10)
  picked = roles.select({"backbone": params}, roles.ALL_ROLES)
  assert "backbone/embed_tokens/embedding" in picked
  assert not any("image_table" in p for p in picked)
  assert roles.role_of("backbone/image_table/embedding") == "base"


@pytest.mark.parametrize(
    "override,message",
    [
        ({"data.public_corpus": "imdb"}, "no format-matched public corpus"),
        ({"vision.without_image": "skip"}, "vision.without_image"),
    ],
)
def test_refusals(override, message):
  with pytest.raises(ValueError, match=message):
    run_lib.validate(micro_vl_config(**override))


def test_shapes_vocabulary_covers_the_prompts():
  tok = vision._tokenizer(micro_vl_config())
  recs = vision.shapes.shapes_task(0, 20, tile=28)
  for r in recs:
    ids = tok(mc.prompt(r)[1], add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
  assert sorted({r.answer for r in recs}) == [0, 1, 2, 3]
  assert {r.image.size for r in recs} == {(28, 28), (56, 28)}


@pytest.mark.slow
def test_tiny_preset_trains_above_chance(tmp_path):
  """configs/deepseek_vl2_scienceqa.py:tiny, non-private, shortened: > 80%."""
  from raptor_jax.train import loop  # pylint: disable=g-import-not-at-top

  config = load_config_module("deepseek_vl2_scienceqa").get_config("tiny")
  config.method = "nonprivate_lora"
  config.epochs = 3
  config.progress_bar = False
  loop.train_and_evaluate(config, str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["finished"] and results["accuracy"] > 0.8
