"""Per-record clipped gradient sums: ``jax.vmap(jax.grad)`` over a microbatch.

These functions are model-agnostic and jittable. A loss is a function
``loss_fn(params, record) -> scalar`` of ONE record (one row of a batch pytree
whose leaves have a leading axis n), so records never interact: the per-record
semantics the sensitivity argument needs.

Guarantee. For every record, the contribution to a returned sum is its
gradient scaled to l2 norm at most ``l2_clip`` (global norm over all leaves,
computed in float32), or exactly zero when the record is padding (mask 0) or
its gradient has a NaN/inf (replaced with ``jnp.where``, so a NaN never reaches
the sum). Adding, removing or masking one record therefore changes a sum by at
most ``l2_clip`` in l2 norm, and, for the owner sums, only in that record's
owner slice. ``transforms.privatize_sums`` turns such sums into a DP release.

One clip-and-sum. ``clip_and_sum`` clips per-record gradients (one joint
norm, or per part) and sums them (over all records, or into each record's
owner's row), returning the norms only when asked (``return_norms``, as
jax_privacy's ``clipped_grad``). ``clipped_grad_sum`` and
``owner_clipped_grad_sum`` are its loss-level forms for one tree: gradients
by ``per_record_grads``, optionally scaled by ``residual_weights``, then
``clip_and_sum``. The trainer's DP step (``train.step.PhaseFunctions``)
composes the same pieces.

Microbatching. A step's Poisson sample is cut into fixed-size microbatches
(``sampling.microbatches``); one jitted function computes the float32 sum of
one microbatch and the caller adds these sums (``optax.tree.add``), starting
from ``zeros_like_f32``; noise is added ONCE per step, to the total.

Owner slices (RAPTOR's expert stream). With expert parameters stacked
``[E, ...]``, the per-record gradient is taken with respect to the record's
owner slice only. ``owner_slices`` gathers each record's owner slice
(``[n, ...]``, passed with ``params_axis=0``); the model takes the slice in
place of its owner's stacked weights, so every expert still runs in the
forward pass while only the owner's slice carries gradient.
"""

from collections.abc import Collection, Mapping
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from raptor_jax import _validate

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def zeros_like_f32(tree: PyTree) -> PyTree:
  """Float32 zeros shaped like ``tree``: the start of a step's sums.

  For owner sums pass the stacked expert parameters ``[E, ...]``.
  """
  return optax.tree.zeros_like(tree, dtype=jnp.float32)


def per_record_grads(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    *,
    params_axis: Optional[int] = None,
) -> PyTree:
  """Gradient of ``loss_fn`` for every record of ``batch``, unclipped.

  Args:
    loss_fn: ``loss_fn(params, record) -> scalar`` for a single record.
    params: parameters; shared by all records (``params_axis=None``) or one
      per record (``params_axis=0``, leaves ``[n, ...]``, e.g. from
      ``owner_slices``).
    batch: pytree of arrays with a leading record axis n.
    params_axis: ``None`` or ``0``, see ``params``.

  Returns:
    Pytree like ``params`` with a leading axis n (in the params' dtype).
  """
  return jax.vmap(jax.grad(loss_fn), in_axes=(params_axis, 0))(params, batch)


def clip_per_record(
    grads: PyTree, l2_clip: float, mask: Optional[jax.Array] = None
) -> tuple[PyTree, jax.Array]:
  """Clips every record's gradient to global l2 norm ``l2_clip``.

  The norm is over all leaves of one record, in float32. A record's factor
  is ``min(1, l2_clip / norm)`` (1 at norm 0). Padding records (mask 0; any
  nonzero mask value counts as a real record, it never scales one) and
  records whose gradient has a NaN/inf (or whose squared norm overflows
  float32) come out exactly zero.

  Args:
    grads: per-record gradients, leaves ``[n, ...]``.
    l2_clip: clipping norm C, a public Python number > 0.
    mask: ``[n]``, 1 for real records and 0 for padding; None means all real.

  Returns:
    ``(clipped, norms)``: float32 clipped gradients like ``grads``, and the
    float32 ``[n]`` unclipped norms (NaN/inf for non-finite records; padding
    rows hold their padding record's norm). The norms are derived from
    private data without noise: use them for in-process diagnostics only,
    never log or release them.
  """
  l2_clip = _validate.positive('l2_clip', l2_clip, _validate.PUBLIC_NUMBER)
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
  leaves = jax.tree.leaves(grads)
  if not leaves:
    raise ValueError('grads has no leaves.')
  n = leaves[0].shape[0]
  norms = jnp.sqrt(
      sum(jnp.sum(jnp.square(g.reshape(n, -1)), axis=1) for g in leaves)
  )
  # Any NaN/inf element makes the norm NaN/inf, so this catches them all.
  keep = jnp.isfinite(norms)
  if mask is not None:
    keep = keep & (jnp.asarray(mask).reshape(n) != 0)
  factor = l2_clip / jnp.maximum(norms, l2_clip)

  def clip(g):
    shape = (n,) + (1,) * (g.ndim - 1)
    return jnp.where(keep.reshape(shape), g * factor.reshape(shape), 0.0)

  return jax.tree.map(clip, grads), norms


