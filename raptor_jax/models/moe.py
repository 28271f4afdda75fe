"""Mixture-of-Experts building blocks: routing, capacity, expert dispatch.

Everything here has *per-record semantics*: routing and expert capacity are
computed per sequence and every expert computation is row-wise, so a record's
output never depends on another record in the batch (the SPEC invariant that
makes per-record gradients, and therefore DP clipping, meaningful).

Expert dispatch
---------------
`grouped_linear` applies, to every (token, expert) row, that expert's weight
matrix. Its cost scales with the number of rows (tokens x k), not with
tokens x E: rows are sorted by expert into fixed-size blocks (each block holds
rows of one expert, padded), and a `lax.scan` multiplies each block by its
expert's weights. Shapes are static (the number of blocks is a worst-case bound
computed from the number of rows and E), so one compilation serves every batch.

Under `jax.vmap` (per-record gradients) the dispatch does not run per record:
a `custom_vmap` rule flattens the vmapped axis into the row axis, so the whole
microbatch shares one sorted dispatch. This is exact because the operation is
row-wise. The base weights of `grouped_linear` are constants (frozen); a
LoRA pair rides in the same blocks and is differentiable, its gradient (every
expert's factors) computed only where asked for. RAPTOR's owner slices use
`owner_lora_delta` / `owner_linear`, whose cost does not grow with E;
`dense_linear` and `expert_lora` are the every-expert references.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}

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


def route_topk(router_logits: jax.Array, k: int, normalize: bool) -> Routing:
  """Top-k routing without capacity (OLMoE / Mixtral style).

  Softmax in float32 over all experts, then the k largest probabilities;
  renormalised to sum to one when `normalize` (OLMoE's `norm_topk_prob`).
  Ties go to the lower expert index (`lax.top_k` is stable).
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(experts.astype(jnp.int32), weights, probs)


# ---------------------------------------------------------------------------
# Grouped (sorted, blocked) dispatch of frozen expert weights.


def block_size(num_rows: int, num_experts: int, max_block: int = 256) -> int:
  """Rows per block so that worst-case padding stays below 1/4 of the rows.

  Each expert's group is padded to a multiple of the block size, which costs
  at most E * (block - 1) extra rows; block <= rows / (4 E + 1) keeps that
  below rows / 4 with room for the elementwise work, so the dispatch does less
  than 1.25x the ideal expert work.
  """
  return int(max(1, min(max_block, num_rows // (4 * num_experts + 1))))


def _dispatch_plan(experts: jax.Array, num_experts: int, block: int):
  """Sorted block layout for the rows of one flat dispatch.

  Args:
    experts: int32 [T]; values in [0, E], E meaning "dropped".
    num_experts: E.
    block: rows per block.

  Returns:
    (dest, block_expert, num_blocks): dest[t] is row t's position in the
    padded, expert-sorted buffer (an out-of-range index for dropped rows);
    block_expert[j] is the expert of block j.
  """
  num_rows = experts.shape[0]
  num_blocks = -(-(num_rows + num_experts * (block - 1)) // block)
  counts = (
      jnp.zeros((num_experts + 1,), jnp.int32).at[experts].add(1)[:num_experts]
  )
  padded = -(-counts // block) * block
  group_end = jnp.cumsum(padded)
  group_start = group_end - padded
  # Rank of each row among the rows of its expert (stable, by position).
  order = jnp.argsort(experts, stable=True)
  sorted_experts = experts[order]
  first_of_expert = jnp.searchsorted(
      sorted_experts, jnp.arange(num_experts + 1)
  )
  rank_sorted = jnp.arange(num_rows) - first_of_expert[sorted_experts]
  rank = (
      jnp.zeros((num_rows,), jnp.int32)
      .at[order]
      .set(rank_sorted.astype(jnp.int32))
  )
  dropped = experts >= num_experts
  safe_expert = jnp.minimum(experts, num_experts - 1)
  dest = jnp.where(dropped, num_blocks * block, group_start[safe_expert] + rank)
  block_expert = jnp.searchsorted(
      group_end, jnp.arange(num_blocks) * block, side="right"
  )
  block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)
  return dest, block_expert, num_blocks


def _to_blocks(
    rows: jax.Array, dest: jax.Array, num_blocks: int, block: int
) -> jax.Array:
  """[num_blocks, block, d]: row t at flat position dest[t], zeros elsewhere.

  Built as a gather of the rows, driven by an int32 scatter of row indices
  (slot -> source row, `T` = empty): on CPU this is much cheaper than
  zero-filling the padded buffer and scattering d-wide rows into it. Dropped
  rows (dest out of range) land nowhere, as before.
  """
  num_rows, width = rows.shape
  source = (
      jnp.full((num_blocks * block,), num_rows, jnp.int32)
      .at[dest]
      .set(jnp.arange(num_rows, dtype=jnp.int32), mode="drop")
  )
  buf = jnp.take(rows, source, axis=0, mode="fill", fill_value=0)
  return buf.reshape(num_blocks, block, width)


def _grouped_linear_flat(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    *lora: jax.Array,
    transpose: bool,
) -> jax.Array:
  """Unbatched grouped dispatch: y[t] = x[t] @ w[e_t] (+ x[t] @ a[e_t] @ b[e_t]).

  `lora` is () or a frozen low-rank pair (a [E, d_in, r], b [E, r, d_out]),
  applied in the same block as the base matrix, so it costs rows x r x
  (d_in + d_out) more and no second dispatch. With `transpose`, the
  transposed map (the input gradient): dy @ w^T (+ dy @ b^T @ a^T).
  """
  num_rows, d_in = x.shape
  num_experts = w.shape[0]
  d_out = w.shape[1] if transpose else w.shape[2]
  block = block_size(num_rows, num_experts)
  dest, block_expert, num_blocks = _dispatch_plan(experts, num_experts, block)
  buf = _to_blocks(x, dest, num_blocks, block)
  contract = (((1,), (1,)), ((), ())) if transpose else (((1,), (0,)), ((), ()))
  low_rank = tuple(reversed(lora)) if transpose else lora

  def matmul(rows, matrix):
    return jax.lax.dot_general(
        rows, matrix, contract, preferred_element_type=jnp.float32
    )

  def one_block(_, inputs):
    rows, expert = inputs
    out = matmul(rows, w[expert])
    if low_rank:
      first, second = low_rank
      out = out + matmul(
          matmul(rows, first[expert]).astype(x.dtype), second[expert]
      )
    return None, out.astype(x.dtype)

  _, out = jax.lax.scan(one_block, None, (buf, block_expert))
  out = out.reshape(num_blocks * block, d_out)
  return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)


def _rowwise(fn):
  """Wraps a row-wise fn(x[T, d], experts[T], *ws) so that vmap flattens rows."""
  wrapped = custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, x, experts, *ws):
    x_batched, experts_batched, *ws_batched = in_batched
    if any(ws_batched):
      raise NotImplementedError(
          "grouped_linear: per-record expert weights are not supported; pass "
          "trainable expert parameters through the LoRA/owner path or use "
          "dispatch='dense'."
      )
    if not x_batched:
      x = jnp.broadcast_to(x, (axis_size,) + x.shape)
    if not experts_batched:
      experts = jnp.broadcast_to(experts, (axis_size,) + experts.shape)
    y = wrapped(x.reshape(-1, x.shape[-1]), experts.reshape(-1), *ws)
    return y.reshape(x.shape[:-1] + y.shape[-1:]), True

  return wrapped


_grouped_forward = _rowwise(
    functools.partial(_grouped_linear_flat, transpose=False)
)
_grouped_backward = _rowwise(
    functools.partial(_grouped_linear_flat, transpose=True)
)


@jax.custom_vjp
def _grouped_linear(x, experts, w, *lora):
  return _grouped_forward(x, experts, w, *lora)


def _grouped_linear_fwd(x, experts, w, *lora):
  # x is kept only for the adapter's gradient.
  return _grouped_forward(x, experts, w, *lora), (
      x if lora else None,
      experts,
      w,
      lora,
  )


def _grouped_linear_bwd(residuals, dy):
  x, experts, w, lora = residuals
  dx = _grouped_backward(dy, experts, w, *lora)
  if not lora:
    return dx, None, None
  return (dx, None, None) + _stacked_lora_grads(x, experts, *lora, dy)


def _stacked_lora_grads(x, experts, a, b, dy):
  """Gradients of sum(dy * x @ a[e] @ b[e]) for EVERY expert's factors.

  The rank-r factors of each row, u = x @ a[e] and g = dy @ b[e]^T, come
  from the grouped dispatch; the outer products are then summed into every
  expert's slice with a one-hot over E (rows x E x r x (d_in + d_out)), the
  size of the result. Only computed where the stacked factors are
  differentiated (e.g. monolithic LoRA); XLA drops it everywhere else.
  """
  one_hot = jax.nn.one_hot(experts, a.shape[0], dtype=dy.dtype)  # dropped -> 0
  u = _grouped_forward(x, experts, a).astype(dy.dtype)
  g = _grouped_backward(dy, experts, b).astype(dy.dtype)
  da = jnp.einsum("td,te,tr->edr", x.astype(dy.dtype), one_hot, g)
  db = jnp.einsum("tr,te,tf->erf", u, one_hot, dy)
  return da.astype(a.dtype), db.astype(b.dtype)


_grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)


def grouped_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """y[t] = x[t] @ w[experts[t]] with work proportional to the rows, not to E.

  Args:
    x: [T, d_in] rows (one per token and routed slot).
    experts: int32 [T] expert of each row; E (= w.shape[0]) drops the row.
    w: [E, d_in, d_out] stacked expert weights, treated as constants (frozen
      base weights: no gradient).
    lora: optional low-rank pair (a [E, d_in, r], b [E, r, d_out]), scale
      already folded into b: y[t] += x[t] @ a[e_t] @ b[e_t], computed in the
      same blocks (rows x r x (d_in + d_out) more work, whatever E). The pair
      is differentiable; its gradient covers every expert's factors, costs a
      one-hot over E, and is only computed where it is used.

  Returns:
    [T, d_out]; zero rows where dropped.
  """
  return _grouped_linear(x, experts, jax.lax.stop_gradient(w), *(lora or ()))


@jax.custom_vjp
def _grouped_linear_trainable(x, experts, w):
  return _grouped_forward(x, experts, w)


def _grouped_linear_trainable_fwd(x, experts, w):
  return _grouped_forward(x, experts, w), (x, experts, w)


def _grouped_linear_trainable_bwd(residuals, dy):
  x, experts, w = residuals
  num_experts = w.shape[0]
  block = block_size(x.shape[0], num_experts)
  dest, block_expert, num_blocks = _dispatch_plan(experts, num_experts, block)

  per_block = jnp.einsum(
      "nbi,nbo->nio",
      _to_blocks(x, dest, num_blocks, block),
      _to_blocks(dy, dest, num_blocks, block),
      preferred_element_type=jnp.float32,
  )
  dw = jax.ops.segment_sum(per_block, block_expert, num_segments=num_experts)
  return _grouped_backward(dy, experts, w), None, dw.astype(w.dtype)


_grouped_linear_trainable.defvjp(
    _grouped_linear_trainable_fwd, _grouped_linear_trainable_bwd
)


def grouped_linear_trainable(
    x: jax.Array, experts: jax.Array, w: jax.Array
) -> jax.Array:
  """`grouped_linear` differentiable in the stacked weights (pretraining).

  The weight gradient dw[e] = sum_{t: e_t = e} x[t]^T dy[t] is computed in
  the same sorted blocks (one outer product per block, summed into its
  expert), so training costs rows x d_in x d_out, not E times that. Not for
  per-record gradients: under `vmap` the weights must stay unbatched.

  Args:
    x: [T, d_in] rows.
    experts: int32 [T] expert of each row; E drops the row.
    w: [E, d_in, d_out].

  Returns:
    [T, d_out]; zero rows where dropped.
  """
  return _grouped_linear_trainable(x, experts, w)


def dense_linear(x: jax.Array, experts: jax.Array, w: jax.Array) -> jax.Array:
  """Reference dispatch: every expert on every row, then select (E x work).

  Fully differentiable, including with respect to `w`; used where expert base
  weights train (full-weight variants) and as the benchmark baseline.
  """
  num_experts = w.shape[0]
  one_hot = jax.nn.one_hot(experts, num_experts, dtype=x.dtype)  # dropped -> 0
  y_all = jnp.einsum("td,edf->tef", x, w)
  return jnp.einsum("tef,te->tf", y_all, one_hot)


# ---------------------------------------------------------------------------
# Differentiable low-rank expert updates (LoRA) and the owner slice.


def expert_lora(
    x: jax.Array,
    experts: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    scale: float,
) -> jax.Array:
  """Per-row LoRA update  scale * x[t] @ A[e_t] @ B[e_t]  (0 if dropped).

  The plain-autodiff reference (every expert's factors on every row, then
  select: T * E * r * (d_in + d_out) multiply-adds, r << d), used with
  `dispatch='dense'`; the grouped dispatch computes the same update inside
  its blocks (`grouped_linear(..., lora=...)`) without the factor E.

  Args:
    x: [T, d_in] rows.
    experts: int32 [T] expert per row (E = dropped).
    lora_a: [E, d_in, r]; lora_b: [E, r, d_out].
    scale: alpha / r.

  Returns:
    [T, d_out] update.
  """
  num_experts = lora_a.shape[0]
  one_hot = jax.nn.one_hot(experts, num_experts, dtype=x.dtype)  # [T, E]
  u_all = jnp.einsum("td,edr->ter", x, lora_a)
  u = jnp.einsum("ter,te->tr", u_all, one_hot)
  v = jnp.einsum("ter,erf->tf", one_hot[..., None] * u[:, None, :], lora_b)
  return scale * v


def owner_lora_delta(
    x: jax.Array,
    experts: jax.Array,
    scale: float,
    owner: jax.Array,
    owner_a: jax.Array,
    owner_b: jax.Array,
) -> jax.Array:
  """The owner slice's gradient path of a frozen expert layer with LoRA.

  RAPTOR's expert stream (Sec. 5.2), for ONE record (this runs under vmap).
  The caller computes the layer with every weight frozen, adapters included,
  e.g. `grouped_linear(x, experts, w, (A, scale * B))`: rows x (d_in d_out +
  r (d_in + d_out)) work whatever E. Adding this function's output,

    delta - stop_gradient(delta),  delta = scale * stop_gradient(x) @ owner_a @ owner_b

  on the rows routed to `owner` (0 elsewhere), leaves the value exactly
  unchanged and gives `owner_a`/`owner_b` (the record's own copy of A[owner],
  B[owner]) the gradient they have in the layer. The record's gradient thus
  reaches its owner's slice only: its per-record gradient has the shape of one
  expert, never E. The input gradient comes from the frozen layer alone,
  which already holds A[owner] B[owner] = owner_a owner_b in value, so the
  owner's adapter is not counted twice.

  Args:
    x: [T, d_in] rows of one record.
    experts: int32 [T] expert per row (E = dropped).
    scale: alpha / r.
    owner: int32 scalar owner expert of this record.
    owner_a: [d_in, r] and owner_b: [r, d_out], the trainable owner slice.

  Returns:
    [T, d_out], zero in value.
  """
  delta = scale * ((jax.lax.stop_gradient(x) @ owner_a) @ owner_b)
  delta = jnp.where((experts == owner)[:, None], delta, 0.0).astype(x.dtype)
  return delta - jax.lax.stop_gradient(delta)


def owner_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    owner: jax.Array,
    owner_w: jax.Array,
) -> jax.Array:
  """`grouped_linear` whose owner expert uses a trainable full-weight slice.

  The full-weight counterpart of the owner path in `expert_lora`: rows routed
  to `owner` are multiplied by `owner_w` (this record's copy of w[owner],
  differentiable); all other rows use the frozen grouped dispatch. The owner
  product runs on every row of the record (one extra expert's work), so memory
  and compute stay independent of E.
  """
  frozen = grouped_linear(x, experts, w)
  own = jnp.einsum("td,df->tf", x, owner_w)
  return jnp.where(
      (experts == owner)[:, None], own.astype(frozen.dtype), frozen
  )
