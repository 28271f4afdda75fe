"""The sparse decoder kit: one attention, one top-k MoE block, one stack.

The Llama-style MoE decoders differ in a handful of switches, so they share
these modules and each family (`olmoe`, `qwen3_moe`, `qwen2_moe`, `mixtral`)
is a config reader, a name table and its defaults. What the switches mean,
against transformers (eager attention, eval mode):

* **Attention** (`Attention`): grouped-query causal attention with default
  RoPE (base `rope_theta`) on q and k, scaled by 1/sqrt(head_dim). Options:
  `qk_norm` 'full' (OLMoE: one RMS norm over all heads' projections) or
  'head' (Qwen3: an RMS norm per head over head_dim), both before RoPE;
  `attention_bias` (a bias on q, k and v: Qwen2); `clip_qkv` (OLMoE);
  `sliding_window` w (Mixtral, Qwen with `use_sliding_window`: query i sees
  key j iff i - w < j <= i). A query sees real tokens only; padding queries
  still see every real token before them, so their states are defined.
* **MoE block** (`SparseMLP`): a frozen float32 router, a float32 softmax
  over all E logits, the top-k probabilities (renormalised iff
  `topk_renormalised`: `norm_topk_prob`; Mixtral always), SwiGLU (or GELU)
  experts with no capacity and no dropped tokens, dispatched by `moe`.
  Optional always-active shared experts (Qwen2-MoE, DeepSeek-MoE), with an
  optional sigmoid output gate (Qwen2-MoE's `shared_expert_gate`); they
  see every token, so they are shared-stream parameters (`roles`).
* **Block and stack** (`DecoderBlock`, `Decoder`): pre-norm attention, then
  a pre-norm MoE block, or a dense SwiGLU MLP for the blocks in
  `dense_layers` (Qwen's `mlp_only_layers` and `decoder_sparse_step`). The
  blocks run as scanned segments (`models.stack`), the block with expert
  adapters outside the scan.

Routing is per token and attention per record, so a record never affects
another record's output: per-record gradients, hence DP clipping, are
meaningful (docs/method.md §3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from raptor_jax import _validate
from raptor_jax.models import attention, common, family, initializers, moe, stack
from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.family import COPY, Rule
from raptor_jax.models.layers import GatedExperts, GatedMLP, RMSNorm, apply_rotary, rotary_tables
from raptor_jax.models.lora import attention_projection

QK_NORMS = ("", "full", "head")


@dataclasses.dataclass(frozen=True)
class DecoderConfig(FineTuningOptions):
  """A sparse decoder's architecture (HF field names) plus fine-tuning options.

  `intermediate_size` is the dense MLP's width and, when
  `moe_intermediate_size` is 0 (OLMoE, Mixtral), each expert's.
  `head_dim` 0 means hidden_size / num_attention_heads.
  `shared_expert_lora` puts adapters on the shared experts: they are the
  shared stream's LoRA, with the attention adapters.
  """

  vocab_size: int = 32000
  hidden_size: int = 1024
  intermediate_size: int = 2048
  moe_intermediate_size: int = 0
  num_hidden_layers: int = 16
  num_attention_heads: int = 16
  num_key_value_heads: int = 16
  head_dim: int = 0
  num_experts: int = 8
  num_experts_per_tok: int = 2
  norm_topk_prob: bool = False
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  hidden_act: str = "silu"
  qk_norm: str = ""
  attention_bias: bool = False
  clip_qkv: float | None = None
  sliding_window: int | None = None
  shared_expert_intermediate_size: int = 0  # 0: no shared experts
  shared_expert_gate: bool = False
  dense_layers: tuple[int, ...] = ()
  shared_expert_lora: bool = dataclasses.field(default=False, kw_only=True)

  def __post_init__(self):
    _validate.one_of("hidden_act", self.hidden_act, sorted(moe.ACTIVATIONS))
    _validate.one_of("qk_norm", self.qk_norm, QK_NORMS)
    if not self.head_dim:
      if self.hidden_size % self.num_attention_heads:
        raise ValueError(
            f"hidden_size {self.hidden_size} is not a multiple of "
            f"num_attention_heads {self.num_attention_heads}; set head_dim"
        )
      object.__setattr__(
          self, "head_dim", self.hidden_size // self.num_attention_heads
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
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window {self.sliding_window} must be >= 1")
    super().__post_init__()

  @property
  def top_k(self) -> int:
    return self.num_experts_per_tok

  @property
  def topk_renormalised(self) -> bool:
    return self.norm_topk_prob

  @property
  def expert_width(self) -> int:
    return self.moe_intermediate_size or self.intermediate_size

  @property
  def shared_expert_width(self) -> int:
    return self.shared_expert_intermediate_size

  routing_groups = None  # DeepSeek's group-limited routing only
  routed_scaling_factor = 1.0

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    return tuple(
        i for i in range(self.num_hidden_layers) if i not in self.dense_layers
    )

  @property
  def num_blocks(self) -> int:
    return self.num_hidden_layers


class Attention(nn.Module):
  """Causal grouped-query attention with RoPE and the kit's options."""

  config: DecoderConfig

  @nn.compact
  def __call__(self, x, allowed_BxSxS, cos, sin):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    heads, kv_heads, head_dim = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    batch, seq = x.shape[:2]

    def proj(name, inputs, features, bias=False):
      return attention_projection(cfg, name, features, bias)(inputs)

    def norm(name, t, num_heads):
      if cfg.qk_norm == "head":  # over head_dim, each head apart
        t = t.reshape(batch, seq, num_heads, head_dim)
      return RMSNorm(cfg.rms_norm_eps, dtype=dtype, name=name)(t)

    bias = cfg.attention_bias
    q = proj("q", x, heads * head_dim, bias)
    k = proj("k", x, kv_heads * head_dim, bias)
    v = proj("v", x, kv_heads * head_dim, bias)
    if cfg.qk_norm:
      q, k = norm("q_norm", q, heads), norm("k_norm", k, kv_heads)
    if cfg.clip_qkv is not None:
      q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
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
    return proj("o", out.reshape(batch, seq, heads * head_dim), cfg.hidden_size)


