"""A backbone's blocks as scanned segments: compile cost independent of depth.

An unrolled Python loop over blocks makes XLA compile every block again, so
compile time grows with depth. Here the blocks run as *segments*, a pure
function of the config (`segments`):

* A **scanned** segment is a run of two or more consecutive *units* of
  identical structure, run by one `nn.scan` (compiled once, whatever its
  length). A unit is the family's repeated group of blocks
  (`config.scan_unit`, units from block `config.scan_start` on): Switch's
  (sparse, dense) pair (`sparse_step` blocks, from block 1), one block of
  OLMoE or DeepSeek-MoE. Its parameters are stacked along a leading unit
  axis under ``blocks_{first}_{last}`` (its first and last block); a unit of
  several blocks names them ``offset_{j}`` inside::

    blocks_2_11/attention/q/kernel           [10, D, D]  (unit = 1 block)
    blocks_1_10/offset_0/mlp/router/kernel   [5, D, E]   (unit = 2 blocks:
                                              blocks 1, 3, 5, 7, 9)

* Every other block runs **unrolled** under its per-layer name
  ``block_{i}``: the blocks before `config.scan_start` (Switch's block 0
  owns the relative-position table), a block whose structure differs from
  its neighbours' (`config.block_kind`: a block with expert adapters among
  blocks without), an incomplete last unit, any block in
  `config.unscanned_layers`, and every block when `config.scan_layers` is
  False (the unrolled twin, for comparison). The trainer keeps the selected
  layer l* unscanned, so its owner slices (`OwnerOverride`,
  `roles.expert_prefix`) and selection by block never cut a stacked leaf.

The family declares only its block: a module with fields `(config, index)`
whose `__call__(x, context, owner_override)` returns `(x, context,
router_logits or None)`; `context` holds what every block reads (masks,
position tables) and passes on. Blocks of one scanned segment run with the
first unit's indices, which is sound because `block_kind` states everything
a block's structure depends on.

On disk parameters stay per layer (Hugging Face checkpoints, exports,
`save_pretrained`): `stack_layers` and `unstack_layers` convert between the
per-layer tree and this layout.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax.models.common import OwnerOverride

Params = Mapping[str, Any]


class Segment(NamedTuple):
  """Consecutive blocks first..stop-1, run unrolled (one block) or scanned."""

  first: int
  stop: int
  unit: int  # blocks per scan step (1 for an unrolled block)
  scanned: bool

  @property
  def name(self) -> str:
    """The segment's parameter subtree: block_{i} or blocks_{first}_{last}."""
    if self.scanned:
      return f"blocks_{self.first}_{self.stop - 1}"
    return f"block_{self.first}"

  @property
  def blocks(self) -> range:
    return range(self.first, self.stop)

  @property
  def length(self) -> int:
    """Scan steps (units) of the segment."""
    return (self.stop - self.first) // self.unit

  def member(self, step: int, offset: int) -> int:
    """The block at `offset` within unit `step`."""
    return self.first + step * self.unit + offset


def segments(config) -> tuple[Segment, ...]:
  """The segments of `config`'s blocks, in order (see the module docstring).

  Args:
    config: a family config (`common.FineTuningOptions`): `num_blocks`,
      `scan_unit`, `block_kind` and `scan_layers` decide the plan.

  Returns:
    Segments covering blocks 0..num_blocks-1 exactly once, in order.
  """
  num, unit, start = config.num_blocks, config.scan_unit, config.scan_start

  def kind(start: int) -> tuple | None:
    members = range(start, min(start + unit, num))
    if not config.scan_layers or len(members) < unit:
      return None
    kinds = tuple(config.block_kind(i) for i in members)
    return None if None in kinds else kinds

  plan = [Segment(i, i + 1, 1, False) for i in range(min(start, num))]
  for key, run in itertools.groupby(range(start, num, unit), key=kind):
    starts = list(run)
    if key is None or len(starts) < 2:
      stop = min(starts[-1] + unit, num)
      plan.extend(Segment(i, i + 1, 1, False) for i in range(starts[0], stop))
    else:
      plan.append(Segment(starts[0], starts[-1] + unit, unit, True))
  return tuple(plan)


