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

Randomness: the Poisson samples and the noise derive from a secret of 256
bits drawn from the operating system (``os.urandom``) unless you pass one, as
the trainer's do: amplification by sampling and the noise both assume the
adversary cannot reproduce them, which a public seed would let them do. The
noise key is 128 bits (two threefry keys, see ``transforms``). ``seed`` seeds
only public randomness (the data and the initial parameters).

Run: ``python examples/dp_linear_regression.py``.
"""

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import grads, sampling, transforms

N, DIM, NUM_EXPERTS = 2000, 8, 4


def fresh_secret() -> bytes:
  """256 bits of OS entropy: the secret behind the samples and the noise."""
  return os.urandom(32)


def _derive(secret: bytes, label: str, size: int) -> bytes:
  """A keyed BLAKE2b of `label`: one independent stream per purpose."""
  return hashlib.blake2b(label.encode(), key=secret, digest_size=size).digest()


def poisson_seed(secret: bytes) -> int:
  """The 256-bit seed of every Poisson sample (`sampling.poisson_sample`)."""
  return int.from_bytes(_derive(secret, 'poisson', 32), 'little')


def noise_key(secret: bytes, label: str) -> jax.Array:
  """A 128-bit noise key: two raw threefry keys stacked (uint32[2, 2])."""
  words = np.frombuffer(_derive(secret, f'noise/{label}', 16), np.uint32)
  return jnp.asarray(words.reshape(2, 2))


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
    secret=None,
):
  secret = fresh_secret() if secret is None else secret
  data = make_data(seed)
  params = init_params(jax.random.key(seed))
  # Noise std noise_multiplier * l2_clip, then divide by the PUBLIC expected
  # batch size, never by the realised one.
  tx = optax.chain(
      transforms.privatize_sums(
          l2_clip, noise_multiplier, batch_size, noise_key(secret, 'linear')
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
    sample = sampling.poisson_sample(
        N, batch_size / N, seed=poisson_seed(secret), step=step
    )
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
    secret=None,
):
  secret = fresh_secret() if secret is None else secret
  data = make_data(seed)
  params = init_params(jax.random.key(seed))
  tx = optax.chain(
      transforms.dp_aggregate(
          l2_clip, noise_multiplier, batch_size, noise_key(secret, 'linear')
      ),
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
    mask[
        sampling.poisson_sample(
            N, batch_size / N, seed=poisson_seed(secret), step=step
        )
    ] = 1.0
    params, opt_state = step_fn(params, opt_state, mask)
  return params, mse(params, data)


def train_owner(
    steps=150,
    batch_size=100,
    l2_clip=1.0,
    noise_multiplier=1.0,
    lr=0.05,
    seed=0,
    secret=None,
):
  secret = fresh_secret() if secret is None else secret
  data = make_data(seed)
  owners = data['owner']
  stacked = {'kernel': jnp.zeros((NUM_EXPERTS, DIM))}  # E linear experts
  tx = optax.chain(
      transforms.owner_dp_aggregate(
          l2_clip,
          noise_multiplier,
          NUM_EXPERTS,
          denominator=batch_size / NUM_EXPERTS,  # public D_e = B / E
          key=noise_key(secret, 'experts'),
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
            seed=poisson_seed(secret),
            stream=sampling.EXPERT_STREAM,
            step=step,
        )
    ] = 1.0
    stacked, opt_state = step_fn(stacked, opt_state, data, mask)
  kernels = np.asarray(stacked['kernel'])[owners]
  pred = np.einsum('nd,nd->n', data['x'], kernels)
  return stacked, float(np.mean((pred - data['y']) ** 2))


def main(steps: int = 150, secret: bytes | None = None) -> dict[str, float]:
  """Trains all three ways from ONE secret (fresh unless given): the
  microbatched and the one-call paths then draw the same samples and noise."""
  secret = fresh_secret() if secret is None else secret
  baseline = float(np.mean(make_data()['y'] ** 2))
  _, microbatched = train_microbatched(steps, secret=secret)
  _, one_call = train_one_call(steps, secret=secret)
  _, owner = train_owner(steps, secret=secret)
  results = {
      'zero predictor': baseline,
      'microbatched privatize_sums': microbatched,
      'one-call dp_aggregate': one_call,
      'owner_dp_aggregate (E experts)': owner,
  }
  for name, value in results.items():
    print(f'{name:32s} mse {value:.3f}')
  return results


if __name__ == '__main__':
  main()
