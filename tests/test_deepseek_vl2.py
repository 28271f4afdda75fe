"""DeepSeek-VL2: tiling, projector, image placement and the whole model.

Hand-computed values on small inputs, then a tiny random checkpoint written
in the reference's tensor layout (`vision.*` timm names, `projector.layers.*`,
`image_newline`, `view_seperator`, `language.model.*`, `language.lm_head`)
whose logits are compared with a PyTorch reference assembled here from
independent parts: transformers' SiglipVisionModel, torch's `F.unfold`
projector, the image layout of DeepSeek-VL2's `prepare_inputs_embeds`
(global view + newlines, separator, local tiles side by side), scattered
into the token embeddings, and the DeepSeek-MoE reference of
tests/hf_references.py (LlamaAttention, as `use_mla: false`).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from PIL import Image

from raptor_jax import models, roles
from raptor_jax.data import images
from raptor_jax.data import multiple_choice as mc
from raptor_jax.models import deepseek_vl2, siglip

import hf_references as refs
import test_siglip

SPEC = images.TileSpec(
    candidate_resolutions=((28, 28), (56, 28), (28, 56)),
    tile=28,
    patch_size=7,
    downsample_ratio=2,
)
N, S = images.NEWLINE, images.SEPARATOR


def test_best_resolution_by_hand():
  cands = ((384, 384), (768, 384), (384, 768), (768, 768))
  # 800 x 300: 768 x 384 keeps 768 * 288 pixels; 768 x 768 keeps as many
  # but wastes more; 384-wide candidates keep 384 * 144.
  assert images.best_resolution((800, 300), cands) == (768, 384)
  assert images.best_resolution((300, 800), cands) == (384, 768)
  # A small image is kept whole by every candidate: least padding wins.
  assert images.best_resolution((100, 80), cands) == (384, 384)
  assert images.best_resolution((1000, 1000), cands) == (768, 768)


def test_token_counts_of_the_real_sizes():
  """384 px tiles, patch 14, 2 x 2 downsample: 14 x 14 tokens per tile."""
  real = images.TileSpec(((384, 384), (768, 384), (384, 768)))
  assert real.side == 14
  assert images.num_image_tokens(1, 1, real) == 14 * 15 + 1 + 14 * 15 == 421
  assert images.num_image_tokens(2, 1, real) == 210 + 1 + 14 * 29 == 617
  assert images.num_image_tokens(1, 2, real) == 210 + 1 + 28 * 15 == 631
  assert len(images.image_token_index(2, 1, real)) == 617
  assert real.max_tiles == 3


def test_image_token_index_by_hand():
  """Grid 4 -> side 2; a 2 x 1 tiling; tile t's token (r, c) at 2 + 4t + 2r + c."""
  assert SPEC.side == 2
  glob = [2, 3, N, 4, 5, N]
  local = [6, 7, 10, 11, N, 8, 9, 12, 13, N]
  np.testing.assert_array_equal(
      images.image_token_index(2, 1, SPEC), glob + [S] + local
  )
  tail = images.TileSpec(SPEC.candidate_resolutions, 28, 7, 2, "tail")
  np.testing.assert_array_equal(
      images.image_token_index(2, 1, tail), local + [S] + glob
  )
  # 1 x 2: tiles stacked; each row of tokens belongs to one tile.
  np.testing.assert_array_equal(
      images.image_token_index(1, 2, SPEC)[7:],
      [6, 7, N, 8, 9, N, 10, 11, N, 12, 13, N],
  )


