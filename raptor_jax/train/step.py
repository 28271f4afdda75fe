"""Jitted pieces of one phase: microbatch clipped sums, the noisy update, eval.

Parameters travel as flat dicts `{path: array}` (see `roles.flatten`):
`trainable[part_name]` holds what a part trains (for an owner part, the
stacked [E, ...] expert leaves of layer l*), `frozen` everything else. Every
function has fixed input shapes, so each compiles once per run: once per
sequence length with length buckets (`data.length_buckets`; a microbatch
of bucket b is [microbatch rows, b] tokens), never per step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from raptor_jax import grads, roles
from raptor_jax.models.common import OwnerOverride
from raptor_jax.train import packed, parallel, setup
from raptor_jax.train.plans import Phase
from raptor_jax.train.parallel import AXIS

Flat = dict[str, jax.Array]
Batch = Mapping[str, jax.Array]  # input_ids, attention_mask, labels, owners


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-record softmax cross-entropy (float32)."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels
  )


def _owner_params(flat_slice: Flat, layer: int) -> dict:
  """{'backbone/block_l/mlp/experts/wi/lora_a': s} -> {'wi': {'lora_a': s}}."""
  prefix = roles.expert_prefix(layer)
  nested: dict[str, dict[str, jax.Array]] = {}
  for path, value in flat_slice.items():
    matrix, leaf = path[len(prefix) :].split("/")
    nested.setdefault(matrix, {})[leaf] = value
  return nested


def merged_flat(frozen: Flat, trainable: Mapping[str, Flat]) -> Flat:
  """`frozen` with every part's leaves put in: the full flat parameter dict."""
  flat = dict(frozen)
  for part in trainable.values():
    flat.update(part)
  return flat


def merged_params(frozen: Flat, trainable: Mapping[str, Flat]) -> dict:
  """The full nested parameter tree."""
  return roles.unflatten(merged_flat(frozen, trainable))


def summed_loss(
    model: nn.Module, params: dict, batch: Batch, mask
) -> jax.Array:
  """Summed cross-entropy of the unmasked records (no clipping)."""
  logits, _ = model.apply(
      {"params": params}, batch["input_ids"], batch["attention_mask"]
  )
  return jnp.sum(cross_entropy(logits, batch["labels"]) * mask)


def with_expert_updates_off(params_flat: Flat, layer: int) -> Flat:
  """`params_flat` with layer `layer`'s expert adapters' B factors at zero.

  LoRA's B starts at zero, so this is the model with the expert stream's
  updates of l* switched off: the 'shared' residual weight's model. Full
  weight experts have no B factor to zero, so they are refused (a trained
  kernel would leak into the "shared-only" logits otherwise).
  """
  prefix = roles.expert_prefix(layer)
  zeroed = lambda p: p.startswith(prefix) and p.endswith("lora_b")
  if not any(zeroed(p) for p in params_flat):
    raise ValueError(
        "residual='shared' switches l*'s expert updates off by zeroing "
        "their LoRA B factors, and l* has none (full-weight experts); "
        "use residual='full' or 'none'"
    )
  return {
      p: jnp.zeros_like(v) if zeroed(p) else v for p, v in params_flat.items()
  }


def _data_parallel(fn: Callable, mesh: Mesh, replicated: int, **jit_kwargs):
  """`fn` jitted under `shard_map`: its first `replicated` arguments are
  replicated, the last two (records, mask) split over the 'data' axis; the
  result is replicated (`fn` psums it)."""
  specs = (PartitionSpec(),) * replicated + (PartitionSpec(AXIS),) * 2
  return jax.jit(
      jax.shard_map(
          fn,
          mesh=mesh,
          in_specs=specs,
          out_specs=PartitionSpec(),
          check_vma=False,
      ),
      **jit_kwargs,
  )


