"""Gradients of low-rank (LoRA) factors, in the layout XLA:CPU runs fast.

A LoRA pair (a [d_in, r], b [r, d_out]) on rows x [T, d_in] with output
gradient dy [T, d_out] has the factor gradients

    da = scale * x^T (dy b^T),    db = scale * (x a)^T dy,

both contractions over the rows T. Written as `x.T @ g`, XLA contracts the
leading (row) axis of both operands, and its CPU matmul library then takes a
slow path: for per-record gradients (under `vmap`, 32 records of 128 rows,
d_in = 256, r = 8) `da` ran at ~10 GF/s, 1.6 ms, and at d_in = 1024 8.5 ms
(2 CPU cores), where the same product as `(g.T @ x).T`, with the small
operand transposed first, runs in 0.3 and 1.2 ms: 5x. XLA's simplifier folds
such transposes back into the product's dimension numbers, so
`rows_contraction` pins the layout with `jax.lax.optimization_barrier` on
the transposed small operand and on the product. The values are the same
sums of the same products (only the summation order inside the matmul
kernel may differ); the barriers only stop the compiler from rewriting the
layout. Used by `LoRADense`'s backward and by RAPTOR's owner slices
(`moe.owner_lora_delta`), the per-record gradients of both streams.
"""

from __future__ import annotations

import functools

import jax

from raptor_jax.models import kernels as kernels_lib


def rows_contraction(small: jax.Array, big: jax.Array) -> jax.Array:
  """small^T @ big, summed over the rows: [T, r], [T, n] -> [r, n].

  The small operand (r columns, e.g. the LoRA rank) is transposed on its
  own and the product is then an ordinary [r, T] @ [T, n] matmul, the form
  XLA:CPU's matmul library runs at full speed (see the module docstring).

  Args:
    small: [T, r] (T rows; r small).
    big: [T, n].

  Returns:
    [r, n] in the promoted dtype of the operands.
  """
  small_t = jax.lax.optimization_barrier(small.T)
  return jax.lax.optimization_barrier(small_t @ big)


def factor_grads(
    rows: jax.Array,
    rows_a: jax.Array,
    d_rows: jax.Array,
    b: jax.Array,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
  """(da, db) of  scale * (rows @ a) @ b  for output gradient d_rows.

  Args:
    rows: [T, d_in] inputs.
    rows_a: [T, r], rows @ a (kept from the forward).
    d_rows: [T, d_out] output gradient.
    b: [r, d_out].
    scale: alpha / r.

  Returns:
    da [d_in, r] = scale * rows^T (d_rows b^T) and
    db [r, d_out] = scale * (rows a)^T d_rows.
  """
  da = scale * rows_contraction(d_rows @ b.T, rows).T
  db = scale * rows_contraction(rows_a, d_rows)
  return da, db


def low_rank_update(
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    scale: float,
    kernels: str = "auto",
) -> jax.Array:
  """scale * (x @ a) @ b with x a constant: gradients reach a and b only.

  The trainable half of a LoRA layer whose base product is computed (and
  differentiated with respect to x) elsewhere, e.g. RAPTOR's owner slice
  next to the frozen expert dispatch. x gets no gradient.

  Args:
    x: [..., d_in] rows (treated as a constant).
    a: [d_in, r].
    b: [r, d_out].
    scale: the Python float alpha / r.
    kernels: 'reference' (autodiff of this product), 'fast' (the factor
      gradients of `factor_grads`) or 'auto' (see `kernels.py`).

  Returns:
    [..., d_out].
  """
  if kernels_lib.resolve(kernels) == "fast":
    return low_rank_update_fast(x, a, b, scale)
  return low_rank_update_reference(x, a, b, scale)


def low_rank_update_reference(
    x: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
  """The definition of `low_rank_update`: autodiff of the product, x constant."""
  return scale * ((jax.lax.stop_gradient(x) @ a) @ b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def low_rank_update_fast(
    x: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
  """`low_rank_update` whose backward is `factor_grads` (module docstring)."""
  return scale * ((x @ a) @ b)


def _low_rank_update_fwd(x, a, b, scale):
  xa = x @ a
  return scale * (xa @ b), (x, xa, a, b)


def _low_rank_update_bwd(scale, residuals, dy):
  x, xa, a, b = residuals
  rows = x.reshape(-1, x.shape[-1])
  da, db = factor_grads(
      rows,
      xa.reshape(-1, xa.shape[-1]),
      dy.reshape(-1, dy.shape[-1]),
      b,
      scale,
  )
  return None, da.astype(a.dtype), db.astype(b.dtype)


low_rank_update_fast.defvjp(_low_rank_update_fwd, _low_rank_update_bwd)
