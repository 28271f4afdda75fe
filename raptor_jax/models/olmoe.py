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
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax.models import attention, common, family, initializers, moe, stack
from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.family import COPY, Rule
from raptor_jax.models.layers import GatedExperts, RMSNorm, apply_rotary, rotary_tables
from raptor_jax.models.lora import LoRADense


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

  @property
  def num_blocks(self) -> int:
    return self.num_hidden_layers


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
        kernel_init=initializers.KERNEL,
        bias_init=initializers.ZEROS,
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
  def __call__(self, x, context, owner_override=None):
    """context: (allowed [B, S, S], cos, sin), passed on unchanged."""
    cfg = self.config
    allowed, cos, sin = context
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
    return x + h, context, router_logits


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
    x = nn.Embed(
        cfg.vocab_size,
        cfg.hidden_size,
        embedding_init=initializers.EMBEDDING,
        name="embed_tokens",
    )(input_ids).astype(dtype)
    x, router_logits = stack.run(
        OlmoeBlock, cfg, x, (allowed, cos, sin), owner_override
    )
    x = RMSNorm(cfg.rms_norm_eps, dtype=dtype, name="final_layer_norm")(x)
    return BackboneOutput(x, router_logits)


# ---------------------------------------------------------------------------
# Hugging Face: config.json, the name table, sizes.

_ARCH_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "rms_norm_eps",
    "clip_qkv",
    "hidden_act",
)


def config_from_hf(hf: Mapping[str, Any], **options) -> OlmoeConfig:
  """OlmoeConfig from an HF config.json dict, plus fine-tuning options."""
  if hf.get("attention_bias"):
    raise ValueError(
        "OLMoE checkpoints with attention_bias=true are not supported "
        "(the port's attention projections are bias-free, as in OLMoE)"
    )
  arch = {k: hf[k] for k in _ARCH_KEYS if hf.get(k) is not None}
  if "num_experts" not in arch and "num_local_experts" in hf:
    arch["num_experts"] = hf["num_local_experts"]
  arch.setdefault(
      "num_key_value_heads",
      arch.get("num_attention_heads", OlmoeConfig.num_attention_heads),
  )
  if "clip_qkv" in arch:
    arch["clip_qkv"] = float(arch["clip_qkv"])
  return OlmoeConfig(**arch, rope_theta=family.rope_theta(hf), **options)


_BLOCK, _LAYER = "block_{i}/", "layers.{i}."
# Names with or without `model.` (OlmoeForCausalLM or OlmoeModel); routed
# experts per expert as `save_pretrained` and the Hub store them, or fused as
# transformers v5 holds them in memory (load only).
HF_NAMES = family.NameTable(
    "OLMoE",
    (
        Rule("embed_tokens/embedding", "embed_tokens.weight", COPY),
        Rule(
            _BLOCK + "attention/{p:q|k|v|o}/kernel",
            _LAYER + "self_attn.{p}_proj.weight",
        ),
        Rule(
            _BLOCK + "attention/{p:q|k}_norm/scale",
            _LAYER + "self_attn.{p}_norm.weight",
            COPY,
        ),
        Rule(
            _BLOCK + "attention_norm/scale",
            _LAYER + "input_layernorm.weight",
            COPY,
        ),
        Rule(
            _BLOCK + "mlp_norm/scale",
            _LAYER + "post_attention_layernorm.weight",
            COPY,
        ),
        *family.gated_moe_rules(_BLOCK, _LAYER),
        Rule("final_layer_norm/scale", "norm.weight", COPY),
    ),
    prefix="model.",
    ignore=("rotary_emb.inv_freq",),  # a buffer old checkpoints stored
)


def params_from_hf(
    tensors: Mapping[str, np.ndarray], config: OlmoeConfig
) -> dict:
  """Maps HF OLMoE decoder tensor names onto the Flax tree (`HF_NAMES`).

  `lm_head` must already be filtered out.
  """
  return HF_NAMES.to_flax(tensors, config.num_experts)


def hf_config(config: OlmoeConfig, **extra):
  """A `transformers.OlmoeConfig` of the decoder."""
  import transformers  # pylint: disable=g-import-not-at-top

  return transformers.OlmoeConfig(
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads,
      num_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      norm_topk_prob=config.norm_topk_prob,
      rms_norm_eps=config.rms_norm_eps,
      clip_qkv=config.clip_qkv,
      hidden_act=config.hidden_act,
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      tie_word_embeddings=False,
      **{"architectures": ["OlmoeForCausalLM"], **extra},
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> OlmoeDecoder:
  """A random OLMoE from generic sizes (`hf.backbone_from_sizes`)."""
  return OlmoeDecoder(
      OlmoeConfig(
          vocab_size=vocab_size,
          hidden_size=sizes.d_model,
          intermediate_size=sizes.d_ff,
          num_hidden_layers=sizes.num_layers,
          num_attention_heads=sizes.num_heads,
          num_key_value_heads=sizes.num_kv_heads,
          num_experts=sizes.num_experts,
          num_experts_per_tok=sizes.top_k,
          norm_topk_prob=sizes.norm_topk_prob,
          **options,
      )
  )


# This family's entries in `hf.FAMILIES`, by the checkpoint's `model_type`.
HF_FAMILIES = {
    "olmoe": family.Family(
        OlmoeDecoder,
        config_from_hf,
        params_from_hf,
        ignored_prefix="lm_head.",
        names=HF_NAMES,
        hf_config=hf_config,
        hf_backbone_class="OlmoeModel",
        heads=("lm_head",),
        head_note="transformers has no sequence-classification class for"
        " OLMoE",
    ),
}
