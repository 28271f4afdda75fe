"""Differentially private aggregation as optax gradient transformations.

Three transforms share one state type and ONE noise code path:

* ``privatize_sums``: input already-clipped float32 sums (e.g. accumulated
  over microbatches with ``grads.clipped_grad_sum``); adds Gaussian noise of
  std ``noise_multiplier * l2_clip`` to every element and divides by a public
  denominator.
* ``dp_aggregate``: input per-record gradients; clips each record, sums, then
  ``privatize_sums``. The DP-SGD aggregation (Eq. 7 of the RAPTOR paper).
* ``owner_dp_aggregate``: input per-record gradients of each record's owner
  expert slice; clips each record, sums by owner, then ``privatize_sums`` with
  independent noise for every expert, including experts that got no record
  (Eq. 9).

All are ``optax.GradientTransformationExtraArgs``: jittable, and chainable
with any optimizer, e.g. ``optax.chain(dp_aggregate(...), optax.adam(lr))``.
They must come first in the chain, since they consume per-record gradients
(or sums) and produce the privatized update. Sums, noise and outputs are
float32 whatever the gradients' dtype; ``optax.apply_updates`` casts the final
update to each parameter's dtype.

Privacy. Under add/remove of one record (or turning one record into padding),
the clipped sums move by at most ``l2_clip`` in l2 norm, so the released
``(sums + N(0, (noise_multiplier * l2_clip)^2 I)) / denominator`` is the
Gaussian mechanism with sensitivity ``l2_clip / denominator`` and noise
multiplier ``noise_multiplier``; with Poisson sampling (``sampling``) one step
is the Poisson-subsampled Gaussian mechanism that ``accounting`` composes. The
denominator is a public constant (e.g. the expected batch size B, or B/E for
the experts), never a realised count, so it reveals nothing. Noise is a
deterministic function of ``(key, step count)``: a run resumed from a saved
state reproduces it. The key must be secret and distinct per transform (split
one key per stream): two transforms sharing a key add identical noise. A
threefry key holds 64 bits; for 128, pass several independent keys stacked
on a leading axis (``[K]`` typed keys or raw ``uint32[K, 2]``): the noise is
then ``sum_k N_k / sqrt(K)`` with one independent standard normal draw
``N_k`` per key, again exactly ``N(0, 1)`` per element, and reproducing it
needs every key. Threefry is counter based, so the draws are the same on any
device count and backend.
``noise_multiplier=0`` turns the noise off, for tests and non-private
baselines only; it gives no privacy.

Gradient accumulation. Do NOT wrap these transforms (or a chain holding them)
in ``optax.MultiSteps``. ``MultiSteps`` calls the inner ``update`` on every
micro-step with the running *mean* of the inputs seen so far, draws the noise
each time, and keeps only the k-th result. The transforms would then privatize
a mean of sums rather than the step's sum (so the release is not the
``(sum + noise) / denominator`` the accountant is told about), and
``dp_aggregate`` / ``owner_dp_aggregate`` would average *different* records
row by row and apply only the last micro-step's ``mask`` and ``owners`` to all
of them, which voids the one-record sensitivity bound above. To accumulate
over microbatches, add their clipped sums (``grads.clipped_grad_sum``) and
call ``privatize_sums`` once per step: one step, one noise draw, one
accounted release. The transforms refuse to run inside ``MultiSteps`` (one
line), and ``dp_aggregate`` / ``owner_dp_aggregate`` refuse an update that is
not the parameter tree plus one leading record axis (a mean gradient).

The front door, ``raptor_jax.make_private`` (``raptor_jax.private``;
``make_private_experts`` for expert streams), assembles the four pieces in
one call, as Opacus's ``make_private_with_epsilon`` does: the noise
multiplier calibrated to a target epsilon, this transform, the Poisson
microbatches and an accountant whose ``epsilon()`` reports the spend.
"""

import inspect
import numbers
import sys
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import _validate
from raptor_jax import grads as grads_lib

PyTree = Any


class DpAggregateState(NamedTuple):
  """The step count and the fixed base key that select each step's noise."""

  count: jax.Array  # int32 [], steps taken so far
  rng_key: jax.Array  # PRNG key, fixed; step t draws from fold_in(rng_key, t)


