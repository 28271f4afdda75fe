"""Fits one sparse layer's router to route public documents by cluster.

Masked-LM pretraining with load balancing balances *tokens*; on the
controlled study's generated text it left a domain's records split over
several experts (owner purity 0.6-0.9). This second pretraining step makes
the router at one sparse layer route whole documents, from public text
alone and without labels:

1. read each token's router input x_t at the layer (the router is linear,
   so probing it with unit columns returns x_t exactly; nothing upstream
   depends on this router);
2. cluster the public documents' mean router inputs into E groups
   (k-means, k-means++ start, fixed seed);
3. fit the router kernel by multinomial logistic regression of every token's
   x_t on its document's cluster (L2-regularised, full batch, Adam).

Every other weight is unchanged, so the rest of the pretrained model is as
`launch/pretrain.py` left it. The data are public texts only: the fit is part
of pretraining and depends on no private record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from raptor_jax import roles
from raptor_jax.models import stack


def router_inputs(
    backbone, params: dict, ids: np.ndarray, mask: np.ndarray, layer: int
) -> np.ndarray:
  """x_t [N, S, d] at sparse block `layer`, by probing its linear router."""
  config = backbone.config
  position = config.sparse_layers.index(layer)
  flat = roles.flatten(stack.unstack_layers(params, config))
  path = f"block_{layer}/mlp/router/kernel"
  d, num_experts = flat[path].shape

  @jax.jit
  def logits(kernel, ids, mask):
    probe = stack.stack_layers(roles.unflatten({**flat, path: kernel}), config)
    return backbone.apply({"params": probe}, ids, mask).router_logits[position]

  columns = []
  eye = np.eye(d, dtype=np.float32)
  for start in range(0, d, num_experts):
    kernel = np.zeros((d, num_experts), np.float32)
    width = min(num_experts, d - start)
    kernel[:, :width] = eye[:, start : start + width]
    out = np.concatenate(
        [
            np.asarray(logits(kernel, ids[i : i + 500], mask[i : i + 500]))
            for i in range(0, len(ids), 500)
        ]
    )
    columns.append(out[..., :width])
  return np.concatenate(columns, axis=-1)


def _lloyd(points: np.ndarray, k: int, rng, iterations: int):
  """(labels, inertia) of one Lloyd's k-means run from a k-means++ start."""
  centers = [points[rng.integers(len(points))]]
  for _ in range(1, k):
    d2 = np.min([np.sum((points - c) ** 2, axis=1) for c in centers], axis=0)
    centers.append(points[rng.choice(len(points), p=d2 / d2.sum())])
  centers = np.stack(centers)
  for _ in range(iterations):
    d2 = np.sum((points[:, None] - centers[None]) ** 2, axis=-1)
    labels = np.argmin(d2, axis=1)
    centers = np.stack(
        [
            points[labels == j].mean(0) if np.any(labels == j) else centers[j]
            for j in range(k)
        ]
    )
  d2 = np.sum((points[:, None] - centers[None]) ** 2, axis=-1)
  labels = np.argmin(d2, axis=1)
  return labels.astype(np.int32), float(np.min(d2, axis=1).sum())


def kmeans(
    points: np.ndarray,
    k: int,
    *,
    seed: int,
    restarts: int = 20,
    iterations: int = 50,
) -> np.ndarray:
  """Cluster labels (int32 [N]): the lowest-inertia of `restarts` k-means runs."""
  rng = np.random.default_rng(seed)
  runs = [_lloyd(points, k, rng, iterations) for _ in range(restarts)]
  return min(runs, key=lambda run: run[1])[0]


def fit_router_kernel(
    x: np.ndarray,
    targets: np.ndarray,
    num_experts: int,
    *,
    steps: int = 500,
    learning_rate: float = 0.05,
    l2: float = 1e-4,
) -> tuple[np.ndarray, float]:
  """(kernel [d, E], token accuracy) of the logistic regression x -> target."""
  x, targets = jnp.asarray(x), jnp.asarray(targets)
  kernel = jnp.zeros((x.shape[1], num_experts))
  tx = optax.adam(learning_rate)
  state = tx.init(kernel)

  def loss(k):
    ce = optax.softmax_cross_entropy_with_integer_labels(x @ k, targets)
    return jnp.mean(ce) + l2 * jnp.sum(k**2)

  @jax.jit
  def update(k, state):
    grads = jax.grad(loss)(k)
    updates, state = tx.update(grads, state)
    return optax.apply_updates(k, updates), state

  for _ in range(steps):
    kernel, state = update(kernel, state)
  accuracy = float(jnp.mean(jnp.argmax(x @ kernel, axis=1) == targets))
  return np.asarray(kernel), accuracy


def fit(
    backbone,
    params: dict,
    ids: np.ndarray,
    mask: np.ndarray,
    layer: int,
    seed=0,
) -> tuple[np.ndarray, dict]:
  """The fitted router kernel of `layer` and a report (public numbers)."""
  num_experts = backbone.config.num_experts
  x = router_inputs(backbone, params, ids, mask, layer)
  m = mask.astype(bool)
  means = (x * m[..., None]).sum(1) / np.maximum(m.sum(1, keepdims=True), 1)
  means = means / np.linalg.norm(means, axis=1, keepdims=True)
  clusters = kmeans(means, num_experts, seed=seed)
  doc_of_token = np.broadcast_to(np.arange(len(ids))[:, None], m.shape)[m]
  kernel, accuracy = fit_router_kernel(
      x[m], clusters[doc_of_token], num_experts
  )
  report = dict(
      layer=layer,
      documents=int(len(ids)),
      cluster_shares=(
          np.bincount(clusters, minlength=num_experts) / len(ids)
      ).tolist(),
      token_accuracy=accuracy,
      seed=seed,
  )
  return kernel, report
