"""Flax ports of sparse MoE transformers, LoRA, heads and checkpoint loading.

module, params = models.from_pretrained("google/switch-base-8")
# or "allenai/OLMoE-1B-7B-0924" (OlmoeDecoder; every block is sparse)
# or a DeepSeek-V2 directory (DeepseekDecoder; routed + shared experts)
# or "Qwen/Qwen3-30B-A3B", "Qwen/Qwen1.5-MoE-A2.7B", "mistralai/Mixtral-8x7B-v0.1"
# (Qwen3MoeDecoder, Qwen2MoeDecoder, MixtralDecoder: the decoder kit)
out = module.apply({"params": params}, input_ids, attention_mask)
out.hidden_states   # [B, S, D]
out.router_logits   # one float32 [B, S, E] per sparse layer
# Identical blocks run as one nn.scan, their parameters stacked under
# blocks_{first}_{last} (see `stack`); on disk they stay per layer.
"""

from raptor_jax.models.common import BackboneOutput, FineTuningOptions, OwnerOverride
from raptor_jax.models.deepseek import DeepseekConfig, DeepseekDecoder
from raptor_jax.models.heads import SequenceClassifier, last_token, masked_mean
from raptor_jax.models.hf import from_pretrained, with_options
from raptor_jax.models.loading import init_missing, merge_params
from raptor_jax.models.initializers import init_params
from raptor_jax.models.lora import ExpertLinear, LoRADense
from raptor_jax.models.mixtral import MixtralConfig, MixtralDecoder
from raptor_jax.models.olmoe import OlmoeConfig, OlmoeDecoder
from raptor_jax.models.qwen2_moe import Qwen2MoeConfig, Qwen2MoeDecoder
from raptor_jax.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeDecoder
from raptor_jax.models.stack import segments, stack_layers, unstack_layers
from raptor_jax.models.switch import SwitchConfig, SwitchEncoder

__all__ = [
    "BackboneOutput",
    "DeepseekConfig",
    "DeepseekDecoder",
    "ExpertLinear",
    "FineTuningOptions",
    "LoRADense",
    "MixtralConfig",
    "MixtralDecoder",
    "OlmoeConfig",
    "OlmoeDecoder",
    "OwnerOverride",
    "Qwen2MoeConfig",
    "Qwen2MoeDecoder",
    "Qwen3MoeConfig",
    "Qwen3MoeDecoder",
    "SequenceClassifier",
    "SwitchConfig",
    "SwitchEncoder",
    "from_pretrained",
    "init_missing",
    "init_params",
    "last_token",
    "masked_mean",
    "merge_params",
    "segments",
    "stack_layers",
    "unstack_layers",
    "with_options",
]
