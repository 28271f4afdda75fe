"""Pooling and the sequence-classification head on top of a backbone."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from raptor_jax import _validate
from raptor_jax.models import initializers


def masked_mean(hidden_BxSxD: jax.Array, mask_BxS: jax.Array) -> jax.Array:
  """Mean of the non-padding token states of each record (encoders)."""
  mask = mask_BxS.astype(jnp.float32)
  # A contraction, not a masked sum: under the trainer's vmap over records
  # (batches of one) XLA:CPU ran the masked sum's fused reduction ~50x slower.
  total = jnp.einsum("bsd,bs->bd", hidden_BxSxD.astype(jnp.float32), mask)
  count = jnp.sum(mask, axis=1, keepdims=True)
  return total / jnp.maximum(count, 1.0)


def last_token(hidden_BxSxD: jax.Array, mask_BxS: jax.Array) -> jax.Array:
  """State of the last non-padding token (decoders; right padding)."""
  last = jnp.maximum(jnp.sum(mask_BxS.astype(jnp.int32), axis=1) - 1, 0)
  return jnp.take_along_axis(
      hidden_BxSxD.astype(jnp.float32), last[:, None, None], axis=1
  )[:, 0]


POOLING = {"mean": masked_mean, "last": last_token}


class SequenceClassifier(nn.Module):
  """Backbone -> pooling -> linear head (float32 logits).

  Parameters live under `backbone/...` and `head/{kernel,bias}` (`head/kernel`
  only with `head_bias=False`: the bias-free `score` of transformers'
  sequence-classification classes, `hf.sequence_classification_class`).
  """

  backbone: nn.Module
  num_labels: int
  pooling: str = "mean"
  head_bias: bool = True

  @nn.compact
  def __call__(self, input_ids, attention_mask, owner_override=None):
    """Returns (logits [B, num_labels] float32, the backbone output)."""
    _validate.one_of(
        "model.pooling",
        self.pooling,
        sorted(POOLING),
        _validate.config_fix("model.pooling"),
    )
    out = self.backbone(
        input_ids, attention_mask, owner_override=owner_override
    )
    pooled = POOLING[self.pooling](out.hidden_states, attention_mask)
    head = initializers.float32_dense(
        self.num_labels, use_bias=self.head_bias, name="head"
    )
    logits = head(pooled)
    return logits, out
