"""Pretraining objectives: masked and causal LM, and the routers' auxiliary losses.

Pretraining uses only public text, so these are ordinary batch-level losses
(nothing here is differentially private, and nothing needs to be).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from raptor_jax.models import moe


class MaskedBatch(NamedTuple):
  """A masked-LM batch: what the model reads and what it must predict."""

  input_ids: jax.Array  # int32 [B, S], with masked positions replaced
  positions: jax.Array  # int32 [B, P], positions to predict (padded)
  targets: jax.Array  # int32 [B, P], original tokens there
  weights: jax.Array  # float32 [B, P], 1 for a real prediction, 0 for padding


def max_predictions(seq_len: int, rate: float) -> int:
  """Prediction slots per sequence: room for `rate` of every position."""
  return max(1, int(round(rate * seq_len + 0.5)))


def mask_tokens(
    key: jax.Array,
    input_ids: jax.Array,
    maskable: jax.Array,
    *,
    mask_id: int,
    random_ids: tuple[int, int],
    rate: float = 0.15,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
) -> MaskedBatch:
  """BERT's masking: `rate` of each sequence's tokens, 80% [MASK] / 10% random / 10% kept.

  Every sequence gets exactly round(rate * m) predictions, m its maskable
  tokens (real tokens that are not special), at uniformly random positions.

  Args:
    key: PRNG key.
    input_ids: int32 [B, S].
    maskable: bool [B, S], positions that may be chosen.
    mask_id: the [MASK] token id.
    random_ids: [low, high) range of ids a random replacement draws from
      (the non-special vocabulary).
    rate: share of maskable tokens to predict.
    mask_prob, random_prob: of the chosen tokens, the share replaced by
      [MASK] and by a random token (the rest stay unchanged).
  """
  batch, seq = input_ids.shape
  slots = max_predictions(seq, rate)
  k_pos, k_kind, k_rand = jax.random.split(key, 3)
  scores = jnp.where(maskable, jax.random.uniform(k_pos, (batch, seq)), -1.0)
  _, positions = jax.lax.top_k(
      scores, slots
  )  # maskable positions first, in random order
  count = jnp.round(rate * maskable.sum(axis=1)).astype(
      jnp.int32
  )  # per sequence
  weights = (jnp.arange(slots)[None, :] < count[:, None]).astype(jnp.float32)
  targets = jnp.take_along_axis(input_ids, positions, axis=1)
  kind = jax.random.uniform(k_kind, (batch, slots))
  replacement = jnp.where(
      kind < mask_prob,
      mask_id,
      jnp.where(
          kind < mask_prob + random_prob,
          jax.random.randint(k_rand, (batch, slots), *random_ids),
          targets,
      ),
  )
  replacement = jnp.where(weights > 0, replacement, targets)
  rows = jnp.arange(batch)[:, None]
  return MaskedBatch(
      input_ids.at[rows, positions].set(replacement),
      positions,
      targets,
      weights,
  )


def token_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(mean loss, accuracy) over the weighted positions, float32."""
  logits = logits.astype(jnp.float32)
  nll = -jnp.take_along_axis(
      jax.nn.log_softmax(logits), targets[..., None], axis=-1
  )[..., 0]
  total = jnp.maximum(weights.sum(), 1.0)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (nll * weights).sum() / total, (correct * weights).sum() / total


def switch_load_balancing_loss(
    router_logits: jax.Array, mask: jax.Array
) -> jax.Array:
  """Switch Transformer's balancing loss of one layer (Fedus et al., Eqs. 4-6).

  Per sequence, E * sum_e f_e P_e with f_e the share of its tokens whose top-1
  expert is e and P_e their mean router probability for e; averaged over
  sequences. Padding is ignored. Uniform routing gives 1, its minimum over
  f on the simplex with P = f. With a full mask it equals transformers'
  `load_balancing_loss_func` of Switch.

  Args:
    router_logits: [B, S, E] float32.
    mask: [B, S] {0, 1}.
  """
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts)
  m = mask.astype(jnp.float32)[..., None]
  tokens = jnp.maximum(m.sum(axis=1), 1.0)  # [B, 1]
  f = (chosen * m).sum(axis=1) / tokens
  p = (probs * m).sum(axis=1) / tokens
  return num_experts * jnp.mean(jnp.sum(f * p, axis=-1))


