"""Mixture-of-Experts building blocks: routing, capacity, expert dispatch.

Everything here has *per-record semantics*: routing and expert capacity are
computed per sequence and every expert computation is row-wise, so a record's
output never depends on another record in the batch (the invariant of docs/method.md §3 that
makes per-record gradients, and therefore DP clipping, meaningful).

Expert dispatch
---------------
`grouped_linear` applies, to every (token, expert) row, that expert's weight
matrix. Its cost scales with the number of rows (tokens x k), not with
tokens x E: rows are sorted by expert into fixed-size blocks (each block holds
rows of one expert, padded; see `block_size`), and a
`lax.scan` multiplies each block by its expert's weights, loaded once at the
expert's first block. Shapes are static (the number of blocks is a worst-case
bound computed from the number of rows and E), so one compilation serves every
batch, and so is the work: every expert owns at least one block, so the scan
runs the same products and weight loads whatever the routing.

Under `jax.vmap` (per-record gradients) the dispatch does not run per record:
a `custom_vmap` rule flattens the vmapped axis into the row axis, so the whole
microbatch shares one sorted dispatch. This is exact because the operation is
row-wise. The base weights of `grouped_linear` are constants (frozen); a
LoRA pair rides in the same blocks and is differentiable, its gradient (every
expert's factors) computed only where asked for. RAPTOR's owner slices use
`owner_lora_delta` / `owner_linear`, whose cost does not grow with E;
`dense_linear` and `expert_lora` are the every-expert references.

`ragged_linear` (and `ragged_linear_trainable`) compute the same functions
with native grouped GEMMs (`jax.lax.ragged_dot`): one sort of the rows by
expert, then one kernel per matrix, with the realised group sizes passed as
data. That is the shape GPU and TPU kernels want; on CPU the scan wins, and
until a GPU or TPU measures otherwise `dispatch='auto'` is the scan on every
backend (`resolve_dispatch`). Routing, and so
capacity drops, is decided before either dispatch: a dropped row has expert
E in both and gets no expert output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from raptor_jax.models import kernels as kernels_lib
from raptor_jax.models import low_rank

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


def block_size(num_rows: int, num_experts: int, max_block: int = 256) -> int:
  """Rows per block: worst-case padding below 1/8 of the rows, or 16-row blocks.

  Each expert's group is padded to a multiple of the block size, which costs
  at most E * (block - 1) extra rows; block <= rows / (8 E + 1) keeps that
  below rows / 8, so the dispatch does less than 1.125x the ideal expert
  work. Each block also costs a fixed overhead (one scan step, its slices
  and updates), and XLA's CPU products of a few rows cost nearly what 16
  rows do, so once there are at least 32 rows per expert blocks have at least
  16 rows (padding then below 16 E <= rows / 2). Measured on 2 CPU cores,
  forward+backward of one d_model 768 x d_ff 3072 expert linear at E=64:
  4096 rows, blocks of 16 instead of 7, 0.82x the time; below 32 rows per
  expert single-row blocks (matrix-vector products) were fastest, 4-row
  blocks 1.17-1.40x slower. The result depends only on the shapes, never on
  the routing.
  """
  block = num_rows // (8 * num_experts + 1)
  if num_rows >= 32 * num_experts:
    block = max(block, 16)
  return int(max(1, min(max_block, block)))


def static_num_blocks(num_rows: int, num_experts: int, block: int) -> int:
  """Blocks of a dispatch of `num_rows` rows, enough for any routing.

  Expert e needs max(1, ceil(c_e / block)) < c_e / block + 1 blocks (one
  even without rows, see `_dispatch_plan`), so sum_e c_e <= rows needs at
  most rows // block + E.
  """
  return num_rows // block + num_experts


def _dispatch_plan(experts: jax.Array, num_experts: int, block: int):
  """Sorted block layout for the rows of one flat dispatch.

  Args:
    experts: int32 [T]; values in [0, E], E meaning "dropped".
    num_experts: E.
    block: rows per block.

  Every expert owns at least one block (an expert without rows an empty
  one), so the blocks of a dispatch always change expert exactly E - 1
  times, whatever the routing (`_grouped_linear_flat` loads each expert's
  weights once, at its first block); the trailing blocks no expert needs
  belong to the last expert.

  Returns:
    (dest, block_expert, num_blocks): dest[t] is row t's position in the
    padded, expert-sorted buffer (an out-of-range index for dropped rows);
    block_expert[j] is the expert of block j (non-decreasing).
  """
  num_rows = experts.shape[0]
  num_blocks = static_num_blocks(num_rows, num_experts, block)
  counts = (
      jnp.zeros((num_experts + 1,), jnp.int32).at[experts].add(1)[:num_experts]
  )
  padded = jnp.maximum(1, -(-counts // block)) * block
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
  factors = tuple(reversed(lora)) if transpose else lora
  # Each expert's weights are sliced once, at its first block, and carried
  # through its other blocks: copying them for every block cost more than
  # the products of small blocks. Blocks change expert exactly E - 1 times
  # (`_dispatch_plan`), so the copies, like the products, do not depend on
  # the routing.
  first_of_expert = jnp.concatenate(
      [jnp.ones((1,), bool), block_expert[1:] != block_expert[:-1]]
  )

  def matmul(rows, matrix):
    return jax.lax.dot_general(
        rows, matrix, contract, preferred_element_type=jnp.float32
    )

  def expert_weights(expert):
    return (w[expert],) + tuple(f[expert] for f in factors)

  def one_block(weights, inputs):
    rows, expert, first = inputs
    weights = jax.lax.cond(
        first, lambda _: expert_weights(expert), lambda held: held, weights
    )
    matrix, *low_rank_pair = weights
    out = matmul(rows, matrix)
    if low_rank_pair:
      a, b = low_rank_pair
      out = out + matmul(matmul(rows, a).astype(x.dtype), b)
    return weights, out.astype(x.dtype)

  _, out = jax.lax.scan(
      one_block,
      tuple(jnp.zeros(a.shape[1:], a.dtype) for a in (w, *factors)),
      (buf, block_expert, first_of_expert),
  )
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


def _stacked_lora_grads(
    x, experts, a, b, dy, forward=_grouped_forward, backward=_grouped_backward
):
  """Gradients of sum(dy * x @ a[e] @ b[e]) for EVERY expert's factors.

  The rank-r factors of each row, u = x @ a[e] and g = dy @ b[e]^T, come
  from the dispatch (`forward` / `backward`: the grouped one unless given);
  the outer products are then summed into every expert's slice with a
  one-hot over E (rows x E x r x (d_in + d_out)), the size of the result.
  Only computed where the stacked factors are differentiated (e.g.
  monolithic LoRA); XLA drops it everywhere else.
  """
  one_hot = jax.nn.one_hot(experts, a.shape[0], dtype=dy.dtype)  # dropped -> 0
  u = forward(x, experts, a).astype(dy.dtype)
  g = backward(dy, experts, b).astype(dy.dtype)
  da = jnp.einsum("td,te,tr->edr", x.astype(dy.dtype), one_hot, g)
  db = jnp.einsum("tr,te,tf->erf", u, one_hot, dy)
  return da.astype(a.dtype), db.astype(b.dtype)


_grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)


def grouped_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
    kernels: str = "auto",
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
    kernels: 'fast' or 'auto' (the custom VJP above, records folded into one
      dispatch under `vmap`) or 'reference' (the definition: `dense_linear`
      and `expert_lora`, autodiff; see `kernels.resolve_expert`).

  Returns:
    [T, d_out]; zero rows where dropped.
  """
  w = jax.lax.stop_gradient(w)
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _grouped_linear(x, experts, w, *(lora or ()))
  return reference_linear(x, experts, w, lora)


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
    x: jax.Array, experts: jax.Array, w: jax.Array, kernels: str = "auto"
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
    kernels: 'fast' or 'auto' (the hand-written weight gradient above) or
      'reference' (`dense_linear`, autodiff; see `kernels.resolve_expert`).

  Returns:
    [T, d_out]; zero rows where dropped.
  """
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _grouped_linear_trainable(x, experts, w)
  return dense_linear(x, experts, w)


# ---------------------------------------------------------------------------
# Ragged dispatch: native grouped GEMMs (`jax.lax.ragged_dot`).

# Every `dispatch` an expert layer accepts. 'auto' and 'auto_train' resolve
# to the grouped ones (`resolve_dispatch`); '*_train' makes the stacked kernels
# trainable (pretraining) and takes no adapters.
DISPATCHES = (
    "auto",
    "grouped",
    "ragged",
    "tokamax",
    "dense",
    "auto_train",
    "grouped_train",
    "ragged_train",
    "tokamax_train",
)
DISPATCH_FIX = (
    "pass dispatch= to from_pretrained / with_options (or set"
    " --config.model.dispatch); 'auto' is 'grouped'"
)


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
  """The dispatch to run: 'auto' is 'grouped', any other value is kept.

  On CPU the sorted-block `lax.scan` (`grouped_linear`) was measured to win:
  XLA CPU has no grouped-GEMM kernel and lowers `ragged_dot` to a masked
  product over every expert. No GPU or TPU has measured either yet, and
  public reports put XLA's default NVIDIA lowering of `ragged_dot` at a dense
  masked product too, so 'auto' resolves to 'grouped' on every backend
  ('auto_train' to 'grouped_train') until a measurement there says
  otherwise (`launch/bench/gpu_dispatch.py`). Both dispatches compute the
  same function; 'ragged' stays available by name.

  Args:
    dispatch: one of `DISPATCHES`.
    backend: 'cpu', 'gpu', 'tpu'...; default `jax.default_backend()`. Kept
      for the day the choice depends on it.

  Returns:
    `dispatch` with 'auto' replaced by 'grouped'.
  """
  del backend  # unmeasured off CPU: the measured choice everywhere
  if not dispatch.startswith("auto"):
    return dispatch
  return "grouped" + dispatch[len("auto") :]


def _ragged_plan(experts: jax.Array, num_groups: int):
  """(order, sizes): a stable sort of the rows by group, and rows per group.

  Rows of the "dropped" group (== num_groups) sort last, outside every group.
  Group sizes are data (an int32 array), not shapes: one compilation serves
  every routing.
  """
  order = jnp.argsort(experts, stable=True)
  sizes = jnp.zeros((num_groups + 1,), jnp.int32).at[experts].add(1)
  return order, sizes[:num_groups]


def _ragged_dims(lhs_contract, rhs_contract, rhs_group):
  return jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((lhs_contract,), (rhs_contract,)), ((), ())),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=rhs_group,
  )


_RAGGED_ROWS = _ragged_dims(1, 1, [0])  # rows[t] @ w[g_t]
_RAGGED_ROWS_T = _ragged_dims(1, 2, [0])  # rows[t] @ w[g_t]^T
_RAGGED_OUTER = _ragged_dims(0, 0, [])  # [G, i, o]: sum_{g_t = g} x[t]^T y[t]


def _ragged_linear_flat(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    *lora: jax.Array,
    transpose: bool,
    ragged_dot_general=jax.lax.ragged_dot_general,
) -> jax.Array:
  """`_grouped_linear_flat` with one `ragged_dot` per matrix instead of a scan.

  Rows are sorted by expert (no padding: the group sizes are the realised
  counts, consumed as data by the kernel, never by Python), multiplied by
  their expert's matrix in one grouped GEMM, and put back in row order.
  Dropped rows sort last, outside every group, and are zeroed explicitly.
  `ragged_dot_general` is the grouped GEMM (`jax.lax`'s, or tokamax's with
  the same signature).
  """
  num_experts = w.shape[0]
  order, sizes = _ragged_plan(experts, num_experts)
  dims = _RAGGED_ROWS_T if transpose else _RAGGED_ROWS

  def matmul(rows, matrix):
    return ragged_dot_general(
        rows, matrix, sizes, dims, preferred_element_type=jnp.float32
    )

  rows = x[order]
  out = matmul(rows, w)
  if lora:
    first, second = tuple(reversed(lora)) if transpose else lora
    out = out + matmul(matmul(rows, first).astype(x.dtype), second)
  out = jnp.zeros(out.shape, x.dtype).at[order].set(out.astype(x.dtype))
  return jnp.where((experts < num_experts)[:, None], out, 0)


def _group_outer_flat(x, groups, y, num_groups, ragged_dot_general):
  """out[g] = sum_{t: groups[t] = g} x[t]^T y[t] in float32, one ragged GEMM."""
  order, sizes = _ragged_plan(groups, num_groups)
  y = jnp.where((groups < num_groups)[:, None], y, 0)
  return ragged_dot_general(
      x[order],
      y[order],
      sizes,
      _RAGGED_OUTER,
      preferred_element_type=jnp.float32,
  )


def _group_outer(num_groups: int, ragged_dot_general):
  """`_group_outer_flat` over `num_groups` groups, batched by group folding.

  Under `vmap` (per-record gradients) record i's rows of group g form group
  i * num_groups + g of one flat ragged GEMM, so the per-record results
  [n, G, i, o] cost one pass over the rows; nested vmaps fold again.
  """
  fn = custom_vmap(
      functools.partial(
          _group_outer_flat,
          num_groups=num_groups,
          ragged_dot_general=ragged_dot_general,
      )
  )

  @fn.def_vmap
  def _rule(axis_size, in_batched, x, groups, y):
    x, groups, y = (
        v if batched else jnp.broadcast_to(v, (axis_size,) + v.shape)
        for v, batched in zip((x, groups, y), in_batched)
    )
    record = jnp.arange(axis_size, dtype=groups.dtype)[:, None]
    folded = jnp.where(
        groups < num_groups,
        record * num_groups + groups,
        axis_size * num_groups,
    )
    out = _group_outer(axis_size * num_groups, ragged_dot_general)(
        x.reshape(-1, x.shape[-1]),
        folded.reshape(-1),
        y.reshape(-1, y.shape[-1]),
    )
    return out.reshape((axis_size, num_groups) + out.shape[1:]), True

  return fn


def _ragged_dispatch(ragged_dot_general):
  """(frozen, trainable) fast ragged dispatches over one grouped GEMM.

  The custom VJPs of `ragged_linear` / `ragged_linear_trainable`, whose
  products are `ragged_dot_general(lhs, rhs, group_sizes, dims, ...)`:
  `jax.lax.ragged_dot_general` or a kernel library's function of the same
  signature (`tokamax_linear`).
  """
  flat = functools.partial(
      _ragged_linear_flat, ragged_dot_general=ragged_dot_general
  )
  forward = _rowwise(functools.partial(flat, transpose=False))
  backward = _rowwise(functools.partial(flat, transpose=True))

  @jax.custom_vjp
  def frozen(x, experts, w, *lora):
    return forward(x, experts, w, *lora)

  def frozen_fwd(x, experts, w, *lora):
    return forward(x, experts, w, *lora), (
        x if lora else None,
        experts,
        w,
        lora,
    )

  def frozen_bwd(residuals, dy):
    x, experts, w, lora = residuals
    dx = backward(dy, experts, w, *lora)
    if not lora:
      return dx, None, None
    grads = _stacked_lora_grads(x, experts, *lora, dy, forward, backward)
    return (dx, None, None) + grads

  frozen.defvjp(frozen_fwd, frozen_bwd)

  @jax.custom_vjp
  def trainable(x, experts, w):
    return forward(x, experts, w)

  def trainable_fwd(x, experts, w):
    return forward(x, experts, w), (x, experts, w)

  def trainable_bwd(residuals, dy):
    x, experts, w = residuals
    dw = _group_outer(w.shape[0], ragged_dot_general)(x, experts, dy)
    return backward(dy, experts, w), None, dw.astype(w.dtype)

  trainable.defvjp(trainable_fwd, trainable_bwd)
  return frozen, trainable


_ragged_linear, _ragged_linear_trainable = _ragged_dispatch(
    jax.lax.ragged_dot_general
)


def ragged_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
    kernels: str = "auto",
) -> jax.Array:
  """`grouped_linear` computed with grouped GEMMs (`jax.lax.ragged_dot`).

  The same function, arguments and gradients as `grouped_linear` (frozen
  `w`, differentiable LoRA pair, dropped rows zero); the rows are sorted by
  expert once per product and each matrix is one `ragged_dot`, the shape
  GPU and TPU grouped-GEMM kernels want. Under `vmap` the records share one
  dispatch, exactly as in `grouped_linear` (`kernels` 'fast' or 'auto');
  'reference' is the definition, as for `grouped_linear`.
  """
  w = jax.lax.stop_gradient(w)
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _ragged_linear(x, experts, w, *(lora or ()))
  return reference_linear(x, experts, w, lora)


def ragged_linear_trainable(
    x: jax.Array, experts: jax.Array, w: jax.Array, kernels: str = "auto"
) -> jax.Array:
  """`ragged_linear` differentiable in the stacked weights (pretraining).

  dw[e] = sum_{t: e_t = e} x[t]^T dy[t] is one ragged GEMM over the sorted
  rows (rows x d_in x d_out work). Unlike `grouped_linear_trainable` it also
  serves per-record gradients: under `vmap` each record's rows form their
  own groups (`_group_outer`), giving [n, E, d_in, d_out] in one pass.
  `kernels` 'reference' is `dense_linear` (the definition) instead.
  """
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _ragged_linear_trainable(x, experts, w)
  return dense_linear(x, experts, w)


# ---------------------------------------------------------------------------
# tokamax: the same ragged dispatch over its grouped-GEMM kernels (Pallas
# kernels for Hopper and Blackwell GPUs and TPUs, XLA's elsewhere).

TOKAMAX_FIX = "pip install 'raptor_jax[gpu]' (or pip install tokamax)"


@functools.cache
def _tokamax_dispatch():
  """`_ragged_dispatch` over `tokamax.ragged_dot_general` (imported lazily)."""
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        f"dispatch='tokamax' needs the tokamax package: {TOKAMAX_FIX}"
    ) from None
  return _ragged_dispatch(tokamax.ragged_dot_general)


def tokamax_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
    kernels: str = "auto",
) -> jax.Array:
  """`ragged_linear` whose grouped GEMMs are tokamax's kernels.

  The same function and gradients as `ragged_linear` (and so as
  `grouped_linear`); tokamax picks its implementation per backend (on CPU
  XLA's `ragged_dot`). Unmeasured on GPU so far: `launch/bench/gpu_dispatch.py`
  times it. Needs the optional `tokamax` package (the `[gpu]` extra).
  """
  w = jax.lax.stop_gradient(w)
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _tokamax_dispatch()[0](x, experts, w, *(lora or ()))
  return reference_linear(x, experts, w, lora)


def tokamax_linear_trainable(
    x: jax.Array, experts: jax.Array, w: jax.Array, kernels: str = "auto"
) -> jax.Array:
  """`ragged_linear_trainable` over tokamax's grouped GEMMs."""
  if kernels_lib.resolve_expert(kernels) == "fast":
    return _tokamax_dispatch()[1](x, experts, w)
  return dense_linear(x, experts, w)


def reference_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """The frozen dispatches' definition: `dense_linear` (+ `expert_lora`).

  y[t] = x[t] @ w[e_t] (+ x[t] @ a[e_t] @ b[e_t], the scale already in b),
  every expert on every row and then a select, differentiated by autodiff
  and batched by JAX's own `vmap` rules: the plain twin of `grouped_linear`
  and `ragged_linear` (`kernels='reference'`).
  """
  y = dense_linear(x, experts, w)
  if lora is not None:
    a, b = lora
    y = y + expert_lora(x, experts, a, b, 1.0)
  return y


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
    kernels: str = "auto",
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
    kernels: of `low_rank.low_rank_update` (see `kernels.py`).

  Returns:
    [T, d_out], zero in value.
  """
  delta = low_rank.low_rank_update(
      jax.lax.stop_gradient(x), owner_a, owner_b, scale, kernels
  )
  delta = jnp.where((experts == owner)[:, None], delta, 0.0).astype(x.dtype)
  return delta - jax.lax.stop_gradient(delta)


def owner_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    owner: jax.Array,
    owner_w: jax.Array,
    frozen_linear=grouped_linear,
) -> jax.Array:
  """`grouped_linear` whose owner expert uses a trainable full-weight slice.

  The full-weight counterpart of the owner path in `expert_lora`: rows routed
  to `owner` are multiplied by `owner_w` (this record's copy of w[owner],
  differentiable); all other rows use the frozen grouped dispatch. The owner
  product runs on every row of the record (one extra expert's work), so memory
  and compute stay independent of E. `frozen_linear` is the frozen dispatch
  (`grouped_linear` or `ragged_linear`).
  """
  frozen = frozen_linear(x, experts, w)
  own = jnp.einsum("td,df->tf", x, owner_w)
  return jnp.where(
      (experts == owner)[:, None], own.astype(frozen.dtype), frozen
  )
