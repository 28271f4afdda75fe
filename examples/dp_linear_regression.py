"""raptor_jax's DP optax transforms in a plain JAX/optax training loop.

No raptor_jax model and no Flax are involved, so ``pip install .`` (the core
dependencies) is enough: a linear regressor on synthetic data, trained three
ways with differential privacy (DP-SGD accounting applies, with sample rate
q = batch_size / n and the noise multiplier below):

* ``train_microbatched``: Poisson sampling on the host, fixed-size padded
  microbatches, ``grads.clipped_grad_sum`` per microbatch, then
  ``transforms.privatize_sums`` (noise once per step) chained with Adam.
* ``train_one_call``: ``transforms.dp_aggregate`` on per-record gradients of
  the whole (masked) dataset in one call.
* ``train_owner``: ``transforms.owner_dp_aggregate`` for E stacked linear
  "experts"; each record trains only its owner expert, a fixed function of
  the record (like RAPTOR's frozen router).

Run: ``python examples/dp_linear_regression.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import grads, sampling, transforms

N, DIM, NUM_EXPERTS = 2000, 8, 4


def make_data(seed: int = 0) -> dict[str, np.ndarray]:
  """y = x @ (w + v_owner) + noise; owner = argmax of x's first E dims."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, DIM)).astype(np.float32)
  owner = np.argmax(x[:, :NUM_EXPERTS], axis=1).astype(np.int32)
  w_true = rng.normal(size=DIM) + 0.3 * rng.normal(size=(NUM_EXPERTS, DIM))
  y = np.einsum('nd,nd->n', x, w_true[owner]) + 0.1 * rng.normal(size=N)
  return {'x': x, 'y': y.astype(np.float32), 'owner': owner}


def init_params(key):
  """A linear layer with one output, initialised as Flax's ``nn.Dense``."""
  kernel = jax.nn.initializers.lecun_normal()(key, (DIM, 1))
  return {'kernel': kernel, 'bias': jnp.zeros((1,))}


def predict(params, x):
  return (x @ params['kernel'] + params['bias'])[..., 0]


def loss_fn(params, record):
  """Squared error of ONE record: per-record gradients via vmap(grad)."""
  return (predict(params, record['x']) - record['y']) ** 2


def mse(params, data) -> float:
  return float(jnp.mean((predict(params, data['x']) - data['y']) ** 2))


def train_microbatched(
    steps=150,
    batch_size=100,
    microbatch_size=32,
    l2_clip=1.0,
    noise_multiplier=1.0,
    lr=0.05,
    seed=0,
):
  data = make_data(seed)
  params_key, noise_key = jax.random.split(jax.random.key(seed))
  params = init_params(params_key)
  # Noise std noise_multiplier * l2_clip, then divide by the PUBLIC expected
  # batch size, never by the realised one.
  tx = optax.chain(
      transforms.privatize_sums(
          l2_clip, noise_multiplier, batch_size, noise_key
      ),
      optax.adam(lr),
  )
  opt_state = tx.init(params)

  @jax.jit
  def accumulate(params, sums, batch, mask):  # one shape: compiles once
    mb_sums, _ = grads.clipped_grad_sum(
        loss_fn, params, batch, l2_clip=l2_clip, mask=mask
    )
    return optax.tree.add(sums, mb_sums)

  @jax.jit
  def apply(params, opt_state, sums):
    updates, opt_state = tx.update(sums, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for step in range(steps):
    sample = sampling.poisson_sample(N, batch_size / N, seed=seed, step=step)
    sums = grads.zeros_like_f32(params)  # an empty sample: noise only
    for mb in sampling.microbatches(sample, microbatch_size):
      batch = jax.tree.map(lambda a: a[mb.indices], data)
      sums = accumulate(params, sums, batch, mb.mask)
    params, opt_state = apply(params, opt_state, sums)
  return params, mse(params, data)


def train_one_call(
    steps=150,
    batch_size=100,
    l2_clip=1.0,
    noise_multiplier=1.0,
    lr=0.05,
    seed=0,
):
  data = make_data(seed)
  params_key, noise_key = jax.random.split(jax.random.key(seed))
  params = init_params(params_key)
  tx = optax.chain(
      transforms.dp_aggregate(l2_clip, noise_multiplier, batch_size, noise_key),
      optax.adam(lr),
  )
  opt_state = tx.init(params)

  @jax.jit
  def step_fn(params, opt_state, mask):
    # Small data: every record every step, the Poisson sample as a mask.
    per_record = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, data)
    updates, opt_state = tx.update(per_record, opt_state, params, mask=mask)
    return optax.apply_updates(params, updates), opt_state

  for step in range(steps):
    mask = np.zeros(N, np.float32)
    mask[sampling.poisson_sample(N, batch_size / N, seed=seed, step=step)] = 1.0
    params, opt_state = step_fn(params, opt_state, mask)
  return params, mse(params, data)


def train_owner(
    steps=150,
    batch_size=100,
    l2_clip=1.0,
    noise_multiplier=1.0,
    lr=0.05,
    seed=0,
):
  data = make_data(seed)
  owners = data['owner']
  stacked = {'kernel': jnp.zeros((NUM_EXPERTS, DIM))}  # E linear experts
  tx = optax.chain(
      transforms.owner_dp_aggregate(
          l2_clip,
          noise_multiplier,
          NUM_EXPERTS,
          denominator=batch_size / NUM_EXPERTS,  # public D_e = B / E
          key=jax.random.key(seed + 1),
      ),
      optax.adam(lr),
  )
  opt_state = tx.init(stacked)

  def expert_loss(kernel_slice, record):
    """Loss of ONE record given only its owner expert's slice."""
    return (record['x'] @ kernel_slice['kernel'] - record['y']) ** 2

  @jax.jit
  def step_fn(stacked, opt_state, batch, mask):
    slices = grads.owner_slices(stacked, batch['owner'])  # [n, DIM]
    per_record = grads.per_record_grads(
        expert_loss, slices, batch, params_axis=0
    )
    updates, opt_state = tx.update(
        per_record, opt_state, stacked, owners=batch['owner'], mask=mask
    )
    return optax.apply_updates(stacked, updates), opt_state

  for step in range(steps):
    mask = np.zeros(N, np.float32)
    mask[
        sampling.poisson_sample(
            N,
            batch_size / N,
            seed=seed,
            stream=sampling.EXPERT_STREAM,
            step=step,
        )
    ] = 1.0
    stacked, opt_state = step_fn(stacked, opt_state, data, mask)
  kernels = np.asarray(stacked['kernel'])[owners]
  pred = np.einsum('nd,nd->n', data['x'], kernels)
  return stacked, float(np.mean((pred - data['y']) ** 2))


def main(steps: int = 150) -> dict[str, float]:
  baseline = float(np.mean(make_data()['y'] ** 2))
  results = {
      'zero predictor': baseline,
      'microbatched privatize_sums': train_microbatched(steps)[1],
      'one-call dp_aggregate': train_one_call(steps)[1],
      'owner_dp_aggregate (E experts)': train_owner(steps)[1],
  }
  for name, value in results.items():
    print(f'{name:32s} mse {value:.3f}')
  return results


if __name__ == '__main__':
  main()