def test_tile_image_by_hand():
  """A red 50 x 20 image: 2 x 1 tiles, grey bands in the global view."""
  red = Image.new("RGB", (50, 20), (255, 0, 0))
  pixels, grid = images.tile_image(red, SPEC)
  assert grid == (2, 1) and pixels.shape == (3, 3, 28, 28)
  grey = (127 / 255 - 0.5) / 0.5
  # Global view: 50 x 20 -> 28 x 11 (int(20 * 28 / 50) = 11), centred at
  # rows 8..18 (ImageOps.pad puts round((28 - 11) / 2) = 8 rows above).
  column = pixels[0, 0, :, 14]
  np.testing.assert_allclose(column[:8], grey, atol=1e-6)
  np.testing.assert_allclose(column[8:19], 1.0, atol=1e-6)
  np.testing.assert_allclose(column[19:], grey, atol=1e-6)
  # Local: 50 x 20 fits 56 x 28 as 56 x 22 (int(20 * 56 / 50) = 22), rows 3..24.
  np.testing.assert_allclose(pixels[1:, 0, 3:25, :], 1.0, atol=1e-6)
  np.testing.assert_allclose(pixels[1:, 1, 3:25, :], -1.0, atol=1e-6)
  np.testing.assert_allclose(pixels[1:, 0, :3, :], grey, atol=1e-6)


def test_tile_spec_refuses_bad_candidates():
  with pytest.raises(ValueError, match="multiple of the tile side"):
    images.TileSpec(((384, 500),))


@pytest.mark.parametrize("grid", [3, 4])
def test_downsample_is_pad_and_unfold(grid):
  rng = np.random.RandomState(grid)
  x = rng.randn(2, grid * grid, 5).astype(np.float32)
  t = torch.tensor(x).reshape(2, grid, grid, 5)
  pad = grid % 2
  t = torch.nn.functional.pad(t, (0, 0, 0, pad, 0, pad))
  t = torch.nn.functional.unfold(t.permute(0, 3, 1, 2), 2, stride=2)
  np.testing.assert_array_equal(
      np.asarray(deepseek_vl2.downsample(jnp.asarray(x), 2)),
      t.permute(0, 2, 1).numpy(),
  )


# --- the whole model against a PyTorch reference -----------------------------

VISION = siglip.SiglipConfig(
    image_size=28, patch_size=7, width=24, layers=2, heads=4, mlp_dim=40
)
HIDDEN = refs.DEEPSEEK_BASE["hidden_size"]
LANGUAGE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_shared_experts=2,
    num_key_value_heads=4,
)


