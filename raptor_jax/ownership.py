"""Owner maps, routing statistics and public layer selection (Sec. 5.1-5.2).

Owner map (Eq. 5): each record is owned by the expert that receives the most
gate weight over its non-padding tokens at the selected layer,
``a(x) = argmax_e sum_t g_e(x, t)``, ties to the lowest index. The gate
weights are the model's own top-k routing weights before any capacity drop:
for top-1 Switch a majority vote of the tokens' argmax experts ('count'), or
their router probabilities ('prob'); for top-k models the top-k weights
exactly as the model uses them (renormalised when it renormalises).

Privacy. The owner map of the *private* data is computed once, from the frozen
pretrained model, and stays in process memory: it is never logged, saved or
put in a metric (it is recomputed on resume; it is deterministic). Routing
statistics and layer selection run on a *public* corpus only, so the selected
layer costs no privacy budget.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import _validate, compilation, length_buckets
from raptor_jax.models import moe

WEIGHTINGS = ("count", "prob")
_log = logging.getLogger("raptor_jax")


def owners(
    router_logits: jax.Array,
    attention_mask: jax.Array,
    top_k: int = 1,
    weighting: str = "count",
    normalize: bool = False,
    groups: tuple[int, int] | None = None,
) -> jax.Array:
  """Owner expert of every record (Eq. 5).

  Args:
    router_logits: [N, S, E] pre-softmax router logits of one layer.
    attention_mask: [N, S], 1 for tokens, 0 for padding (padding never votes).
    top_k: experts per token of the model.
    weighting: 'count' (each token gives 1 to each of its top-k experts) or
      'prob' (each token gives its top-k gate weights).
    normalize: renormalise the top-k weights to sum to one (OLMoE's
      `norm_topk_prob`); only matters for 'prob'.
    groups: (n_group, topk_group) of group-limited routing (DeepSeek-V2's
      `group_limited_greedy`), so that the votes go to the experts the model
      really routes to; None for plain top-k.

  Returns:
    int32 [N] owners; ties go to the lowest expert index (a record without
    tokens is owned by expert 0).
  """
  _validate.one_of(
      "raptor.owner_weighting",
      weighting,
      WEIGHTINGS,
      _validate.config_fix("raptor.owner_weighting"),
  )
  num_experts = router_logits.shape[-1]
  # The model's own routing (stable top-k: ties to the lower index).
  routing = moe.route_topk(jnp.asarray(router_logits), top_k, normalize, groups)
  gates = routing.weights
  if weighting == "count":
    gates = jnp.ones_like(gates)
  gates = gates * jnp.asarray(attention_mask, jnp.float32)[..., None]
  votes = jnp.einsum(
      "nsk,nske->ne", gates, jax.nn.one_hot(routing.experts, num_experts)
  )
  return jnp.argmax(votes, axis=-1).astype(jnp.int32)


def routing_stats(owners_: np.ndarray, num_experts: int) -> dict[str, float]:
  """Balance of an owner distribution q (Tab. 7, Tab. 9).

  Returns:
    dict with `entropy_norm` = H(q)/log E, `entropy_deficit` = log E - H(q),
    `chi2` = chi^2(q || uniform) = E * sum_e (q_e - 1/E)^2, and `cv` = the
    coefficient of variation of the expert loads, std(q)/mean(q).
  """
  counts = np.bincount(np.asarray(owners_).reshape(-1), minlength=num_experts)
  if counts.sum() == 0:
    raise ValueError("routing_stats needs at least one record")
  q = counts / counts.sum()
  nonzero = q[q > 0]
  entropy = float(-np.sum(nonzero * np.log(nonzero)))
  log_e = math.log(num_experts)
  return dict(
      entropy_norm=entropy / log_e if num_experts > 1 else 1.0,
      entropy_deficit=log_e - entropy,
      chi2=float(num_experts * np.sum((q - 1.0 / num_experts) ** 2)),
      cv=float(np.std(q) / np.mean(q)),
  )


RouterFn = Callable[[jax.Array, jax.Array], Sequence[jax.Array]]


def owners_per_layer(
    router_fn: RouterFn,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    batch_size: int,
    top_k: int = 1,
    weighting: str = "count",
    normalize: bool = False,
    groups: tuple[int, int] | None = None,
    buckets: tuple[int, ...] = (),
) -> np.ndarray:
  """Owners of every record at every sparse layer of a frozen model.

  Args:
    router_fn: (input_ids, attention_mask) -> router logits per sparse layer
      (e.g. a jitted backbone apply); called on fixed-size batches (the last
      one padded), so it compiles once.
    input_ids, attention_mask: [N, S] records.
    batch_size: records per call.
    top_k, weighting, normalize, groups: see `owners`.
    buckets: length buckets (`length_buckets`): records run in batches of
      the smallest bucket length that holds them (`router_fn` compiles once
      per bucket); `()`: every batch at the records' full width, in order.
      Right padding never votes, so the owners are the same either way.

  Returns:
    int32 [num_sparse_layers, N].
  """
  if input_ids.shape[0] == 0:
    raise ValueError("no records to compute owners for")

  def batch_owners(ids, mask):  # int32 [batch, num_sparse_layers]
    logits = router_fn(jnp.asarray(ids), jnp.asarray(mask))
    return np.stack(
        [
            np.asarray(owners(l, mask, top_k, weighting, normalize, groups))
            for l in logits
        ],
        axis=1,
    )

  return np.ascontiguousarray(
      length_buckets.map_split(
          batch_owners, input_ids, attention_mask, buckets, batch_size
      ).T
  )


def layer_table(
    public_owners: np.ndarray, layers: Sequence[int], num_experts: int
) -> list[dict[str, float]]:
  """Routing statistics of every candidate layer on the public corpus.

  Args:
    public_owners: int [num_layers, N_pub] owners of the public texts.
    layers: block index of each row of `public_owners`.
    num_experts: E.

  Returns:
    One dict per layer: {'layer', 'entropy_norm', 'entropy_deficit', 'chi2', 'cv'}.
  """
  return [
      dict(layer=int(layer), **routing_stats(row, num_experts))
      for layer, row in zip(layers, public_owners)
  ]


def select_layer(
    how: str | int,
    layers: Sequence[int],
    table: Sequence[dict[str, float]] | None = None,
) -> int:
  """The expert-stream layer l*.

  Args:
    how: 'entropy' (argmax of H(q) on the public corpus, Eq. 4; the last sparse
      layer when no corpus is given), 'first', 'last', or a block index.
    layers: the sparse block indices of the model.
    table: `layer_table` of the public corpus (needed for 'entropy').

  Returns:
    A block index from `layers`.
  """
  if not layers:
    raise ValueError(
        "the model has no sparse (MoE) layer; RAPTOR's expert stream needs one"
    )
  if isinstance(how, (int, np.integer)) and not isinstance(how, bool):
    _validate.one_of(
        "raptor.layer",
        how,
        layers,
        "it is not a sparse layer of this model; "
        + _validate.config_fix("raptor.layer"),
    )
    return int(how)
  if how == "first":
    return layers[0]
  if how == "last" or (how == "entropy" and not table):
    return layers[-1]
  if how == "entropy":
    best = max(table, key=lambda row: (row["entropy_norm"], -row["layer"]))
    return int(best["layer"])
  _validate.fail(
      "raptor.layer",
      "'entropy', 'first', 'last' or a sparse block index",
      how,
      _validate.config_fix("raptor.layer"),
  )


# -- a backbone's owner maps (the trainer's glue) ---------------------------------


def _router_program(backbone, layer_positions=None):
  """Jitted (params, ids, mask) -> router logits of every (or the given)
  sparse layer. The parameters are an argument, not constants folded into
  the program: it compiles fast, and its cache entry holds no weights."""

  @jax.jit
  def fn(params, ids, mask):
    logits = backbone.apply({"params": params}, ids, mask).router_logits
    return (
        logits
        if layer_positions is None
        else tuple(logits[i] for i in layer_positions)
    )

  return fn


def _router_fn(backbone, params, layer_positions=None) -> RouterFn:
  """(ids, mask) -> router logits of every (or the given) sparse layer."""
  return functools.partial(_router_program(backbone, layer_positions), params)


def owner_program(backbone, layer_positions, rule: dict):
  """Jitted (params, ids, mask) -> int32 [batch, layers] owners of the
  sparse layers at `layer_positions` (None: all) by `rule` (`owner_rule`):
  the router and `owners` in one program, one compile per batch shape.
  The parameters are an argument, not constants folded into the program.
  One program per (backbone, layers, rule) in a process, so passes that
  share them share its compiles."""
  return _owner_program(
      backbone,
      None if layer_positions is None else tuple(layer_positions),
      tuple(sorted(rule.items())),
  )


@functools.lru_cache(maxsize=8)
def _owner_program(backbone, layer_positions, rule_items):
  rule = dict(rule_items)

  @jax.jit
  def owner_fn(params, ids, mask):
    logits = backbone.apply({"params": params}, ids, mask).router_logits
    if layer_positions is not None:
      logits = tuple(logits[i] for i in layer_positions)
    return jnp.stack([owners(l, mask, **rule) for l in logits], axis=1)

  return owner_fn


def owner_pass(
    config,
    backbone,
    params,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    layer_positions=None,
    *,
    what: str = "owner map",
) -> np.ndarray:
  """Owners (int32 [layers, N]) of the records by `owner_rule`, compiled ahead.

  The pass runs batches of `config.eval_batch_size` records, by length
  bucket (`data.length_buckets`); its program is compiled for EVERY bucket
  first (`compilation.compile_ahead`), whether or not the records fill it,
  so which programs exist, and their compile time, depend on the public
  config only. A pass whose program an earlier pass of this process
  compiled (the layer selection's, for the owner map) finds it in JAX's
  cache: its "compiling" lines take milliseconds.
  """
  rule = owner_rule(backbone.config, config.raptor.owner_weighting)
  program = owner_program(backbone, layer_positions, rule)
  buckets = length_buckets.from_config(config)
  batch = int(config.eval_batch_size)
  dtypes = [
      jax.dtypes.canonicalize_dtype(a.dtype)
      for a in (input_ids, attention_mask)
  ]
  widths = buckets or (np.shape(input_ids)[1],)
  compilation.compile_ahead(
      [
          compilation.Program(
              f"{what} {width}",
              program,
              (
                  compilation.abstract(params),
                  *(jax.ShapeDtypeStruct((batch, width), d) for d in dtypes),
              ),
          )
          for width in widths
      ],
      progress=_log.info,
      what=what,
  )
  return np.ascontiguousarray(
      length_buckets.map_split(
          lambda ids, mask: program(params, ids, mask),
          input_ids,
          attention_mask,
          buckets,
          batch,
      ).T
  )


def owner_weighting(weighting: str, backbone_config) -> str:
  """Top-k models vote with their gate weights (docs/method.md §1.2); top-1 as configured."""
  return weighting if backbone_config.top_k == 1 else "prob"


def owner_rule(backbone_config, weighting: str) -> dict:
  """The `owners` arguments that read a model's routed gates as it uses them.

  Top-k models vote with their top-k gate weights, renormalised iff the
  model renormalises (`norm_topk_prob`) and group-limited iff it routes so
  (`routing_groups`, DeepSeek-V2); top-1 models (Switch) by `weighting`.
  Shared experts (DeepSeek-MoE) take every token and have no router logit:
  they never vote.
  """
  return dict(
      top_k=backbone_config.top_k,
      weighting=owner_weighting(weighting, backbone_config),
      normalize=bool(getattr(backbone_config, "norm_topk_prob", False)),
      groups=getattr(backbone_config, "routing_groups", None),
  )


def select_expert_layer(
    config, backbone, params, run_data
) -> tuple[int, list | None]:
  """l* by the public corpus (Eq. 4) as `config.raptor.layer` says.

  Only the public corpus (`run_data.public`) is routed, so the choice costs
  no privacy budget.

  Returns:
    (layer, `layer_table` of the public corpus or None).
  """
  bc = backbone.config
  how = config.raptor.layer
  if isinstance(how, str) and how.lstrip("-").isdigit():
    how = int(how)
  table = None
  if how == "entropy" and run_data.public is not None:
    ids, mask = run_data.public
    if len(ids) == 0:
      raise ValueError(
          "the public corpus is empty; set --config.data.public_corpus or "
          "--config.data.public_path to a corpus with texts"
      )
    public_owners = owner_pass(
        config, backbone, params, ids, mask, what="layer selection"
    )
    table = layer_table(public_owners, bc.sparse_layers, bc.num_experts)
  return select_layer(how, bc.sparse_layers, table), table


def private_owner_map(
    config, backbone, params, records, layer: int
) -> np.ndarray:
  """Owners (int32 [N]) of `records` (input_ids, attention_mask) at block `layer`.

  Computed from the frozen pretrained model. For private records the result
  is private: never log, save or return it outside the process (docs/method.md §1.2).
  With `data.length_buckets` the records run by length bucket: the same
  owners (padding never votes), a layout that only the process sees.
  """
  position = backbone.config.sparse_layers.index(layer)
  # Every sparse layer's owners, the layer selection's program: one compile
  # for both passes. The other layers' rows are dropped here.
  result = owner_pass(
      config,
      backbone,
      params,
      records.input_ids,
      records.attention_mask,
  )
  return result[position]


def format_layer_table(table: Sequence[dict[str, float]], chosen: int) -> str:
  """The public layer-selection table as text, l* marked."""
  lines = ["layer  H/logE  deficit    chi2      cv   (public corpus)"]
  for row in table:
    mark = "  <- l*" if row["layer"] == chosen else ""
    lines.append(
        f"{row['layer']:>5}  {row['entropy_norm']:.4f}  {row['entropy_deficit']:.4f}"
        f"  {row['chi2']:.4f}  {row['cv']:.4f}{mark}"
    )
  return "\n".join(lines)
