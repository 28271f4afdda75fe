"""Switch Transformer encoder (Fedus et al., 2022) as flax.linen modules.

A faithful port of `transformers.SwitchTransformersEncoderModel` in eval
mode (no dropout, no router jitter; fine-tuning freezes the router):

* T5 RMS norm: no mean subtraction, no bias, variance in float32.
* Relative position buckets computed in block 0 and reused by every block;
  attention scores are not scaled by 1/sqrt(d_kv).
* Dense ReLU feed-forward blocks, sparse (MoE) blocks at Hugging Face's
  positions: block i is sparse iff i % sparse_step == 1, or every block when
  sparse_step == 1.
* Top-1 float32 router softmax with HF's per-sequence expert capacity; kept
  tokens are scaled by their router probability, dropped tokens pass through
  the residual only (see `moe.route_top1`).
* Expert weights stacked along an expert axis and dispatched with work
  proportional to the tokens (see `moe.grouped_linear`).

Routing and capacity are per record, so a record never affects another.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax.models import attention, common, family, initializers, moe, stack
from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.family import COPY, Rule
from raptor_jax.models.layers import RMSNorm
from raptor_jax.models.lora import ExpertLinear, LoRADense, attention_projection


@dataclasses.dataclass(frozen=True)
class SwitchConfig(FineTuningOptions):
  """Architecture (from HF config.json) plus the shared fine-tuning options."""

  vocab_size: int = 32128
  d_model: int = 768
  d_kv: int = 64
  d_ff: int = 3072
  num_layers: int = 12
  num_heads: int = 12
  num_experts: int = 8
  expert_capacity: int = 64
  sparse_step: int = 2
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  dense_act_fn: str = "relu"
  router_bias: bool = False

  def __post_init__(self):
    if self.dense_act_fn not in moe.ACTIVATIONS:
      raise ValueError(
          f"unsupported dense_act_fn {self.dense_act_fn!r}; "
          f"supported: {sorted(moe.ACTIVATIONS)}"
      )
    super().__post_init__()

  @property
  def top_k(self) -> int:
    """Experts per token (Switch routes each token to one expert)."""
    return 1

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    """Indices of the sparse (MoE) blocks, in HF's placement."""
    if self.sparse_step <= 0:
      return ()
    return tuple(
        i
        for i in range(self.num_layers)
        if self.sparse_step == 1 or i % self.sparse_step == 1
    )

  @property
  def num_blocks(self) -> int:
    return self.num_layers

  @property
  def scan_unit(self) -> int:
    """The repeated unit: `sparse_step` blocks (a sparse one, then dense)."""
    return max(self.sparse_step, 1)

  @property
  def scan_start(self) -> int:
    """Units start at block 1: block 0 owns the relative-position table.

    Units then start with a sparse block (HF: i % sparse_step == 1), so the
    last block, sparse and the usual l*, stays out of the scan on its own
    rather than with a dense block beside it.
    """
    return 1


class T5RMSNorm(RMSNorm):
  """Scale-only RMS norm computed in float32 (HF SwitchTransformersLayerNorm).

  `layers.RMSNorm` with the scale applied in float32, then cast.
  """

  eps: float = 1e-6
  float32_scale: bool = True


def relative_position_bucket(
    relative_position: jax.Array, num_buckets: int, max_distance: int
) -> jax.Array:
  """T5's bidirectional relative-position buckets (HF `_relative_position_bucket`)."""
  num_buckets //= 2
  buckets = (relative_position > 0).astype(jnp.int32) * num_buckets
  relative_position = jnp.abs(relative_position)
  max_exact = num_buckets // 2
  is_small = relative_position < max_exact
  safe = jnp.maximum(relative_position, 1).astype(jnp.float32)
  if_large = max_exact + (
      jnp.log(safe / max_exact)
      / math.log(max_distance / max_exact)
      * (num_buckets - max_exact)
  ).astype(jnp.int32)
  if_large = jnp.minimum(if_large, num_buckets - 1)
  return buckets + jnp.where(is_small, relative_position, if_large)


