"""Mixture-of-Experts building blocks: one namespace over routing and dispatch.

* `raptor_jax.models.routing`: top-1 routing with per-sequence capacity
  (Switch), top-k (OLMoE, DeepSeek) and DeepSeek's group limit.
* `raptor_jax.models.dispatch`: the expert computations (the grouped block
  scan, its loop-free batched twin for GPUs, and the dense reference) and
  RAPTOR's owner slices.
* `raptor_jax.models.ragged`: the same computations on grouped GEMMs (XLA's
  `ragged_dot`, tokamax's kernels).

Everything has per-record semantics: a record's output never depends on
another record in the batch (docs/method.md §3), which makes per-record
gradients, and therefore DP clipping, meaningful. The model families import
this module; each part is also importable on its own.
"""

# pylint: disable=unused-import
from raptor_jax.models.dispatch import (
    ACTIVATIONS,
    DISPATCH_FIX,
    DISPATCHES,
    batched_block_size,
    batched_linear,
    batched_linear_trainable,
    block_size,
    dense_linear,
    expert_lora,
    grouped_linear,
    grouped_linear_trainable,
    owner_linear,
    owner_lora_delta,
    reference_linear,
    resolve_dispatch,
    static_num_blocks,
)
from raptor_jax.models.ragged import (
    TOKAMAX_FIX,
    ragged_linear,
    ragged_linear_trainable,
    tokamax_linear,
    tokamax_linear_trainable,
)
from raptor_jax.models.routing import (
    Routing,
    combine,
    limit_to_groups,
    route_top1,
    route_topk,
)
