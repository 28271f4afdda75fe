"""Every parameter's initializer, and parameters drawn without compiling the forward.

`jax.jit(module.init)` traces and compiles the whole forward pass plus one
inlined RNG program per leaf (flax issues 879, 1277, 1331); for the
switch-base-8 shape that took 20 s on 2 CPU cores and 75 s on an H200.
`init_params` instead takes the leaves' shapes from `jax.eval_shape` (a
trace, nothing compiled) and draws each leaf with its initializer, one small
program per distinct (leaf name, shape, dtype).

A leaf's initializer is a function of its name (`LEAF_INITIALIZERS`), and the
modules declare theirs from this table and nowhere else (`KERNEL`,
`EMBEDDING`, `LORA_A`, `ONES`, `ZEROS`), so `module.init` and `init_params`
draw from the same distributions (tests/test_initializers.py checks every
leaf). Leading axes beyond a leaf's own matrix or vector (the expert axis,
a scanned segment's unit axis) are batch axes: each slice is drawn as its
own parameter, as `nn.scan`'s split RNGs do.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, Callable, Mapping
import zlib

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]


def _matrix(make: Callable[..., Initializer]) -> Initializer:
  """An initializer of [..., d_in, d_out] leaves, leading axes as batch axes."""

  def init(key, shape, dtype=jnp.float32):
    batch = tuple(range(len(shape) - 2))
    return make(in_axis=-2, out_axis=-1, batch_axis=batch)(key, shape, dtype)

  return init


def lora_a(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """PEFT's default for A: kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(d_in), 1/sqrt(d_in))."""
  bound = 1.0 / jnp.sqrt(shape[-2])
  return jax.random.uniform(key, shape, dtype, -bound, bound)


# Kernels [..., d_in, d_out]: LeCun normal, fan-in d_in (flax's Dense default).
KERNEL = _matrix(nn.initializers.lecun_normal)
# Embeddings [..., V, D]: normal with variance 1 / D (flax's Embed default).
EMBEDDING = _matrix(
    functools.partial(
        nn.initializers.variance_scaling, 1.0, "fan_out", "normal"
    )
)
LORA_A = lora_a
ONES = nn.initializers.ones  # norm scales
ZEROS = (
    nn.initializers.zeros
)  # biases, LoRA B (a fresh adapter changes nothing)

LEAF_INITIALIZERS: dict[str, Initializer] = {
    "kernel": KERNEL,
    "embedding": EMBEDDING,
    "lora_a": LORA_A,
    "lora_b": ZEROS,
    "scale": ONES,
    "bias": ZEROS,
}


def float32_dense(features: int, *, use_bias: bool, name: str) -> nn.Dense:
  """A float32 `nn.Dense` with this table's initializers: routers, heads.

  Routers and the classifier head compute and keep their weights in
  float32 whatever the activation dtype (their outputs feed the routing
  and the loss).
  """
  return nn.Dense(
      features,
      use_bias=use_bias,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      kernel_init=KERNEL,
      bias_init=ZEROS,
      name=name,
  )


def embedding(num_embeddings: int, features: int, name: str) -> nn.Embed:
  """An `nn.Embed` drawn with `EMBEDDING`: token tables, position biases."""
  return nn.Embed(num_embeddings, features, embedding_init=EMBEDDING, name=name)


def example_inputs() -> tuple[jax.Array, jax.Array]:
  """A tiny (input_ids, attention_mask) batch for initialisation."""
  return jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)