class SparseMLP(nn.Module):
  """Frozen float32 top-k router, routed experts and optional shared experts.

  `config` is a `DecoderConfig` or any config with the same routing fields
  (`DeepseekConfig`).
  """

  config: DecoderConfig
  rank: int = 0  # adapters of the routed experts

  @nn.compact
  def __call__(self, x, owner=None, owner_params=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    batch, seq, d_model = x.shape
    router = initializers.float32_dense(
        cfg.num_experts, use_bias=False, name="router"
    )
    router_logits = router(x.astype(jnp.float32))
    routing = moe.route_topk(
        router_logits,
        cfg.top_k,
        cfg.topk_renormalised,
        cfg.routing_groups,
        cfg.routed_scaling_factor,
    )
    # One row per (token, slot): work scales with tokens x k, not tokens x E.
    rows = jnp.repeat(x.reshape(batch * seq, d_model), cfg.top_k, axis=0)
    experts = GatedExperts(
        cfg.num_experts,
        cfg.expert_width,
        rank=self.rank,
        alpha=cfg.lora_alpha,
        dispatch=cfg.dispatch,
        dtype=dtype,
        act=cfg.hidden_act,
        kernels=cfg.kernels,
        name="experts",
    )
    out = experts(rows, routing.experts.reshape(-1), owner, owner_params)
    out = moe.combine(out, routing.weights)
    if cfg.shared_expert_width:
      out = out + GatedMLP(
          cfg.shared_expert_width,
          rank=cfg.lora_rank if cfg.shared_expert_lora else 0,
          alpha=cfg.lora_alpha,
          dtype=dtype,
          act=cfg.hidden_act,
          kernels=cfg.kernels,
          output_gate=cfg.shared_expert_gate,
          name="shared_experts",
      )(x)
    return out, router_logits


class DecoderBlock(nn.Module):
  """Pre-norm attention, then a pre-norm sparse (or dense) MLP sub-layer.

  `attention_class`: the attention module, called as `(config)(x,
  *context)`; DeepSeek's blocks put MLA there (context `(allowed,)`), the
  kit's `Attention` reads `(allowed, cos, sin)`.
  """

  config: DecoderConfig
  index: int
  attention_class: ClassVar[type[nn.Module]] = Attention

  @nn.compact
  def __call__(self, x, context, owner_override=None):
    """context: what attention reads (a tuple), passed on unchanged."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype=dtype, name=name)
    attend = self.attention_class(cfg, name="attention")
    x = x + attend(norm("attention_norm")(x), *context)
    h = norm("mlp_norm")(x)
    if self.index not in cfg.sparse_layers:
      mlp = GatedMLP(
          cfg.intermediate_size,
          dtype=dtype,
          act=cfg.hidden_act,
          kernels=cfg.kernels,
          name="mlp",
      )
      return x + mlp(h), context, None
    rank = cfg.lora_rank if self.index in cfg.expert_lora_layers else 0
    owner, owner_params = None, None
    if owner_override is not None and owner_override.layer == self.index:
      owner, owner_params = owner_override.owner, owner_override.params
    out, router_logits = SparseMLP(cfg, rank=rank, name="mlp")(
        h, owner, owner_params
    )
    return x + out, context, router_logits


def allowed_keys(
    input_ids: jax.Array, attention_mask: jax.Array | None, window: int | None
) -> jax.Array:
  """bool [B, S_q, S_k]: the causal mask, within `window` keys if set."""
  allowed = common.causal_mask(input_ids, attention_mask)
  if window is None:
    return allowed
  pos = jnp.arange(input_ids.shape[1])
  return allowed & (pos[None, :] > pos[:, None] - window)[None]


class Decoder(nn.Module):
  """A kit decoder stack (token embedding to final norm, no lm_head).

  Families subclass it by name only (`OlmoeDecoder`, ...), so that the
  front door and the export find a module's family by its class.
  """

  config: DecoderConfig

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
      owner_override: optional `OwnerOverride` of a sparse block whose
        params are {'gate': ..., 'up': ..., 'down': ...} (routed experts);
        only for a single record (B = 1), e.g. inside `jax.vmap` over
        records.

    Returns:
      BackboneOutput(hidden_states [B, S, D] after the final norm,
      router_logits: one float32 [B, S, E] per sparse block, in order).
    """
    cfg = self.config
    common.check_owner_layer(owner_override, cfg.sparse_layers)
    dtype = jnp.dtype(cfg.dtype)
    allowed = allowed_keys(input_ids, attention_mask, cfg.sliding_window)
    cos, sin = rotary_tables(
        input_ids.shape[1], cfg.head_dim, cfg.rope_theta, dtype
    )
    embed = initializers.embedding(
        cfg.vocab_size, cfg.hidden_size, "embed_tokens"
    )
    x = embed(input_ids).astype(dtype)
    x, router_logits = stack.run(
        DecoderBlock, cfg, x, (allowed, cos, sin), owner_override
    )
    x = RMSNorm(cfg.rms_norm_eps, dtype=dtype, name="final_layer_norm")(x)
    return BackboneOutput(x, router_logits)


# ---------------------------------------------------------------------------
# Hugging Face: what the kit's families share in config.json and names.

BLOCK, LAYER = "block_{i}/", "layers.{i}."
# The config.json keys of every Llama-style MoE decoder, DeepSeek's too.
LLAMA_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts_per_tok",
    "rms_norm_eps",
    "hidden_act",
)
# config.json key -> DecoderConfig field, where a family's key is the kit's.
HF_KEYS = LLAMA_HF_KEYS + (
    "head_dim",
    "num_experts",
    "norm_topk_prob",
    "clip_qkv",
    "shared_expert_intermediate_size",
)


