"""The SigLIP vision tower of DeepSeek-VL2 (a timm ViT) as flax.linen modules.

DeepSeek-VL2 builds its vision encoder as timm's `VisionTransformer` with
`class_token=False`, `global_pool='map'` and `ignore_head=True`
(deepseek_vl2/models/modeling_deepseek_vl_v2.py, DeepseekVLV2ForCausalLM
.__init__; deepseek_vl2/models/siglip_vit.py, VisionTransformer). With
`ignore_head` its output is `forward_features`: the final LayerNorm of the
patch tokens; the attention-pooling head (`attn_pool.*`) is built but never
run, so it is not ported (its tensors are skipped on load). The computation:

* patch embedding: a `patch_size` x `patch_size` convolution, stride
  `patch_size`, no padding, with bias (`pre_norm=False`). 384 px at patch 14
  gives a 27 x 27 grid; the last 384 - 27 * 14 = 6 pixel rows and columns
  are never read (a VALID convolution), and neither are they here.
* a learned absolute position embedding added to every patch (no class
  token, no resampling: tiles always have the tower's own size);
* `layers` pre-norm blocks: LayerNorm (eps 1e-6) -> multi-head attention
  with one fused `qkv` projection (with bias), scale head_dim^-1/2, no mask
  -> `proj`; LayerNorm -> `fc1` -> tanh-approximated GELU -> `fc2`; no layer
  scale, no drop path (eval);
* a final LayerNorm.

transformers' `SiglipVisionModel` (`vision_use_head=False`) computes the
same function with q, k, v as three projections; tests/test_siglip.py checks
outputs and every parameter's gradient against it in float64.

The tower is frozen in the paper's setting (LoRA on the language model
only), so it has no adapters and no experts: it plays no part in RAPTOR's
roles. Its parameter tree keeps timm's names (`siglip_names`), so the
checkpoint's `vision.` tensors load by name; its blocks are `vit_block_{i}`,
never `block_{i}`, so `roles.py` never takes them for language-model blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax.models import family
from raptor_jax.models.family import COPY, Layout, Rule


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
  """Sizes of the tower (DeepSeek-VL2's `vision_config`).

  Attributes:
    image_size: the side of a square tile in pixels (384).
    patch_size: the side of a patch (14 for SigLIP-SO400M/14).
    width: the token width (1152).
    layers: number of blocks (27).
    heads: attention heads (16).
    mlp_dim: the MLP's hidden width, `int(width * mlp_ratio)` as timm sizes
      it (4304 = int(1152 * 3.7362)).
    layer_norm_eps: every LayerNorm's eps (1e-6, siglip_vit.py).
  """

  image_size: int = 384
  patch_size: int = 14
  width: int = 1152
  layers: int = 27
  heads: int = 16
  mlp_dim: int = 4304
  layer_norm_eps: float = 1e-6

  def __post_init__(self):
    if self.width % self.heads:
      raise ValueError(
          f"vision_config: width {self.width} must be divisible by heads"
          f" {self.heads}"
      )
    if self.image_size < self.patch_size:
      raise ValueError(
          f"vision_config: image_size {self.image_size} is smaller than"
          f" patch_size {self.patch_size}"
      )

  @property
  def grid(self) -> int:
    """Patches per side: floor(image_size / patch_size) (a VALID conv)."""
    return self.image_size // self.patch_size

  @property
  def num_patches(self) -> int:
    return self.grid * self.grid


def config_from_hf(vision: dict[str, Any]) -> SiglipConfig:
  """SiglipConfig of a DeepSeek-VL2 `vision_config` dict.

  Reads the same keys DeepseekVLV2ForCausalLM passes to VisionTransformer
  (image_size, patch_size, width, layers, heads, mlp_ratio); the defaults are
  VisionEncoderConfig's. `global_pool`, `ignore_head` and `class_token` must
  be the values DeepSeek-VL2 runs with ('map', true, false): another value
  would change what the tower returns.
  """
  expected = {"ignore_head": True, "class_token": False}
  bad = {k: vision[k] for k, v in expected.items() if vision.get(k, v) != v}
  if bad:
    raise ValueError(
        f"vision_config: {bad} is not supported; the port is the tower"
        " DeepSeek-VL2 runs (ignore_head=true, class_token=false)"
    )
  width = int(vision.get("width", 1024))
  return SiglipConfig(
      image_size=int(vision.get("image_size", 384)),
      patch_size=int(vision.get("patch_size", 16)),
      width=width,
      layers=int(vision.get("layers", 24)),
      heads=int(vision.get("heads", 16)),
      mlp_dim=int(width * float(vision.get("mlp_ratio", 4))),
  )


def hf_vision_config(config: SiglipConfig) -> dict[str, Any]:
  """The `vision_config` dict DeepSeek-VL2's code reads for this tower.

  `mlp_ratio` is written so that `int(width * mlp_ratio)` gives back
  `mlp_dim` exactly.
  """
  return {
      "model_name": "siglip_so400m_patch14_384",
      "image_size": config.image_size,
      "patch_size": config.patch_size,
      "width": config.width,
      "layers": config.layers,
      "heads": config.heads,
      "mlp_ratio": (config.mlp_dim + 0.5) / config.width,
      "global_pool": "map",
      "ignore_head": True,
      "class_token": False,
  }


def patchify(pixels_BxCxHxW: jax.Array, patch_size: int) -> jax.Array:
  """Non-overlapping patches [B, gh * gw, C * p * p], row-major over the grid.

  Each patch is flattened in (channel, row, column) order, the order of a
  torch Conv2d weight [D, C, p, p], so the patch embedding is one matmul.
  Rows and columns past the last whole patch are dropped (VALID conv).
  """
  b, c, h, w = pixels_BxCxHxW.shape
  p = patch_size
  gh, gw = h // p, w // p
  x = pixels_BxCxHxW[:, :, : gh * p, : gw * p]
  x = x.reshape(b, c, gh, p, gw, p).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(b, gh * gw, c * p * p)


def _layer_norm(eps: float, name: str) -> nn.LayerNorm:
  # Two-pass variance, as torch's LayerNorm computes it.
  return nn.LayerNorm(epsilon=eps, use_fast_variance=False, name=name)


class SiglipAttention(nn.Module):
  """Multi-head self-attention with a fused `qkv` projection (timm)."""

  heads: int

  @nn.compact
  def __call__(self, x_BxNxD: jax.Array) -> jax.Array:
    b, n, d = x_BxNxD.shape
    head_dim = d // self.heads
    qkv = nn.Dense(3 * d, name="qkv")(x_BxNxD)
    qkv = qkv.reshape(b, n, 3, self.heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * head_dim**-0.5, k)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, d)
    return nn.Dense(d, name="proj")(out)


class SiglipBlock(nn.Module):
  """x + attn(norm1(x)); x + fc2(gelu_tanh(fc1(norm2(x))))."""

  config: SiglipConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + SiglipAttention(cfg.heads, name="attn")(
        _layer_norm(cfg.layer_norm_eps, "norm1")(x)
    )
    h = _layer_norm(cfg.layer_norm_eps, "norm2")(x)
    h = nn.Dense(cfg.mlp_dim, name="fc1")(h)
    h = nn.Dense(cfg.width, name="fc2")(jax.nn.gelu(h, approximate=True))
    return x + h


class SiglipVisionTower(nn.Module):
  """Pixels [B, 3, H, W] (normalised to [-1, 1]) -> patch tokens [B, N, width].

  H and W must equal `config.image_size` (tiles are cut to it by
  `vl2_processing`). The dtype follows the parameters and the input (float64
  in the parity tests).
  """

  config: SiglipConfig

  @nn.compact
  def __call__(self, pixels_BxCxHxW: jax.Array) -> jax.Array:
    cfg = self.config
    if pixels_BxCxHxW.shape[-2:] != (cfg.image_size, cfg.image_size):
      raise ValueError(
          f"pixels: tiles must be {cfg.image_size} x {cfg.image_size}, got"
          f" {pixels_BxCxHxW.shape[-2:]}; cut images with vl2_processing"
      )
    patches = patchify(pixels_BxCxHxW, cfg.patch_size)
    x = nn.Dense(cfg.width, name="patch_embed")(patches)
    pos = self.param(
        "pos_embed",
        nn.initializers.normal(0.02),
        (cfg.num_patches, cfg.width),
    )
    x = x + pos.astype(x.dtype)
    for i in range(cfg.layers):
      x = SiglipBlock(cfg, name=f"vit_block_{i}")(x)
    return _layer_norm(cfg.layer_norm_eps, "norm")(x)


# --- timm / DeepSeek-VL2 tensor names <-> the Flax tree ----------------------


def _conv_to_flat(w: np.ndarray) -> tuple[np.ndarray]:
  """torch Conv2d weight [D, C, p, p] -> Dense kernel [C * p * p, D]."""
  w = np.asarray(w)
  return (np.ascontiguousarray(w.reshape(w.shape[0], -1).T),)


def _flat_to_conv(kernel: np.ndarray, patch_size: int) -> np.ndarray:
  d = kernel.shape[1]
  return np.ascontiguousarray(
      np.asarray(kernel, np.float32).T.reshape(d, -1, patch_size, patch_size)
  )


_POS = Layout(
    lambda w: (np.ascontiguousarray(np.asarray(w).reshape(w.shape[-2:])),),
    family.float32(lambda w: np.ascontiguousarray(w[None])),
)
_BLOCK, _LAYER = "vit_block_{i}/", "blocks.{i}."


def _linear(ours: str, theirs: str) -> tuple[Rule, Rule]:
  return (
      Rule(ours + "/kernel", theirs + ".weight"),
      Rule(ours + "/bias", theirs + ".bias", COPY),
  )


def _norm(ours: str, theirs: str) -> tuple[Rule, Rule]:
  return (
      Rule(ours + "/scale", theirs + ".weight", COPY),
      Rule(ours + "/bias", theirs + ".bias", COPY),
  )


def siglip_names(patch_size: int) -> family.NameTable:
  """The tower's names in DeepSeek-VL2 checkpoints (timm's, under `vision.`).

  `attn_pool.*` (the unused attention-pooling head) is skipped on load; the
  patch embedding's conv weight needs `patch_size` to be written back.
  """
  conv = Layout(_conv_to_flat, lambda k: _flat_to_conv(k, patch_size))
  return family.NameTable(
      "SigLIP",
      (
          Rule("patch_embed/kernel", "patch_embed.proj.weight", conv),
          Rule("patch_embed/bias", "patch_embed.proj.bias", COPY),
          Rule("pos_embed", "pos_embed", _POS),
          *_norm(_BLOCK + "norm1", _LAYER + "norm1"),
          *_linear(_BLOCK + "attn/qkv", _LAYER + "attn.qkv"),
          *_linear(_BLOCK + "attn/proj", _LAYER + "attn.proj"),
          *_norm(_BLOCK + "norm2", _LAYER + "norm2"),
          *_linear(_BLOCK + "fc1", _LAYER + "mlp.fc1"),
          *_linear(_BLOCK + "fc2", _LAYER + "mlp.fc2"),
          *_norm("norm", "norm"),
      ),
      prefix="vision.",
  )


def params_from_hf(tensors: dict[str, np.ndarray], config: SiglipConfig):
  """The tower's Flax parameters from a checkpoint's `vision.` tensors."""
  ours = {
      name: w
      for name, w in tensors.items()
      if name.startswith("vision.") and not name.startswith("vision.attn_pool.")
  }
  return siglip_names(config.patch_size).to_flax(ours, num_experts=0)
