"""`init_params` draws every leaf as the module's own initializer would.

The reference is `module.init` itself (flax calling each module's declared
initializer): the same tree, shapes and dtypes; ones and zeros exactly; the
same spread for the random leaves, per leaf and against the declared
scale (LeCun normal: std 1 / sqrt(fan-in); embeddings 1 / sqrt(D); LoRA A
uniform, std 1 / sqrt(3 d_in)).
"""

import dataclasses
import math
import zlib

import jax
import numpy as np
import pytest

from raptor_jax import models, roles
from raptor_jax.models import initializers, loading

from test_stack import BACKBONES


def _classifier(family):
  backbone, config = BACKBONES[family]
  layer = config.sparse_layers[-1]
  config = dataclasses.replace(
      config, expert_lora_layers=(layer,), unscanned_layers=(layer,)
  )
  return models.SequenceClassifier(backbone(config), num_labels=3)


def _declared_std(path, shape):
  name = path.rsplit("/", 1)[-1]
  if name in ("kernel", "embedding"):
    fan = shape[-1] if name == "embedding" else shape[-2]
    return 1 / math.sqrt(fan)
  if name == "lora_a":
    return 1 / math.sqrt(3 * shape[-2])
  return 0.0


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_drawn_leaves_follow_the_modules_initializers(family):
  module = _classifier(family)
  drawn = roles.flatten(models.init_params(module, jax.random.key(0)))
  flax_init = roles.flatten(
      jax.jit(module.init)(jax.random.key(1), *initializers.example_inputs())[
          "params"
      ]
  )
  assert set(drawn) == set(flax_init)
  assert any("/blocks_" in p for p in drawn)  # stacked leaves too
  assert {p.rsplit("/", 1)[-1] for p in drawn} <= set(
      initializers.LEAF_INITIALIZERS
  )
  pooled = {}
  for path, got in drawn.items():
    want = flax_init[path]
    assert got.shape == want.shape and got.dtype == want.dtype, path
    name = path.rsplit("/", 1)[-1]
    if name == "scale":
      assert np.all(np.asarray(got) == 1) and np.all(np.asarray(want) == 1)
      continue
    if name in ("bias", "lora_b"):
      assert not np.any(np.asarray(got)) and not np.any(np.asarray(want))
      continue
    std = _declared_std(path, got.shape)
    assert std > 0, path
    # Each slice of a stacked or expert leaf is its own draw.
    got, want = np.asarray(got) / std, np.asarray(want) / std
    if got.size >= 2000:  # per leaf, where the estimate is tight
      assert np.std(got) == pytest.approx(np.std(want), rel=0.1), path
      assert np.std(got) == pytest.approx(1.0, rel=0.1), path
    pooled.setdefault(name, ([], []))
    pooled[name][0].append(got.ravel())
    pooled[name][1].append(want.ravel())
  for name, (got, want) in pooled.items():
    got, want = np.concatenate(got), np.concatenate(want)
    # 5 standard errors of a sample std (about 1 / sqrt(2 n) of it): the
    # embedding pool of the small switch holds 928 numbers, where 5% is 1.5.
    assert abs(np.std(got) - 1.0) < 5 / np.sqrt(2 * got.size), name
    both = 5 * np.sqrt(1 / (2 * got.size) + 1 / (2 * want.size))
    assert abs(np.std(got) - np.std(want)) < both, name
    assert abs(np.mean(got)) < 5 / np.sqrt(got.size), name  # 5 std errors
    if name == "lora_a":  # uniform: bounded by the declared bound
      assert np.max(np.abs(got)) <= math.sqrt(3) + 1e-6


def test_a_leaf_depends_on_the_key_and_its_path_only():
  module = _classifier("olmoe")
  full = roles.flatten(models.init_params(module, jax.random.key(0)))
  shapes = initializers.abstract_params(module)
  some = [p for p in shapes if p.endswith("lora_a")][:3]
  part = initializers.draw({p: shapes[p] for p in some}, jax.random.key(0))
  for path in some:
    np.testing.assert_array_equal(part[path], full[path])
  other = roles.flatten(models.init_params(module, jax.random.key(1)))
  assert not np.array_equal(other[some[0]], full[some[0]])


