"""DeepSeek-VL2's image pre-processing and tiling, as numpy / PIL functions.

What DeepSeek-VL2's processor does with one image
(deepseek_vl2/models/processing_deepseek_vl_v2.py, `tokenize_with_images`
and `select_best_resolution`), restated as small functions of public sizes:

1. **Best resolution.** Among the candidate resolutions (w, h), each a
   multiple of the tile side, the one that keeps the most of the image's
   pixels when the image is scaled to fit inside it (effective resolution
   min(int(W s) * int(H s), W * H), s = min(w / W, h / H)); ties go to the
   least padding (w h minus the effective resolution); the first candidate
   wins an exact tie. (The processor crops only when a prompt has at most 2
   images; a single-image record always does.)
2. **Global view.** The whole image, scaled to fit a tile (aspect kept,
   bicubic, `PIL.ImageOps.pad`) and centred on a background of the mean
   colour int(0.5 * 255) = 127.
3. **Local views.** The image fitted the same way into the best resolution,
   cut into (h / tile) rows of (w / tile) tiles, row by row.
4. **Pixels.** RGB / 255, then (x - 0.5) / 0.5, channels first.
5. **Tokens.** A tile of `grid` = tile // patch patches per side gives
   `side` = ceil(grid / downsample) tokens per side after the projector's
   2 x 2 downsample. The global view takes side * (side + 1) tokens (a
   newline after each row), one view separator follows, and the local
   views (th * side) * (tw * side + 1): the tiles of a row of tiles are
   laid side by side, one newline per row of tokens.

The token count is a function of the image's size (and the public
candidates) alone, so a record's sequence length, hence its length bucket,
depends only on that record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

BACKGROUND = 127  # int(0.5 * 255): the processor's padding colour
# Table slots of the two learned embeddings in `image_token_index`; tile
# tokens follow from slot 2 on.
NEWLINE, SEPARATOR, FIRST_TILE_SLOT = 0, 1, 2
TEXT = -1  # a text position in `image_token_index`


@dataclasses.dataclass(frozen=True)
class TileSpec:
  """The public sizes of DeepSeek-VL2's tiling.

  Attributes:
    candidate_resolutions: (width, height) pairs, each a multiple of
      `tile` (config.json's `candidate_resolutions`).
    tile: the side of a tile in pixels (the vision tower's image_size;
      the processor uses candidate_resolutions[0][0]).
    patch_size: the vision tower's patch side.
    downsample_ratio: the projector's downsample (2).
    global_view_pos: 'head' (global view, separator, local views) or
      'tail' (local views, separator, global view).
  """

  candidate_resolutions: tuple[tuple[int, int], ...] = ((384, 384),)
  tile: int = 384
  patch_size: int = 14
  downsample_ratio: int = 2
  global_view_pos: str = "head"

  def __post_init__(self):
    bad = [
        c
        for c in self.candidate_resolutions
        if len(c) != 2 or c[0] % self.tile or c[1] % self.tile or min(c) <= 0
    ]
    if bad or not self.candidate_resolutions:
      raise ValueError(
          f"candidate_resolutions: {bad or 'empty'}; every candidate must be"
          f" a positive (width, height) multiple of the tile side {self.tile}"
      )
    if self.global_view_pos not in ("head", "tail"):
      raise ValueError(
          f"global_view_pos: {self.global_view_pos!r}, must be 'head' or"
          " 'tail'"
      )

  @property
  def side(self) -> int:
    """Tokens per side of one tile after the projector's downsample."""
    return math.ceil((self.tile // self.patch_size) / self.downsample_ratio)

  @property
  def max_tiles(self) -> int:
    """The most local tiles any candidate gives, plus the global view."""
    return 1 + max(
        (w // self.tile) * (h // self.tile)
        for w, h in self.candidate_resolutions
    )


def best_resolution(
    image_size: tuple[int, int], candidates: Sequence[tuple[int, int]]
) -> tuple[int, int]:
  """The candidate (w, h) that keeps the most pixels, then wastes the least."""
  width, height = image_size
  best, best_kept, best_waste = None, -1, None
  for w, h in candidates:
    scale = min(w / width, h / height)
    kept = min(int(width * scale) * int(height * scale), width * height)
    waste = w * h - kept
    if kept > best_kept or (kept == best_kept and waste < best_waste):
      best, best_kept, best_waste = (int(w), int(h)), kept, waste
  return best


def tile_grid(image_size: tuple[int, int], spec: TileSpec) -> tuple[int, int]:
  """(tiles across, tiles down) of an image of `image_size` = (W, H)."""
  w, h = best_resolution(image_size, spec.candidate_resolutions)
  return w // spec.tile, h // spec.tile


def num_image_tokens(tiles_w: int, tiles_h: int, spec: TileSpec) -> int:
  """Sequence positions one image takes (global + separator + local)."""
  s = spec.side
  return s * (s + 1) + 1 + (tiles_h * s) * (tiles_w * s + 1)


def image_token_index(tiles_w: int, tiles_h: int, spec: TileSpec) -> np.ndarray:
  """int32 [num_image_tokens]: where each image position reads its embedding.

  Entries index a table whose slot NEWLINE (0) is the learned image newline,
  slot SEPARATOR (1) the view separator, and slot 2 + t * side^2 + r * side
  + c the projected token (r, c) of tile t (t = 0 the global view, then the
  local tiles row by row): the layout of `prepare_inputs_embeds` in
  modeling_deepseek_vl_v2.py, as a gather.
  """
  s = spec.side
  r, c = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
  newline_col = np.full((s, 1), NEWLINE)
  glob = np.concatenate([FIRST_TILE_SLOT + r * s + c, newline_col], axis=1)
  R, C = np.meshgrid(
      np.arange(tiles_h * s), np.arange(tiles_w * s), indexing="ij"
  )
  tile = 1 + (R // s) * tiles_w + (C // s)
  local = FIRST_TILE_SLOT + tile * s * s + (R % s) * s + (C % s)
  local = np.concatenate(
      [local, np.full((tiles_h * s, 1), NEWLINE)], axis=1
  ).reshape(-1)
  glob = glob.reshape(-1)
  sep = np.array([SEPARATOR])
  parts = (glob, sep, local)
  if spec.global_view_pos == "tail":
    parts = (local, sep, glob)
  return np.concatenate(parts).astype(np.int32)


def to_pixels(image) -> np.ndarray:
  """float32 [3, H, W] in [-1, 1]: RGB / 255, normalised by mean = std = 0.5."""
  x = np.asarray(image.convert("RGB"), np.float32) / 255.0
  return ((x - 0.5) / 0.5).transpose(2, 0, 1)


def fit(image, size: tuple[int, int]):
  """The image scaled to fit `size` (aspect kept, bicubic), centred on grey."""
  from PIL import ImageOps  # pylint: disable=g-import-not-at-top

  return ImageOps.pad(image.convert("RGB"), size, color=(BACKGROUND,) * 3)


def tile_image(image, spec: TileSpec) -> tuple[np.ndarray, tuple[int, int]]:
  """(pixels [1 + tw * th, 3, tile, tile], (tw, th)): global view, then tiles.

  `image` is a PIL image; its size alone picks the grid (`tile_grid`).
  """
  tw, th = tile_grid(image.size, spec)
  t = spec.tile
  views = [to_pixels(fit(image, (t, t)))]
  local = fit(image, (tw * t, th * t))
  for i in range(th):
    for j in range(tw):
      views.append(
          to_pixels(local.crop((j * t, i * t, (j + 1) * t, (i + 1) * t)))
      )
  return np.stack(views), (tw, th)