class PhaseFunctions(packed.PartsUpdate):
  """The jitted programs of one phase: microbatch sums, then the update.

  `accumulate` runs under `shard_map` on the 'data' mesh (`parallel`): each
  device sums the clipped gradients of its records and `psum` combines the
  sums. The update (`packed.PartsUpdate`: noise, then Adam) runs replicated:
  one noise draw per step. `accumulate` and `loss_sum` compile once per
  microbatch length (`cycle`'s length buckets), and every bucket's sums add
  up before the one update.
  """

  def __init__(
      self,
      model: nn.Module,
      phase: Phase,
      *,
      mesh: Mesh,
      expert_layer: int,
      num_experts: int,
      learning_rate: float,
      residual: str,
      residual_gamma: float,
      key: jax.Array,
  ):
    super().__init__(phase.parts, learning_rate=learning_rate, key=key)
    self.model, self.phase = model, phase
    self._differentiated = phase.parts + phase.clip_with
    self.expert_layer, self.num_experts = expert_layer, num_experts
    self.residual, self.residual_gamma = residual, residual_gamma
    self.accumulate = _data_parallel(
        self._accumulate, mesh, 3, donate_argnums=(2,)
    )
    self.loss_sum = _data_parallel(self._loss_sum, mesh, 2)
    self.zero_sums = jax.jit(
        self._zero_sums, out_shardings=NamedSharding(mesh, PartitionSpec())
    )

  def _zero_sums(self, trainable: Mapping[str, Flat]) -> dict[str, Flat]:
    """Float32 zeros shaped like the phase's sums: a step with no record is noise only."""
    return {
        p.name: grads.zeros_like_f32(trainable[p.name])
        for p in self.phase.parts
    }

  def _record_loss(self, dense, slices, constants, record) -> jax.Array:
    """Loss of ONE record; `slices` are its owner slices (owner parts)."""
    override = None
    if slices:  # at most one owner part: the experts of layer l*
      (part_slices,) = slices.values()
      override = OwnerOverride(
          self.expert_layer,
          record["owners"],
          _owner_params(part_slices, self.expert_layer),
      )
    logits, _ = self.model.apply(
        {"params": merged_params(constants, dense)},
        record["input_ids"][None],
        record["attention_mask"][None],
        owner_override=override,
    )
    return cross_entropy(logits[0], record["labels"])

  def _residual_weights(self, params_flat: Flat, batch: Batch) -> jax.Array:
    """w_i = (1 - softmax(z_i)[y_i]) ** gamma without gradient (Eq. 8):
    'shared' from the model with l*'s expert updates off
    (`with_expert_updates_off`), 'full' from the current model."""
    if self.residual == "shared":
      params_flat = with_expert_updates_off(params_flat, self.expert_layer)

    # Record by record, exactly as the gradient's forward runs (vmap over
    # B = 1): the blocks below l* are then the same computation in both, and
    # XLA computes them once (CSE) instead of twice.
    def record_logits(ids, mask):
      logits, _ = self.model.apply(
          {"params": roles.unflatten(params_flat)}, ids[None], mask[None]
      )
      return logits[0]

    logits = jax.vmap(record_logits)(
        batch["input_ids"], batch["attention_mask"]
    )
    return grads.residual_weights(logits, batch["labels"], self.residual_gamma)

  def _accumulate(self, trainable, frozen, sums, batch, mask):
    """sums + this device's clipped per-record gradient sums (float32),
    psummed over the devices."""
    local = self._local_sums(trainable, frozen, batch, mask)
    return jax.tree.map(jnp.add, sums, jax.lax.psum(local, AXIS))

  def _split(
      self, trainable: Mapping[str, Flat], frozen: Flat
  ) -> tuple[dict, Flat]:
    """(the dense parts differentiated here, everything else as constants).

    Differentiated: the phase's parts and its `clip_with` parts. Owner parts'
    stacked experts are constants too: they run in the forward pass, while
    the gradient goes to per-record owner slices.
    """
    dense = {
        p.name: trainable[p.name] for p in self._differentiated if not p.owner
    }
    constants = merged_flat(
        frozen, {n: v for n, v in trainable.items() if n not in dense}
    )
    return dense, constants

  def released_per_record(self, trainable, frozen, batch, mask):
    """Each record's contribution to the phase's sums, per part (float32).

    Per-record gradients (owner parts: with respect to the record's owner
    slice), times the residual weight where the part uses it, clipped as
    the phase clips; padding and non-finite records are exactly zero; with
    `clip_with` parts, only the phase's own parts, each a piece of a vector
    of norm <= C. A non-private phase: the raw gradients, masked.
    Diagnostics read these; the trainer's sums come from `_local_sums`.
    """
    per_record = self._per_record_grads(trainable, frozen, batch)
    if not self.phase.private:
      f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)
      return {
          n: grads.scale_records(f32(g), mask) for n, g in per_record.items()
      }
    return self._clip_and_sum(per_record, mask, keep_batch_dim=True)

  def _per_record_grads(self, trainable, frozen, batch) -> dict[str, Flat]:
    """Per part, each record's gradient times its residual weight where used."""
    parts = self._differentiated
    dense, constants = self._split(trainable, frozen)
    slices = {
        p.name: grads.owner_slices(trainable[p.name], batch["owners"])
        for p in parts
        if p.owner
    }
    dense_grads, slice_grads = jax.vmap(
        jax.grad(self._record_loss, argnums=(0, 1)), in_axes=(None, 0, None, 0)
    )(dense, slices, constants, batch)
    per_record = {**dense_grads, **slice_grads}
    if self.residual != "none" and any(p.residual for p in parts):
      weights = self._residual_weights(merged_flat(constants, dense), batch)
      for part in parts:
        if part.residual:
          per_record[part.name] = grads.scale_records(
              per_record[part.name], weights
          )
    return per_record

  def _clip_and_sum(
      self, per_record, mask, owners=None, *, keep_batch_dim=False
  ):
    """`grads.clip_and_sum` as the phase clips: one norm over everything in
    `per_record` (joint: the phase's and its `clip_with` parts) or one per
    part; owner parts sum into their owner's row of [E, ...]. Only the
    phase's own parts are returned."""
    parts = self.phase.parts
    if self.phase.joint_clip:
      l2_clip = parts[0].l2_clip
    else:
      l2_clip = {p.name: p.l2_clip for p in parts}
      per_record = {p.name: per_record[p.name] for p in parts}
    out = grads.clip_and_sum(
        dict(per_record),
        l2_clip,
        mask=mask,
        owners=owners,
        num_experts=self.num_experts,
        owner_parts={p.name for p in self._differentiated if p.owner},
        keep_batch_dim=keep_batch_dim,
    )
    return {p.name: out[p.name] for p in parts}

  def _local_sums(self, trainable, frozen, batch, mask):
    """This device's clipped per-record gradient sums (float32); for a
    non-private phase the plain gradient of the summed, unclipped loss."""
    if self.phase.private:
      per_record = self._per_record_grads(trainable, frozen, batch)
      return self._clip_and_sum(per_record, mask, batch["owners"])
    dense, constants = self._split(trainable, frozen)
    loss = lambda d: summed_loss(
        self.model, merged_params(constants, d), batch, mask
    )
    return jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(dense))

  def _loss_sum(self, trainable, frozen, batch, mask) -> jax.Array:
    """Summed training loss of the records (NOT private; opt-in logging only)."""
    params = merged_params(frozen, trainable)
    return jax.lax.psum(summed_loss(self.model, params, batch, mask), AXIS)