class TorchVL2(torch.nn.Module):
  """The reference: HF SigLIP + unfold projector + layout + DeepSeek-MoE."""

  def __init__(self, tmp_path):
    super().__init__()
    self.vision = test_siglip.hf_reference(VISION, seed=5).float()
    torch.manual_seed(6)
    self.projector = torch.nn.Sequential(
        torch.nn.Linear(4 * VISION.width, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
    )
    self.image_newline = torch.nn.Parameter(torch.randn(HIDDEN))
    self.view_seperator = torch.nn.Parameter(torch.randn(HIDDEN))
    self.language = refs.save_deepseek_mha(tmp_path / "lm", 7, **LANGUAGE)
    self.lm_head = torch.nn.Linear(HIDDEN, refs.VOCAB, bias=False)
    self.language_config = json.loads((tmp_path / "lm/config.json").read_text())

  def image_tokens(self, tiles, tw, th):
    feats = self.vision(pixel_values=tiles).last_hidden_state
    b, n, c = feats.shape
    g = int(n**0.5)
    x = feats.reshape(b, g, g, c)
    x = torch.nn.functional.pad(x, (0, 0, 0, g % 2, 0, g % 2))
    x = torch.nn.functional.unfold(x.permute(0, 3, 1, 2), 2, stride=2)
    x = self.projector(x.permute(0, 2, 1))
    h = int(x.shape[1] ** 0.5)
    glob = torch.cat(
        [x[0].view(h, h, -1), self.image_newline.expand(h, 1, -1)], 1
    ).reshape(-1, HIDDEN)
    local = x[1 : 1 + tw * th].reshape(th, tw, h, h, -1)
    local = local.permute(0, 2, 1, 3, 4).reshape(th * h, tw * h, -1)
    local = torch.cat(
        [local, self.image_newline.expand(th * h, 1, -1)], 1
    ).reshape(-1, HIDDEN)
    return torch.cat([glob, self.view_seperator[None], local])

  def forward(self, ids, mask, tiles, grids, image_mask):
    embeds = self.language.embed_tokens(ids)
    rows = []
    for b, (tw, th) in enumerate(grids):
      row = embeds[b].clone()
      row[image_mask[b]] = self.image_tokens(tiles[b], tw, th)
      rows.append(row)
    out = self.language(inputs_embeds=torch.stack(rows), attention_mask=mask)
    return self.lm_head(out.last_hidden_state)

  def checkpoint(self):
    """The state dict in DeepSeek-VL2's names."""
    vision = test_siglip.hf_to_timm(
        {k: v.detach().numpy() for k, v in self.vision.state_dict().items()}
    )
    tensors = dict(vision)
    tensors["vision.attn_pool.latent"] = np.zeros((1, 1, VISION.width))
    for k, v in self.projector.state_dict().items():
      tensors[f"projector.layers.{k}"] = v.numpy()
    tensors["image_newline"] = self.image_newline.detach().numpy()
    tensors["view_seperator"] = self.view_seperator.detach().numpy()
    for k, v in self.language.state_dict().items():
      tensors[f"language.model.{k}"] = v.numpy()
    tensors["language.lm_head.weight"] = self.lm_head.weight.detach().numpy()
    return {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(checkpoint dir, torch reference) of a tiny random DeepSeek-VL2."""
  tmp = tmp_path_factory.mktemp("vl2")
  with torch.no_grad():
    ref = TorchVL2(tmp).eval()
  path = tmp / "ckpt"
  path.mkdir()
  safetensors.numpy.save_file(ref.checkpoint(), str(path / "model.safetensors"))
  config = deepseek_vl2.VL2Config(
      vision=VISION,
      projector=deepseek_vl2.ProjectorConfig(VISION.width, HIDDEN),
      language=models.deepseek.config_from_hf(ref.language_config),
      tiles=SPEC,
  )
  deepseek_vl2.write_config(path, config, ref.language_config)
  return path, ref


def _records():
  """Two records: a 2 x 1 image, and a 1 x 1 image with right padding."""
  rng = np.random.RandomState(3)
  pics = [
      Image.fromarray(rng.randint(0, 256, (20, 50, 3), np.uint8)),
      Image.fromarray(rng.randint(0, 256, (30, 30, 3), np.uint8)),
  ]
  seq = 3 + images.num_image_tokens(2, 1, SPEC) + 2
  ids = rng.randint(1, refs.VOCAB, (2, seq))
  mask = np.ones((2, seq), np.int64)
  index = np.full((2, seq), images.TEXT, np.int32)
  tiles = np.zeros((2, SPEC.max_tiles, 3, 28, 28), np.float32)
  grids = []
  for b, pic in enumerate(pics):
    pixels, (tw, th) = images.tile_image(pic, SPEC)
    tiles[b, : len(pixels)] = pixels
    grids.append((tw, th))
    slots = images.image_token_index(tw, th, SPEC)
    index[b, 3 : 3 + len(slots)] = slots
    mask[b, 3 + len(slots) + 2 :] = 0
  ids[mask == 0] = 0
  return ids, mask, tiles, grids, index


def test_logits_match_the_reference(tiny):
  path, ref = tiny
  module, params = models.from_pretrained(path)  # the whole model
  assert isinstance(module, deepseek_vl2.DeepseekVL2)
  ids, mask, tiles, grids, index = _records()
  assert grids == [(2, 1), (1, 1)]
  with torch.no_grad():
    want = ref(
        torch.tensor(ids),
        torch.tensor(mask),
        torch.tensor(tiles),
        grids,
        torch.tensor(index >= 0),
    ).numpy()
  got, _ = jax.jit(module.apply)({"params": params}, ids, mask, tiles, index)
  err = refs.rel_err(np.asarray(got), want)
  print(f"VL2 logits rel err {err:.1e}")
  assert err <= 1e-5


def test_text_only_is_the_decoder_bit_for_bit(tiny):
  """Without images the whole model's states are the text-only decoder's."""
  path, _ = tiny
  module, params = deepseek_vl2.from_pretrained(path)
  decoder, dparams = models.from_pretrained(path, language_only=True)
  assert isinstance(decoder, models.DeepseekDecoder)
  ids, mask = refs.batch()
  _, out = jax.jit(module.apply)({"params": params}, ids, mask)
  want = jax.jit(decoder.apply)({"params": dparams}, ids, mask)
  np.testing.assert_array_equal(out.hidden_states, want.hidden_states)


def test_a_text_head_on_the_whole_model_says_language_only(tiny):
  with pytest.raises(ValueError, match="pass language_only=True"):
    models.from_pretrained(tiny[0], num_labels=2)
  clf, _ = models.from_pretrained(tiny[0], num_labels=2, language_only=True)
  assert isinstance(clf.backbone, models.DeepseekDecoder)


def test_norm_topk_prob_is_read_for_vl2(tiny):
  """deepseek_vl_v2 keeps `norm_topk_prob` (DeepSeek's MoEGate applies it)."""
  hf = json.loads((tiny[0] / "config.json").read_text())
  assert not deepseek_vl2.config_from_hf(hf).language.norm_topk_prob
  hf["language_config"]["norm_topk_prob"] = True
  assert deepseek_vl2.config_from_hf(hf).language.norm_topk_prob


@pytest.mark.slow
def test_norm_topk_prob_changes_the_routing(tiny):
  """The renormalised top-k weights reach the experts (outputs change)."""
  path, _ = tiny
  hf = json.loads((path / "config.json").read_text())
  hf["language_config"]["norm_topk_prob"] = True
  config = deepseek_vl2.config_from_hf(hf)
  _, params = deepseek_vl2.from_pretrained(path)
  ids, mask = refs.batch()
  plain = models.deepseek.DeepseekDecoder(
      deepseek_vl2.config_from_hf(
          json.loads((path / "config.json").read_text())
      ).language
  )
  normed = models.deepseek.DeepseekDecoder(config.language)
  a = plain.apply({"params": params["language"]}, ids, mask).hidden_states
  b = normed.apply({"params": params["language"]}, ids, mask).hidden_states
  assert not np.allclose(a, b)


WORDS = ["question", "what", "colour", "is", "it", "red", "blue", "answer"]


def _scienceqa_config(path, tmp_path):
  """configs/deepseek_vl2_scienceqa.py on `path` and 4 JSONL image records."""
  from helpers import load_config_module  # pylint: disable=g-import-not-at-top
  from raptor_jax import data  # pylint: disable=g-import-not-at-top

  tok = data.build_word_tokenizer(WORDS + list("abcde") + ["?", ":", "."])
  tok.save_pretrained(str(path))
  rng = np.random.RandomState(0)
  lines = []
  for i, size in enumerate([(50, 20), (30, 30), (20, 50), (28, 28)]):
    Image.fromarray(rng.randint(0, 256, size[::-1] + (3,), np.uint8)).save(
        tmp_path / f"{i}.png"
    )
    lines.append(
        json.dumps(
            {
                "image": f"{i}.png",
                "question": "what colour is it?",
                "choices": ["red", "blue"],
                "answer": i % 2,
            }
        )
    )
  (tmp_path / "d.jsonl").write_text("\n".join(lines))
  # The same records as dev set: the trainer refuses one file for both.
  (tmp_path / "dev.jsonl").write_text("\n".join(lines))
  config = load_config_module("deepseek_vl2_scienceqa").get_config()
  config.model.name = str(path)
  config.model.dtype = "float32"
  config.data.train_path = str(tmp_path / "d.jsonl")
  config.data.dev_path = str(tmp_path / "dev.jsonl")
  config.data.max_length = 48
  config.data.length_buckets = (48,)
  config.batch_size = 2
  config.microbatch_size = 4
  return config, tok


@pytest.mark.slow
def test_scienceqa_run_on_the_tiny_checkpoint(tiny, tmp_path):
  """The trainer's image path (frozen table) equals the whole model's image
  path, and the head scores the letters with the LM head."""
  from raptor_jax.train.run import build_run  # pylint: disable=g-import-not-at-top

  path, _ = tiny
  letters = list("abcde")
  config, tok = _scienceqa_config(path, tmp_path)
  run = build_run(config)
  module, params = deepseek_vl2.from_pretrained(path)
  lm_head = np.asarray(params["lm_head"]["kernel"])
  letter_ids = [tok.convert_tokens_to_ids(l) for l in letters]
  flat = {**run.frozen}
  for part in run.trainable.values():
    flat.update(part)
  np.testing.assert_array_equal(flat["head/kernel"], lm_head[:, letter_ids])
  dev = run.data.dev

  logits, _ = run.model.apply(
      {"params": roles.unflatten(flat)}, dev.input_ids, dev.attention_mask
  )
  # The whole model on the same records, images through the tower.
  v = run.backbone_config.vocab_size
  index = np.full(dev.input_ids.shape, images.TEXT)
  tiles = np.zeros((4, SPEC.max_tiles, 3, 28, 28), np.float32)
  records = mc.read_image_choices(tmp_path / "d.jsonl")
  for b, r in enumerate(records):
    pixels, grid = images.tile_image(r.image, SPEC)
    tiles[b, : len(pixels)] = pixels
    slots = images.image_token_index(*grid, SPEC)
    index[b, 1 : 1 + len(slots)] = slots
  ids = np.where(dev.input_ids >= v, 0, dev.input_ids)
  full, _ = module.apply(
      {"params": params}, ids, dev.attention_mask, tiles, index
  )
  last = dev.attention_mask.sum(1) - 1
  want = np.asarray(full)[np.arange(4), last][:, letter_ids]
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_export_writes_deepseeks_layout(tiny, tmp_path):
  """A trained run exports as a deepseek_vl_v2 checkpoint: tower, projector
  and layout embeddings unchanged, the merged language model, the trained
  head in the LM head's letter rows, and no image table."""
  from raptor_jax import release  # pylint: disable=g-import-not-at-top
  from raptor_jax.models import lora, stack  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import loop  # pylint: disable=g-import-not-at-top

  path, _ = tiny
  config, tok = _scienceqa_config(path, tmp_path)
  config.epochs = 1
  config.progress_bar = False
  loop.train_and_evaluate(config, str(tmp_path / "work"))
  out = release.export(tmp_path / "work", tmp_path / "out")
  names = safetensors.numpy.load_file(str(out / "model.safetensors"))
  assert not any("image_table" in n for n in names)
  assert "DeepSeek-VL2" in (out / "README.md").read_text()
  _, source = deepseek_vl2.from_pretrained(path)
  _, exported = deepseek_vl2.from_pretrained(out)
  jax.tree.map(
      np.testing.assert_array_equal, exported["encoder"], source["encoder"]
  )
  run, params, _ = release.trained_model(tmp_path / "work")
  letters = [tok.convert_tokens_to_ids(l) for l in "abcde"]
  head = np.asarray(exported["lm_head"]["kernel"])
  np.testing.assert_array_equal(head[:, letters], params["head"]["kernel"])
  others = [i for i in range(head.shape[1]) if i not in letters]
  np.testing.assert_array_equal(
      head[:, others], np.asarray(source["lm_head"]["kernel"])[:, others]
  )
  config = run.model.backbone.config
  merged = lora.merge(params["backbone"], config.lora_alpha, config.lora_rank)
  merged.pop("image_table")
  language = deepseek_vl2.config_from_hf(
      json.loads((out / "config.json").read_text())
  ).language
  per_layer = lambda tree, c: roles.flatten(stack.unstack_layers(tree, c))
  flat = per_layer(exported["language"], language)
  want = per_layer(merged, config)
  assert set(flat) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(flat[name], value, rtol=1e-6, atol=1e-7)
  before = per_layer(source["language"], language)
  # training moved the language model
  assert any(not np.array_equal(before[n], flat[n]) for n in flat)
