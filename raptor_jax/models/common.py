"""Types every backbone family shares: its output, the owner override, options.

A family (Switch, OLMoE, ...) is one module with a frozen config dataclass
that subclasses `FineTuningOptions` and adds its architecture fields, and a
backbone whose `__call__(input_ids, attention_mask, owner_override)` returns
a `BackboneOutput`; `hf.FAMILIES` maps its Hugging Face `model_type` to the
backbone and its checkpoint name table. The fine-tuning options are written
once, here, so every family takes the same `from_pretrained` options.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from raptor_jax import _validate
from raptor_jax.models import kernels, moe


class BackboneOutput(NamedTuple):
  """Output of a backbone: final hidden states and per-sparse-layer logits."""

  hidden_states: jax.Array  # [B, S, D]
  router_logits: tuple[jax.Array, ...]  # one float32 [B, S, E] per sparse layer


class OwnerOverride(NamedTuple):
  """Routes one record's expert-stream gradient into its owner's slice.

  The block must run unrolled (`stack`: the trainer keeps l* out of every
  scan with `unscanned_layers`); one inside a scanned segment is refused.

  Attributes:
    layer: index of the block whose experts train (a Python int).
    owner: int32 scalar, the record's owner expert.
    params: this block's trainable expert parameters without the expert
      axis, e.g. {'wi': {'lora_a', 'lora_b'} | {'kernel'}, 'wo': {...}} for
      Switch (the names of the family's expert projections).
  """

  layer: int
  owner: jax.Array
  params: Mapping[str, Mapping[str, jax.Array]]


def check_owner_layer(
    owner_override: OwnerOverride | None, sparse_layers
) -> None:
  """Refuses an owner override of a block that is not sparse (one line)."""
  if owner_override is not None and owner_override.layer not in sparse_layers:
    raise ValueError(
        f"owner layer {owner_override.layer} is not a sparse block of this "
        f"model; sparse blocks: {list(sparse_layers)}"
    )


def causal_mask(
    input_ids: jax.Array, attention_mask: jax.Array | None
) -> jax.Array:
  """bool [B, S_q, S_k]: key k is visible to query q (k <= q, k a token).

  `attention_mask` is {0, 1} [B, S] (1 = token); None means all tokens.
  """
  if attention_mask is None:
    attention_mask = jnp.ones(input_ids.shape, jnp.int32)
  seq = input_ids.shape[1]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  return causal[None] & (attention_mask[:, None, :] > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FineTuningOptions:
  """Fine-tuning options of every family's config (not part of the checkpoint).

  Keyword-only, so a family config keeps its architecture fields' positional
  order. A subclass defines `sparse_layers` (indices of its sparse blocks)
  and calls `super().__post_init__()` from its own `__post_init__`.
  """

  lora_rank: int = 0  # LoRA rank r; 0 disables every adapter.
  lora_alpha: float = 16.0  # LoRA scale is alpha / r.
  attention_lora: bool = False  # adapters on q, k, v, o of every block.
  expert_lora_layers: tuple[int, ...] = ()  # blocks whose experts get adapters.
  dispatch: str = (
      "auto"  # expert dispatch, one of moe.DISPATCHES (`resolve_dispatch`).
  )
  dtype: str = (
      "float32"  # activation dtype; routers and norm statistics use float32.
  )
  kernels: str = (
      "auto"  # hand-written backwards: auto | fast | reference (kernels.py).
  )
  scan_layers: bool = True  # identical blocks run as one nn.scan (stack.py).
  unscanned_layers: tuple[int, ...] = ()  # blocks kept out of any scan.

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    raise NotImplementedError("a family config defines its sparse blocks")

  @property
  def num_blocks(self) -> int:
    raise NotImplementedError("a family config defines its number of blocks")

  @property
  def scan_unit(self) -> int:
    """Blocks in the repeated unit a scan steps over (`stack.segments`)."""
    return 1

  @property
  def scan_start(self) -> int:
    """The first block of the first unit; the blocks before it are unrolled."""
    return 0

  def block_kind(self, index: int) -> tuple | None:
    """What block `index`'s structure depends on, or None: keep it unrolled.

    Blocks of equal kind have the same parameters and computation, so a run
    of units of equal kinds can be one `nn.scan` (`stack.segments`). A
    family whose blocks depend on their index in another way extends this
    (or keeps them before `scan_start`).
    """
    if index in self.unscanned_layers:
      return None
    return (index in self.sparse_layers, index in self.expert_lora_layers)

  def __post_init__(self):
    _validate.one_of(
        "dispatch",
        self.dispatch,
        moe.DISPATCHES,
        moe.DISPATCH_FIX,
    )
    _validate.one_of(
        "kernels", self.kernels, kernels.KERNELS, kernels.KERNELS_FIX
    )
    bad = [l for l in self.expert_lora_layers if l not in self.sparse_layers]
    if bad:
      raise ValueError(
          f"expert_lora_layers {bad} are not sparse blocks of this model; its "
          f"sparse blocks are {list(self.sparse_layers)}"
      )
    bad = [l for l in self.unscanned_layers if not 0 <= l < self.num_blocks]
    if bad:
      raise ValueError(
          f"unscanned_layers {bad} are not blocks of this model; its blocks"
          f" are 0..{self.num_blocks - 1}"
      )


FINE_TUNING_OPTIONS = tuple(
    f.name for f in dataclasses.fields(FineTuningOptions)
)
