"""The embedded offline image task: coloured shapes, 4 choices, no files.

Each record is a small picture of one shape (square, disc, triangle or
cross) in one of 4 colours on a light, noisy background, and the question
"what colour is the <shape>?" with the 4 colours as choices A-D in a fixed
order; the answer is the shape's colour. Pictures are one tile wide or two
(`wide_fraction`), so records fall into two public tilings and two sequence
lengths. Everything is drawn from `seed` (public randomness); the words of
the prompt are a fixed public vocabulary (`VOCABULARY`).
"""

from __future__ import annotations

import numpy as np

from raptor_jax.data import multiple_choice

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 40),
}
SHAPES = ("square", "disc", "triangle", "cross")
# Every word `multiple_choice.prompt` writes for these records.
VOCABULARY = tuple(
    sorted(
        {"question", "what", "colour", "is", "the", "answer"}
        | set(SHAPES)
        | set(COLOURS)
        | {letter.lower() for letter in multiple_choice.LETTERS[:4]}
    )
)


def _mask(shape: str, size: int, rng: np.random.RandomState) -> np.ndarray:
  """bool [size, size]: one shape of random size and place."""
  r = rng.randint(size // 4, size // 2 - 1)
  cy, cx = rng.randint(r + 1, size - r - 1, 2)
  y, x = np.mgrid[:size, :size]
  dy, dx = y - cy, x - cx
  if shape == "square":
    return (np.abs(dy) <= r) & (np.abs(dx) <= r)
  if shape == "disc":
    return dy**2 + dx**2 <= r**2
  if shape == "triangle":
    return (dy <= r) & (dy >= -r) & (np.abs(dx) <= (dy + r) / 2)
  return ((np.abs(dy) <= r // 3) & (np.abs(dx) <= r)) | (
      (np.abs(dx) <= r // 3) & (np.abs(dy) <= r)
  )


def picture(colour: str, shape: str, tile: int, wide: bool, rng):
  """A PIL RGB picture, `tile` high and 1 or 2 tiles wide."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  width = 2 * tile if wide else tile
  img = 200 + rng.randint(-25, 26, (tile, width, 3))
  offset = rng.randint(0, width - tile + 1)
  region = img[:, offset : offset + tile]
  region[_mask(shape, tile, rng)] = COLOURS[colour]
  return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def shapes_task(
    seed: int, n: int, *, tile: int, wide_fraction: float = 0.5
) -> list[multiple_choice.ChoiceRecord]:
  """`n` records of the coloured-shapes task (see the module docstring)."""
  rng = np.random.RandomState(seed)
  names = list(COLOURS)
  records = []
  for _ in range(n):
    colour = int(rng.randint(len(names)))
    shape = SHAPES[rng.randint(len(SHAPES))]
    image = picture(names[colour], shape, tile, rng.rand() < wide_fraction, rng)
    records.append(
        multiple_choice.ChoiceRecord(
            question=f"what colour is the {shape}?",
            choices=tuple(names),
            answer=colour,
            image=image,
        )
    )
  return records