def _public_number(name: str, value, *, allow_zero: bool = False) -> float:
  check = _validate.non_negative if allow_zero else _validate.positive
  return check(name, value, _validate.PUBLIC_NUMBER)


def _single_key_ndim(key: jax.Array) -> int:
  """The ndim of ONE key of `key`'s kind: 0 typed, 1 raw (`uint32[2]`)."""
  return 0 if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else 1


def _canonical_key(key: Union[jax.Array, int]) -> jax.Array:
  if isinstance(key, numbers.Integral) and not isinstance(key, bool):
    return jax.random.key(int(key))
  if isinstance(key, jax.Array) and (
      0 <= key.ndim - _single_key_ndim(key) <= 1
  ):
    return key
  _validate.fail(
      'key',
      'a jax PRNG key, several stacked on a leading axis, or an int',
      _validate.Shown(
          f'a {type(key).__name__} of shape {getattr(key, "shape", None)}'
      ),
      'pass jax.random.key(seed), or jax.random.split(key) for 128 bits',
  )


def fold_in(key: jax.Array, data) -> jax.Array:
  """`jax.random.fold_in` of each key of `key` (one, or several stacked)."""
  if key.ndim == _single_key_ndim(key):
    return jax.random.fold_in(key, data)
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(key, data)


def _normal_like(key: jax.Array, like: PyTree) -> PyTree:
  """Float32 N(0, 1) noise shaped like `like` from ONE key.

  One flat draw of as many elements as `like` holds, cut into its leaves in
  order: every element is an independent standard normal, as with one
  draw per leaf, and the program hashes the key once (one threefry) however
  many leaves there are. A tree of one leaf (a packed vector,
  `train.packed`) then compiles one sampler.
  """
  leaves, treedef = jax.tree.flatten(like)
  sizes = [int(np.prod(jnp.shape(leaf), dtype=np.int64)) for leaf in leaves]
  flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
  cuts = np.cumsum(sizes)[:-1].tolist()
  return treedef.unflatten(
      [
          part.reshape(jnp.shape(leaf))
          for part, leaf in zip(jnp.split(flat, cuts), leaves)
      ]
  )


def _standard_normal(key: jax.Array, like: PyTree) -> PyTree:
  """N(0, 1) noise shaped like `like`: the normalised sum of one draw per key."""
  if key.ndim == _single_key_ndim(key):
    return _normal_like(key, like)
  draws = [_normal_like(k, like) for k in key]
  scale = 1.0 / len(draws) ** 0.5
  return jax.tree.map(lambda *d: sum(d) * scale, *draws)


# optax.MultiSteps's source file: an update called from it is refused.
_MULTISTEPS_FILE = inspect.getsourcefile(optax.MultiSteps)