class SwitchAttention(nn.Module):
  """Unscaled multi-head self-attention with T5 relative position bias."""

  config: SwitchConfig

  @nn.compact
  def __call__(self, x, mask_bias, position_bias):
    """Returns (output, position_bias); block 0 (position_bias None) owns the bias table."""
    cfg = self.config
    inner = cfg.num_heads * cfg.d_kv
    proj = functools.partial(attention_projection, cfg)
    batch, seq = x.shape[:2]
    q = proj("q", inner)(x).reshape(batch, seq, cfg.num_heads, cfg.d_kv)
    k = proj("k", inner)(x).reshape(batch, seq, cfg.num_heads, cfg.d_kv)
    v = proj("v", inner)(x).reshape(batch, seq, cfg.num_heads, cfg.d_kv)
    if position_bias is None:
      bias_table = initializers.embedding(
          cfg.relative_attention_num_buckets,
          cfg.num_heads,
          "relative_attention_bias",
      )
      positions = jnp.arange(seq)
      buckets = relative_position_bucket(
          positions[None, :] - positions[:, None],
          cfg.relative_attention_num_buckets,
          cfg.relative_attention_max_distance,
      )
      position_bias = jnp.transpose(bias_table(buckets), (2, 0, 1))[
          None
      ]  # [1, H, S, S]
    out = attention.attend_tokens(
        q, k, v, position_bias, mask_bias, kernels=cfg.kernels
    )
    return proj("o", cfg.d_model)(out), position_bias


class DenseMLP(nn.Module):
  """wi -> activation -> wo, no bias (HF SwitchTransformersDenseActDense)."""

  config: SwitchConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h = moe.ACTIVATIONS[cfg.dense_act_fn](
        LoRADense(cfg.d_ff, dtype=dtype, kernels=cfg.kernels, name="wi")(x)
    )
    return LoRADense(cfg.d_model, dtype=dtype, kernels=cfg.kernels, name="wo")(
        h
    )


class SwitchExperts(nn.Module):
  """E stacked (wi, wo) expert MLPs, applied to routed rows."""

  config: SwitchConfig
  rank: int = 0

  @nn.compact
  def __call__(self, rows, experts, owner=None, owner_params=None):
    cfg = self.config
    owner_params = owner_params or {}

    def linear(name, features):
      return ExpertLinear(
          cfg.num_experts,
          features,
          rank=self.rank,
          alpha=cfg.lora_alpha,
          dispatch=cfg.dispatch,
          dtype=jnp.dtype(cfg.dtype),
          kernels=cfg.kernels,
          name=name,
      )

    h = linear("wi", cfg.d_ff)(rows, experts, owner, owner_params.get("wi"))
    h = moe.ACTIVATIONS[cfg.dense_act_fn](h)
    return linear("wo", cfg.d_model)(h, experts, owner, owner_params.get("wo"))


class SwitchSparseMLP(nn.Module):
  """Top-1 router (frozen, float32) + capacity + expert dispatch."""

  config: SwitchConfig
  rank: int = 0

  @nn.compact
  def __call__(self, x, owner=None, owner_params=None):
    cfg = self.config
    batch, seq, d_model = x.shape
    router = initializers.float32_dense(
        cfg.num_experts, use_bias=cfg.router_bias, name="router"
    )
    router_logits = router(x.astype(jnp.float32))
    routing = moe.route_top1(router_logits, cfg.expert_capacity)
    rows = x.reshape(batch * seq, d_model)
    out = SwitchExperts(cfg, rank=self.rank, name="experts")(
        rows, routing.experts.reshape(-1), owner, owner_params
    )
    return moe.combine(out, routing.weights), router_logits