def sum_by_owner(tree: PyTree, owners: jax.Array, num_experts: int) -> PyTree:
  """Segment-sums per-record leaves ``[n, ...]`` into ``[num_experts, ...]``.

  Uses ``jax.ops.segment_sum`` (exact float32 adds; a one-hot matmul could
  run in reduced precision on accelerators). A row whose owner is outside
  ``[0, num_experts)`` is dropped, so it can never add to another expert.
  """
  owners = jnp.asarray(owners).reshape(-1)
  return jax.tree.map(
      lambda g: jax.ops.segment_sum(g, owners, num_segments=num_experts), tree
  )


def scale_records(tree: PyTree, weights: jax.Array) -> PyTree:
  """Multiplies each record's leaves ``[n, ...]`` by its weight ``[n]``.

  The one residual-weight path (RAPTOR Eq. 8): applied to per-record
  gradients BEFORE clipping, so the sensitivity stays ``l2_clip`` whatever
  the weights (they must carry no gradient: ``jax.lax.stop_gradient``).
  Also used to zero padding records of unclipped (non-private) gradients.
  """
  return jax.tree.map(
      lambda g: g
      * weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype),
      tree,
  )


def residual_weights(
    logits: jax.Array, labels: jax.Array, gamma: float
) -> jax.Array:
  """RAPTOR's residual weight w_i = (1 - softmax(z_i)[y_i]) ** gamma (Eq. 8).

  A record the model already gets right weighs little. The weights carry no
  gradient (``jax.lax.stop_gradient``) and are applied to per-record
  gradients before clipping (``scale_records``), so the sensitivity stays
  ``l2_clip`` whatever they are.

  Args:
    logits: ``[n, num_labels]`` logits of the records (any float dtype; the
      softmax runs in float32).
    labels: int ``[n]`` labels.
    gamma: the exponent (public, >= 0).

  Returns:
    float32 ``[n]`` weights in [0, 1].
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  p_true = jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
  return jax.lax.stop_gradient((1.0 - p_true) ** gamma)


def clip_and_sum(
    per_record: PyTree,
    l2_clip: Union[float, Mapping[str, float]],
    *,
    mask: Optional[jax.Array] = None,
    owners: Optional[jax.Array] = None,
    num_experts: Optional[int] = None,
    owner_parts: Optional[Collection[str]] = None,
    keep_batch_dim: bool = False,
    return_norms: bool = False,
):
  """Clips per-record gradients and sums them: the one clip-and-sum.

  Guarantee: each record changes the result by at most its clip in l2 norm
  (one norm over everything for a joint clip; per part, each part by its own
  clip, for per-part clips); summed by owner, only in that record's owner's
  row. Padding (mask 0) and non-finite records add exactly zero
  (``clip_per_record``). ``transforms.privatize_sums`` turns the sums into a
  DP release.

  Args:
    per_record: per-record gradients, leaves ``[n, ...]``; a mapping of parts
      (``{part: tree}``) for per-part clips.
    l2_clip: one public number > 0 clips each record jointly over all of
      ``per_record`` (parts that only join the norm are simply not read from
      the result); a mapping ``{part: clip}`` with the keys of
      ``per_record`` clips each part on its own.
    mask: ``[n]``, 1 real, 0 padding; None means all real.
    owners: int ``[n]``, each record's owner in ``[0, num_experts)``: the
      records are then summed into their owner's row of ``[num_experts,
      ...]`` (out-of-range owners are dropped, see ``sum_by_owner``).
    num_experts: E, with ``owners``.
    owner_parts: the parts summed by owner (default: all of ``per_record``);
      the other parts are summed over all records.
    keep_batch_dim: return the clipped per-record gradients, unsummed.
    return_norms: also return the unclipped norms (``[n]``, or per part for
      per-part clips). They are private, unnoised: in-process diagnostics
      only, never logged or released.

  Returns:
    float32 sums like one record's gradient (owner leaves
    ``[num_experts, ...]``), or the clipped ``[n, ...]`` gradients with
    ``keep_batch_dim``; with ``return_norms``, ``(result, norms)``.
  """
  if isinstance(l2_clip, Mapping):
    if set(l2_clip) != set(per_record):
      raise ValueError(
          f'per-part clips {sorted(l2_clip)} must name the parts of the'
          f' gradients {sorted(per_record)}; give one clip per part, or one'
          ' number for a joint clip'
      )
    clipped_norms = {
        name: clip_per_record(per_record[name], clip, mask)
        for name, clip in l2_clip.items()
    }
    clipped = {name: c for name, (c, _) in clipped_norms.items()}
    norms = {name: n for name, (_, n) in clipped_norms.items()}
  else:
    clipped, norms = clip_per_record(per_record, l2_clip, mask)
  result = (
      clipped
      if keep_batch_dim
      else _sum_records(clipped, owners, num_experts, owner_parts)
  )
  return (result, norms) if return_norms else result


def _sum_records(clipped, owners, num_experts, owner_parts):
  """Sums over records; with owners, (the owner parts) into their owner's row."""
  if owners is None:
    return jax.tree.map(lambda g: jnp.sum(g, axis=0), clipped)
  if num_experts is None:
    raise ValueError('owners need num_experts (E, the number of experts)')
  if owner_parts is None:
    return sum_by_owner(clipped, owners, num_experts)
  return {
      name: (
          sum_by_owner(g, owners, num_experts)
          if name in owner_parts
          else jax.tree.map(lambda x: jnp.sum(x, axis=0), g)
      )
      for name, g in clipped.items()
  }


