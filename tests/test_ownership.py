"""Owner map (Eq. 5), routing statistics and public layer selection (Eq. 4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import ownership


def _logits_for(experts_per_token, num_experts=4, strength=5.0):
  """Router logits whose argmax is the given expert for each token."""
  return jax.nn.one_hot(jnp.asarray(experts_per_token), num_experts) * strength


def test_majority_vote_with_ties_to_lowest_index():
  logits = _logits_for([[2, 2, 1, 1, 3]])  # 2 and 1 tie at two votes each
  mask = jnp.ones((1, 5))
  assert int(ownership.owners(logits, mask)[0]) == 1


def test_padding_tokens_never_vote():
  # Real tokens vote for expert 3; three padding tokens "vote" for expert 0.
  logits = _logits_for([[3, 3, 0, 0, 0]])
  mask = jnp.array([[1, 1, 0, 0, 0]])
  assert int(ownership.owners(logits, mask)[0]) == 3
  assert int(ownership.owners(logits, jnp.ones((1, 5)))[0]) == 0


def test_prob_weighting_differs_from_count():
  # Two weak votes for expert 0 against one confident vote for expert 1.
  logits = jnp.array([[[0.1, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 9.0, 0.0]]])
  mask = jnp.ones((1, 3))
  assert int(ownership.owners(logits, mask, weighting="count")[0]) == 0
  assert int(ownership.owners(logits, mask, weighting="prob")[0]) == 1


def test_top_k_gate_weighted_plurality_against_brute_force():
  rng = np.random.RandomState(0)
  logits = rng.randn(20, 7, 6).astype(np.float32)
  mask = (rng.rand(20, 7) > 0.3).astype(np.float32)
  for k, normalize in ((2, False), (3, True)):
    got = np.asarray(
        ownership.owners(
            logits, mask, top_k=k, weighting="prob", normalize=normalize
        )
    )
    for i in range(20):
      votes = np.zeros(6)
      for t in range(7):
        p = np.exp(logits[i, t]) / np.exp(logits[i, t]).sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / (p[top].sum() if normalize else 1.0)
        votes[top] += mask[i, t] * w
      assert got[i] == int(np.argmax(votes))


def test_routing_stats_by_hand():
  stats = ownership.routing_stats(np.array([0, 0, 1, 1]), num_experts=2)
  assert stats["entropy_norm"] == pytest.approx(1.0)
  assert stats["chi2"] == pytest.approx(0.0)
  assert stats["cv"] == pytest.approx(0.0)
  stats = ownership.routing_stats(np.array([0, 0, 0, 1]), num_experts=4)
  q = np.array([0.75, 0.25, 0, 0])
  entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
  assert stats["entropy_norm"] == pytest.approx(entropy / math.log(4))
  assert stats["entropy_deficit"] == pytest.approx(math.log(4) - entropy)
  assert stats["chi2"] == pytest.approx(4 * np.sum((q - 0.25) ** 2))
  assert stats["cv"] == pytest.approx(np.std(q) / np.mean(q))


def test_layer_selection_picks_maximum_entropy_layer():
  public_owners = np.array(
      [
          [0, 0, 0, 0, 1, 1, 2, 3],  # skewed
          [0, 1, 2, 3, 0, 1, 2, 3],  # uniform: maximum entropy
          [0, 0, 1, 1, 0, 0, 1, 1],  # two experts
      ]
  )
  table = ownership.layer_table(public_owners, layers=(1, 3, 5), num_experts=4)
  assert ownership.select_layer("entropy", (1, 3, 5), table) == 3
  assert (
      ownership.select_layer("entropy", (1, 3, 5), None) == 5
  )  # no corpus: last
  assert ownership.select_layer("first", (1, 3, 5), table) == 1
  assert ownership.select_layer(5, (1, 3, 5), table) == 5
  with pytest.raises(ValueError, match="not a sparse layer"):
    ownership.select_layer(2, (1, 3, 5), table)
  with pytest.raises(ValueError, match="no sparse"):
    ownership.select_layer("entropy", (), None)


def test_owners_per_layer_pads_and_trims():
  calls = []

  def router_fn(ids, mask):
    calls.append(ids.shape)
    return (
        jax.nn.one_hot(ids % 3, 3) * 4.0,
        jax.nn.one_hot((ids + 1) % 3, 3) * 4.0,
    )

  ids = np.array([[0, 0, 1], [1, 1, 2], [2, 2, 0], [1, 0, 1], [2, 2, 2]])
  mask = np.ones_like(ids)
  got = ownership.owners_per_layer(router_fn, ids, mask, batch_size=2)
  np.testing.assert_array_equal(got, [[0, 1, 2, 1, 2], [1, 2, 0, 2, 0]])
  assert set(calls) == {(2, 3)}  # fixed shape, the last batch padded


def test_the_owner_map_runs_the_layer_selection_s_compiled_program():
  """Layer selection and the private owner map run one program (every
  sparse layer's owners), compiled once; the owner map is that program's
  row for l*, the owners the one-layer program gives."""
  from helpers import compiled_names, micro_config  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import setup  # pylint: disable=g-import-not-at-top

  config = micro_config(**{"raptor.layer": "entropy"})
  run_data = setup.load_run_data(config)
  backbone, params = setup.load_backbone(config, run_data)
  jax.clear_caches()  # an earlier test of this process may have compiled it
  with jax.log_compiles(), compiled_names() as compiled:
    layer, table = ownership.select_expert_layer(
        config, backbone, params, run_data
    )
    got = ownership.private_owner_map(
        config, backbone, params, run_data.train, layer
    )
  assert table is not None
  assert compiled.count("owner_fn") == 1, compiled
  position = backbone.config.sparse_layers.index(layer)
  rule = ownership.owner_rule(backbone.config, config.raptor.owner_weighting)
  one_layer = ownership.owner_program(backbone, (position,), rule)
  ids, mask = run_data.train.input_ids, run_data.train.attention_mask
  want = np.asarray(one_layer(params, ids, mask))[:, 0]
  np.testing.assert_array_equal(got, want)
  assert len(set(want.tolist())) > 1  # owners that tell experts apart
