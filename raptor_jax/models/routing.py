"""Mixture-of-Experts routing: top-1 with capacity, top-k, group limits.

Routing is computed per sequence (capacity counts the tokens of one sequence,
never of the batch), so a record's routing, and therefore its output, never
depends on another record in the batch: the invariant of docs/method.md §3
that makes per-record gradients, and so DP clipping, meaningful. A dropped
slot carries expert E (`num_experts`) and weight 0; every dispatch
(`raptor_jax.models.dispatch`) gives it no expert output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Rows routed to this "expert" (== num_experts) are dropped: they get no
# expert output (capacity overflow, or padding rows of the dispatch).


class Routing(NamedTuple):
  """Top-k routing decision for every token.

  Attributes:
    experts: int32 [..., S, k] chosen experts, dropped slots set to E.
    weights: float32 [..., S, k] gate weights used to scale expert outputs
      (0 where dropped).
    probs: float32 [..., S, E] router probabilities (softmax of the logits).
  """

  experts: jax.Array
  weights: jax.Array
  probs: jax.Array


def route_top1(router_logits: jax.Array, expert_capacity: int) -> Routing:
  """Switch Transformer top-1 routing with Hugging Face's per-sequence capacity.

  Tokens choose their argmax expert. Within each sequence, a token whose
  position among the tokens routed to its expert exceeds `expert_capacity`
  is dropped: it gets no expert output and passes only through the residual.
  Kept tokens are scaled by their router probability. Padding tokens are
  routed and count towards capacity exactly as in Hugging Face (with right
  padding they come last, so they never displace a real token).

  Args:
    router_logits: [..., S, E] pre-softmax logits (any float dtype).
    expert_capacity: per-sequence capacity of each expert.

  Returns:
    Routing with k = 1.
  """
  num_experts = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  expert = jnp.argmax(probs, axis=-1)
  one_hot = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)
  priority = jnp.sum(jnp.cumsum(one_hot, axis=-2) * one_hot, axis=-1)
  keep = priority <= expert_capacity
  experts = jnp.where(keep, expert, num_experts).astype(jnp.int32)
  weights = jnp.where(keep, jnp.max(probs, axis=-1), 0.0)
  return Routing(experts[..., None], weights[..., None], probs)


def combine(out: jax.Array, weights: jax.Array) -> jax.Array:
  """Each token's gate-weighted sum of its k expert outputs, on token rows.

  For token t: sum_j weights[t, j] * out[t * k + j], computed on flat token
  rows [T, k, D] (T = every leading axis times S), never on the model's
  [B, S, ...] layout: under the trainer's `vmap` over records of a batch of
  one, that layout carries a size-1 axis, and XLA:CPU's fused reductions
  over such shapes (the gradient of the gate weights here) ran 5-50x slower
  than on the same data without it.

  Args:
    out: [T * k, D] expert outputs, k consecutive rows per token.
    weights: [..., S, k] gate weights (0 for dropped slots).

  Returns:
    [..., S, D] in `out`'s dtype.
  """
  *lead, k = weights.shape
  d = out.shape[-1]
  rows = out.reshape(-1, k, d)
  w = weights.reshape(-1, k).astype(out.dtype)
  if k == 1:  # no size-1 slot axis either (the same slow reductions)
    mixed = rows[:, 0] * w
  else:
    mixed = jnp.sum(rows * w[..., None], axis=1)
  return mixed.reshape(*lead, d)


def limit_to_groups(
    probs: jax.Array, num_groups: int, top_groups: int
) -> jax.Array:
  """DeepSeek-V2's group-limited candidates: experts outside the best groups get 0.

  The E experts form `num_groups` consecutive groups; a token keeps the
  `top_groups` groups whose largest probability is highest and may only be
  routed to their experts (Hugging Face's `group_limited_greedy`), which
  bounds the devices a token's experts live on.
  """
  *lead, num_experts = probs.shape
  grouped = probs.reshape(*lead, num_groups, num_experts // num_groups)
  _, best = jax.lax.top_k(jnp.max(grouped, axis=-1), top_groups)
  keep = jnp.sum(jax.nn.one_hot(best, num_groups, dtype=probs.dtype), axis=-2)
  return (grouped * keep[..., None]).reshape(probs.shape)


def route_topk(
    router_logits: jax.Array,
    k: int,
    normalize: bool,
    groups: tuple[int, int] | None = None,
    scale: float = 1.0,
) -> Routing:
  """Top-k routing without capacity (OLMoE, Mixtral and DeepSeek-V2 style).

  Softmax in float32 over all experts, then the k largest probabilities;
  renormalised to sum to one when `normalize` (OLMoE's `norm_topk_prob`).
  `groups` = (n_group, topk_group) first restricts the candidates to the best
  groups (`limit_to_groups`); `scale` multiplies the weights (DeepSeek's
  `routed_scaling_factor`). Ties go to the lower expert index (`lax.top_k` is
  stable).
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  candidates = probs if groups is None else limit_to_groups(probs, *groups)
  weights, experts = jax.lax.top_k(candidates, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(experts.astype(jnp.int32), weights * scale, probs)


# ---------------------------------------------------------------------------
# Grouped (sorted, blocked) dispatch of frozen expert weights.
