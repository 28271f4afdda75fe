"""One vector per part: the layout the noisy update runs on.

A part's trainable leaves (`{path: array}`) are packed into ONE flat vector
in `jax.tree` order (sorted paths) for the update: the noise draw, Adam and
the parameter step then run as one elementwise program over one vector, so
the update compiles in about the same time whatever the number of adapter
leaves (a per-leaf update compiles one sampler and one Adam per leaf; XLA
copies a shared draw into every leaf's consumer). The vector is unpacked
by a second program of slices only.

The noise is unchanged: `transforms` draws one flat normal per key over the
sums in the same order (`transforms._normal_like`), so the packed update
adds the very noise the per-leaf transforms add, element by element.
Checkpoints and every other program keep the unpacked leaves.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Layout(NamedTuple):
  """Where each leaf of a `{path: array}` lives in its packed vector.

  Static (hashable): the paths in `jax.tree` order, their shapes and the
  one dtype the leaves share.
  """

  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtype: np.dtype

  @classmethod
  def of(cls, flat: Mapping[str, jax.Array]) -> Layout | None:
    """The layout of `flat`, or None when its leaves mix dtypes (those are
    updated leaf by leaf)."""
    paths = tuple(sorted(flat))
    dtypes = {jnp.result_type(flat[p]) for p in paths}
    if len(dtypes) != 1:
      return None
    shapes = tuple(tuple(jnp.shape(flat[p])) for p in paths)
    return cls(paths, shapes, np.dtype(dtypes.pop()))

  def pack(self, flat: Mapping[str, jax.Array], dtype=None) -> jax.Array:
    """One vector of the leaves of `flat`, in order (cast to `dtype`)."""
    dtype = self.dtype if dtype is None else dtype
    if not self.paths:
      return jnp.zeros((0,), dtype)
    return jnp.concatenate(
        [jnp.ravel(flat[p]).astype(dtype) for p in self.paths]
    )

  def unpack(self, vector: jax.Array) -> dict[str, jax.Array]:
    """`{path: array}` of a packed vector (slices only)."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return {
        path: vector[start:end].reshape(shape)
        for path, shape, start, end in zip(
            self.paths, self.shapes, offsets[:-1], offsets[1:]
        )
    }
