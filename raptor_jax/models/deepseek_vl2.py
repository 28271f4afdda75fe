"""DeepSeek-VL2: the SigLIP tower, the projector, and the image tokens in the sequence.

The whole vision-language model of a `deepseek_vl_v2` checkpoint
(deepseek_vl2/models/modeling_deepseek_vl_v2.py), as flax.linen modules:

* `vision`: `siglip.SiglipVisionTower`, one pass per tile (the global view
  and each local tile, `data.images.tile_image`).
* `projector` (`MlpProjector`, type `downsample_mlp_gelu`): the tower's
  grid x grid tokens are zero-padded at the bottom and right to an even
  grid, each 2 x 2 block is concatenated channel-major (feature c * 4 + 2 i
  + j, the order of torch's `F.unfold`), then Linear -> GELU (exact erf)
  -> Linear to the language model's width (`depth` linears in all, hidden
  width n_embed * mlp_ratio).
* `image_newline`, `view_separator` (the checkpoint's `view_seperator`):
  two learned vectors of the language model's width. The image's tokens
  are placed where the prompt has image positions, in the 2D tile-tag
  layout `data.images.image_token_index` computes from the tile grid.
* `language`: the existing `DeepseekDecoder`, unchanged; the image tokens
  replace its token embeddings at the image positions (`image_embeds`,
  `image_mask`). Without images the call is the text-only decoder's.

The language model's `lm_head` (`language.lm_head.weight`) is kept as
`lm_head` (Flax layout [D, V]): multiple-choice tasks score the choice
letters with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax.data import images as image_data
from raptor_jax.models import deepseek, family, loading, siglip, stack
from raptor_jax.models.family import COPY, Rule


@dataclasses.dataclass(frozen=True)
class ProjectorConfig:
  """DeepSeek-VL2's `projector_config` (MlpProjectorConfig's defaults)."""

  input_dim: int = 1152
  n_embed: int = 2048
  depth: int = 2
  mlp_ratio: int = 1
  downsample_ratio: int = 2

  def __post_init__(self):
    if self.depth < 1 or self.downsample_ratio < 1:
      raise ValueError(
          f"projector_config: depth {self.depth} and downsample_ratio"
          f" {self.downsample_ratio} must be >= 1"
      )


def projector_config_from_hf(hf: dict[str, Any]) -> ProjectorConfig:
  kind = hf.get("projector_type", "downsample_mlp_gelu")
  if kind != "downsample_mlp_gelu" or hf.get("token_pooling", False):
    raise ValueError(
        f"projector_config: projector_type {kind!r} (token_pooling"
        f" {hf.get('token_pooling', False)}) is not supported; DeepSeek-VL2"
        " uses 'downsample_mlp_gelu' without token pooling"
    )
  fields = [f.name for f in dataclasses.fields(ProjectorConfig)]
  return ProjectorConfig(**{k: int(hf[k]) for k in fields if k in hf})


def downsample(tokens_TxNxC: jax.Array, ratio: int) -> jax.Array:
  """[T, g * g, C] -> [T, ceil(g / r)^2, C * r * r], as pad + F.unfold.

  Zero padding at the bottom and the right up to a multiple of r; block
  (bi, bj) row-major; within a block, feature c * r * r + i * r + j.
  """
  t, n, c = tokens_TxNxC.shape
  g = int(round(n**0.5))
  if g * g != n:
    raise ValueError(f"downsample: {n} tokens are not a square grid")
  side = -(-g // ratio)
  pad = side * ratio - g
  x = tokens_TxNxC.reshape(t, g, g, c)
  x = jnp.pad(x, ((0, 0), (0, pad), (0, pad), (0, 0)))
  x = x.reshape(t, side, ratio, side, ratio, c).transpose(0, 1, 3, 5, 2, 4)
  return x.reshape(t, side * side, c * ratio * ratio)


class MlpProjector(nn.Module):
  """downsample -> Linear -> (GELU -> Linear) x (depth - 1)."""

  config: ProjectorConfig

  @nn.compact
  def __call__(self, tokens_TxNxC: jax.Array) -> jax.Array:
    cfg = self.config
    x = downsample(tokens_TxNxC, cfg.downsample_ratio)
    hidden = cfg.n_embed * cfg.mlp_ratio
    for j in range(cfg.depth):
      if j:
        x = jax.nn.gelu(x, approximate=False)
      width = cfg.n_embed if j == cfg.depth - 1 else hidden
      x = nn.Dense(width, name=f"layers_{2 * j}")(x)  # torch Sequential index
    return x


@dataclasses.dataclass(frozen=True)
class VL2Config:
  """The three parts' configs and the public tiling."""

  vision: siglip.SiglipConfig
  projector: ProjectorConfig
  language: deepseek.DeepseekConfig
  tiles: image_data.TileSpec

  def __post_init__(self):
    if self.projector.input_dim != self.vision.width:
      raise ValueError(
          f"projector_config.input_dim {self.projector.input_dim} must equal"
          f" the vision width {self.vision.width}"
      )
    if self.projector.n_embed != self.language.hidden_size:
      raise ValueError(
          f"projector_config.n_embed {self.projector.n_embed} must equal the"
          f" language model's hidden_size {self.language.hidden_size}"
      )
    if self.tiles.tile != self.vision.image_size:
      raise ValueError(
          f"candidate_resolutions[0][0] = {self.tiles.tile} must equal the"
          f" vision image_size {self.vision.image_size}"
      )


