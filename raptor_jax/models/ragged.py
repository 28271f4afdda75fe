"""Grouped-GEMM expert dispatch: XLA's `ragged_dot` and tokamax's kernels.

`ragged_linear` (and `ragged_linear_trainable`) compute the functions of
`dispatch.grouped_linear` (and `grouped_linear_trainable`) with native
grouped GEMMs: one sort of the rows by expert, then one kernel per matrix,
with the realised group sizes passed as data. That is the shape GPU and TPU
kernels want; on CPU the block scan wins, and `dispatch='auto'` is the scan
there and the loop-free batched blocks elsewhere
(`dispatch.resolve_dispatch`), until a GPU measures a grouped GEMM faster. `tokamax_linear` runs the same dispatch over
tokamax's kernels (the optional `[gpu]` extra). Under `vmap` the records
share one dispatch (`custom_vmap`), exactly as the scan; `kernels='reference'`
is the dense definition (`dispatch.reference_linear`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from raptor_jax.models import dispatch as grouped


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

  The custom VJPs of `ragged_linear` / `ragged_linear_trainable`
  (`dispatch.dispatch_vjps`), whose products are
  `ragged_dot_general(lhs, rhs, group_sizes, dims, ...)`:
  `jax.lax.ragged_dot_general` or a kernel library's function of the same
  signature (`tokamax_linear`).
  """
  flat = functools.partial(
      _ragged_linear_flat, ragged_dot_general=ragged_dot_general
  )
  return grouped.dispatch_vjps(
      flat,
      lambda x, experts, dy, num_experts: _group_outer(
          num_experts, ragged_dot_general
      )(x, experts, dy),
  )


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
  return grouped.frozen_front(_ragged_linear, x, experts, w, lora, kernels)


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
  return grouped.trainable_front(
      _ragged_linear_trainable, x, experts, w, kernels
  )


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
  fast = lambda *args: _tokamax_dispatch()[0](*args)  # imports it lazily
  return grouped.frozen_front(fast, x, experts, w, lora, kernels)


def tokamax_linear_trainable(
    x: jax.Array, experts: jax.Array, w: jax.Array, kernels: str = "auto"
) -> jax.Array:
  """`ragged_linear_trainable` over tokamax's grouped GEMMs."""
  fast = lambda *args: _tokamax_dispatch()[1](*args)  # imports it lazily
  return grouped.trainable_front(fast, x, experts, w, kernels)
