"""Linear layers with optional low-rank adapters (LoRA).

`LoRADense` is a bias-free dense layer whose frozen `kernel` [d_in, d_out]
can carry a trainable low-rank update  (alpha / r) * x @ lora_a @ lora_b,
`lora_b` initialised to zero so a fresh adapter leaves the model unchanged.
`ExpertLinear` is the same for E stacked experts (`kernel` [E, d_in, d_out],
`lora_a` [E, d_in, r], `lora_b` [E, r, d_out]) applied row by row through the
MoE dispatch of `dispatch.py` and `ragged.py`.

Parameter names are chosen so that roles are easy to select by path: every
adapter leaf is called `lora_a` or `lora_b`, expert weights live under
`.../mlp/experts/...`, routers under `.../mlp/router/...`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import _validate
from raptor_jax.models import kernels as kernels_lib
from raptor_jax.models import initializers, low_rank, moe

Dtype = Any


class LoRADense(nn.Module):
  """Dense layer with an optional LoRA adapter (rank 0 = none).

  Bias-free unless `use_bias` (Qwen2's q, k, v): the bias is a base weight
  (frozen with the kernel), never part of the adapter.

  `kernels` 'fast' (or 'auto' on CPU) runs float32 adapters through
  `low_rank_linear_fast`'s folded backward; 'reference' is the split form
  x @ kernel + scale (x @ a) @ b differentiated by autodiff (see
  `kernels.py`).
  """

  features: int
  rank: int = 0
  alpha: float = 16.0
  dtype: Dtype = jnp.float32
  kernels: str = "auto"
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    out = self._linear(x)
    if self.use_bias:
      bias = self.param("bias", initializers.ZEROS, (self.features,))
      out = out + bias.astype(self.dtype)
    return out

  def _linear(self, x: jax.Array) -> jax.Array:
    d_in = x.shape[-1]
    kernel = self.param("kernel", initializers.KERNEL, (d_in, self.features))
    x = x.astype(self.dtype)
    kernel = kernel.astype(self.dtype)
    if self.rank == 0:
      return x @ kernel
    a = self.param("lora_a", initializers.LORA_A, (d_in, self.rank))
    b = self.param("lora_b", initializers.ZEROS, (self.rank, self.features))
    a, b, scale = (
        a.astype(self.dtype),
        b.astype(self.dtype),
        self.alpha / self.rank,
    )
    fast = kernels_lib.resolve(self.kernels) == "fast"
    if fast and jnp.dtype(self.dtype) == jnp.float32:
      return low_rank_linear_fast(x, kernel, a, b, scale)
    # The definition; narrow dtypes always use it, since a merged kernel
    # would round the small update away.
    return low_rank_linear_reference(x, kernel, a, b, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def low_rank_linear_fast(
    x: jax.Array, kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
  """x @ kernel + scale * (x @ a) @ b, with the backward folded.

  The forward is the split form, exactly as autodiff would compute it. The
  backward folds the adapter into the kernel (d_in x r x d_out work per
  call, not per row): dx = dy @ (kernel + scale a b)^T in one full-rank
  product, and the factors' gradients
      da = scale * x^T (dy b^T),   db = scale * (x a)^T dy
  from rank-r products (`low_rank.factor_grads`, in the layout XLA:CPU
  runs fast), x a kept from the forward (never the d_in x d_out outer
  product x^T dy, which is only formed if the kernel itself is
  differentiated). On CPU the rank-r products run far below the matmul
  rate: autodiff of the split form cost 2.2x this gradient (16,384 rows of
  one 256-wide layer, r = 8, 2 CPU cores).

  Why not fold the forward too (it would halve the forward): the merged kernel
  rounds the effective weights kernel + scale a b to float32 once, a
  perturbation shared by every record that does not average out. In the
  fixed-shape Switch benchmark (launch/bench/vs_opacus.py) (the mean gradient of 128 records, whose gradients
  nearly cancel) it alone moved the exact float64 gradient by 1e-3 and put
  raptor_jax 2.5e-3 from float64 PyTorch, against 1e-4 with this form. A
  folded backward only rounds the linear map applied to dy: 1e-4 as well.
  float32 only: in a narrow dtype the merged kernel would round the update
  away (LoRADense keeps the split form there).

  Args:
    x: [..., d_in] rows.
    kernel: [d_in, d_out].
    a: [d_in, r].
    b: [r, d_out].
    scale: the Python float alpha / r.

  Returns:
    [..., d_out].
  """
  return x @ kernel + scale * ((x @ a) @ b)


def _low_rank_linear_fwd(x, kernel, a, b, scale):
  xa = x @ a
  y = x @ kernel + scale * (xa @ b)
  return y, (x, xa, kernel + scale * (a @ b), b)


def _low_rank_linear_bwd(scale, residuals, dy):
  x, xa, merged, b = residuals
  rows = x.reshape(-1, x.shape[-1])
  d_rows = dy.reshape(-1, dy.shape[-1])
  d_kernel = rows.T @ d_rows  # dead code (removed by XLA) unless trained
  da, db = low_rank.factor_grads(
      rows, xa.reshape(-1, xa.shape[-1]), d_rows, b, scale
  )
  return dy @ merged.T, d_kernel, da, db


low_rank_linear_fast.defvjp(_low_rank_linear_fwd, _low_rank_linear_bwd)


def low_rank_linear_reference(
    x: jax.Array, kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float
) -> jax.Array:
  """The definition of `low_rank_linear_fast`: the split form, autodiff."""
  return x @ kernel + scale * ((x @ a) @ b)


def attention_projection(
    config: Any, name: str, features: int, use_bias: bool = False
) -> LoRADense:
  """A backbone's attention projection `name`, with its config's adapters.

  Adapters of rank `config.lora_rank` iff `config.attention_lora` (the
  shared stream's attention LoRA); dtype and kernels the config's. Built in
  an attention module's compact `__call__`, it is that module's child
  `name`: every family's q, k, v, o (and MLA's latent projections) is
  this one layer.
  """
  return LoRADense(
      features,
      rank=config.lora_rank if config.attention_lora else 0,
      alpha=config.lora_alpha,
      dtype=jnp.dtype(config.dtype),
      kernels=config.kernels,
      use_bias=use_bias,
      name=name,
  )


class ExpertLinear(nn.Module):
  """E stacked bias-free linear maps applied per routed row.

  Attributes:
    num_experts: E.
    features: d_out.
    rank: LoRA rank (0 = no adapter).
    alpha: LoRA alpha; the update is scaled by alpha / rank.
    dispatch: 'grouped' (sorted blocks, work ~ rows; base kernel frozen),
      'batched' (the same blocks in one batched product, no loop),
      'ragged' (the same with grouped GEMMs, `jax.lax.ragged_dot`),
      'tokamax' (the same with tokamax's grouped-GEMM kernels), 'auto'
      (grouped on CPU, batched elsewhere: `moe.resolve_dispatch`), 'dense'
      (every expert on every row; differentiable in the kernel, used when
      full expert weights train) or 'grouped_train' / 'batched_train' /
      'ragged_train' / 'auto_train' (differentiable in the kernel;
      pretraining, without adapters).
    kernels: 'fast' (the dispatches' custom VJPs and `custom_vmap` rules),
      'reference' (autodiff of the same dispatch functions) or 'auto' (see
      `kernels.py`).
  """

  num_experts: int
  features: int
  rank: int = 0
  alpha: float = 16.0
  dispatch: str = "auto"
  dtype: Dtype = jnp.float32
  kernels: str = "auto"

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      experts: jax.Array,
      owner: jax.Array | None = None,
      owner_params: Mapping[str, jax.Array] | None = None,
  ) -> jax.Array:
    """Applies expert `experts[t]` to row `x[t]`.

    Args:
      x: [T, d_in] rows.
      experts: int32 [T] (E = dropped row, output 0).
      owner: optional int32 scalar, this record's owner expert (the model is
        then being run on one record, e.g. under vmap).
      owner_params: the owner slice, a dict with the leaves of this layer's
        trainable expert parameters minus the expert axis (`lora_a` [d_in, r]
        and `lora_b` [r, d_out], or `kernel` [d_in, d_out]); gradients reach
        only these, never the stacked parameters.

    Returns:
      [T, d_out].
    """
    d_in = x.shape[-1]
    kernel = self.param(
        "kernel", initializers.KERNEL, (self.num_experts, d_in, self.features)
    )
    x = x.astype(self.dtype)
    kernel = kernel.astype(self.dtype)
    owner_params = owner_params or {}
    if self.rank > 0:
      a = self.param(
          "lora_a", initializers.LORA_A, (self.num_experts, d_in, self.rank)
      )
      b = self.param(
          "lora_b",
          initializers.ZEROS,
          (self.num_experts, self.rank, self.features),
      )
      a, b, scale = (
          a.astype(self.dtype),
          b.astype(self.dtype),
          self.alpha / self.rank,
      )
    # An owner LoRA slice trains alone: the stacked factors are then constants,
    # so a record's gradient can only reach its owner's slice.
    owner_lora = self.rank > 0 and "lora_a" in owner_params
    if owner_lora:
      a, b = jax.lax.stop_gradient(a), jax.lax.stop_gradient(b)
    factors = (a, b, scale) if self.rank > 0 else None
    owner_kernel = None
    if "kernel" in owner_params:
      owner_kernel = owner_params["kernel"].astype(self.dtype)
    y = _stacked_output(
        x,
        experts,
        kernel,
        factors,
        self.dispatch,
        owner,
        owner_kernel,
        self.kernels,
    )
    if owner_lora:
      y = y + moe.owner_lora_delta(
          x,
          experts,
          scale,
          owner,
          owner_params["lora_a"].astype(self.dtype),
          owner_params["lora_b"].astype(self.dtype),
          self.kernels,
      )
    return y


def _stacked_output(
    x: jax.Array,
    experts: jax.Array,
    kernel: jax.Array,
    factors: tuple[jax.Array, jax.Array, float] | None,
    dispatch: str,
    owner: jax.Array | None,
    owner_kernel: jax.Array | None,
    kernels: str,
) -> jax.Array:
  """`ExpertLinear`'s output from its stacked parameters, row by row.

  Args:
    x: [T, d_in] rows.
    experts: int32 [T] (E = dropped row, output 0).
    kernel: [E, d_in, d_out] stacked kernels.
    factors: `(lora_a, lora_b, alpha / rank)` of the stacked adapters, or
      `None` without adapters.
    dispatch: one of `moe.DISPATCHES` (see `ExpertLinear`).
    owner: the record's owner expert, when `owner_kernel` is given.
    owner_kernel: [d_in, d_out] owner kernel slice that trains alone, or
      `None`; it replaces the owner's stacked kernel and overrides `dispatch`.
    kernels: 'fast', 'reference' or 'auto' (see `kernels.py`).

  Returns:
    [T, d_out].
  """
  lora = None
  if factors is not None:
    a, b, scale = factors
    lora = (a, scale * b)
  _validate.one_of("dispatch", dispatch, moe.DISPATCHES, moe.DISPATCH_FIX)
  dispatch = moe.resolve_dispatch(dispatch)
  with_kernels = lambda fn: functools.partial(fn, kernels=kernels)
  frozen = {
      "grouped": with_kernels(moe.grouped_linear),
      "batched": with_kernels(moe.batched_linear),
      "ragged": with_kernels(moe.ragged_linear),
      "tokamax": with_kernels(moe.tokamax_linear),
  }
  trainable = {
      "grouped_train": with_kernels(moe.grouped_linear_trainable),
      "batched_train": with_kernels(moe.batched_linear_trainable),
      "ragged_train": with_kernels(moe.ragged_linear_trainable),
      "tokamax_train": with_kernels(moe.tokamax_linear_trainable),
  }
  if owner_kernel is not None:
    y = moe.owner_linear(
        x,
        experts,
        kernel,
        owner,
        owner_kernel,
        frozen.get(dispatch.removesuffix("_train"), frozen["grouped"]),
    )
    if lora is not None:
      y = y + moe.expert_lora(x, experts, a, b, scale)
  elif dispatch in frozen:
    # Adapters ride in the base weights' products: no factor E in the forward.
    y = frozen[dispatch](x, experts, kernel, lora)
  elif dispatch in trainable:
    if lora is not None:
      raise ValueError(
          f"dispatch={dispatch!r} trains the base kernels; it takes no adapters"
      )
    y = trainable[dispatch](x, experts, kernel)
  else:
    y = moe.dense_linear(x, experts, kernel)
    if lora is not None:
      y = y + moe.expert_lora(x, experts, a, b, scale)
  return y


def merge(params: Mapping[str, Any], alpha: float, rank: int) -> dict:
  """The same function without adapters: kernel + (alpha / r) lora_a @ lora_b.

  `LoRADense` computes x @ kernel + (alpha / r) (x @ lora_a) @ lora_b and
  `ExpertLinear` the same per expert ([E, ...] factors, batched matmul), so
  folding each adapter into its kernel leaves every output unchanged. The
  merge runs in float32 on the host.

  Args:
    params: a nested parameter tree, with or without adapters.
    alpha: the model's `lora_alpha`.
    rank: its `lora_rank` r (> 0 if there is any adapter).

  Returns:
    A nested tree (numpy leaves) with no `lora_a` / `lora_b` leaf.
  """
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  merged = {
      p: np.asarray(v, np.float32)
      for p, v in flat.items()
      if p.rsplit("/", 1)[-1] not in ("lora_a", "lora_b")
  }
  for path in flat:
    if path.rsplit("/", 1)[-1] != "lora_a":
      continue
    prefix = path[: -len("lora_a")]  # "" or ".../"
    if rank <= 0:
      raise ValueError(
          f"{path} is an adapter but lora_rank is {rank}; pass the rank the "
          "model was built with"
      )
    a = np.asarray(flat[path], np.float32)
    b = np.asarray(flat[f"{prefix}lora_b"], np.float32)
    merged[f"{prefix}kernel"] = merged[f"{prefix}kernel"] + (
        alpha / rank
    ) * np.matmul(a, b)
  return flax.traverse_util.unflatten_dict(merged, sep="/")
