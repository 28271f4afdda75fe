"""Which parameter belongs to which role (App. C, docs/method.md §1.5).

Parameters are addressed by their flat path in the classifier's tree, e.g.
`backbone/block_3/mlp/experts/wi/lora_a` or `head/kernel`; a leaf of a
scanned segment, `backbone/blocks_2_11/attention/q/lora_a`, stacks the same
parameter of blocks 2..11 (`models.stack`) and has that parameter's role.
Every leaf has exactly one role::

  attention_adapter      LoRA factors of the attention projections (q, k, v, o;
                         MLA's q_a, q_b, kv_a, kv_b) of any block
  attention_kernel       their base weights
  head                   the classification head
  shared_expert_adapter  LoRA factors of the always-active shared experts
                         (DeepSeek-MoE) of a sparse block
  shared_expert_kernel   the shared experts' base weights
  expert_adapter         LoRA factors of the routed experts of a sparse block
  expert_kernel          the routed experts' base weights
  router                 the (always frozen) routers
  base                   everything else: embeddings, norms, dense FFNs, ...

A method trains a set of roles, optionally restricted to some blocks. RAPTOR's
shared stream is {attention_adapter, shared_expert_adapter, head}: shared
experts see every token, so they are shared parameters, not experts (paper
Sec. 3.3); its expert stream is the expert_adapter role at the selected block
l* (owner slices of the routed experts). The role sets of
the streams and the path conventions (`expert_prefix`, `is_adapter`) are
defined here once; `train.methods`, `diagnostics` and `models.hf` use them.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import flax
import numpy as np

ROLES = (
    "attention_adapter",
    "attention_kernel",
    "head",
    "shared_expert_adapter",
    "shared_expert_kernel",
    "expert_adapter",
    "expert_kernel",
    "router",
    "base",
)
ADAPTER_LEAVES = ("lora_a", "lora_b")
_BLOCK = re.compile(r"(?:^|/)block_(\d+)/")
_BLOCKS = re.compile(r"(?:^|/)blocks_(\d+)_(\d+)/")  # a scanned segment
_ATTENTION_PROJECTION = re.compile(r"/attention/(?:[qkvo]|q_a|q_b|kv_a|kv_b)/")

# Stream membership: the roles each stream (or method) trains.
SHARED_ROLES = (  # RAPTOR's shared stream (LoRA)
    "attention_adapter",
    "shared_expert_adapter",
    "head",
)
SHARED_FULL_ROLES = (  # ... with full attention and shared-expert weights
    "attention_kernel",
    "shared_expert_kernel",
    "head",
)
EXPERT_ROLES = ("expert_adapter",)  # RAPTOR's expert stream at l* (LoRA)
EXPERT_FULL_ROLES = ("expert_kernel",)  # ... with full expert weights
LORA_ROLES = (  # every adapter + head
    "attention_adapter",
    "shared_expert_adapter",
    "head",
    "expert_adapter",
)
ALL_ROLES = (  # every weight
    "attention_kernel",
    "shared_expert_kernel",
    "head",
    "expert_kernel",
    "router",
    "base",
)

# The paper's top-level roles (App. G diagnostics) as unions of `ROLES`.
DIAGNOSTIC_ROLES = {
    "shared": ("attention_adapter", "attention_kernel", "base"),
    "shared_expert": ("shared_expert_adapter", "shared_expert_kernel"),
    "router": ("router",),
    "head": ("head",),
    "experts": ("expert_adapter", "expert_kernel"),
}
_DIAGNOSTIC_OF = {
    role: group
    for group, members in DIAGNOSTIC_ROLES.items()
    for role in members
}


def expert_prefix(layer: int, root: str = "backbone/") -> str:
  """Flat path prefix of the stacked experts of block `layer`.

  `root` is where the backbone sits: 'backbone/' in the classifier's tree
  (the default), '' in a bare backbone's.
  """
  return f"{root}block_{layer}/mlp/experts/"


def is_adapter(path: str) -> bool:
  """Whether the leaf at a flat path is a LoRA factor (lora_a or lora_b)."""
  return path.rsplit("/", 1)[-1] in ADAPTER_LEAVES


def is_image_table(path: str) -> bool:
  """Whether the leaf is an image task's frozen table of image tokens."""
  return path.endswith("image_table/embedding")


