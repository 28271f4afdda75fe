"""OLMoE decoder (Muennighoff et al., 2024) as flax.linen modules.

A faithful port of `transformers.OlmoeModel` (eager attention, eval mode):

* Llama-style RMS norm: variance in float32, the normalised state cast to
  the activation dtype, then scaled.
* Rotary position embeddings (default RoPE, base `rope_theta`, positions
  0..S-1 for every record) on queries and keys after their RMS norms.
* q and k RMS norms over the full projection width (all heads together, not
  per head), then optional clipping of q, k and v to [-clip_qkv, clip_qkv].
* Causal attention with grouped key/value heads, scaled by 1/sqrt(head_dim);
  a query sees key j iff j <= its position and j is not padding (HF's mask
  for right padding: padding queries still see every real token, so their
  states are well defined).
* Every block is sparse: a float32 softmax over all E router logits, the
  top-k probabilities (renormalised iff `norm_topk_prob`), SwiGLU experts
  stacked along an expert axis, no capacity and no dropped tokens.

Routing is per token, so a record never affects another.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from raptor_jax.models import attention, common, moe
from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.lora import ExpertLinear, LoRADense


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(FineTuningOptions):
  """Architecture (from HF config.json) plus the shared fine-tuning options."""

  vocab_size: int = 50304
  hidden_size: int = 2048
  intermediate_size: int = 2048  # per expert
  num_hidden_layers: int = 16
  num_attention_heads: int = 16
  num_key_value_heads: int = 16
  num_experts: int = 64
  num_experts_per_tok: int = 8
  norm_topk_prob: bool = False
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  clip_qkv: float | None = None
  hidden_act: str = "silu"

  def __post_init__(self):
    if self.hidden_act not in moe.ACTIVATIONS:
      raise ValueError(
          f"unsupported hidden_act {self.hidden_act!r}; "
          f"supported: {sorted(moe.ACTIVATIONS)}"
      )
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(
          f"hidden_size {self.hidden_size} is not a multiple of "
          f"num_attention_heads {self.num_attention_heads}"
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads {self.num_attention_heads} is not a multiple "
          f"of num_key_value_heads {self.num_key_value_heads}"
      )
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
          f"num_experts_per_tok {self.num_experts_per_tok} must be in "
          f"[1, num_experts={self.num_experts}]"
      )
    super().__post_init__()

  @property
  def top_k(self) -> int:
    """Experts per token."""
    return self.num_experts_per_tok

  @property
  def head_dim(self) -> int:
    """Per-head width; q_norm spans all heads (HF OLMoE has no head_dim field)."""
    return self.hidden_size // self.num_attention_heads

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    """Indices of the sparse (MoE) blocks: every block of OLMoE."""
    return tuple(range(self.num_hidden_layers))


class RMSNorm(nn.Module):
  """Scale-only RMS norm (HF OlmoeRMSNorm): statistics in float32."""

  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    # On flat rows: see `moe.combine` (a size-1 batch axis under vmap slowed
    # the fused reductions of the backward on CPU).
    x32 = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)
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


class OlmoeAttention(nn.Module):
  """Causal grouped-query attention with q/k RMS norms, clipping and RoPE."""

  config: OlmoeConfig

  @nn.compact
  def __call__(self, x, allowed_BxSxS, cos, sin):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    rank = cfg.lora_rank if cfg.attention_lora else 0
    heads, kv_heads, head_dim = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )

    def proj(name, features):
      return LoRADense(
          features,
          rank=rank,
          alpha=cfg.lora_alpha,
          dtype=dtype,
          kernels=cfg.kernels,
          name=name,
      )

    def norm(name):
      return RMSNorm(cfg.rms_norm_eps, dtype=dtype, name=name)

    q = norm("q_norm")(proj("q", heads * head_dim)(x))
    k = norm("k_norm")(proj("k", kv_heads * head_dim)(x))
    v = proj("v", kv_heads * head_dim)(x)
    if cfg.clip_qkv is not None:
      q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    batch, seq = x.shape[:2]
    q = apply_rotary(q.reshape(batch, seq, heads, head_dim), cos, sin)
    k = apply_rotary(k.reshape(batch, seq, kv_heads, head_dim), cos, sin)
    v = v.reshape(batch, seq, kv_heads, head_dim)
    # Query head h reads key/value head h // (heads / kv_heads) (HF repeat_kv).
    k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
    out = attention.attend_tokens(
        q * head_dim**-0.5,
        k,
        v,
        attention.mask_bias(allowed_BxSxS),
        kernels=cfg.kernels,
    )
    return proj("o", cfg.hidden_size)(out)


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


class OlmoeSparseMLP(nn.Module):
  """Frozen float32 top-k router + expert dispatch (no capacity, no drops)."""

  config: OlmoeConfig
  rank: int = 0

  @nn.compact
  def __call__(self, x, owner=None, owner_params=None):
    cfg = self.config
    batch, seq, d_model = x.shape
    router = nn.Dense(
        cfg.num_experts,
        use_bias=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        name="router",
    )
    router_logits = router(x.astype(jnp.float32))
    routing = moe.route_topk(router_logits, cfg.top_k, cfg.norm_topk_prob)
    # One row per (token, slot): work scales with tokens x k, not tokens x E.
    rows = jnp.repeat(x.reshape(batch * seq, d_model), cfg.top_k, axis=0)
    experts = GatedExperts(
        cfg.num_experts,
        cfg.intermediate_size,
        rank=self.rank,
        alpha=cfg.lora_alpha,
        dispatch=cfg.dispatch,
        dtype=jnp.dtype(cfg.dtype),
        act=cfg.hidden_act,
        kernels=cfg.kernels,
        name="experts",
    )
    out = experts(rows, routing.experts.reshape(-1), owner, owner_params)
    out = moe.combine(out, routing.weights)
    return out, router_logits


class OlmoeBlock(nn.Module):
  """Pre-norm attention sub-layer, then a pre-norm sparse MoE sub-layer."""

  config: OlmoeConfig
  index: int

  @nn.compact
  def __call__(self, x, allowed, cos, sin, owner_override=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype=dtype, name=name)
    x = x + OlmoeAttention(cfg, name="attention")(
        norm("attention_norm")(x), allowed, cos, sin
    )
    rank = cfg.lora_rank if self.index in cfg.expert_lora_layers else 0
    owner, owner_params = None, None
    if owner_override is not None and owner_override.layer == self.index:
      owner, owner_params = owner_override.owner, owner_override.params
    h, router_logits = OlmoeSparseMLP(cfg, rank=rank, name="mlp")(
        norm("mlp_norm")(x), owner, owner_params
    )
    return x + h, router_logits


class OlmoeDecoder(nn.Module):
  """The OLMoE decoder stack (token embedding to final norm, no lm_head)."""

  config: OlmoeConfig

  @nn.compact
  def __call__(
      self,
      input_ids: jax.Array,
      attention_mask: jax.Array | None = None,
      owner_override: OwnerOverride | None = None,
  ) -> BackboneOutput:
    """Decodes a batch (right padding).

    Args:
      input_ids: int [B, S].
      attention_mask: {0, 1} [B, S] (1 = token, padding on the right); None
        means all tokens.
      owner_override: optional `OwnerOverride` whose params are
        {'gate': ..., 'up': ..., 'down': ...}; only for a single record
        (B = 1), e.g. inside `jax.vmap` over records.

    Returns:
      BackboneOutput(hidden_states [B, S, D] after the final norm,
      router_logits: one float32 [B, S, E] per block).
    """
    cfg = self.config
    common.check_owner_layer(owner_override, cfg.sparse_layers)
    dtype = jnp.dtype(cfg.dtype)
    seq = input_ids.shape[1]
    allowed = common.causal_mask(input_ids, attention_mask)  # [B, S_q, S_k]
    cos, sin = rotary_tables(seq, cfg.head_dim, cfg.rope_theta, dtype)
    x = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed_tokens")(
        input_ids
    ).astype(dtype)
    router_logits = []
    for i in range(cfg.num_hidden_layers):
      x, logits = OlmoeBlock(cfg, i, name=f"block_{i}")(
          x, allowed, cos, sin, owner_override
      )
      router_logits.append(logits)
    x = RMSNorm(cfg.rms_norm_eps, dtype=dtype, name="final_layer_norm")(x)
    return BackboneOutput(x, tuple(router_logits))