class SwitchBlock(nn.Module):
  """Self-attention sub-layer, then a dense or sparse feed-forward sub-layer."""

  config: SwitchConfig
  index: int

  @nn.compact
  def __call__(self, x, context, owner_override=None):
    """context: (mask_bias, position_bias); block 0 fills in the bias."""
    cfg = self.config
    mask_bias, position_bias = context
    dtype = jnp.dtype(cfg.dtype)
    norm = lambda name: T5RMSNorm(
        cfg.layer_norm_epsilon, dtype=dtype, name=name
    )
    attn_out, position_bias = SwitchAttention(cfg, name="attention")(
        norm("attention_norm")(x), mask_bias, position_bias
    )
    x = x + attn_out
    h = norm("mlp_norm")(x)
    router_logits = None
    if self.index in cfg.sparse_layers:
      rank = cfg.lora_rank if self.index in cfg.expert_lora_layers else 0
      owner, owner_params = None, None
      if owner_override is not None and owner_override.layer == self.index:
        owner, owner_params = owner_override.owner, owner_override.params
      h, router_logits = SwitchSparseMLP(cfg, rank=rank, name="mlp")(
          h, owner, owner_params
      )
    else:
      h = DenseMLP(cfg, name="mlp")(h)
    return x + h, (mask_bias, position_bias), router_logits


class SwitchEncoder(nn.Module):
  """The Switch Transformer encoder stack (token embedding to final norm)."""

  config: SwitchConfig

  @nn.compact
  def __call__(
      self,
      input_ids: jax.Array,
      attention_mask: jax.Array | None = None,
      owner_override: OwnerOverride | None = None,
  ) -> BackboneOutput:
    """Encodes a batch.

    Args:
      input_ids: int [B, S].
      attention_mask: {0, 1} [B, S] (1 = token); None means all tokens.
      owner_override: optional `OwnerOverride`; only for a single record
        (B = 1), e.g. inside `jax.vmap` over records.

    Returns:
      BackboneOutput(hidden_states [B, S, D], router_logits per sparse block).
    """
    cfg = self.config
    common.check_owner_layer(owner_override, cfg.sparse_layers)
    dtype = jnp.dtype(cfg.dtype)
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    embed = initializers.embedding(cfg.vocab_size, cfg.d_model, "embed_tokens")
    x = embed(input_ids).astype(dtype)
    mask_bias = (
        (1.0 - attention_mask.astype(jnp.float32)) * jnp.finfo(jnp.float32).min
    )[:, None, None, :]
    x, router_logits = stack.run(
        SwitchBlock, cfg, x, (mask_bias, None), owner_override
    )
    x = T5RMSNorm(cfg.layer_norm_epsilon, dtype=dtype, name="final_layer_norm")(
        x
    )
    return BackboneOutput(x, router_logits)


# ---------------------------------------------------------------------------
# Hugging Face: config.json, the name table, sizes.

# The sizes a generic size config also states (`from_sizes`), by their names.
_SIZE_KEYS = (
    "d_model",
    "d_kv",
    "d_ff",
    "num_layers",
    "num_heads",
    "num_experts",
    "expert_capacity",
)
_ARCH_KEYS = (
    "vocab_size",
    *_SIZE_KEYS,
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "layer_norm_epsilon",
    "dense_act_fn",
    "router_bias",
)


def config_from_hf(hf: Mapping[str, Any], **options) -> SwitchConfig:
  """SwitchConfig from an HF config.json dict, plus fine-tuning options."""
  arch = {k: hf[k] for k in _ARCH_KEYS if k in hf}
  step = hf.get("encoder_sparse_step")
  if step is None:  # HF derives the step when config.json does not store it.
    num_sparse = hf.get("num_sparse_encoder_layers", 3)
    num_layers = hf.get("num_layers", 12)
    step = num_layers // num_sparse if num_sparse > 0 else num_layers
  return SwitchConfig(**arch, sparse_step=step, **options)


