"""Llama-style layers the decoder families share (`decoder`, DeepSeek-MoE).

RMS norm with float32 statistics, default (rotate-half) RoPE, the dense
gated (SwiGLU) MLP and the stack of gated routed experts. A shared layer: families import it, it
imports no family.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from raptor_jax.models import initializers, moe
from raptor_jax.models.lora import ExpertLinear, LoRADense


def rms_normalised(x: jax.Array, eps: float) -> jax.Array:
  """float32 [N, D]: the rows of x over its RMS (+ eps), scale not applied.

  The statistics of every RMS norm (`RMSNorm`, Switch's T5 norm), in
  float32 on flat rows: see `moe.combine` (a size-1 batch axis under vmap
  slowed the fused reductions of the backward on CPU).
  """
  x32 = x.astype(jnp.float32).reshape(-1, x.shape[-1])
  variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return x32 * jax.lax.rsqrt(variance + eps)


class RMSNorm(nn.Module):
  """Scale-only RMS norm (HF OlmoeRMSNorm): statistics in float32.

  The normalised rows are cast to `dtype` before the scale multiplies them,
  as Llama-style decoders do; `float32_scale` multiplies in float32 and
  casts the result instead (T5's norm, Switch's `T5RMSNorm`).
  """

  eps: float = 1e-5
  dtype: Any = jnp.float32
  float32_scale: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", initializers.ONES, (x.shape[-1],))
    normed = rms_normalised(x, self.eps)
    if self.float32_scale:
      return (scale * normed).reshape(x.shape).astype(self.dtype)
    normed = normed.astype(self.dtype)
    return (scale.astype(self.dtype) * normed).reshape(x.shape)


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, dtype: Any
) -> tuple[jax.Array, jax.Array]:
  """cos and sin [S, head_dim] of default RoPE (HF OlmoeRotaryEmbedding)."""
  inv_freq = 1.0 / (
      theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  )
  freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rotary(
    x_BxSxHxD: jax.Array, cos_SxD: jax.Array, sin_SxD: jax.Array
) -> jax.Array:
  """x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)."""
  x1, x2 = jnp.split(x_BxSxHxD, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxSxHxD * cos_SxD[:, None, :] + rotated * sin_SxD[:, None, :]


class GatedExperts(nn.Module):
  """E stacked gated experts  down(act(gate(x)) * up(x)), applied to routed rows.

  Shared by the top-k families (OLMoE, DeepSeek-MoE): parameters
  `{gate, up, down}/{kernel, lora_a, lora_b}` with a leading expert axis.
  """

  num_experts: int
  features: int  # each expert's intermediate width
  rank: int = 0
  alpha: float = 16.0
  dispatch: str = "grouped"
  dtype: Any = jnp.float32
  act: str = "silu"
  kernels: str = "auto"  # see kernels.py

  @nn.compact
  def __call__(self, rows, experts, owner=None, owner_params=None):
    owner_params = owner_params or {}

    def linear(name, features, x):
      layer = ExpertLinear(
          self.num_experts,
          features,
          rank=self.rank,
          alpha=self.alpha,
          dispatch=self.dispatch,
          dtype=self.dtype,
          kernels=self.kernels,
          name=name,
      )
      return layer(x, experts, owner, owner_params.get(name))

    gate = linear("gate", self.features, rows)
    up = linear("up", self.features, rows)
    return linear("down", rows.shape[-1], moe.ACTIVATIONS[self.act](gate) * up)


class GatedMLP(nn.Module):
  """Dense gated MLP  down(act(gate(x)) * up(x)): dense blocks, shared experts.

  `output_gate`: the output times sigmoid(x @ output_gate) (Qwen2-MoE's
  `shared_expert_gate`, a [D, 1] base weight).
  """

  features: int
  rank: int = 0
  alpha: float = 16.0
  dtype: Any = jnp.float32
  act: str = "silu"
  kernels: str = "auto"  # see kernels.py
  output_gate: bool = False

  @nn.compact
  def __call__(self, x):
    def proj(name, features, inputs, rank):
      return LoRADense(
          features,
          rank=rank,
          alpha=self.alpha,
          dtype=self.dtype,
          kernels=self.kernels,
          name=name,
      )(inputs)

    gate = moe.ACTIVATIONS[self.act](proj("gate", self.features, x, self.rank))
    hidden = gate * proj("up", self.features, x, self.rank)
    out = proj("down", x.shape[-1], hidden, self.rank)
    if self.output_gate:
      out = out * jax.nn.sigmoid(proj("output_gate", 1, x, 0))
    return out