def arch_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The kit's fields that a config.json states, by their HF names.

  Reads `num_local_experts` (Mixtral), RoPE (default only), and Qwen's
  dense blocks (`mlp_only_layers`, `decoder_sparse_step`). A sliding window
  is read only when it applies to every block alike; a per-block pattern
  (`layer_types` mixing full and sliding attention) is refused.
  """
  arch = {k: hf[k] for k in HF_KEYS if hf.get(k) is not None}
  if "num_experts" not in arch and "num_local_experts" in hf:
    arch["num_experts"] = hf["num_local_experts"]
  arch.setdefault(
      "num_key_value_heads",
      arch.get("num_attention_heads", DecoderConfig.num_attention_heads),
  )
  arch.setdefault("head_dim", 0)  # absent or null: hidden / heads
  if "clip_qkv" in arch:
    arch["clip_qkv"] = float(arch["clip_qkv"])
  layers = arch.get("num_hidden_layers", DecoderConfig.num_hidden_layers)
  step = hf.get("decoder_sparse_step") or 1
  arch["dense_layers"] = tuple(
      i
      for i in range(layers)
      if i in (hf.get("mlp_only_layers") or ()) or (i + 1) % step
  )
  window = hf.get("sliding_window") or None
  if "use_sliding_window" in hf and not hf["use_sliding_window"]:
    window = None
  kinds = set(hf.get("layer_types") or ())
  if window is not None and kinds and kinds != {"sliding_attention"}:
    raise ValueError(
        f"config.json: layer_types {sorted(kinds)} mix sliding and full"
        " attention, which the port does not run; set use_sliding_window ="
        " false (exact whenever data.max_length <= sliding_window"
        f" = {window})"
    )
  arch["sliding_window"] = window
  return {**arch, "rope_theta": family.rope_theta(hf)}


def refuse_attention_bias(hf: Mapping[str, Any], name: str, why: str) -> None:
  """Refuses a config.json with `attention_bias` set (OLMoE, Qwen3-MoE).

  The kit's bias is Qwen2's `qkv_bias`; a family whose port has no bias
  (`why`) refuses the key in one line rather than load wrong outputs.
  """
  if hf.get("attention_bias"):
    raise ValueError(
        f"{name} checkpoints with attention_bias=true are not supported"
        f" ({why})"
    )


def hf_rules(
    *, qk_norm: bool = False, qkv_bias: bool = False, dense_mlp: bool = False
) -> tuple[Rule, ...]:
  """A kit decoder's names besides its sparse MLP's (under `model.`)."""
  rules = [
      Rule("embed_tokens/embedding", "embed_tokens.weight", COPY),
      Rule(
          BLOCK + "attention/{p:q|k|v|o}/kernel",
          LAYER + "self_attn.{p}_proj.weight",
      ),
      Rule(
          BLOCK + "attention_norm/scale", LAYER + "input_layernorm.weight", COPY
      ),
      Rule(
          BLOCK + "mlp_norm/scale",
          LAYER + "post_attention_layernorm.weight",
          COPY,
      ),
      Rule("final_layer_norm/scale", "norm.weight", COPY),
  ]
  if qk_norm:
    rules.append(
        Rule(
            BLOCK + "attention/{p:q|k}_norm/scale",
            LAYER + "self_attn.{p}_norm.weight",
            COPY,
        )
    )
  if qkv_bias:
    rules.append(
        Rule(
            BLOCK + "attention/{p:q|k|v}/bias",
            LAYER + "self_attn.{p}_proj.bias",
            COPY,
        )
    )
  if dense_mlp:
    rules.append(
        Rule(
            BLOCK + "mlp/{p:gate|up|down}/kernel",
            LAYER + "mlp.{p}_proj.weight",
        )
    )
  return tuple(rules)


def hf_kwargs(config: DecoderConfig) -> dict[str, Any]:
  """The config.json keys every kit family writes (export)."""
  return dict(
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_hidden_layers,
      num_attention_heads=config.num_attention_heads,
      num_key_value_heads=config.num_key_value_heads,
      num_experts_per_tok=config.num_experts_per_tok,
      rms_norm_eps=config.rms_norm_eps,
      hidden_act=config.hidden_act,
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      tie_word_embeddings=False,
  )


def qwen_kwargs(config: DecoderConfig) -> dict[str, Any]:
  """The config.json keys both Qwen MoE families write besides `hf_kwargs`.

  Routed experts of their own width, the renormalisation switch, the dense
  blocks as `mlp_only_layers` and the window as `use_sliding_window` plus
  `sliding_window`.
  """
  return dict(
      moe_intermediate_size=config.expert_width,
      num_experts=config.num_experts,
      norm_topk_prob=config.norm_topk_prob,
      mlp_only_layers=list(config.dense_layers),
      use_sliding_window=config.sliding_window is not None,
      sliding_window=config.sliding_window,
  )


def transformers_config(
    stem: str, config: DecoderConfig, extra: Mapping[str, Any], **keys: Any
):
  """`transformers.<stem>Config` of a kit decoder (a family's `hf_config`).

  The kit's keys (`hf_kwargs`), the family's `keys`, `<stem>ForCausalLM` as
  its architecture, and the caller's `extra` (which may replace it).
  """
  import transformers  # pylint: disable=g-import-not-at-top

  return getattr(transformers, stem + "Config")(
      **hf_kwargs(config),
      **keys,
      **{"architectures": [stem + "ForCausalLM"], **extra},
  )


def sized(sizes: Any, vocab_size: int) -> dict[str, Any]:
  """The kit's fields from generic sizes (`hf.backbone_from_sizes`)."""
  return dict(
      vocab_size=vocab_size,
      hidden_size=sizes.d_model,
      intermediate_size=sizes.d_ff,
      num_hidden_layers=sizes.num_layers,
      num_attention_heads=sizes.num_heads,
      num_key_value_heads=sizes.num_kv_heads,
      num_experts=sizes.num_experts,
      num_experts_per_tok=sizes.top_k,
      norm_topk_prob=sizes.norm_topk_prob,
  )
