"""Pretraining models: a backbone with its language-model head and loss.

* Switch (encoder): masked LM. The head is tied to the token embedding and
  reads the final states scaled by d_model^-1/2, as T5/Switch do with tied
  embeddings, so the exported checkpoint is the encoder alone.
* OLMoE (decoder): causal LM with an untied `lm_head` (OLMoE's layout).
* DeepSeek-MoE (decoder): causal LM with an untied `lm_head`; MLA, a dense
  first block, routed and shared experts (DeepSeek-V2's layout).

Every parameter trains, routers included: the expert kernels use a grouped
dispatch that is differentiable in the kernels (`dispatch='auto_train'`:
the sorted blocks of `grouped_train` on CPU, `batched_train` elsewhere), so
training costs tokens x k
expert work, not tokens x E. Each family adds its
own router auxiliary losses (Switch: load balancing and z-loss per sparse
layer, averaged over layers; OLMoE: load balancing over all layers' tokens;
DeepSeek: the sequence-wise expert-level balance loss, summed over layers),
and optionally an owner-balance term (`objectives.owner_balance_loss`) that
balances RAPTOR's record owners, not only tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from raptor_jax import models
from raptor_jax.models import hf, initializers
from raptor_jax.pretrain import objectives

# Default coefficients of each family's router losses: Hugging Face's configs'
# (DeepSeek: DeepSeek-V2's `aux_loss_alpha`; transformers trains no DeepSeek
# router).
HF_AUX_LOSS_COEF = {"switch": 0.001, "olmoe": 0.01, "deepseek": 0.001}
HF_Z_LOSS_COEF = {"switch": 0.001, "olmoe": 0.0, "deepseek": 0.0}


class SpecialIds(NamedTuple):
  """Token ids the objectives need (from the tokenizer)."""

  pad: int
  mask: int
  first_regular: (
      int  # ids below are special tokens; random replacements draw above
  )
  vocab_size: int


def backbone(
    family: str, mc: ml_collections.ConfigDict, vocab_size: int
) -> nn.Module:
  """The backbone module of a pretraining config (trainable expert kernels)."""
  return hf.backbone_from_sizes(
      family,
      mc,
      vocab_size,
      dispatch="auto_train",
      kernels=mc.get("kernels", "auto"),
  )


def _switch_std(path: str, cfg: models.SwitchConfig) -> float:
  """T5/Switch initialisation (HF `_init_weights`), except the router.

  The router uses the Switch paper's reduced scale (std sqrt(0.1 / d_model))
  instead of HF's std 1, which saturates the router softmax at step 0.
  """
  d, dkv, heads = cfg.d_model, cfg.d_kv, cfg.num_heads
  table = {
      "embed_tokens/embedding": 1.0,
      "attention/q/kernel": (d * dkv) ** -0.5,
      "attention/k/kernel": d**-0.5,
      "attention/v/kernel": d**-0.5,
      "attention/o/kernel": (heads * dkv) ** -0.5,
      "relative_attention_bias/embedding": d**-0.5,
      "mlp/wi/kernel": d**-0.5,
      "mlp/wo/kernel": cfg.d_ff**-0.5,
      "experts/wi/kernel": d**-0.5,
      "experts/wo/kernel": cfg.d_ff**-0.5,
      "router/kernel": (0.1 / d) ** 0.5,
  }
  for suffix, std in table.items():
    if path.endswith(suffix):
      return std
  raise ValueError(f"no initialisation rule for {path}")


def init_params(module: nn.Module, key: jax.Array) -> dict[str, Any]:
  """{'backbone': ..., ['lm_head': {'kernel': [D, V]}]}, initialised as HF does.

  Norm scales start at 1; every matrix is normal with the family's std
  (Switch: `_switch_std`; OLMoE and DeepSeek: initializer_range 0.02).
  """
  flat = initializers.abstract_params(module)
  _, key = jax.random.split(key)  # the draws' key of earlier versions
  is_switch = isinstance(module, models.SwitchEncoder)
  out = {}
  for i, (path, leaf) in enumerate(sorted(flat.items())):
    if path.endswith("/scale"):
      out[path] = jnp.ones(leaf.shape, leaf.dtype)
    elif path.endswith("/bias"):
      out[path] = jnp.zeros(leaf.shape, leaf.dtype)
    else:
      std = _switch_std(path, module.config) if is_switch else 0.02
      out[path] = std * jax.random.normal(
          jax.random.fold_in(key, i), leaf.shape, leaf.dtype
      )
  params = {"backbone": flax.traverse_util.unflatten_dict(out, sep="/")}
  if not is_switch:
    cfg = module.config
    params["lm_head"] = {
        "kernel": 0.02
        * jax.random.normal(
            jax.random.fold_in(key, len(flat)),
            (cfg.hidden_size, cfg.vocab_size),
        )
    }
  return params


def lm_logits(module: nn.Module, params: dict, hidden: jax.Array) -> jax.Array:
  """Vocabulary logits of hidden states [..., D] -> [..., V] (float32)."""
  if isinstance(module, models.SwitchEncoder):
    embedding = params["backbone"]["embed_tokens"]["embedding"]
    scaled = hidden.astype(jnp.float32) * module.config.d_model**-0.5
    return scaled @ embedding.T.astype(jnp.float32)
  return hidden.astype(jnp.float32) @ params["lm_head"]["kernel"].astype(
      jnp.float32
  )


def router_losses(
    module: nn.Module, router_logits, mask: jax.Array
) -> dict[str, jax.Array]:
  """The family's auxiliary router losses and the owner-balance term (unweighted)."""
  layers = len(router_logits)
  mean = lambda fn: sum(fn(l, mask) for l in router_logits) / layers
  owner = dict(owner_balance_loss=mean(objectives.owner_balance_loss))
  if isinstance(module, models.SwitchEncoder):
    return dict(
        aux_loss=mean(objectives.switch_load_balancing_loss),
        z_loss=mean(objectives.router_z_loss),
        **owner,
    )
  cfg = module.config
  if isinstance(module, models.DeepseekDecoder):
    aux = objectives.deepseek_balance_loss(
        router_logits, mask, cfg.top_k, cfg.routing_groups
    )
  else:
    aux = objectives.topk_load_balancing_loss(router_logits, mask, cfg.top_k)
  return dict(aux_loss=aux, **owner)