class ImageEncoder(nn.Module):
  """Tiles [B, T, 3, S, S] -> the embedding table of each record's image.

  Returns [B, 2 + T * side^2, D]: slot 0 the image newline, slot 1 the view
  separator, then every tile's projected tokens (`data.images` layout).
  Tiles past a record's own count are zeros whose tokens no index reads.
  """

  config: VL2Config

  @nn.compact
  def __call__(self, pixels_BxTxCxSxS: jax.Array) -> jax.Array:
    cfg = self.config
    b, t = pixels_BxTxCxSxS.shape[:2]
    tiles = pixels_BxTxCxSxS.reshape((b * t,) + pixels_BxTxCxSxS.shape[2:])
    feats = siglip.SiglipVisionTower(cfg.vision, name="vision")(tiles)
    feats = MlpProjector(cfg.projector, name="projector")(feats)
    d = feats.shape[-1]
    feats = feats.reshape(b, -1, d)
    init = nn.initializers.normal(cfg.projector.n_embed**-0.5)
    newline = self.param("image_newline", init, (d,))
    separator = self.param("view_separator", init, (d,))
    special = jnp.broadcast_to(
        jnp.stack([newline, separator]).astype(feats.dtype), (b, 2, d)
    )
    return jnp.concatenate([special, feats], axis=1)


