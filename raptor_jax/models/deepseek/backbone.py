"""DeepSeek-MoE's config and decoder modules (see the package docstring)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from raptor_jax import _validate
from raptor_jax.models import attention, common, decoder, initializers, moe, stack
from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.lora import attention_projection
from raptor_jax.models.layers import RMSNorm, rotary_tables

TOPK_METHODS = ("greedy", "group_limited_greedy")
# HF builds q_a_layernorm / kv_a_layernorm with the default eps.
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DeepseekConfig(FineTuningOptions):
  """Architecture (HF config.json; defaults: DeepSeek-V2-Lite) plus fine-tuning options.

  Besides the shared `FineTuningOptions`, `shared_expert_lora` puts adapters
  on the shared experts of every sparse block: they are the shared stream's
  LoRA (with the attention adapters), since shared experts see every token.
  """

  vocab_size: int = 102400
  hidden_size: int = 2048
  intermediate_size: int = 10944  # dense blocks' MLP width
  moe_intermediate_size: int = 1408  # routed expert width; shared: x n_shared
  num_hidden_layers: int = 27
  num_attention_heads: int = 16
  num_key_value_heads: int = 16  # MHA variant only (MLA expands keys per head)
  use_mla: bool = True  # False: plain multi-head attention (DeepSeek-VL2-Tiny)
  q_lora_rank: int | None = None  # None: queries from one projection `q`
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  n_routed_experts: int = 64
  n_shared_experts: int = 2
  num_experts_per_tok: int = 6
  first_k_dense_replace: int = 1  # blocks 0..k-1 are dense
  topk_method: str = "greedy"
  n_group: int | None = None  # group_limited_greedy: expert groups
  topk_group: int | None = None  # group_limited_greedy: groups a token may use
  routed_scaling_factor: float = 1.0
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  hidden_act: str = "silu"
  shared_expert_lora: bool = dataclasses.field(default=False, kw_only=True)
  # DeepSeek-VL2 fine-tuning with a frozen vision tower (`raptor_jax.vision`):
  # rows of precomputed image-token embeddings, read by token ids >=
  # vocab_size (id vocab_size + r reads row r). 0 = text only (no table).
  image_table_size: int = dataclasses.field(default=0, kw_only=True)
  # Renormalise the top-k weights (then times routed_scaling_factor), as
  # DeepSeek's own code does when top_k > 1 (modeling_deepseek.py, MoEGate).
  # Set from a `deepseek_vl_v2` checkpoint, whose reference is that code;
  # transformers' DeepseekV2 ignores the key, so `deepseek_v2` ones leave it off.
  norm_topk_prob: bool = dataclasses.field(default=False, kw_only=True)

  def __post_init__(self):
    _validate.one_of("hidden_act", self.hidden_act, sorted(moe.ACTIVATIONS))
    _validate.one_of(
        "topk_method",
        self.topk_method,
        TOPK_METHODS,
        "noaux_tc / sigmoid scoring (DeepSeek-V3, VL2) are not ported",
    )
    _validate.check(
        1 <= self.num_experts_per_tok <= self.n_routed_experts,
        "num_experts_per_tok",
        f"in [1, n_routed_experts={self.n_routed_experts}]",
        self.num_experts_per_tok,
    )
    _validate.check(
        self.n_shared_experts >= 1,
        "n_shared_experts",
        ">= 1 (DeepSeek-MoE has shared experts)",
        self.n_shared_experts,
    )
    _validate.check(
        0 <= self.first_k_dense_replace <= self.num_hidden_layers,
        "first_k_dense_replace",
        f"in [0, num_hidden_layers={self.num_hidden_layers}]",
        self.first_k_dense_replace,
    )
    if self.use_mla:
      self._check_mla()
    else:
      self._check_mha()
    if self.topk_method == "group_limited_greedy":
      self._check_groups()
    super().__post_init__()

  def _check_mla(self):
    _validate.check(
        self.num_key_value_heads == self.num_attention_heads,
        "num_key_value_heads",
        f"num_attention_heads={self.num_attention_heads} (MLA expands keys"
        " and values to every head)",
        self.num_key_value_heads,
    )
    _validate.check(
        self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
        "qk_rope_head_dim",
        "positive and even",
        self.qk_rope_head_dim,
    )
    _validate.check(
        self.kv_lora_rank > 0 and self.v_head_dim > 0,
        "(kv_lora_rank, v_head_dim)",
        "both positive for MLA",
        (self.kv_lora_rank, self.v_head_dim),
    )

  def _check_mha(self):
    _validate.check(
        self.hidden_size % self.num_attention_heads == 0
        and self.head_dim % 2 == 0,
        "num_attention_heads",
        f"a divisor of hidden_size={self.hidden_size} with an even head size",
        self.num_attention_heads,
    )
    _validate.check(
        self.num_attention_heads % self.num_key_value_heads == 0,
        "num_key_value_heads",
        f"a divisor of num_attention_heads={self.num_attention_heads}",
        self.num_key_value_heads,
    )

  def _check_groups(self):
    groups, top = self.n_group or 0, self.topk_group or 0
    _validate.check(
        groups >= 1
        and self.n_routed_experts % groups == 0
        and 1 <= top <= groups
        and top * (self.n_routed_experts // groups) >= self.num_experts_per_tok,
        "(n_group, topk_group)",
        f"n_group dividing n_routed_experts={self.n_routed_experts} and"
        " topk_group in [1, n_group] whose groups hold >= num_experts_per_tok"
        " experts (group_limited_greedy)",
        (self.n_group, self.topk_group),
    )

  @property
  def num_experts(self) -> int:
    """Routed experts per sparse block (E); shared experts are not counted."""
    return self.n_routed_experts

  @property
  def top_k(self) -> int:
    """Routed experts per token."""
    return self.num_experts_per_tok

  @property
  def head_dim(self) -> int:
    """Per-head width of the plain multi-head attention variant."""
    return self.hidden_size // self.num_attention_heads

  @property
  def topk_renormalised(self) -> bool:
    """DeepSeek renormalises only when top_k > 1 (MoEGate)."""
    return self.norm_topk_prob and self.top_k > 1

  @property
  def expert_width(self) -> int:
    return self.moe_intermediate_size

  @property
  def shared_expert_width(self) -> int:
    """The shared experts as one gated MLP of n_shared times the width."""
    return self.moe_intermediate_size * self.n_shared_experts

  shared_expert_gate = False  # Qwen2-MoE's sigmoid gate; none here
  # The kit attention's options (`decoder.Attention`, the MHA variant): none.
  qk_norm = ""
  attention_bias = False
  clip_qkv = None

  @property
  def routing_groups(self) -> tuple[int, int] | None:
    """(n_group, topk_group) of group-limited routing; None for greedy."""
    if self.topk_method == "group_limited_greedy":
      return self.n_group, self.topk_group
    return None

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    """Indices of the sparse (MoE) blocks: every block after the dense ones."""
    return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

  @property
  def num_blocks(self) -> int:
    return self.num_hidden_layers


def interleaved_rotary_tables(
    seq_len: int, dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
  """float32 cos and sin [S, dim / 2] of default RoPE, one angle per pair of features."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_interleaved_rotary(
    x_BxSxHxD: jax.Array, cos_SxR: jax.Array, sin_SxR: jax.Array
) -> jax.Array:
  """Rotates each pair (x[2i], x[2i+1]) by its angle, in float32 (HF's complex RoPE)."""
  pairs = x_BxSxHxD.astype(jnp.float32).reshape(*x_BxSxHxD.shape[:-1], -1, 2)
  x1, x2 = pairs[..., 0], pairs[..., 1]
  cos, sin = cos_SxR[:, None, :], sin_SxR[:, None, :]
  rotated = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return rotated.reshape(x_BxSxHxD.shape).astype(x_BxSxHxD.dtype)