def test_init_missing_adds_only_the_adapters():
  backbone, config = BACKBONES["olmoe"]
  module = backbone(config)
  params = models.init_params(module, jax.random.key(0))
  base = {
      p: v for p, v in roles.flatten(params).items() if not roles.is_adapter(p)
  }
  merged = roles.flatten(
      loading.init_missing(module, roles.unflatten(base), jax.random.key(0))
  )
  for path, value in roles.flatten(params).items():
    np.testing.assert_array_equal(merged[path], value)
  with pytest.raises(ValueError, match="checkpoint lacks 1 model parameters"):
    loading.init_missing(
        module,
        roles.unflatten(
            {p: v for p, v in base.items() if p != "embed_tokens/embedding"}
        ),
        jax.random.key(0),
    )


def test_an_undeclared_leaf_name_is_refused():
  with pytest.raises(ValueError, match="no initializer is declared for leaves"):
    initializers.draw(
        {"block_0/gamma": jax.ShapeDtypeStruct((3,), np.float32)},
        jax.random.key(0),
    )


_SHAPES = {
    "a/kernel": jax.ShapeDtypeStruct((3, 64, 96), np.float32),
    "b/embedding": jax.ShapeDtypeStruct((500, 48), np.float32),
    "c/lora_a": jax.ShapeDtypeStruct((4, 96, 8), np.float32),
    "d/kernel": jax.ShapeDtypeStruct((96, 2), jax.numpy.bfloat16),
    "e/scale": jax.ShapeDtypeStruct((96,), np.float32),
}


def _plain(path, leaf, key, **compiler_options):
  """`path`'s leaf drawn by its initializer under a plain `jax.jit`, with
  the classic (not partitionable) threefry, as `draw` draws."""
  name = path.rsplit("/", 1)[-1]
  leaf_key = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
  init = initializers.LEAF_INITIALIZERS[name]

  @jax.jit
  def fn(k):
    with jax.threefry_partitionable(False):
      return init(k, leaf.shape, leaf.dtype)

  return np.asarray(
      fn.lower(leaf_key).compile(compiler_options=compiler_options)(leaf_key),
      np.float32,
  )


def test_a_draw_equals_the_plain_jitted_initializer():
  """`draw` compiles its programs ahead, in threads, and calls them: the
  values are those of the initializer under a plain `jax.jit`."""
  key = jax.random.key(5)
  got = initializers.draw(_SHAPES, key)
  for path, leaf in _SHAPES.items():
    assert got[path].dtype == leaf.dtype, path
    np.testing.assert_array_equal(
        np.asarray(got[path], np.float32), _plain(path, leaf, key), path
    )


@pytest.mark.parametrize("partitionable", [False, True])
def test_draws_do_not_depend_on_the_caller_s_threefry(partitionable):
  """`draw` sets the classic threefry inside its programs (4x faster for
  bfloat16 leaves on CPU), so the values are the same whichever threefry
  the caller has switched on."""
  key = jax.random.key(7)
  with jax.threefry_partitionable(partitionable):
    got = initializers.draw(_SHAPES, key)
  for path, leaf in _SHAPES.items():
    np.testing.assert_array_equal(
        np.asarray(got[path], np.float32), _plain(path, leaf, key), path
    )
  # and the classic threefry is what it draws with: the default differs
  path, leaf = "a/kernel", _SHAPES["a/kernel"]
  leaf_key = jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
  with jax.threefry_partitionable(True):
    other = initializers.KERNEL(leaf_key, leaf.shape, leaf.dtype)
  assert not np.array_equal(np.asarray(other), np.asarray(got[path]))


def test_draws_compiled_at_o2_equal_xla_s_default_o3():
  """Outside the test suite (which compiles at -O0) `draw` compiles at
  `DRAW_COMPILER_OPTIONS` on CPU: its values must be XLA's default's, bit for
  bit, or every random-init result would move."""
  key = jax.random.key(6)
  for path, leaf in _SHAPES.items():
    np.testing.assert_array_equal(
        _plain(path, leaf, key, **initializers.DRAW_COMPILER_OPTIONS),
        _plain(path, leaf, key, xla_backend_optimization_level=3),
        path,
    )