def make_eval_fn(model: nn.Module) -> Callable:
  """Jitted batched logits of the current parameters."""

  @jax.jit
  def logits_fn(trainable, frozen, input_ids, attention_mask):
    logits, _ = model.apply(
        {"params": merged_params(frozen, trainable)}, input_ids, attention_mask
    )
    return logits

  return logits_fn


class StepState(NamedTuple):
  """The state `PhaseStep` threads: replicated on its mesh.

  Attributes:
    trainable: {part name: {path: array}} the phase's parts.
    frozen: {path: array} every other parameter.
    opt_state: {part name: state of chain(privatize_sums, adam)}; holds the
      secret noise key: as private as the training data.
  """

  trainable: dict[str, Flat]
  frozen: Flat
  opt_state: dict[str, Any]


class PhaseStep:
  """One phase's DP step, exactly as the trainer runs it.

  Usage::

      phase = run.plan.phases[0]   # or plans.Phase(name=..., stream=..., parts=(...))
      dp = PhaseStep(model, phase, key=jax.random.key(0), learning_rate=1e-3)
      state = dp.init(params)      # the classifier's full parameter tree
      sums = dp.zero_sums(state)
      for batch, mask in microbatches:  # fixed-size; dict of input_ids,
        sums = dp.accumulate(state, sums, batch, mask)  # attention_mask, labels, owners
      state = dp.update(state, sums)   # noise drawn once, then Adam
      params = dp.params(state)

  `accumulate` adds the microbatch's clipped per-record gradient sums (float32,
  psum over the mesh's devices); `update` makes the phase's one noisy update.
  Guarantee (private phase): each record moves the sums of each part by at
  most its clip norm (jointly for `joint_clip`, with `clip_with` parts
  inside the norm but not released), and `update` adds Gaussian
  noise of std sigma * C to every element before dividing by the public
  denominator; with a Poisson sample per step (`sampling.poisson_sample`) it
  is the subsampled Gaussian mechanism the ledger accounts for. Call
  `update` once per sample, never per microbatch.

  Args:
    model: the classifier (`models.SequenceClassifier`).
    key: secret PRNG key (`jax.random.key(seed)` or a raw `PRNGKey`, or
      several stacked for 128 bits as the trainer's `secrecy.noise_key`);
      part i of the phase draws its noise from `transforms.fold_in(key, i)`.
    mesh: a 1-D 'data' mesh (`parallel.make_mesh`; default: every device).
    expert_layer: l* (default: the block of the phase's owner part, else the
      last sparse block).
    residual, residual_gamma: the residual weight (Eq. 8): 'none', 'shared'
      or 'full', and gamma.
  """

  def __init__(
      self,
      model: nn.Module,
      phase: Phase,
      *,
      key: jax.Array,
      learning_rate: float = 1e-3,
      mesh: Mesh | None = None,
      expert_layer: int | None = None,
      residual: str = "none",
      residual_gamma: float = 1.0,
  ):
    bc = model.backbone.config
    if expert_layer is None:
      blocks = [
          part.blocks[0] for part in phase.parts if part.owner and part.blocks
      ]
      expert_layer = blocks[0] if blocks else bc.sparse_layers[-1]
    self.mesh = mesh if mesh is not None else parallel.make_mesh()
    self.phase = phase
    self.functions = PhaseFunctions(
        model,
        phase,
        mesh=self.mesh,
        expert_layer=expert_layer,
        num_experts=bc.num_experts,
        learning_rate=learning_rate,
        residual=residual,
        residual_gamma=residual_gamma,
        key=key,
    )

  def init(self, params: Mapping[str, Any]) -> StepState:
    """Splits `params` into the phase's parts and the rest; fresh optimizer states."""
    trainable, frozen = setup.partition(
        params, self.phase.parts + self.phase.clip_with
    )
    opt_state = self.functions.init_opt_states(trainable)
    return StepState(
        *parallel.replicate((trainable, frozen, opt_state), self.mesh)
    )

  def zero_sums(self, state: StepState) -> dict[str, Flat]:
    """Float32 zero sums: the start of every step."""
    return self.functions.zero_sums(state.trainable)

  def accumulate(
      self,
      state: StepState,
      sums: dict[str, Flat],
      batch: Batch,
      mask: Any = None,
  ) -> dict[str, Flat]:
    """`sums` + the clipped gradient sums of one microbatch of host records.

    `batch`: input_ids, attention_mask, labels, owners (int [n], zeros when no
    part uses owners); `mask`: [n], 1 real, 0 padding (default: all real).
    n must be a multiple of the mesh's devices and fixed (one compilation).
    `sums` is donated: use the returned sums.
    """
    n = len(batch["labels"])
    mask = jnp.ones((n,), jnp.float32) if mask is None else mask
    placed, placed_mask = parallel.shard_records((dict(batch), mask), self.mesh)
    return self.functions.accumulate(
        state.trainable, state.frozen, sums, placed, placed_mask
    )

  def update(self, state: StepState, sums: Mapping[str, Flat]) -> StepState:
    """The phase's one noisy DP-Adam update from the step's total sums."""
    trainable, opt_state = self.functions.update(
        state.trainable, state.opt_state, sums
    )
    return StepState(trainable, state.frozen, opt_state)

  def params(self, state: StepState) -> dict:
    """The full nested parameter tree of `state`."""
    return merged_params(state.frozen, state.trainable)