def loss_fn(
    module: nn.Module,
    params: dict,
    input_ids: jax.Array,
    key: jax.Array,
    special: SpecialIds,
    *,
    mlm_rate: float,
    aux_loss_coef: float,
    z_loss_coef: float,
    owner_balance_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total loss and its parts for one batch of packed rows [B, S].

  Padding (id `special.pad`) is masked out; the masked-LM family predicts
  `mlm_rate` of the non-special tokens, the causal family every next token.
  """
  mask = (input_ids != special.pad).astype(jnp.int32)
  if isinstance(module, models.SwitchEncoder):
    maskable = (mask > 0) & (input_ids >= special.first_regular)
    batch = objectives.mask_tokens(
        key,
        input_ids,
        maskable,
        mask_id=special.mask,
        random_ids=(special.first_regular, special.vocab_size),
        rate=mlm_rate,
    )
    out = module.apply({"params": params["backbone"]}, batch.input_ids, mask)
    hidden = jnp.take_along_axis(
        out.hidden_states, batch.positions[..., None], axis=1
    )
    targets, weights = batch.targets, batch.weights
  else:
    out = module.apply({"params": params["backbone"]}, input_ids, mask)
    hidden = out.hidden_states[:, :-1]
    targets, weights = input_ids[:, 1:], (mask[:, 1:] * mask[:, :-1]).astype(
        jnp.float32
    )
  lm_loss, accuracy = objectives.token_cross_entropy(
      lm_logits(module, params, hidden), targets, weights
  )
  parts = router_losses(module, out.router_logits, mask)
  total = (
      lm_loss
      + aux_loss_coef * parts["aux_loss"]
      + z_loss_coef * parts.get("z_loss", 0.0)
      + owner_balance_coef * parts["owner_balance_loss"]
  )
  return total, dict(loss=total, lm_loss=lm_loss, accuracy=accuracy, **parts)