def clipped_grad_sum(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    *,
    l2_clip: float,
    mask: Optional[jax.Array] = None,
    weights: Optional[jax.Array] = None,
    params_axis: Optional[int] = None,
) -> tuple[PyTree, jax.Array]:
  """Sum over records of clipped per-record gradients (one microbatch).

  Guarantee: each record changes the sum by at most ``l2_clip`` in l2 norm;
  padding and non-finite records change it by exactly nothing.

  Args:
    loss_fn: ``loss_fn(params, record) -> scalar`` for a single record.
    params: parameters (see ``per_record_grads``).
    batch: pytree with a leading record axis n.
    l2_clip: clipping norm C, a public Python number > 0.
    mask: ``[n]``, 1 real, 0 padding; None means all real.
    weights: optional ``[n]`` per-record weights (RAPTOR's residual
      weight w_i, Eq. 8), without gradient. Each record's gradient is
      multiplied by its weight (``scale_records``) before clipping: the
      sensitivity stays ``l2_clip`` whatever the weights.
    params_axis: ``None`` (shared params) or ``0`` (per-record params).

  Returns:
    ``(sums, norms)``: float32 sums shaped like one record's gradient, and
    the ``[n]`` unclipped norms (see ``clip_per_record``).

  Example:
    >>> import jax.numpy as jnp
    >>> from raptor_jax import grads
    >>> loss_fn = lambda p, record: jnp.sum(p['w'] * record['x'])
    >>> params = {'w': jnp.zeros(2)}
    >>> batch = {'x': jnp.array([[3.0, 4.0], [0.3, 0.4], [9.0, 9.0]])}
    >>> mask = jnp.array([1.0, 1.0, 0.0])  # the last row is padding
    >>> sums, _ = grads.clipped_grad_sum(
    ...     loss_fn, params, batch, l2_clip=1.0, mask=mask)
    >>> [round(float(x), 3) for x in sums['w']]  # (.6, .8) + (.3, .4) + 0
    [0.9, 1.2]
  """
  grads = per_record_grads(loss_fn, params, batch, params_axis=params_axis)
  if weights is not None:
    grads = scale_records(grads, weights)
  return clip_and_sum(grads, l2_clip, mask=mask, return_norms=True)


def owner_clipped_grad_sum(
    loss_fn: LossFn,
    slices: PyTree,
    batch: PyTree,
    *,
    owners: jax.Array,
    num_experts: int,
    l2_clip: float,
    mask: Optional[jax.Array] = None,
    weights: Optional[jax.Array] = None,
) -> tuple[PyTree, jax.Array]:
  """Per-expert sums of clipped owner-slice gradients (one microbatch).

  Each record's gradient is taken with respect to its own owner's slice
  (``slices`` leaves ``[n, ...]``, e.g. ``owner_slices(stacked, owners)``),
  clipped to ``l2_clip``, and added to its owner's row of the output.

  Guarantee: one record changes only its owner's slice of the output, by at
  most ``l2_clip`` in l2 norm (so also the whole ``[E, ...]`` output by at
  most ``l2_clip``); padding rows add exactly zero whatever their owner.

  Args:
    loss_fn: ``loss_fn(slice, record) -> scalar`` for a single record; if it
      needs the owner index, put it in the record.
    slices: each record's owner slice, leaves ``[n, ...]``.
    batch: pytree with a leading record axis n.
    owners: int ``[n]``, each record's owner expert in ``[0, num_experts)``.
    num_experts: E, the number of experts (static).
    l2_clip: clipping norm C, a public Python number > 0.
    mask: ``[n]``, 1 real, 0 padding; None means all real.
    weights: optional ``[n]`` residual weights, applied to the loss before
      clipping (see ``clipped_grad_sum``).

  Returns:
    ``(sums, norms)``: float32 sums with leaves ``[num_experts, ...]`` (zero
    for experts without records), and the ``[n]`` unclipped norms.
  """
  grads = per_record_grads(loss_fn, slices, batch, params_axis=0)
  if weights is not None:
    grads = scale_records(grads, weights)
  return clip_and_sum(
      grads,
      l2_clip,
      mask=mask,
      owners=owners,
      num_experts=num_experts,
      return_norms=True,
  )


def owner_slices(stacked: PyTree, owners: jax.Array) -> PyTree:
  """Gathers each record's owner slice: leaves ``[E, ...]`` -> ``[n, ...]``.

  The values equal the owner's current parameters; differentiate with
  respect to this per-record copy (``params_axis=0``) to get owner-only
  gradients of size one slice per record instead of E.
  """
  return jax.tree.map(lambda p: p[owners], stacked)