class MultiHeadLatentAttention(nn.Module):
  """DeepSeek-V2's MLA (HF `DeepseekV2Attention`), causal, optional LoRA on every projection."""

  config: DeepseekConfig

  @nn.compact
  def __call__(self, x, allowed):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    heads, nope, rope, v_dim = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    batch, seq = x.shape[:2]

    def proj(name, features, inputs):
      return attention_projection(cfg, name, features)(inputs)

    def norm(name, inputs):
      return RMSNorm(LATENT_NORM_EPS, dtype=dtype, name=name)(inputs)

    if cfg.q_lora_rank is None:
      q = proj("q", heads * (nope + rope), x)
    else:
      q = proj(
          "q_b",
          heads * (nope + rope),
          norm("q_a_norm", proj("q_a", cfg.q_lora_rank, x)),
      )
    q = q.reshape(batch, seq, heads, nope + rope)
    latent, k_rot = jnp.split(
        proj("kv_a", cfg.kv_lora_rank + rope, x), [cfg.kv_lora_rank], axis=-1
    )
    kv = proj("kv_b", heads * (nope + v_dim), norm("kv_a_norm", latent))
    kv = kv.reshape(batch, seq, heads, nope + v_dim)
    cos, sin = interleaved_rotary_tables(seq, rope, cfg.rope_theta)
    q_rot = apply_interleaved_rotary(q[..., nope:], cos, sin)
    k_rot = apply_interleaved_rotary(k_rot[:, :, None, :], cos, sin)[:, :, 0]
    # [q_nope, q_rot] . [k_nope, k_rot]: the position part's key is shared by all heads.
    q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
    k = jnp.concatenate(
        [kv[..., :nope], jnp.broadcast_to(k_rot[:, :, None], q_rot.shape)],
        axis=-1,
    )
    out = attention.attend_tokens(
        q * (nope + rope) ** -0.5,
        k,
        kv[..., nope:],
        attention.mask_bias(allowed),
        kernels=cfg.kernels,
    )
    return proj("o", cfg.hidden_size, out)