def router_z_loss(router_logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean squared log-partition of the router logits over real tokens (ST-MoE)."""
  log_z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
  m = mask.astype(jnp.float32)
  return (jnp.square(log_z) * m).sum() / jnp.maximum(m.sum(), 1.0)


def topk_load_balancing_loss(
    router_logits: Sequence[jax.Array], mask: jax.Array, top_k: int
) -> jax.Array:
  """OLMoE's (Mixtral's) balancing loss over all layers' tokens.

  E * sum_e c_e P_e, where c_e is the number of top-k slots given to expert e
  per token and P_e the mean router probability of e, both over every real
  token of every layer (transformers' `load_balancing_loss_func` of OLMoE,
  with its attention mask). Uniform routing gives top_k.
  """
  num_experts = router_logits[0].shape[-1]
  m = mask.astype(jnp.float32).reshape(-1, 1)
  counts, probs_sum = 0.0, 0.0
  for logits in router_logits:
    probs = jax.nn.softmax(
        logits.astype(jnp.float32).reshape(-1, num_experts), axis=-1
    )
    _, chosen = jax.lax.top_k(probs, top_k)
    counts = counts + (jax.nn.one_hot(chosen, num_experts).sum(axis=1) * m).sum(
        axis=0
    )
    probs_sum = probs_sum + (probs * m).sum(axis=0)
  rows = len(router_logits) * jnp.maximum(m.sum(), 1.0)
  return num_experts * jnp.sum((counts / rows) * (probs_sum / rows))


def owner_balance_loss(router_logits: jax.Array, mask: jax.Array) -> jax.Array:
  """The Switch balancing loss applied to records' owners instead of tokens.

  RAPTOR partitions records by owner: a record's owner is the expert that
  most of its tokens route to (top-1 vote, the owner rule of Eq. 5). Token
  balance does not give owner balance (an expert can take 10% of the tokens
  and win no record), so this term is E * sum_e f_e P_e over the batch's
  records, f_e the share of records that e owns and P_e the mean over
  records of each record's mean router probability for e. The gradient
  reaches the router through P, as in the token loss; uniform ownership
  gives the minimum 1.

  Args:
    router_logits: [B, S, E] float32 of one layer (each row a record).
    mask: [B, S] {0, 1}.
  """
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  m = mask.astype(jnp.float32)[..., None]
  votes = (jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts) * m).sum(
      axis=1
  )
  owned = jax.nn.one_hot(
      jnp.argmax(votes, axis=-1), num_experts
  )  # ties: lowest index
  record_probs = (probs * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
  return num_experts * jnp.sum(owned.mean(axis=0) * record_probs.mean(axis=0))


def deepseek_balance_loss(
    router_logits: Sequence[jax.Array],
    mask: jax.Array,
    top_k: int,
    groups: tuple[int, int] | None = None,
) -> jax.Array:
  """DeepSeek-V2's expert-level balance loss, sequence-wise, summed over layers.

  Per layer and sequence, sum_e f_e P_e with f_e = E / (k T) x (top-k slots
  given to expert e) and P_e the mean router probability of e, over the T
  real tokens of the sequence (DeepSeek's `seq_aux`); the mean over
  sequences, and every sparse layer adds its own term, as DeepSeek's gates
  do. Slots are the experts the model really routes to (group-limited if it
  is). Uniform routing gives 1 per layer; shared experts take no part.

  Args:
    router_logits: one [B, S, E] array per sparse layer.
    mask: [B, S] {0, 1}.
    top_k: routed experts per token.
    groups: (n_group, topk_group) of group-limited routing, or None.
  """
  m = mask.astype(jnp.float32)[..., None]  # [B, S, 1]
  tokens = jnp.maximum(m.sum(axis=1), 1.0)  # [B, 1]
  total = 0.0
  for logits in router_logits:
    num_experts = logits.shape[-1]
    routing = moe.route_topk(logits, top_k, False, groups)
    one_hot = jax.nn.one_hot(routing.experts, num_experts).sum(axis=-2)
    f = (one_hot * m).sum(axis=1) * num_experts / (top_k * tokens)
    p = (routing.probs * m).sum(axis=1) / tokens
    total = total + jnp.mean(jnp.sum(f * p, axis=-1))
  return total