_BLOCK, _LAYER = "block_{i}/", "encoder.block.{i}.layer."
# The encoder's tensors (the decoder and lm_head are not read); the
# embedding is `shared.weight`, or its tied copy in an encoder-only save.
HF_NAMES = family.NameTable(
    "Switch",
    (
        Rule("embed_tokens/embedding", "shared.weight", COPY),
        Rule(
            "embed_tokens/embedding",
            "encoder.embed_tokens.weight",
            COPY,
            load_only=True,
            tied=True,
        ),
        Rule(
            _BLOCK + "attention/{p:q|k|v|o}/kernel",
            _LAYER + "0.SelfAttention.{p}.weight",
        ),
        Rule(
            _BLOCK + "attention/relative_attention_bias/embedding",
            _LAYER + "0.SelfAttention.relative_attention_bias.weight",
            COPY,
        ),
        Rule(
            _BLOCK + "attention_norm/scale",
            _LAYER + "0.layer_norm.weight",
            COPY,
        ),
        Rule(_BLOCK + "mlp_norm/scale", _LAYER + "1.layer_norm.weight", COPY),
        Rule(_BLOCK + "mlp/{p:wi|wo}/kernel", _LAYER + "1.mlp.{p}.weight"),
        Rule(
            _BLOCK + "mlp/router/kernel",
            _LAYER + "1.mlp.router.classifier.weight",
        ),
        Rule(
            _BLOCK + "mlp/router/bias",
            _LAYER + "1.mlp.router.classifier.bias",
            COPY,
        ),
        Rule(
            _BLOCK + "mlp/experts/{p:wi|wo}/kernel",
            _LAYER + "1.mlp.experts.expert_{e}.{p}.weight",
            family.EXPERTS,
        ),
        Rule("final_layer_norm/scale", "encoder.final_layer_norm.weight", COPY),
    ),
    scope=("encoder.", "shared."),
)


def params_from_hf(
    tensors: Mapping[str, np.ndarray], config: SwitchConfig
) -> dict:
  """Maps HF Switch encoder tensor names onto the Flax tree (`HF_NAMES`)."""
  if not {"shared.weight", "encoder.embed_tokens.weight"} & set(tensors):
    raise ValueError(
        "checkpoint has neither shared.weight nor encoder.embed_tokens.weight"
    )
  return HF_NAMES.to_flax(tensors, config.num_experts)


def hf_config(config: SwitchConfig, **extra):
  """A `transformers.SwitchTransformersConfig` of the encoder (decoder sized alike)."""
  import transformers  # pylint: disable=g-import-not-at-top

  num_sparse = len(config.sparse_layers)
  if num_sparse and config.num_layers // num_sparse != config.sparse_step:
    raise ValueError(
        f"sparse_step {config.sparse_step} with {config.num_layers} layers has no "
        "Hugging Face equivalent (it derives the step as layers // sparse layers)"
    )
  return transformers.SwitchTransformersConfig(
      vocab_size=config.vocab_size,
      d_model=config.d_model,
      d_kv=config.d_kv,
      d_ff=config.d_ff,
      num_layers=config.num_layers,
      num_decoder_layers=config.num_layers,
      num_heads=config.num_heads,
      num_experts=config.num_experts,
      num_sparse_encoder_layers=num_sparse,
      num_sparse_decoder_layers=num_sparse,
      expert_capacity=config.expert_capacity,
      router_bias=config.router_bias,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      layer_norm_epsilon=config.layer_norm_epsilon,
      dense_act_fn=config.dense_act_fn,
      **{"architectures": ["SwitchTransformersEncoderModel"], **extra},
  )


def from_sizes(sizes: Any, vocab_size: int, **options) -> SwitchEncoder:
  """A random Switch encoder from generic sizes (`hf.backbone_from_sizes`)."""
  arch = {key: getattr(sizes, key) for key in _SIZE_KEYS + ("sparse_step",)}
  return SwitchEncoder(SwitchConfig(vocab_size=vocab_size, **arch, **options))


# This family's entries in `hf.FAMILIES`, by the checkpoint's `model_type`.
HF_FAMILIES = {
    "switch_transformers": family.Family(
        SwitchEncoder,
        config_from_hf,
        params_from_hf,
        ignored_prefix="decoder.",
        names=HF_NAMES,
        hf_config=hf_config,
        hf_backbone_class="SwitchTransformersEncoderModel",
        head_note="Switch's masked-LM head is tied to the embedding",
        pooling="mean",
    ),
}
