"""Held-out evaluation of a pretraining run: LM quality and routing health.

Routing is measured on held-out public documents taken as *records*
(`[CLS] text [SEP]`, truncated and padded like fine-tuning inputs), because
RAPTOR's owner rule works on records: for every sparse layer we report the
token load of each expert and its normalised entropy, and the owner
distribution under the owner rule (Eq. 5) with its routing statistics. The
layer that entropy selection would pick must not have collapsed: each of its
experts must own at least `min_share` of the records.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import ownership
from raptor_jax.models import moe


def _normalized_entropy(shares: np.ndarray) -> float:
  nonzero = shares[shares > 0]
  return float(-np.sum(nonzero * np.log(nonzero)) / math.log(len(shares)))


def routing_report(
    router_logits,
    mask: np.ndarray,
    *,
    layers,
    rule: dict,
    min_share: float,
) -> dict[str, Any]:
  """Per-layer token load, owner shares and the collapse check.

  Args:
    router_logits: one [N, S, E] array per sparse layer (all records).
    mask: [N, S] attention mask of the records.
    layers: block index of each sparse layer.
    rule: the model's routing and owner rule (`ownership.owner_rule`).
    min_share: the smallest owner share an expert of the selected layer
      may have.
  """
  num_experts = router_logits[0].shape[-1]
  rows, owners = [], []
  for layer, logits in zip(layers, router_logits):
    chosen = moe.route_topk(
        jnp.asarray(logits), rule["top_k"], False, rule["groups"]
    ).experts
    chosen = np.asarray(chosen)[np.asarray(mask) > 0].reshape(-1)
    load = np.bincount(chosen, minlength=num_experts) / max(chosen.size, 1)
    owner = np.asarray(ownership.owners(logits, mask, **rule))
    owners.append(owner)
    shares = np.bincount(owner, minlength=num_experts) / len(owner)
    rows.append(
        dict(
            layer=int(layer),
            token_load=load.tolist(),
            token_entropy_norm=_normalized_entropy(load),
            owner_shares=shares.tolist(),
            min_owner_share=float(shares.min()),
            **ownership.routing_stats(owner, num_experts),
        )
    )
  table = ownership.layer_table(np.stack(owners), layers, num_experts)
  selected = ownership.select_layer("entropy", layers, table)
  min_selected = next(
      r["min_owner_share"] for r in rows if r["layer"] == selected
  )
  return dict(
      layers=rows,
      selected_layer=selected,
      selected_min_owner_share=min_selected,
      min_share_required=min_share,
      collapsed=bool(min_selected < min_share),
      records=int(len(mask)),
  )


def evaluate(
    module,
    params: dict,
    loss: Callable,
    heldout_rows: np.ndarray,
    record_ids: np.ndarray,
    record_mask: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    min_share: float,
) -> dict[str, Any]:
  """Held-out LM loss/accuracy (fixed masking) and the routing report.

  Returns:
    {'scalars': flat numbers for the metric writers, 'routing': the report}.
  """
  eval_key = jax.random.PRNGKey(seed + 2)
  parts_fn = jax.jit(lambda p, ids, key: loss(p, ids, key)[1])
  totals: dict[str, float] = {}
  batches = max(1, len(heldout_rows) // batch_size)
  for i in range(batches):
    ids = jnp.asarray(heldout_rows[i * batch_size : (i + 1) * batch_size])
    for k, v in parts_fn(params, ids, jax.random.fold_in(eval_key, i)).items():
      totals[k] = totals.get(k, 0.0) + float(v) / batches
  router_fn = jax.jit(
      lambda p, ids, mask: module.apply(
          {"params": p["backbone"]}, ids, mask
      ).router_logits
  )
  logits = [[] for _ in module.config.sparse_layers]
  for start in range(0, len(record_ids), batch_size):
    out = router_fn(
        params,
        jnp.asarray(record_ids[start : start + batch_size]),
        jnp.asarray(record_mask[start : start + batch_size]),
    )
    for layer_logits, chunk in zip(logits, out):
      layer_logits.append(np.asarray(chunk))
  cfg = module.config
  routing = routing_report(
      [np.concatenate(l) for l in logits],
      record_mask,
      layers=cfg.sparse_layers,
      rule=ownership.owner_rule(cfg, "count"),
      min_share=min_share,
  )
  scalars = {
      "lm_loss": totals["lm_loss"],
      "accuracy": totals["accuracy"],
      "aux_loss": totals["aux_loss"],
      "owner_balance_loss": totals["owner_balance_loss"],
      "selected_min_owner_share": routing["selected_min_owner_share"],
  }
  for row in routing["layers"]:
    scalars[f"token_entropy_norm/layer_{row['layer']}"] = row[
        "token_entropy_norm"
    ]
    scalars[f"owner_entropy_norm/layer_{row['layer']}"] = row["entropy_norm"]
  return dict(scalars=scalars, routing=routing)