def abstract_params(
    module: nn.Module, example_args: tuple | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
  """{flat path: shape and dtype} of `module`'s parameters (traced, not compiled).

  `example_args` are the module's call arguments (default: `example_inputs()`,
  a backbone's or classifier's).
  """
  args = example_inputs() if example_args is None else example_args
  shapes = jax.eval_shape(
      lambda key: module.init(key, *args)["params"], jax.random.key(0)
  )
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(shapes), sep="/")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_leaf(key: jax.Array, name: str, shape: tuple, dtype: Any):
  # A leaf is drawn whole on one device, so the partitionable threefry (JAX's
  # default since 0.5, for draws sharded across devices) buys nothing here
  # and costs: it hashes a 64-bit counter per value and a whole 32-bit word
  # per 16-bit value. The classic one draws the switch-base-8 shape's
  # bfloat16 kernels 4x faster on CPU (launch/bench/compile_time.py's
  # set-up). Set inside the trace, so the values do not depend on the
  # caller's setting.
  with jax.threefry_partitionable(False):
    return LEAF_INITIALIZERS[name](key, shape, dtype)


def draw(
    shapes: Mapping[str, jax.ShapeDtypeStruct], key: jax.Array
) -> dict[str, jax.Array]:
  """Draws each leaf of `shapes` with its initializer.

  A leaf's key is `key` folded with its path, so a leaf's value depends on
  `key` and its path only, not on which other leaves are drawn (the adapters
  `loading.init_missing` adds equal those of the whole tree).

  Args:
    shapes: {flat '/'-separated path: shape and dtype}, e.g. from
      `abstract_params`.
    key: a PRNG key.

  Returns:
    {path: array}.

  Raises:
    ValueError: a leaf name without a declared initializer.
  """
  for path in shapes:
    name = path.rsplit("/", 1)[-1]
    if name not in LEAF_INITIALIZERS:
      raise ValueError(
          f"{path}: no initializer is declared for leaves named {name!r};"
          " declare it in models.initializers.LEAF_INITIALIZERS"
      )
  compiled = _compile_draws(
      list(dict.fromkeys(map(_program, shapes.items()))),
      jax.eval_shape(lambda: key),
  )
  out = {}
  for path, leaf in shapes.items():
    leaf_key = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
    out[path] = compiled[_program((path, leaf))].result()(leaf_key)
  return out


def _program(item) -> tuple[str, tuple[int, ...], Any]:
  path, leaf = item
  return path.rsplit("/", 1)[-1], tuple(leaf.shape), jnp.dtype(leaf.dtype)


def _compile_draws(programs, key) -> dict[tuple, concurrent.futures.Future]:
  """{(name, shape, dtype): future of `_draw_leaf`'s executable}, in threads.

  XLA compiles outside the GIL, so on a machine of several cores the small
  draw programs compile side by side, and the first leaves are drawn while
  later programs still compile. On CPU they compile at LLVM's -O2 rather than
  XLA's default -O3, in half the time (threefry's twenty unrolled rounds are
  what -O3 spends it on) and to the same values, since neither level may
  reorder or contract floating point differently (tests/test_initializers.py
  compares them with a plain jitted draw). The trainer's own programs keep
  the default: for them the level changed nothing measurable.
  """
  options = _draw_compiler_options()
  pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=min(8, os.cpu_count() or 1)
  )
  futures = {
      program: pool.submit(
          _draw_leaf.lower(key, *program).compile, compiler_options=options
      )
      for program in programs
  }
  pool.shutdown(wait=False)
  return futures


# XLA:CPU's LLVM optimisation level for the draw programs (see above).
DRAW_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}


def _draw_compiler_options() -> dict:
  """`DRAW_COMPILER_OPTIONS` on CPU, unless XLA_FLAGS sets the level itself
  (the test suite compiles at -O0; a user's choice stands)."""
  if jax.default_backend() != "cpu":
    return {}
  if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
    return {}
  return dict(DRAW_COMPILER_OPTIONS)


def init_params(
    module: nn.Module, key: jax.Array, example_args: tuple | None = None
) -> dict:
  """`module.init(key, *example_args)['params']` without compiling the forward.

  The same tree of shapes and dtypes, each leaf drawn from its module's
  initializer (`LEAF_INITIALIZERS`); the values differ from `module.init`'s
  (another split of `key`), the distributions do not.
  """
  flat = draw(abstract_params(module, example_args), key)
  return flax.traverse_util.unflatten_dict(flat, sep="/")