def _refuse_multisteps(name: str) -> None:
  """Refuses to run inside ``optax.MultiSteps`` (module docstring: it would
  privatize a running mean, voiding the guarantee). Python-level, so it runs
  when the update is traced, not on every step of a jitted loop."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None:
    code = frame.f_code
    if code.co_filename == _MULTISTEPS_FILE and 'MultiSteps' in getattr(
        code, 'co_qualname', 'MultiSteps'
    ):
      raise ValueError(
          f'{name}: must not run inside optax.MultiSteps (it hands the'
          ' transform a running mean of its inputs, not one step of'
          ' per-record gradients or sums, and the guarantee is void);'
          ' accumulate microbatch sums with grads.clipped_grad_sum and call'
          ' privatize_sums once per step'
      )
    frame = frame.f_back


def _shape_of(leaf) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))


def _check_per_record(
    name: str, updates: PyTree, reference: PyTree, mask, *, sliced: bool
) -> None:
  """Refuses updates that are not per-record gradients (one line).

  Per-record gradients are the parameter tree with ONE leading record axis
  (``sliced``: of each expert's slice, the parameters' leading expert axis
  replaced by the record axis). A mean gradient (the parameter tree itself)
  would be taken as records and clipped row by row: the one-record bound,
  hence the guarantee, would not hold.
  """
  fix = (
      'pass per-record gradients, e.g. jax.vmap(jax.grad(loss),'
      ' in_axes=(None, 0))(params, batch), not a mean gradient'
  )
  if sliced:
    fix = (
        'pass per-record gradients of the owner slices,'
        ' jax.vmap(jax.grad(loss))(grads.owner_slices(params, owners), batch)'
    )
  if jax.tree.structure(updates) != jax.tree.structure(reference):
    _validate.fail(
        f'{name} updates',
        'the parameter tree with one leading record axis',
        _validate.Shown(f'a tree of structure {jax.tree.structure(updates)}'),
        fix,
    )
  records = set()
  for (path, leaf), ref in zip(
      jax.tree_util.tree_flatten_with_path(updates)[0],
      jax.tree.leaves(reference),
  ):
    want = tuple(jnp.shape(ref))[1:] if sliced else tuple(jnp.shape(ref))
    shape = tuple(jnp.shape(leaf))
    _validate.check(
        len(shape) == len(want) + 1 and shape[1:] == want,
        f'{name} updates{jax.tree_util.keystr(path)}',
        f'per-record gradients of shape (n, *{want})',
        _validate.Shown(f'shape {shape}'),
        fix,
    )
    records.add(shape[0])
  if mask is not None:
    records.add(jnp.shape(mask)[0] if jnp.ndim(mask) == 1 else -1)
  _validate.check(
      len(records) <= 1,
      f'{name} updates',
      'one record count n on every leaf (and the mask)',
      _validate.Shown(f'counts {sorted(records)}'),
      fix,
  )


def _guarded(name: str, privatizer, *, sliced: bool) -> tuple[Any, Any]:
  """(init_fn, guard) of a per-record transform: init records the parameter
  shapes; guard(updates, params, mask) refuses `optax.MultiSteps` and
  updates without a record axis (`_check_per_record`)."""
  shapes = {}

  def init_fn(params):
    shapes['params'] = jax.tree.map(_shape_of, params)
    return privatizer.init(params)

  def guard(updates, params, mask):
    _refuse_multisteps(name)
    reference = params if params is not None else shapes.get('params')
    if reference is not None:
      _check_per_record(name, updates, reference, mask, sliced=sliced)

  return init_fn, guard


def _privatize(
    sums: PyTree,
    state: DpAggregateState,
    *,
    l2_clip: float,
    noise_multiplier: float,
    denominator: float,
) -> tuple[PyTree, DpAggregateState]:
  """The one noise code path: (sums + N(0, (sigma C)^2)) / denominator."""
  sums = jax.tree.map(lambda s: jnp.asarray(s, jnp.float32), sums)
  std = noise_multiplier * l2_clip
  if std > 0:
    step_key = fold_in(state.rng_key, state.count)
    noise = _standard_normal(step_key, sums)
    sums = optax.tree.add_scale(sums, std, noise)
  updates = jax.tree.map(lambda s: s / denominator, sums)
  return updates, DpAggregateState(
      count=optax.safe_increment(state.count), rng_key=state.rng_key
  )


def privatize_sums(
    l2_clip: float,
    noise_multiplier: float,
    denominator: float,
    key: Union[jax.Array, int],
) -> optax.GradientTransformationExtraArgs:
  """Adds Gaussian noise to clipped gradient sums and divides by a constant.

  Use it when the sums are accumulated over microbatches: compute each
  microbatch's sum with ``grads.clipped_grad_sum`` (or
  ``grads.owner_clipped_grad_sum``), add them up, then call ``update`` once
  per step, so noise is drawn once per step. Under data parallelism, reduce
  the sums across devices first and privatize the total (replicated, every
  device draws the same noise from the same state), never per device. It
  refuses ``optax.MultiSteps`` (module docstring): accumulate sums instead.

  Precondition (the caller's part of the guarantee): adding or removing one
  record changes the input sums by at most ``l2_clip`` in l2 norm, as the
  ``grads`` sums ensure; for owner sums ``[E, ...]`` one record touches one
  expert's slice only. Then every output element gets independent noise of
  std ``noise_multiplier * l2_clip / denominator`` and the release has
  sensitivity ``l2_clip / denominator``: the Gaussian mechanism with noise
  multiplier ``noise_multiplier``.

  Args:
    l2_clip: the clipping norm C the sums were built with (public, > 0).
    noise_multiplier: sigma, noise std in units of C (>= 0; 0 = no noise, no
      privacy, for tests and non-private baselines).
    denominator: public constant the noisy sum is divided by (e.g. the
      expected batch size B, or B/E for the experts); never a realised count.
    key: secret PRNG key, distinct for every transform instance; several
      stacked on a leading axis for more than 64 bits (module docstring).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update(sums, state,
    params=None)`` returns float32 updates shaped like ``sums``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from raptor_jax import grads, transforms
    >>> params = {'w': jnp.zeros(3)}
    >>> loss_fn = lambda p, record: jnp.sum((p['w'] - record['x']) ** 2)
    >>> batch = {'x': jnp.ones((8, 3))}
    >>> tx = optax.chain(
    ...     transforms.privatize_sums(1.0, 1.1, 8.0, jax.random.key(0)),
    ...     optax.adam(1e-3))
    >>> state = tx.init(params)
    >>> sums = grads.zeros_like_f32(params)
    >>> for micro in (batch['x'][:4], batch['x'][4:]):  # two microbatches
    ...   micro_sum, _ = grads.clipped_grad_sum(
    ...       loss_fn, params, {'x': micro}, l2_clip=1.0)
    ...   sums = optax.tree.add(sums, micro_sum)
    >>> updates, state = tx.update(sums, state, params)  # noise once per step
    >>> params = optax.apply_updates(params, updates)
    >>> params['w'].shape, params['w'].dtype
    ((3,), dtype('float32'))
  """
  l2_clip = _public_number('l2_clip', l2_clip)
  noise_multiplier = _public_number(
      'noise_multiplier', noise_multiplier, allow_zero=True
  )
  denominator = _public_number('denominator', denominator)
  key = _canonical_key(key)

  def init_fn(params):
    del params
    return DpAggregateState(count=jnp.zeros([], jnp.int32), rng_key=key)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    _refuse_multisteps('privatize_sums')
    return _privatize(
        updates,
        state,
        l2_clip=l2_clip,
        noise_multiplier=noise_multiplier,
        denominator=denominator,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dp_aggregate(
    l2_clip: float,
    noise_multiplier: float,
    denominator: float,
    key: Union[jax.Array, int],
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD aggregation of per-record gradients (RAPTOR Eq. 7).

  ``update(per_record_grads, state, params=None, *, mask=None)`` returns
  ``(sum_i mask_i * clip(g_i, l2_clip) + N(0, (sigma * l2_clip)^2 I)) /
  denominator`` in float32, with ``clip`` to global l2 norm per record
  (``grads.clip_per_record``: records with NaN/inf gradients count as zero).

  Guarantee: adding or removing one record, or masking it as padding, changes
  the noiseless output by at most ``l2_clip / denominator`` in l2 norm, and
  the noise has std ``noise_multiplier * l2_clip / denominator`` per element:
  the Gaussian mechanism with noise multiplier ``noise_multiplier``.

  Call ``update`` once per step with the whole sample; for a sample split into
  microbatches use ``grads.clipped_grad_sum`` and ``privatize_sums``, never
  ``optax.MultiSteps``, which would average different records row by row and
  mask them all with the last micro-step's ``mask`` (see the module
  docstring).

  Args:
    l2_clip: per-record clipping norm C (public, > 0).
    noise_multiplier: sigma (>= 0; 0 = no noise, no privacy).
    denominator: public constant, e.g. the expected batch size B; never a
      realised count.
    key: secret PRNG key, distinct for every transform instance; several
      stacked on a leading axis for more than 64 bits (module docstring).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``update`` takes
    per-record gradients (leaves ``[n, ...]``) and an optional ``mask``
    ``[n]`` (1 real record, 0 padding), and returns leaves ``[...]``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from raptor_jax import transforms
    >>> params = {'w': jnp.zeros(3)}
    >>> loss_fn = lambda p, record: jnp.sum((p['w'] - record['x']) ** 2)
    >>> batch = {'x': jnp.ones((4, 3))}
    >>> mask = jnp.array([1.0, 1.0, 1.0, 0.0])  # the last row is padding
    >>> tx = optax.chain(
    ...     transforms.dp_aggregate(1.0, 1.1, 4.0, jax.random.key(0)),
    ...     optax.adam(1e-3))
    >>> state = tx.init(params)
    >>> g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, batch)
    >>> updates, state = tx.update(g, state, params, mask=mask)
    >>> jax.tree.map(jnp.shape, updates)
    {'w': (3,)}
  """
  privatizer = privatize_sums(l2_clip, noise_multiplier, denominator, key)
  init_fn, guard = _guarded('dp_aggregate', privatizer, sliced=False)

  def update_fn(updates, state, params=None, *, mask=None, **extra_args):
    del extra_args
    guard(updates, params, mask)
    clipped, _ = grads_lib.clip_per_record(updates, l2_clip, mask)
    sums = jax.tree.map(lambda g: jnp.sum(g, axis=0), clipped)
    return privatizer.update(sums, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def owner_dp_aggregate(
    l2_clip: float,
    noise_multiplier: float,
    num_experts: int,
    denominator: float,
    key: Union[jax.Array, int],
) -> optax.GradientTransformationExtraArgs:
  """Per-owner-expert DP aggregation (RAPTOR Eq. 9).

  ``update(per_record_grads, state, params=None, *, owners, mask=None)`` takes
  each record's gradient with respect to its owner expert's slice (leaves
  ``[n, ...]``, see ``grads.owner_slices``) and returns leaves
  ``[num_experts, ...]``: for expert e, ``(sum_{i: owners_i = e} mask_i *
  clip(g_i, l2_clip) + N(0, (sigma * l2_clip)^2 I)) / denominator``. Every
  expert gets its own independent noise every step; an expert with no record
  gets noise only, so the output never reveals realised per-expert counts.

  Guarantee: one record touches one expert's slice only, by at most
  ``l2_clip / denominator`` in l2 norm (noiseless); other experts' outputs do
  not change at all. This needs each record's owner to be a function of that
  record alone, fixed for the run (RAPTOR computes it once from the frozen
  pretrained router): if adding a record could change another record's owner,
  the bound does not hold. Hence each expert's release is a Gaussian
  mechanism on its owner group (parallel composition, Lemma 1), and the whole
  ``[E, ...]`` release has l2 sensitivity ``l2_clip / denominator``: one
  Gaussian mechanism with noise multiplier ``noise_multiplier``. It refuses
  ``optax.MultiSteps`` (averaged records, the last ``owners``: module doc).

  Args:
    l2_clip: per-record clipping norm C_e (public, > 0).
    noise_multiplier: sigma_e (>= 0; 0 = no noise, no privacy).
    num_experts: E (>= 1).
    denominator: public constant, e.g. D_e = B / E; never a realised count.
    key: secret PRNG key, distinct for every transform instance; several
      stacked on a leading axis for more than 64 bits (module docstring).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` requires
    ``owners`` (int ``[n]`` in ``[0, E)``; a record with an owner outside that
    range is dropped) and takes an optional ``mask`` ``[n]``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from raptor_jax import grads, transforms
    >>> experts = {'w': jnp.zeros((4, 3))}  # E = 4 stacked expert slices
    >>> loss_fn = lambda p, record: jnp.sum((p['w'] - record['x']) ** 2)
    >>> batch = {'x': jnp.ones((5, 3))}
    >>> owners = jnp.array([0, 2, 2, 3, 0])
    >>> tx = optax.chain(
    ...     transforms.owner_dp_aggregate(1.0, 1.1, 4, 5.0 / 4,
    ...                                   jax.random.key(1)),
    ...     optax.adam(1e-3))
    >>> state = tx.init(experts)
    >>> slices = grads.owner_slices(experts, owners)  # leaves [n, ...]
    >>> g = jax.vmap(jax.grad(loss_fn))(slices, batch)
    >>> updates, state = tx.update(g, state, experts, owners=owners)
    >>> jax.tree.map(jnp.shape, updates)
    {'w': (4, 3)}
  """
  num_experts = _validate.positive_int('num_experts', num_experts)
  privatizer = privatize_sums(l2_clip, noise_multiplier, denominator, key)
  init_fn, guard = _guarded('owner_dp_aggregate', privatizer, sliced=True)

  def update_fn(
      updates, state, params=None, *, owners=None, mask=None, **extra_args
  ):
    del extra_args
    guard(updates, params, mask)
    _validate.check(
        owners is not None,
        'owners',
        "given to owner_dp_aggregate's update",
        owners,
        "pass owners= (int [n], each record's owner expert)",
    )
    clipped, _ = grads_lib.clip_per_record(updates, l2_clip, mask)
    sums = grads_lib.sum_by_owner(clipped, owners, num_experts)
    return privatizer.update(sums, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
