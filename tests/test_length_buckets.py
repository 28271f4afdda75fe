"""Length buckets: every sampled record once, in a bucket that holds it, and
a record's gradient independent of how far its bucket pads it."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import length_buckets, models
from raptor_jax.models import hf


def test_default_buckets_and_bad_buckets_get_one_line():
  assert length_buckets.default_buckets(64) == (16, 32, 64)
  assert length_buckets.default_buckets(16) == (16,)
  assert length_buckets.default_buckets(8) == (8,)
  assert length_buckets.check_buckets([16, 64], 64) == (16, 64)
  for bad in ((16, 32), (32, 16, 64), (), (0, 64)):
    with pytest.raises(ValueError, match="data.length_buckets") as err:
      length_buckets.check_buckets(bad, 64)
    assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match="more than the last bucket"):
    length_buckets.bucket_index(np.array([3, 70]), (16, 64))


@pytest.mark.parametrize("processes", [1, 3])
def test_every_sampled_record_runs_once_in_a_bucket_that_holds_it(processes):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 65, 500)
  sample = np.sort(rng.choice(500, 137, replace=False))
  buckets = (16, 32, 64)
  per_host = [
      length_buckets.bucketed_microbatches(
          sample,
          lengths,
          buckets,
          8,
          processes=processes,
          process_index=p,
      )
      for p in range(processes)
  ]
  # The same bucket sequence on every host (collectives line up).
  layouts = [[item.length for item in items] for items in per_host]
  assert all(layout == layouts[0] for layout in layouts)
  assert layouts[0] == sorted(layouts[0])
  seen = []
  for p, items in enumerate(per_host):
    for item in items:
      mb = item.microbatch
      assert mb.indices.shape == mb.mask.shape == (8,)
      real = mb.indices[mb.mask > 0] * processes + p  # global indices
      assert np.all(lengths[real] <= item.length)
      smaller = [b for b in buckets if b < item.length]
      if smaller:  # the smallest bucket that holds it
        assert np.all(lengths[real] > smaller[-1])
      seen += real.tolist()
  assert sorted(seen) == sample.tolist()
  assert (
      length_buckets.bucketed_microbatches(
          np.array([], np.int64), lengths, buckets, 8
      )
      == []
  )


SIZES = types.SimpleNamespace(
    d_model=16,
    d_kv=4,
    d_ff=24,
    num_layers=2,
    num_heads=2,
    num_experts=4,
    expert_capacity=3,  # drops tokens of a 12-token record
    sparse_step=1,
    num_kv_heads=1,
    top_k=2,
    norm_topk_prob=True,
    num_shared_experts=1,
    first_k_dense=1,
    kv_lora_rank=8,
)


@pytest.mark.parametrize("family", ["switch", "olmoe", "deepseek"])
def test_padding_inside_a_bucket_never_changes_a_records_gradient(family):
  """One 12-token record padded to 16 and 40 tokens: the same logits
  and the same gradient of every parameter (right padding is masked;
  routing and capacity see the real tokens first)."""
  backbone = hf.backbone_from_sizes(family, SIZES, 50, dispatch="dense")
  pooling = "mean" if family == "switch" else "last"
  model = models.SequenceClassifier(backbone, 2, pooling=pooling)
  ids = jnp.asarray(np.random.default_rng(1).integers(2, 50, (1, 12)))
  params = model.init(
      jax.random.PRNGKey(0), ids, jnp.ones_like(ids, jnp.int32)
  )["params"]

  def loss(params, length):
    padded = jnp.pad(ids, ((0, 0), (0, length - 12)))
    mask = (jnp.arange(length) < 12)[None].astype(jnp.int32)
    logits, _ = model.apply({"params": params}, padded, mask)
    return jax.nn.log_softmax(logits)[0, 1], logits

  results = {
      length: jax.grad(loss, has_aux=True)(params, length)
      for length in (16, 40)
  }
  grads16, logits16 = results[16]
  for length in (40,):
    grads, logits = results[length]
    np.testing.assert_allclose(logits, logits16, rtol=1e-5, atol=1e-6)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(grads16)):
      np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)
