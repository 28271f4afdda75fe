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

from raptor_jax import grads, roles, transforms
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


class PhaseFunctions:
  """Builds the jitted microbatch-sum and update functions of one phase.

  `accumulate` runs under `shard_map` on a 1-D 'data' mesh: each device sums
  the clipped gradients of its records, `psum` combines the sums, and the
  result is replicated. `update` then runs replicated: one noise draw per
  step from one PRNG state, identical parameters on every device.

  Length buckets: `accumulate` (and `loss_sum`) take microbatches of any
  fixed sequence length; jit compiles one executable per length (per
  (phase, bucket)), and the sums of every bucket's microbatches add up
  before the one `update`, so the release is the same function of the
  sample as with every record at max_length.
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
    self.model = model
    self.phase = phase
    self._differentiated = phase.parts + phase.clip_with
    self.expert_layer = expert_layer
    self.num_experts = num_experts
    self.residual = residual
    self.residual_gamma = residual_gamma
    # Per part, as README documents: chain(privatize_sums, adam). The noise
    # key of part i is fold_in(key, i): distinct and secret per transform.
    self.privatizers = {
        part.name: transforms.privatize_sums(
            part.l2_clip,
            part.noise_multiplier,
            part.denominator,
            transforms.fold_in(key, i),
        )
        for i, part in enumerate(phase.parts)
    }
    self.optimizers = {
        name: optax.chain(privatizer, optax.adam(learning_rate))
        for name, privatizer in self.privatizers.items()
    }
    replicated, records = PartitionSpec(), PartitionSpec(AXIS)
    self.accumulate = jax.jit(
        jax.shard_map(
            self._accumulate,
            mesh=mesh,
            in_specs=(replicated, replicated, replicated, records, records),
            out_specs=replicated,
            check_vma=False,
        ),
        donate_argnums=(2,),
    )
    self.packed_update = jax.jit(self._packed_update)
    self.unpack = jax.jit(self._unpack, static_argnums=0)
    self.loss_sum = jax.jit(
        jax.shard_map(
            self._loss_sum,
            mesh=mesh,
            in_specs=(replicated, replicated, records, records),
            out_specs=replicated,
            check_vma=False,
        )
    )
    self.zero_sums = jax.jit(
        self._zero_sums, out_shardings=NamedSharding(mesh, replicated)
    )

  # -- per-record losses ------------------------------------------------------

  def _zero_sums(self, trainable: Mapping[str, Flat]) -> dict[str, Flat]:
    """Float32 zeros shaped like the phase's sums: a step with no record is noise only."""
    return {
        p.name: grads.zeros_like_f32(trainable[p.name])
        for p in self.phase.parts
    }

  def _record_loss(
      self,
      dense: Mapping[str, Flat],
      slices: Mapping[str, Flat],
      constants: Flat,
      record: Batch,
  ) -> jax.Array:
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
    """w_i = (1 - softmax(z_i)[y_i]) ** gamma without gradient (Eq. 8).

    'shared' logits come from the model with the expert stream's updates of
    layer l* switched off (its adapters' B factors at zero, their initial
    value); 'full' uses the current model. Full-weight experts have no B
    factor to zero, so 'shared' refuses them (a trained kernel would leak
    into the "shared-only" logits otherwise).
    """
    if self.residual == "shared":
      prefix = roles.expert_prefix(self.expert_layer)
      if not any(
          p.startswith(prefix) and p.endswith("lora_b") for p in params_flat
      ):
        raise ValueError(
            "residual='shared' switches l*'s expert updates off by zeroing "
            "their LoRA B factors, and l* has none (full-weight experts); "
            "use residual='full' or 'none'"
        )
      params_flat = {
          p: (
              jnp.zeros_like(v)
              if p.startswith(prefix) and p.endswith("lora_b")
              else v
          )
          for p, v in params_flat.items()
      }

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

  # -- the two jitted functions -------------------------------------------------

  def _accumulate(
      self,
      trainable: Mapping[str, Flat],
      frozen: Flat,
      sums: Mapping[str, Flat],
      batch: Batch,
      mask: jax.Array,
  ):
    """sums + this microbatch's clipped per-record gradient sums (float32).

    Runs per device on its records; the devices' sums are combined by psum.
    """
    return jax.tree.map(
        jnp.add,
        sums,
        jax.lax.psum(self._local_sums(trainable, frozen, batch, mask), AXIS),
    )

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
    constants = dict(frozen)
    for name, part_params in trainable.items():
      if name not in dense:
        constants.update(part_params)
    return dense, constants

  def released_per_record(
      self,
      trainable: Mapping[str, Flat],
      frozen: Flat,
      batch: Batch,
      mask: jax.Array,
  ) -> dict[str, Flat]:
    """Each record's contribution to the phase's sums, per part (float32).

    Per-record gradients (owner parts: with respect to the record's owner
    slice), multiplied by the residual weight where the part uses it, then
    clipped as the phase clips (jointly or per part); padding and non-finite
    records are exactly zero. With `clip_with` parts (the full-model clip),
    their gradients join the joint norm and are then dropped: only the
    phase's own parts are returned, each a piece of a vector of norm <= C.
    For a non-private phase: the raw gradients, masked. Diagnostics read
    these; the trainer's sums come from `_local_sums`.
    """
    per_record = self._per_record_grads(trainable, frozen, batch)
    if not self.phase.private:
      return {
          name: grads.scale_records(
              jax.tree.map(lambda g: g.astype(jnp.float32), g_part), mask
          )
          for name, g_part in per_record.items()
      }
    return self._clip_and_sum(per_record, mask, keep_batch_dim=True)

  def _per_record_grads(
      self, trainable: Mapping[str, Flat], frozen: Flat, batch: Batch
  ) -> dict[str, Flat]:
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
      self,
      per_record: Mapping[str, Flat],
      mask: jax.Array,
      owners: jax.Array | None = None,
      *,
      keep_batch_dim: bool = False,
  ) -> dict[str, Flat]:
    """`grads.clip_and_sum` as the phase clips: jointly or per part.

    A joint clip takes one norm over everything in `per_record` (the phase's
    parts and its `clip_with` parts); only the phase's parts are returned.
    Owner parts are summed into their owner's row of [E, ...].
    """
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

  def _local_sums(
      self,
      trainable: Mapping[str, Flat],
      frozen: Flat,
      batch: Batch,
      mask: jax.Array,
  ):
    """This device's clipped per-record gradient sums (float32)."""
    if not self.phase.private:
      return self._nonprivate_sums(*self._split(trainable, frozen), batch, mask)
    return self._clip_and_sum(
        self._per_record_grads(trainable, frozen, batch), mask, batch["owners"]
    )

  def _loss_sum(self, trainable, frozen, batch, mask) -> jax.Array:
    """Summed training loss of the records (NOT private; opt-in logging only)."""
    logits, _ = self.model.apply(
        {"params": merged_params(frozen, trainable)},
        batch["input_ids"],
        batch["attention_mask"],
    )
    return jax.lax.psum(
        jnp.sum(cross_entropy(logits, batch["labels"]) * mask), AXIS
    )

  def _nonprivate_sums(self, dense, constants, batch, mask):
    """Plain gradient of the summed (unclipped) loss: the non-private bounds."""

    def total_loss(dense):
      logits, _ = self.model.apply(
          {"params": merged_params(constants, dense)},
          batch["input_ids"],
          batch["attention_mask"],
      )
      return jnp.sum(cross_entropy(logits, batch["labels"]) * mask)

    return jax.tree.map(
        lambda g: g.astype(jnp.float32), jax.grad(total_loss)(dense)
    )

  def update(
      self,
      trainable: dict[str, Flat],
      opt_states: dict[str, Any],
      sums: Mapping[str, Flat],
  ):
    """One noisy DP-Adam update of every part of the phase (noise drawn once).

    Each part's `optax.chain(privatize_sums, adam)` adds N(0, (sigma C)^2) to
    its clipped sums, divides by the public denominator, then takes the Adam
    step: the release is the privatized sum, Adam is post-processing. The
    update runs on each part's packed vector (`train.packed`: one program
    whatever the number of leaves), then a program of slices unpacks it.

    Returns:
      (trainable with the phase's parts updated, opt_states).
    """
    new, opt_states = self.packed_update(trainable, opt_states, sums)
    layouts = self.layouts(trainable)
    unpacked = self.unpack(
        tuple(sorted(layouts.items())), {n: new.pop(n) for n in layouts}
    )
    return {**trainable, **new, **unpacked}, opt_states

  def layouts(self, trainable: Mapping[str, Flat]) -> dict[str, packed.Layout]:
    """The packed layout of each part of the phase that packs (one dtype)."""
    out = {}
    for part in self.phase.parts:
      layout = packed.Layout.of(trainable[part.name])
      if layout is not None:
        out[part.name] = layout
    return out

  def _packed_update(
      self,
      trainable: Mapping[str, Flat],
      opt_states: dict[str, Any],
      sums: Mapping[str, Flat],
  ):
    """({part: new packed vector, or new leaves if it does not pack},
    new opt_states): `update` before unpacking."""
    layouts, opt_states, out = self.layouts(trainable), dict(opt_states), {}
    for part in self.phase.parts:
      params, part_sums = trainable[part.name], sums[part.name]
      layout = layouts.get(part.name)
      if layout is not None:
        params = layout.pack(params)
        part_sums = layout.pack(part_sums, jnp.float32)
      updates, opt_states[part.name] = self.optimizers[part.name].update(
          part_sums, opt_states[part.name], params
      )
      out[part.name] = optax.apply_updates(params, updates)
    return out, opt_states

  @staticmethod
  def _unpack(layouts, vectors) -> dict[str, Flat]:
    """{part: leaves} of the packed vectors; `layouts`: sorted (part,
    `packed.Layout`) pairs (static)."""
    layouts = dict(layouts)
    return {name: layouts[name].unpack(v) for name, v in vectors.items()}

  def init_opt_states(self, trainable: Mapping[str, Flat]) -> dict[str, Any]:
    """Per part: the chain's state (noise transform's PRNG state, Adam
    state), over the part's packed vector where it packs."""
    layouts = self.layouts(trainable)
    return {
        p.name: self.optimizers[p.name].init(
            layouts[p.name].pack(trainable[p.name])
            if p.name in layouts
            else trainable[p.name]
        )
        for p in self.phase.parts
    }


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
    phase: a `plans.Phase`.
    key: secret PRNG key (`jax.random.key(seed)` or a raw `PRNGKey`, or
      several stacked for 128 bits as the trainer's `secrecy.noise_key`);
      part i of the phase draws its noise from `transforms.fold_in(key, i)`.
    learning_rate: Adam's learning rate.
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
