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

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import transforms
from raptor_jax.train.plans import Part

Flat = dict[str, jax.Array]


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


class PartsUpdate:
  """The noisy DP-Adam update of a phase's parts, each on its packed vector.

  Per part i, `optax.chain(transforms.privatize_sums(C, sigma, denominator,
  fold_in(key, i)), adam)`: the clipped sums get N(0, (sigma C)^2) noise on
  every element and are divided by the public denominator (the release),
  then Adam steps (post-processing). The noise key of part i is
  `fold_in(key, i)`: distinct and secret per transform. The noise is drawn
  once per call: call `update` once per Poisson sample. `packed_update` and
  `unpack` are the two jitted programs (module docstring).
  """

  def __init__(
      self, parts: Sequence[Part], *, learning_rate: float, key: jax.Array
  ):
    self.parts = tuple(parts)
    self.privatizers = {
        part.name: transforms.privatize_sums(
            part.l2_clip,
            part.noise_multiplier,
            part.denominator,
            transforms.fold_in(key, i),
        )
        for i, part in enumerate(self.parts)
    }
    self.optimizers = {
        name: optax.chain(privatizer, optax.adam(learning_rate))
        for name, privatizer in self.privatizers.items()
    }
    self.packed_update = jax.jit(self._packed_update)
    self.unpack = jax.jit(self._unpack, static_argnums=0)

  def layouts(self, trainable: Mapping[str, Flat]) -> dict[str, Layout]:
    """The packed layout of each part that packs (one dtype)."""
    layouts = {p.name: Layout.of(trainable[p.name]) for p in self.parts}
    return {name: lay for name, lay in layouts.items() if lay is not None}

  def _pack(self, trainable, name, layouts, dtype=None):
    flat = trainable[name]
    return layouts[name].pack(flat, dtype) if name in layouts else flat

  def init_opt_states(self, trainable: Mapping[str, Flat]) -> dict[str, Any]:
    """Per part: the chain's state (the noise transform's PRNG state, Adam's
    state), over the part's packed vector where it packs."""
    layouts = self.layouts(trainable)
    return {
        p.name: self.optimizers[p.name].init(
            self._pack(trainable, p.name, layouts)
        )
        for p in self.parts
    }

  def update(
      self,
      trainable: dict[str, Flat],
      opt_states: dict[str, Any],
      sums: Mapping[str, Flat],
  ):
    """(trainable with every part updated, opt_states) from the step's sums."""
    new, opt_states = self.packed_update(trainable, opt_states, sums)
    layouts = self.layouts(trainable)
    unpacked = self.unpack(
        tuple(sorted(layouts.items())), {n: new.pop(n) for n in layouts}
    )
    return {**trainable, **new, **unpacked}, opt_states

  def _packed_update(self, trainable, opt_states, sums):
    """({part: new packed vector, or new leaves if it does not pack},
    new opt_states): `update` before unpacking."""
    layouts, opt_states, out = self.layouts(trainable), dict(opt_states), {}
    for part in self.parts:
      params = self._pack(trainable, part.name, layouts)
      part_sums = self._pack(sums, part.name, layouts, jnp.float32)
      updates, opt_states[part.name] = self.optimizers[part.name].update(
          part_sums, opt_states[part.name], params
      )
      out[part.name] = optax.apply_updates(params, updates)
    return out, opt_states

  @staticmethod
  def _unpack(layouts, vectors) -> dict[str, Flat]:
    """{part: leaves} of the packed vectors; `layouts`: sorted (part,
    `Layout`) pairs (static)."""
    layouts = dict(layouts)
    return {name: layouts[name].unpack(v) for name, v in vectors.items()}