class _Unit(nn.Module):
  """One scan step of a segment whose unit has several blocks (offset_{j})."""

  block: type[nn.Module]
  config: Any
  first: int

  @nn.compact
  def __call__(self, x, context):
    logits = []
    for j in range(self.config.scan_unit):
      block = self.block(self.config, self.first + j, name=f"offset_{j}")
      x, _, out = block(x, context, None)
      logits.append(out)
    return x, tuple(logits)


def _block_step(block, x, context):
  x, _, out = block(x, context, None)
  return x, (out,)


def _unit_step(unit, x, context):
  return unit(x, context)


def run(
    block: type[nn.Module],
    config,
    x: jax.Array,
    context: Any,
    owner_override: OwnerOverride | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Runs every block of `config` on `x`; call it inside a compact method.

  Args:
    block: the family's block class (see the module docstring).
    config: the family config.
    x: the hidden states entering block 0.
    context: what every block reads (block 0 may replace it, e.g. with
      Switch's position bias); broadcast to the steps of a scan.
    owner_override: an `OwnerOverride` of an unrolled block, or None.

  Returns:
    (hidden states after the last block, one router-logit array per sparse
    block in block order).

  Raises:
    ValueError: `owner_override` names a block inside a scanned segment.
  """
  logits = []
  for seg in segments(config):
    if not seg.scanned:
      x, context, out = block(config, seg.first, name=seg.name)(
          x, context, owner_override
      )
      if out is not None:
        logits.append(out)
      continue
    if owner_override is not None and owner_override.layer in seg.blocks:
      layer = owner_override.layer
      raise ValueError(
          f"owner layer {layer} is inside the scanned segment {seg.name};"
          f" keep it out of the scan with unscanned_layers=({layer},)"
      )
    if seg.unit == 1:
      step, module = _block_step, block(config, seg.first, name=seg.name)
    else:
      step = _unit_step
      module = _Unit(block, config, seg.first, name=seg.name)
    x, outs = nn.scan(
        step,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=seg.length,
    )(module, x, context)
    for k in range(seg.length):
      logits.extend(out[k] for out in outs if out is not None)
  return x, tuple(logits)


def _stack(*leaves):
  if all(isinstance(leaf, np.ndarray) for leaf in leaves):
    return np.stack(leaves)
  return jnp.stack(leaves)


def stack_layers(per_layer_params: Params, config) -> dict:
  """A backbone's per-layer parameters (`block_{i}` subtrees) in `config`'s layout.

  Args:
    per_layer_params: the backbone's tree with one `block_{i}` per block
      (a checkpoint's layout; adapters may be absent, as long as the blocks
      of one segment agree).
    config: the family config whose `segments` give the layout.

  Returns:
    The same leaves, those of each scanned segment stacked along a new
    leading axis under its name (other subtrees unchanged).
  """
  tree = dict(flax.core.unfreeze(per_layer_params))
  for seg in segments(config):
    if not seg.scanned:
      continue
    members = []
    for j in range(seg.unit):
      names = [f"block_{seg.member(k, j)}" for k in range(seg.length)]
      missing = [n for n in names if n not in tree]
      if missing:
        raise ValueError(
            f"params: {missing[0]} is missing; stack_layers takes per-layer"
            f" parameters (block_0..block_{config.num_blocks - 1})"
        )
      members.append(jax.tree.map(_stack, *(tree.pop(n) for n in names)))
    if seg.unit == 1:
      tree[seg.name] = members[0]
    else:
      tree[seg.name] = {f"offset_{j}": m for j, m in enumerate(members)}
  return tree


def unstack_layers(params: Params, config) -> dict:
  """The inverse of `stack_layers`: one `block_{i}` subtree per block."""
  tree = dict(flax.core.unfreeze(params))
  for seg in segments(config):
    if not seg.scanned:
      continue
    if seg.name not in tree:
      raise ValueError(
          f"params: {seg.name} is missing; unstack_layers takes parameters"
          " in the layout of the config's segments (stack.segments)"
      )
    stacked = tree.pop(seg.name)
    for j in range(seg.unit):
      member = stacked if seg.unit == 1 else stacked[f"offset_{j}"]
      for k in range(seg.length):
        tree[f"block_{seg.member(k, j)}"] = jax.tree.map(
            lambda leaf, k=k: leaf[k], member
        )
  return tree