def diagnostic_role(path: str) -> str:
  """The App. G role (shared | shared_expert | router | head | experts) of a path.

  Shared experts (DeepSeek-MoE) train in the shared stream but are reported
  apart, so M_role shows what they move.
  """
  return _DIAGNOSTIC_OF[role_of(path)]


def role_of(path: str) -> str:
  """The role of the leaf at a flat '/'-separated path."""
  if path.startswith("head/"):
    return "head"
  if "/mlp/router/" in path:
    return "router"
  if "/mlp/shared_experts/" in path:
    return (
        "shared_expert_adapter" if is_adapter(path) else "shared_expert_kernel"
    )
  if "/mlp/experts/" in path:
    return "expert_adapter" if is_adapter(path) else "expert_kernel"
  if _ATTENTION_PROJECTION.search(path):
    return "attention_adapter" if is_adapter(path) else "attention_kernel"
  return "base"


def blocks_of(path: str) -> range:
  """The blocks a leaf belongs to: one for `block_{i}`, first..last for a
  stacked leaf of a scanned segment `blocks_{first}_{last}` (`models.stack`),
  none outside the blocks (embeddings, head)."""
  if match := _BLOCKS.search(path):
    return range(int(match[1]), int(match[2]) + 1)
  if match := _BLOCK.search(path):
    return range(int(match[1]), int(match[1]) + 1)
  return range(0)


def flatten(params: Mapping[str, Any]) -> dict[str, Any]:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  return flax.traverse_util.unflatten_dict(dict(flat), sep="/")


def select(
    params: Mapping[str, Any],
    roles: Iterable[str],
    blocks: Iterable[int] | None = None,
) -> list[str]:
  """Sorted flat paths of the leaves with one of `roles` (in `blocks`, if given).

  An image task's `image_table` (role 'base') is never selected: it holds
  the records' frozen image tokens (`raptor_jax.vision`), so no method trains it,
  not even those that train every weight.

  Raises:
    ValueError: `blocks` holds some but not all of the blocks of a stacked
      leaf with one of `roles` (a selection by block never cuts a leaf).
  """
  roles = set(roles)
  unknown = roles - set(ROLES)
  if unknown:
    raise ValueError(f"unknown roles {sorted(unknown)}; roles are {ROLES}")
  blocks = None if blocks is None else set(blocks)
  selected = []
  for path in flatten(params):
    if role_of(path) not in roles or is_image_table(path):
      continue
    covered = set(blocks_of(path))
    if blocks is not None and covered & blocks and not covered <= blocks:
      raise ValueError(
          f"{path} stacks blocks {min(covered)}..{max(covered)}, and selecting"
          f" blocks {sorted(blocks)} would cut it; keep those blocks out of"
          " the scan (model.unscanned_layers) or set model.scan_layers=False"
      )
    if blocks is None or (covered and covered <= blocks):
      selected.append(path)
  return sorted(selected)


def has_shared_experts(params: Mapping[str, Any]) -> bool:
  """Whether the model has always-active shared experts (shared stream)."""
  return any(role_of(p) == "shared_expert_kernel" for p in flatten(params))


def count_by_role(params: Mapping[str, Any]) -> dict[str, int]:
  """Number of scalars per role (for results.json).

  An image task's frozen `image_table` (`raptor_jax.vision`) is not counted: its
  size is the records' total image tokens, a statistic of the private data.
  """
  counts = dict.fromkeys(ROLES, 0)
  for path, leaf in flatten(params).items():
    if is_image_table(path):
      continue
    counts[role_of(path)] += int(np.prod(np.shape(leaf)))
  return counts
