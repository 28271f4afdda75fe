"""Mixture-of-Experts expert dispatch: every (token, expert) row through its expert.

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

`batched_linear` is the same sorted blocks without the scan: every block in
one batched product, each block's expert weights gathered (at most 1.5x the
rows' FLOPs, no loop), the default off CPU, where XLA drives each loop step
from the host (`resolve_dispatch`). `raptor_jax.models.ragged` computes the
same functions with native grouped GEMMs (`jax.lax.ragged_dot`, tokamax).
Routing
(`raptor_jax.models.routing`), and so capacity drops, is decided before any
dispatch: a dropped row has expert E and gets no expert output.
"""

from __future__ import annotations

import functools

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
  # Loop-free throughout (no `searchsorted` scan): on a GPU every loop step
  # is a round trip driven by the host.
  counts_all = jnp.zeros((num_experts + 1,), jnp.int32).at[experts].add(1)
  counts = counts_all[:num_experts]
  padded = jnp.maximum(1, -(-counts // block)) * block
  group_end = jnp.cumsum(padded)
  group_start = group_end - padded
  # Rank of each row among the rows of its expert (stable, by position).
  order = jnp.argsort(experts, stable=True)
  sorted_experts = experts[order]
  first_of_expert = jnp.cumsum(counts_all) - counts_all
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
      group_end,
      jnp.arange(num_blocks) * block,
      side="right",
      method="compare_all",
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


def rowwise(fn):
  """Wraps a row-wise `fn(x[T, d], experts[T], *ws)` so that vmap flattens rows."""
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


def stacked_lora_grads(x, experts, a, b, dy, forward, backward):
  """Gradients of sum(dy * x @ a[e] @ b[e]) for EVERY expert's factors.

  The rank-r factors of each row, u = x @ a[e] and g = dy @ b[e]^T, come
  from the dispatch (`forward` / `backward`); the outer products are then
  summed into every expert's slice with a one-hot over E (rows x E x r x
  (d_in + d_out)), the size of the result. Only computed where the stacked
  factors are differentiated (e.g. monolithic LoRA); XLA drops it
  everywhere else.
  """
  one_hot = jax.nn.one_hot(experts, a.shape[0], dtype=dy.dtype)  # dropped -> 0
  u = forward(x, experts, a).astype(dy.dtype)
  g = backward(dy, experts, b).astype(dy.dtype)
  da = jnp.einsum("td,te,tr->edr", x.astype(dy.dtype), one_hot, g)
  db = jnp.einsum("tr,te,tf->erf", u, one_hot, dy)
  return da.astype(a.dtype), db.astype(b.dtype)


def dispatch_vjps(flat, weight_grad):
  """(frozen, trainable): the custom VJPs of one row-wise expert dispatch.

  `flat(x, experts, w, *lora, transpose)` is the dispatched product on flat
  rows: `transpose=False` the forward, `transpose=True` its transpose (the
  input gradient); both run `rowwise` (records folded under `vmap`).
  `weight_grad(x, experts, dy, E)` is dw[e] = sum_{t: e_t = e} x[t]^T dy[t]
  in float32. `frozen(x, experts, w, *lora)` treats `w` as a constant and
  differentiates the LoRA pair (every expert's factors,
  `stacked_lora_grads`); `trainable(x, experts, w)` differentiates `w`.
  Shared by the grouped, batched and ragged dispatches.
  """
  forward = rowwise(functools.partial(flat, transpose=False))
  backward = rowwise(functools.partial(flat, transpose=True))

  @jax.custom_vjp
  def frozen(x, experts, w, *lora):
    return forward(x, experts, w, *lora)

  def frozen_fwd(x, experts, w, *lora):
    # x is kept only for the adapter's gradient.
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
    grads = stacked_lora_grads(x, experts, *lora, dy, forward, backward)
    return (dx, None, None) + grads

  frozen.defvjp(frozen_fwd, frozen_bwd)

  @jax.custom_vjp
  def trainable(x, experts, w):
    return forward(x, experts, w)

  def trainable_fwd(x, experts, w):
    return forward(x, experts, w), (x, experts, w)

  def trainable_bwd(residuals, dy):
    x, experts, w = residuals
    dw = weight_grad(x, experts, dy, w.shape[0])
    return backward(dy, experts, w), None, dw.astype(w.dtype)

  trainable.defvjp(trainable_fwd, trainable_bwd)
  return frozen, trainable


def frozen_front(fast, x, experts, w, lora, kernels):
  """A frozen dispatch's front door (`grouped_linear` and its kin).

  `w` gets no gradient; `fast(x, experts, w, *lora)` (a `dispatch_vjps`
  frozen VJP) runs where `kernels` resolves to 'fast', the definition
  `reference_linear` (autodiff) elsewhere.
  """
  w = jax.lax.stop_gradient(w)
  if kernels_lib.resolve_expert(kernels) == "fast":
    return fast(x, experts, w, *(lora or ()))
  return reference_linear(x, experts, w, lora)


def trainable_front(fast, x, experts, w, kernels):
  """A trainable dispatch's front door (`grouped_linear_trainable` and kin).

  `fast(x, experts, w)` (a `dispatch_vjps` trainable VJP) where `kernels`
  resolves to 'fast', the definition `dense_linear` (autodiff) elsewhere.
  """
  if kernels_lib.resolve_expert(kernels) == "fast":
    return fast(x, experts, w)
  return dense_linear(x, experts, w)


def _block_outer(x, experts, dy, num_experts, rows_per_block):
  """dw[e] = sum_{t: e_t = e} x[t]^T dy[t] (float32), one product per block.

  The blocks of `rows_per_block(rows, E)` rows, as the forward's.
  """
  block = rows_per_block(x.shape[0], num_experts)
  dest, block_expert, num_blocks = _dispatch_plan(experts, num_experts, block)
  per_block = jnp.einsum(
      "nbi,nbo->nio",
      _to_blocks(x, dest, num_blocks, block),
      _to_blocks(dy, dest, num_blocks, block),
      preferred_element_type=jnp.float32,
  )
  return jax.ops.segment_sum(per_block, block_expert, num_segments=num_experts)


_grouped_linear, _grouped_linear_trainable = dispatch_vjps(
    _grouped_linear_flat,
    functools.partial(_block_outer, rows_per_block=block_size),
)


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
  return frozen_front(_grouped_linear, x, experts, w, lora, kernels)


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
  return trainable_front(_grouped_linear_trainable, x, experts, w, kernels)


# ---------------------------------------------------------------------------
# Batched dispatch: the sorted blocks as one batched product, no loop (GPU).


def batched_block_size(num_rows: int, num_experts: int) -> int:
  """Rows per block of `batched_linear`: ceil(rows / 2E), 8-aligned above 8.

  The dispatch computes all `static_num_blocks` = rows // block + E blocks,
  i.e. at most rows + E * block <= 1.5 x rows (+ 8 E) rows of products, and
  gathers one weight matrix per block: at most 3E of them (+ 1), about 3x
  the layer's stacked weights, whatever the number of rows. Blocks of 8k
  rows suit tensor-core tiles. Shapes only, never the routing.
  """
  block = -(-num_rows // (2 * num_experts))
  if block > 8:
    block = -(-block // 8) * 8
  return int(max(1, block))


def _batched_linear_flat(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    *lora: jax.Array,
    transpose: bool,
) -> jax.Array:
  """`_grouped_linear_flat` with every block in one batched product.

  The same sorted, padded blocks (`_dispatch_plan`: every routing fits, no
  row is dropped), but each block's expert matrices are gathered
  ([blocks, d_in, d_out]) and all blocks are multiplied at once: one
  batched GEMM per matrix instead of a `lax.scan` over the blocks, so the
  compiled program has no loop (on a GPU each scan step is a round trip
  driven by the host). `lora` and `transpose` as in `_grouped_linear_flat`.
  """
  num_rows = x.shape[0]
  num_experts = w.shape[0]
  block = batched_block_size(num_rows, num_experts)
  dest, block_expert, num_blocks = _dispatch_plan(experts, num_experts, block)
  buf = _to_blocks(x, dest, num_blocks, block)
  # rows[n, b, i] @ matrix[n, i, j], or @ matrix[n, j, i]^T (the transpose).
  spec = "nbi,nji->nbj" if transpose else "nbi,nij->nbj"
  factors = tuple(reversed(lora)) if transpose else lora

  def matmul(rows, stacked):
    return jnp.einsum(
        spec,
        rows,
        jnp.take(stacked, block_expert, axis=0, mode="clip"),
        preferred_element_type=jnp.float32,
    )

  out = matmul(buf, w)
  if factors:
    first, second = factors
    out = out + matmul(matmul(buf, first).astype(x.dtype), second)
  out = out.astype(x.dtype).reshape(num_blocks * block, out.shape[-1])
  return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)


_batched_linear, _batched_linear_trainable = dispatch_vjps(
    _batched_linear_flat,
    functools.partial(_block_outer, rows_per_block=batched_block_size),
)


def batched_linear(
    x: jax.Array,
    experts: jax.Array,
    w: jax.Array,
    lora: tuple[jax.Array, jax.Array] | None = None,
    kernels: str = "auto",
) -> jax.Array:
  """`grouped_linear` without its loop: the GPU's default dispatch.

  The same function, arguments and gradients as `grouped_linear`; the
  sorted blocks (`batched_block_size`, at most 1.5x the rows) are
  multiplied in one batched product per matrix, their experts' weights
  gathered per block, so the compiled step has no host-driven loop
  (docs/performance.md, "GPU dispatch"). Under `vmap` the records share one
  dispatch (`kernels` 'fast' or 'auto'); 'reference' is the definition
  (`reference_linear`).
  """
  return frozen_front(_batched_linear, x, experts, w, lora, kernels)


def batched_linear_trainable(
    x: jax.Array, experts: jax.Array, w: jax.Array, kernels: str = "auto"
) -> jax.Array:
  """`batched_linear` differentiable in the stacked weights (pretraining).

  As `grouped_linear_trainable`, without a loop: the weight gradient is one
  outer product per block summed into its expert. Not for per-record
  gradients (the weights must stay unbatched under `vmap`). `kernels`
  'reference' is `dense_linear` (the definition).
  """
  return trainable_front(_batched_linear_trainable, x, experts, w, kernels)


# ---------------------------------------------------------------------------
# Ragged dispatch: native grouped GEMMs (`jax.lax.ragged_dot`).

# Every `dispatch` an expert layer accepts. 'auto' and 'auto_train' resolve
# per backend (`resolve_dispatch`); '*_train' makes the stacked kernels
# trainable (pretraining) and takes no adapters.
DISPATCHES = (
    "auto",
    "grouped",
    "batched",
    "ragged",
    "tokamax",
    "dense",
    "auto_train",
    "grouped_train",
    "batched_train",
    "ragged_train",
    "tokamax_train",
)
DISPATCH_FIX = (
    "pass dispatch= to from_pretrained / with_options (or set"
    " --config.model.dispatch); 'auto' is 'grouped' on CPU, 'batched'"
    " elsewhere"
)


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
  """The dispatch to run: 'auto' per backend, any other value is kept.

  On CPU the sorted-block `lax.scan` (`grouped_linear`) was measured to
  win: XLA CPU has no grouped-GEMM kernel and lowers `ragged_dot` to a
  masked product over every expert. Elsewhere 'auto' is the same sorted
  blocks without the scan (`batched_linear`): XLA:GPU drives a loop from
  the host, a round trip per step, and the scan runs about 9E steps per
  product (over a thousand per layer at E = 64); the batched product has
  no loop, at most 1.5x the expert FLOPs of the rows, where XLA's own
  NVIDIA lowering of `ragged_dot` is a masked product over every expert (E
  x) and tokamax is an optional package. The argument is in
  docs/performance.md ("GPU dispatch"); `launch/bench/gpu_dispatch.py`
  measures it. Every dispatch computes the same function.

  Args:
    dispatch: one of `DISPATCHES`.
    backend: 'cpu', 'gpu', 'tpu'...; default `kernels.default_backend()`
      (JAX's, unless `kernels.defaults_of` says otherwise).

  Returns:
    `dispatch` with 'auto' replaced by 'grouped' (CPU) or 'batched'.
  """
  if not dispatch.startswith("auto"):
    return dispatch
  backend = backend or kernels_lib.default_backend()
  chosen = "grouped" if backend == "cpu" else "batched"
  return chosen + dispatch[len("auto") :]


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
