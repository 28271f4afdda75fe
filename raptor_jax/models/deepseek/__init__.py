"""DeepSeek-MoE decoder (DeepSeek-V2, DeepSeek-VL2's language model) as flax.linen modules.

A faithful port of `transformers.DeepseekV2Model` (transformers 5.x, eager
attention, eval mode), plus the plain multi-head attention variant that
DeepSeek's own code selects with `use_mla: false` (DeepSeek-VL2-Tiny):

* Llama-style RMS norm (float32 statistics). The two latent norms of MLA use
  eps 1e-6 whatever `rms_norm_eps` says, as Hugging Face builds them.
* Multi-head latent attention (MLA): queries from `q` (or the low-rank
  `q_a` -> norm -> `q_b` when `q_lora_rank` is set); keys and values from a
  compressed latent `kv_a` -> norm -> `kv_b`; each head's query/key splits
  into a `qk_nope_head_dim` part without position and a `qk_rope_head_dim`
  part with RoPE, whose key is one vector shared by all heads; values have
  `v_head_dim`; scores scaled by (nope + rope)^-1/2. RoPE rotates adjacent
  pairs (x[2i], x[2i+1]), Hugging Face's complex form.
* `use_mla=False`: `transformers.LlamaAttention` (q, k, v, o; grouped key /
  value heads; rotate-half RoPE over head_dim = hidden / heads), the class
  DeepSeek's code maps `mha_eager` to.
* The first `first_k_dense_replace` blocks have a dense SwiGLU MLP; every
  later block is sparse: a float32 softmax router over the routed experts,
  top-k (`greedy`, or `group_limited_greedy`: only the `topk_group` best of
  `n_group` expert groups compete), weights times `routed_scaling_factor`,
  routed SwiGLU experts in the grouped dispatch (tokens x k work), plus
  `n_shared_experts` always-active shared experts run as ONE dense SwiGLU MLP
  of width n_shared_experts x moe_intermediate_size (tokens x 1 work).
* `norm_topk_prob`: a `deepseek_v2` checkpoint's is ignored, as transformers
  5.x's DeepseekV2 ignores it; a `deepseek_vl_v2` checkpoint's is applied
  (`DeepseekConfig.norm_topk_prob`), as DeepSeek's own code, its reference,
  renormalises the top-k weights when it is set and top_k > 1.

Routing is per token, so a record never affects another. RAPTOR's roles:
shared experts see every token, so they join the shared stream (role
`shared_expert_*`, see `roles.py`); only the routed experts' gates decide
ownership and layer selection.

The family in two modules: `backbone` (the config and the decoder) and
`checkpoint` (config.json, the Hugging Face name table `HF_NAMES`, sizes);
everything public is importable from this package.
"""

from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.deepseek.backbone import (
    LATENT_NORM_EPS,
    TOPK_METHODS,
    DeepseekBlock,
    DeepseekConfig,
    DeepseekDecoder,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    apply_interleaved_rotary,
    interleaved_rotary_tables,
)
from raptor_jax.models.deepseek.checkpoint import (
    DEEPSEEK_ATTENTION,
    HF_FAMILIES,
    HF_NAMES,
    config_from_hf,
    from_sizes,
    hf_config,
    params_from_hf,
    sized_config,
    vl2_config_from_hf,
    vl2_params_from_hf,
)
from raptor_jax.models.layers import GatedExperts, GatedMLP, RMSNorm, apply_rotary, rotary_tables

__all__ = [
    "DEEPSEEK_ATTENTION",
    "HF_FAMILIES",
    "HF_NAMES",
    "LATENT_NORM_EPS",
    "TOPK_METHODS",
    "DeepseekBlock",
    "DeepseekConfig",
    "DeepseekDecoder",
    "GatedMLP",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "apply_interleaved_rotary",
    "config_from_hf",
    "from_sizes",
    "hf_config",
    "interleaved_rotary_tables",
    "params_from_hf",
    "sized_config",
    "vl2_config_from_hf",
    "vl2_params_from_hf",
]