class MultiHeadAttention(decoder.Attention):
  """Plain causal attention with grouped key/value heads (`transformers.LlamaAttention`).

  The kit's attention (`decoder.Attention`; DeepSeek has no q/k norms, bias
  or clipping) on its own RoPE tables, made here as MLA makes its own.
  """

  config: DeepseekConfig

  def __call__(self, x, allowed):  # pylint: disable=arguments-differ
    cfg = self.config
    cos, sin = rotary_tables(
        x.shape[1], cfg.head_dim, cfg.rope_theta, jnp.dtype(cfg.dtype)
    )
    return super().__call__(x, allowed, cos, sin)


class DeepseekBlock(decoder.DecoderBlock):
  """The kit's block (`decoder.DecoderBlock`: pre-norm attention, then a
  pre-norm dense or sparse MLP, the sparse one with shared experts) with
  DeepSeek's attention: MLA, or plain multi-head attention (VL2-Tiny)."""

  config: DeepseekConfig

  @property
  def attention_class(self):
    return (
        MultiHeadLatentAttention if self.config.use_mla else MultiHeadAttention
    )


class DeepseekDecoder(nn.Module):
  """The DeepSeek-MoE decoder stack (token embedding to final norm, no lm_head)."""

  config: DeepseekConfig

  @nn.compact
  def __call__(
      self,
      input_ids: jax.Array,
      attention_mask: jax.Array | None = None,
      owner_override: OwnerOverride | None = None,
      image_embeds: jax.Array | None = None,
      image_mask: jax.Array | None = None,
  ) -> BackboneOutput:
    """Decodes a batch (right padding).

    Args:
      input_ids: int [B, S].
      attention_mask: {0, 1} [B, S] (1 = token, padding on the right); None
        means all tokens.
      owner_override: optional `OwnerOverride` of a sparse block whose params
        are {'gate': ..., 'up': ..., 'down': ...} (routed experts only); only
        for a single record (B = 1), e.g. inside `jax.vmap` over records.
      image_embeds: optional [B, S, D] embeddings that replace the token
        embedding where `image_mask` is true (DeepSeek-VL2's image tokens,
        `models.deepseek_vl2`); None (text only) leaves the computation
        exactly as without them.
      image_mask: bool [B, S], with `image_embeds`.

    Returns:
      BackboneOutput(hidden_states [B, S, D] after the final norm,
      router_logits: one float32 [B, S, E] per sparse block, in block order).
    """
    cfg = self.config
    common.check_owner_layer(owner_override, cfg.sparse_layers)
    dtype = jnp.dtype(cfg.dtype)
    allowed = common.causal_mask(input_ids, attention_mask)  # [B, S_q, S_k]
    embed = initializers.embedding(
        cfg.vocab_size, cfg.hidden_size, "embed_tokens"
    )
    if cfg.image_table_size:
      x = self._with_image_table(embed, input_ids, dtype)
    else:
      x = embed(input_ids).astype(dtype)
    if image_embeds is not None:
      x = jnp.where(image_mask[..., None], image_embeds.astype(dtype), x)
    x, router_logits = stack.run(
        DeepseekBlock, cfg, x, (allowed,), owner_override
    )
    x = RMSNorm(cfg.rms_norm_eps, dtype=dtype, name="final_layer_norm")(x)
    return BackboneOutput(x, router_logits)

  def _with_image_table(self, embed, input_ids, dtype):
    """Token embeddings, with ids >= vocab_size read from `image_table`.

    `image_table/embedding` holds the precomputed image tokens of the run's
    records (`raptor_jax.vision`). The table is frozen (`roles.select` never
    picks it) and each record's ids point only at its own rows,
    so a record's gradient depends on that record alone.
    """
    cfg = self.config
    # Drawn as any table, always overwritten.
    table = initializers.embedding(
        cfg.image_table_size, cfg.hidden_size, "image_table"
    )
    is_image = input_ids >= cfg.vocab_size
    text = embed(jnp.minimum(input_ids, cfg.vocab_size - 1)).astype(dtype)
    row = jnp.clip(input_ids - cfg.vocab_size, 0, cfg.image_table_size - 1)
    image = table(row).astype(dtype)
    return jnp.where(is_image[..., None], image, text)