def place_images(
    table_BxKxD: jax.Array, image_index_BxS: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(image_embeds [B, S, D], image_mask [B, S]) from the per-record tables."""
  mask = image_index_BxS >= 0
  idx = jnp.maximum(image_index_BxS, 0)
  embeds = jnp.take_along_axis(table_BxKxD, idx[..., None], axis=1)
  return embeds, mask


class DeepseekVL2(nn.Module):
  """Tokens (and tiles) -> the language model's output.

  Parameters: `encoder/{vision, projector, image_newline, view_separator}`,
  `language/...` (the `DeepseekDecoder` tree), `lm_head/kernel` [D, V].
  """

  config: VL2Config

  def setup(self):
    self.encoder = ImageEncoder(self.config)
    self.language = deepseek.DeepseekDecoder(self.config.language)
    self.lm_head = nn.Dense(
        self.config.language.vocab_size, use_bias=False, name="lm_head"
    )

  def __call__(
      self,
      input_ids,
      attention_mask=None,
      pixels=None,
      image_index=None,
      owner_override=None,
  ):
    """Returns (logits [B, S, V], BackboneOutput).

    Args:
      input_ids: int [B, S] (any id at image positions; it is replaced).
      attention_mask: {0, 1} [B, S].
      pixels: optional float [B, T, 3, S_img, S_img] tiles of each record's
        image (`data.images.tile_image`, zero tiles as padding).
      image_index: int [B, S], -1 at text positions, else the slot of
        `ImageEncoder`'s table (`data.images.image_token_index`).
    """
    if pixels is None:
      out = self.language(input_ids, attention_mask, owner_override)
    else:
      embeds, mask = place_images(self.encoder(pixels), image_index)
      out = self.language(
          input_ids,
          attention_mask,
          owner_override,
          image_embeds=embeds,
          image_mask=mask,
      )
    return self.lm_head(out.hidden_states.astype(jnp.float32)), out


# --- loading a deepseek_vl_v2 checkpoint -------------------------------------


def config_from_hf(hf: dict[str, Any], **options) -> VL2Config:
  """VL2Config of a `deepseek_vl_v2` config.json (options: the decoder's)."""
  tile_tag = hf.get("tile_tag", "2D")
  if tile_tag != "2D":
    raise ValueError(
        f"config.json: tile_tag {tile_tag!r} is not supported; DeepSeek-VL2"
        " uses '2D' (the 1D layout is marked abandoned in its code)"
    )
  vision = siglip.config_from_hf(hf.get("vision_config", {}))
  candidates = tuple(
      tuple(int(v) for v in c)
      for c in hf.get("candidate_resolutions", [[384, 384]])
  )
  projector = projector_config_from_hf(hf.get("projector_config", {}))
  return VL2Config(
      vision=vision,
      projector=projector,
      language=deepseek.vl2_config_from_hf(hf, **options),
      tiles=image_data.TileSpec(
          candidate_resolutions=candidates,
          tile=candidates[0][0],
          patch_size=vision.patch_size,
          downsample_ratio=projector.downsample_ratio,
          global_view_pos=hf.get("global_view_pos", "head"),
      ),
  )


def _projector_rules(depth: int) -> tuple[Rule, ...]:
  return tuple(
      rule
      for j in range(depth)
      for rule in (
          Rule(
              f"projector/layers_{2 * j}/kernel",
              f"projector.layers.{2 * j}.weight",
          ),
          Rule(
              f"projector/layers_{2 * j}/bias",
              f"projector.layers.{2 * j}.bias",
              COPY,
          ),
      )
  )


def encoder_names(config: VL2Config) -> family.NameTable:
  """Projector and special embeddings (the tower: `siglip.siglip_names`)."""
  return family.NameTable(
      "DeepSeek-VL2",
      (
          *_projector_rules(config.projector.depth),
          Rule("image_newline", "image_newline", COPY),
          Rule(
              "view_separator", "view_seperator", COPY
          ),  # sic, the checkpoint's
      ),
  )


def params_from_hf(tensors: dict[str, np.ndarray], config: VL2Config) -> dict:
  """The whole model's parameter tree from a checkpoint's tensors."""
  vision = siglip.params_from_hf(tensors, config.vision)
  rest = {
      n: w
      for n, w in tensors.items()
      if n.startswith("projector.") or n in ("image_newline", "view_seperator")
  }
  encoder = dict(encoder_names(config).to_flax(rest, num_experts=0))
  encoder["vision"] = vision
  language = {
      n: w
      for n, w in tensors.items()
      if n.startswith("language.") and not n.startswith("language.lm_head.")
  }
  known = (
      "vision.",
      "projector.",
      "language.",
      "image_newline",
      "view_seperator",
  )
  unknown = sorted(n for n in tensors if not n.startswith(known))
  if unknown:
    raise ValueError(
        f"unexpected tensor {unknown[0]} in the DeepSeek-VL2 checkpoint"
    )
  params = {
      "encoder": encoder,
      "language": deepseek.vl2_params_from_hf(language, config.language),
  }
  if "language.lm_head.weight" in tensors:
    params["lm_head"] = {
        "kernel": family.torch_linear(tensors["language.lm_head.weight"])
    }
  return params


def vl2_checkpoint(path: str | os.PathLike):
  """(directory, config.json dict) of a `deepseek_vl_v2` checkpoint."""
  model_dir = loading.resolve_model_dir(path)
  hf = loading.read_config(model_dir)
  if hf.get("model_type") != "deepseek_vl_v2":
    raise ValueError(
        f"{model_dir}/config.json: model_type {hf.get('model_type')!r}, not"
        " 'deepseek_vl_v2' (DeepSeek-VL2); load text checkpoints with"
        " models.from_pretrained"
    )
  return model_dir, hf


def from_pretrained(path: str | os.PathLike, *, seed: int = 0, **options):
  """(DeepseekVL2, params) of a `deepseek_vl_v2` checkpoint (`models.from_pretrained`'s).

  `options` are the language model's (`models.from_pretrained`'s, e.g.
  lora_rank, scan_layers); the vision tower and projector are loaded as
  they are; `seed` draws the adapters the checkpoint lacks. Raises
  ValueError for another `model_type`.
  """
  model_dir, hf = vl2_checkpoint(path)
  config = config_from_hf(hf, **options)
  tensors = loading.load_tensors(model_dir, keep=lambda n: True)
  params = params_from_hf(tensors, config)
  params["language"] = stack.stack_layers(params["language"], config.language)
  module = DeepseekVL2(config)
  # LoRA factors and anything else the checkpoint lacks, as the text path does.
  language = deepseek.DeepseekDecoder(config.language)
  params["language"] = loading.init_missing(
      language, params["language"], jax.random.PRNGKey(seed)
  )
  return module, params


def encoder_from_pretrained(path: str | os.PathLike):
  """(ImageEncoder, its params, TileSpec) of a `deepseek_vl_v2` checkpoint.

  Reads only the tower, the projector and the layout embeddings (the
  frozen part of the paper's fine-tuning), not the language model.
  """
  model_dir, hf = vl2_checkpoint(path)
  config = config_from_hf(hf)
  tensors = loading.load_tensors(
      model_dir, keep=lambda n: not n.startswith("language.")
  )
  rest = {n: w for n, w in tensors.items() if not n.startswith("vision.")}
  encoder = dict(encoder_names(config).to_flax(rest, num_experts=0))
  encoder["vision"] = siglip.params_from_hf(tensors, config.vision)
  return ImageEncoder(config), encoder, config.tiles


def language_head(path: str | os.PathLike) -> tuple[int, np.ndarray | None]:
  """(vocab_size, `language.lm_head.weight` [V, D] or None) of a checkpoint."""
  model_dir, hf = vl2_checkpoint(path)
  vocab = int(hf["language_config"]["vocab_size"])
  tensors = loading.load_tensors(
      model_dir, keep=lambda n: n == "language.lm_head.weight"
  )
  head = tensors.get("language.lm_head.weight")
  return vocab, None if head is None else np.asarray(head, np.float32)


def hf_config_dict(config: VL2Config, language: dict[str, Any]) -> dict:
  """A `deepseek_vl_v2` config.json dict (tests write tiny checkpoints with it)."""
  return {
      "model_type": "deepseek_vl_v2",
      "architectures": ["DeepseekVLV2ForCausalLM"],
      "tile_tag": "2D",
      "global_view_pos": config.tiles.global_view_pos,
      "candidate_resolutions": [
          list(c) for c in config.tiles.candidate_resolutions
      ],
      "vision_config": siglip.hf_vision_config(config.vision),
      "projector_config": {
          "projector_type": "downsample_mlp_gelu",
          **dataclasses.asdict(config.projector),
      },
      "language_config": language,
  }


def write_config(path, config: VL2Config, language: dict[str, Any]) -> None:
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config_dict(config, language), f)
