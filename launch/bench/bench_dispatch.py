r"""Benchmarks the expert dispatch of one sparse layer: grouped, ragged, all-experts.

  python -m launch.bench.bench_dispatch
  python -m launch.bench.bench_dispatch --num_experts=8 --batch_sizes=32 \
      --max_dense_gflop=1000
  python -m launch.bench.bench_dispatch --family=olmoe
  python -m launch.bench.bench_dispatch --family=olmoe --d_model=1024 --d_ff=512 \
      --num_experts=8,64 --batch_sizes=1,8
  python -m launch.bench.bench_dispatch --family=deepseek

What it measures, how, and what it checks: docs/performance.md, "The
benchmark scripts in detail".
"""

import dataclasses
import functools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.bench import harness
from raptor_jax.models import decoder, deepseek, initializers, moe, olmoe, switch

# Per family (switch-base-8/-64, OLMoE-1B-7B, DeepSeek-VL2-Tiny): size
# defaults, one expert MLP's matrices in order, the other variants run.
_KEYS = ('num_experts', 'batch_sizes', 'd_model', 'd_ff', 'top_k')
_family = lambda *values, matrices, others: dict(
    zip(_KEYS, values),
    matrices=tuple(matrices.split()),
    references=tuple(others.split()),
)
_SWIGLU = 'gate up down'
FAMILIES = {
    'switch': _family(
        (8, 64), (1, 8), 768, 3072, 1, matrices='wi wo', others='ragged dense'
    ),
    'olmoe': _family(
        (64,), (1,), 2048, 1024, 8, matrices=_SWIGLU, others='ragged dense all'
    ),
    'deepseek': _family(
        (64,), (1,), 1280, 896, 6, matrices=_SWIGLU, others='dense all'
    ),
}


def define_flags() -> None:
  """Defines the flags, only when run (tests import several scripts); a size
  flag left unset takes FAMILIES'."""
  flags.DEFINE_enum('family', 'switch', list(FAMILIES), 'The sparse layer.')
  flags.DEFINE_list('num_experts', None, 'Values of E.')
  flags.DEFINE_list('batch_sizes', None, 'Records per call (B).')
  flags.DEFINE_integer('top_k', None, 'Routed experts per token.')
  flags.DEFINE_integer('shared_experts', 2, 'Shared experts (deepseek only).')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record (S).')
  flags.DEFINE_integer('d_model', None, 'Model width.')
  flags.DEFINE_integer('d_ff', None, 'Expert hidden width.')
  flags.DEFINE_integer('expert_capacity', 64, 'Per-record capacity (switch).')
  flags.DEFINE_integer('repeats', 5, 'Timed rounds per variant.')
  flags.DEFINE_float(
      'max_dense_gflop', 250.0, 'Do not time other variants above this GFLOP.'
  )


PASSES = ('fwd', 'fwd+bwd')
_NAN = float('nan')


def ideal_flops(
    tokens, d_model, d_ff, num_experts, top_k=1, matmuls=2, shared=0
):
  """Forward FLOPs of top-k routing done perfectly: k expert MLPs of
  `matmuls` matrices per token, plus the `shared` experts' one MLP of
  width shared x d_ff per token, plus the router."""
  mlp = matmuls * 2 * d_model * d_ff
  return tokens * (top_k + shared) * mlp + 2 * tokens * d_model * num_experts


def grouped_blocks(rows: int, num_experts: int) -> tuple[int, int]:
  """(block size, static number of blocks) of `moe.grouped_linear` for `rows`."""
  block = moe.block_size(rows, num_experts)
  return block, moe.static_num_blocks(rows, num_experts, block)


def layer_config(family, *, num_experts, d_model, d_ff, top_k=1, **extra):
  """The config of one sparse layer of `family` (Switch, OLMoE or DeepSeek);
  `extra`: expert_capacity (Switch, 64), shared_experts (DeepSeek, 2)."""
  if family == 'switch':
    if top_k != 1:
      raise ValueError(f'Switch routes top-1; got top_k={top_k} (use olmoe)')
    return switch.SwitchConfig(
        d_model=d_model,
        d_ff=d_ff,
        num_experts=num_experts,
        expert_capacity=extra.get('expert_capacity', 64),
    )
  sizes = dict(hidden_size=d_model, num_experts_per_tok=top_k)
  if family == 'olmoe':
    return olmoe.OlmoeConfig(
        **sizes, intermediate_size=d_ff, num_experts=num_experts
    )
  if family == 'deepseek':
    return deepseek.DeepseekConfig(
        **sizes,
        moe_intermediate_size=d_ff,
        n_routed_experts=num_experts,
        n_shared_experts=extra.get('shared_experts', 2),
        num_hidden_layers=1,
        first_k_dense_replace=0,
    )
  raise ValueError(f'unknown family {family!r}; use one of {sorted(FAMILIES)}')


def sparse_layer(config, rank: int = 0):
  """The sparse layer of `config`: Switch's, or the decoder kit's."""
  if isinstance(config, switch.SwitchConfig):
    return switch.SwitchSparseMLP(config, rank=rank)
  return decoder.SparseMLP(config, rank=rank)


def _route(c, logits: jax.Array) -> moe.Routing:
  """The layer's own top-k routing, as `decoder.SparseMLP` routes."""
  extra = (c.topk_renormalised, c.routing_groups, c.routed_scaling_factor)
  return moe.route_topk(logits, c.top_k, *extra)


def _expert_mlp(rows: jax.Array, kernels: tuple[jax.Array, ...]) -> jax.Array:
  """One expert's MLP on rows: ReLU (wi, wo) or SwiGLU (gate, up, down; OLMoE's silu)."""
  if len(kernels) == 2:
    w_in, w_out = kernels
    return jax.nn.relu(rows @ w_in) @ w_out
  w_gate, w_up, w_down = kernels
  return (jax.nn.silu(rows @ w_gate) * (rows @ w_up)) @ w_down


def _with_input_grad(forward, scalar=None):
  """(forward, forward_backward): f(weights, x) and the gradient in x of
  `scalar(weights, x, cotangent)` (default: <forward(weights, x), cotangent>).
  """
  if scalar is None:
    scalar = lambda weights, x, ct: jnp.vdot(forward(weights, x), ct)

  def forward_backward(weights, x, cotangent):
    return jax.grad(lambda x: scalar(weights, x, cotangent))(x)

  return forward, forward_backward


def _one_expert_fns(config):
  """The ideal top-k compute as plain matmuls: router + one expert MLP per row
  (+ the shared experts' MLP per token)."""
  k = config.top_k

  def forward(weights, x):
    (w_router, *kernels), shared = weights
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ w_router
    out = _expert_mlp(jnp.repeat(tokens, k, axis=0), kernels)
    out = out.reshape(x.shape[:-1] + (k, x.shape[-1])).sum(-2)
    return (out + _expert_mlp(x, shared) if shared else out), logits

  def scalar(weights, x, cotangent):
    out, logits = forward(weights, x)
    return jnp.vdot(out, cotangent) + jnp.sum(logits)

  return _with_input_grad(forward, scalar)


def _all_experts_fns(config):
  """Every SwiGLU expert on every token, mixed by the top-k gates (tokens x E
  work), plus the shared experts' MLP."""

  def forward(weights, x):
    (w_router, w_gate, w_up, w_down), shared = weights
    routing = _route(config, x.astype(jnp.float32) @ w_router)
    gates = jnp.einsum(
        'bske,bsk->bse',
        jax.nn.one_hot(routing.experts, config.num_experts),
        routing.weights,
    )
    up = lambda w: jnp.einsum('bsd,edf->bsef', x, w)
    h = jax.nn.silu(up(w_gate)) * up(w_up) * gates[..., None].astype(x.dtype)
    out = jnp.einsum('bsef,efd->bsd', h, w_down)
    return out + _expert_mlp(x, shared) if shared else out

  return _with_input_grad(forward)


def _variants(config, params, matrices, references):
  """({variant: (forward, forward_backward)}, {variant: its weights}): the
  layer per dispatch, and the references on its router and expert kernels
  (in `matrices` order) and shared experts' (gate, up, down) kernels."""
  p = params['params']
  w_router = p['router']['kernel']
  kernels = [p['experts'][m]['kernel'] for m in matrices]
  shared = p.get('shared_experts') or {}
  shared = tuple(shared[m]['kernel'] for m in ('gate', 'up', 'down') if shared)
  fns = {}
  for v in ('grouped', 'ragged', 'dense'):
    layer = sparse_layer(dataclasses.replace(config, dispatch=v))
    fns[v] = _with_input_grad(lambda p, x, layer=layer: layer.apply(p, x)[0])
  weights = dict.fromkeys(fns, params)
  fns['one_expert'] = _one_expert_fns(config)
  weights['one_expert'] = ((w_router,) + tuple(w[0] for w in kernels), shared)
  if 'all' in references:
    fns['all'] = _all_experts_fns(config)
    weights['all'] = ((w_router, *kernels), shared)
  return fns, weights


def _time_pass(fns, args, i, references, repeats, max_dense_gflop):
  """(FLOP and time columns, {variant: call}) of pass `i` (0: forward, 1:
  forward+backward) of every variant; a reference variant above
  `max_dense_gflop` is not timed (NaN)."""
  compiled = {v: jax.jit(fns[v][i]).lower(*args[v]).compile() for v in fns}
  grouped_raw, grouped = harness.loop_corrected_flops(
      fns['grouped'][i], *args['grouped'], compiled=compiled['grouped']
  )
  ref_flops = {v: harness.flops(compiled[v]) for v in references}
  timed = ('one_expert', 'grouped') + tuple(
      v for v in references if ref_flops[v] <= max_dense_gflop * 1e9
  )
  calls = {v: functools.partial(compiled[v], *args[v]) for v in timed}
  pairs = [(v, 'grouped') for v in timed[2:]] + [('grouped', 'one_expert')]
  ms, ratios = harness.interleaved_medians(calls, repeats=repeats, pairs=pairs)
  row = dict(grouped_xla_gflop=grouped_raw / 1e9, grouped_gflop=grouped / 1e9)
  for v in references:
    row[f'{v}_gflop'] = ref_flops[v] / 1e9
    row[f'{v}_over_grouped'] = ratios.get((v, 'grouped'), _NAN)
  for v in ('one_expert', 'grouped') + references:
    row[f'{v}_ms'] = ms.get(v, _NAN)
  row['grouped_over_one_expert'] = ratios['grouped', 'one_expert']
  return row, calls


def run(*, family='switch', repeats=5, max_dense_gflop=250.0, **options):
  """Measures every (E, B, pass); returns one dict per row of the tables.

  `options`: the sizes (`FAMILIES[family]`'s where left out or None),
  seq_len (128), expert_capacity (64), shared_experts (2), seed (0). Row
  keys: E, B, k, pass, block, blocks, ideal_gflop, grouped_xla_gflop,
  grouped_gflop (loop-corrected), per other variant v of the family's
  `references` v_gflop, v_ms (NaN when skipped) and v_over_grouped;
  one_expert_ms, grouped_ms, grouped_over_one_expert and max_abs_diff (the
  largest |grouped - v| of the forward outputs of the variants that ran).
  """
  spec = FAMILIES[family]
  get = lambda k: spec[k] if options.get(k) is None else options[k]
  top_k, d_model, d_ff = get('top_k'), get('d_model'), get('d_ff')
  seq_len, seed = options.get('seq_len', 128), options.get('seed', 0)
  shared = options.get('shared_experts', 2)
  references, matrices = spec['references'], spec['matrices']
  rows_out = []
  for e in get('num_experts'):
    capacity = options.get('expert_capacity', 64)
    config = layer_config(
        family,
        num_experts=e,
        d_model=d_model,
        d_ff=d_ff,
        top_k=top_k,
        expert_capacity=capacity,
        shared_experts=shared,
    )
    for b in get('batch_sizes'):
      key = jax.random.fold_in(jax.random.PRNGKey(seed), e * 1000 + b)
      k_param, k_x, k_ct = jax.random.split(key, 3)
      x = jax.random.normal(k_x, (b, seq_len, d_model), jnp.float32)
      cotangent = jax.random.normal(k_ct, x.shape, jnp.float32)
      layer = sparse_layer(config)
      params = {'params': initializers.init_params(layer, k_param, (x,))}
      fns, weights = _variants(config, params, matrices, references)
      tokens = b * seq_len
      block, blocks = grouped_blocks(tokens * top_k, e)
      shared_mlps = shared if family == 'deepseek' else 0
      ideal = ideal_flops(
          tokens, d_model, d_ff, e, top_k, len(matrices), shared_mlps
      )
      rows, out = [], {}
      for i, name in enumerate(PASSES):
        args = {v: (weights[v], x) + ((cotangent,) if i else ()) for v in fns}
        row, calls = _time_pass(
            fns, args, i, references, repeats, max_dense_gflop
        )
        rows.append(
            dict(E=e, B=b, k=top_k, block=block, blocks=blocks, **row)
            | {'pass': name, 'ideal_gflop': ideal * (i + 1) / 1e9}
        )
        if i == 0:
          out = {v: calls[v]() for v in ('grouped',) + references if v in calls}
      diffs = [float(jnp.max(jnp.abs(out['grouped'] - out[v]))) for v in out]
      for row in rows:  # the references' (out[grouped] - itself is 0)
        row['max_abs_diff'] = max(diffs) if len(diffs) > 1 else _NAN
      rows_out += rows
  return rows_out


_COLUMNS = ('E', 'B', 'k', 'pass')  # the first columns of both tables


def _references(rows: list[dict]) -> tuple[str, ...]:
  return tuple(v for v in ('ragged', 'dense', 'all') if f'{v}_gflop' in rows[0])


def flops_table(rows: list[dict]) -> str:
  columns = [(c, c, '') for c in _COLUMNS] + [
      ('block x blocks', 'blocks_text', ''),
      ('ideal GF', 'ideal_gflop', '.2f'),
      ('grouped XLA raw GF', 'grouped_xla_gflop', '.3f'),
      ('grouped GF (loops x trips)', 'grouped_gflop', '.2f'),
      ('grouped/ideal', 'grouped_over_ideal', '.3f'),
  ]
  for v in _references(rows):
    columns += [(f'{v} GF', f'{v}_gflop', '.1f')]
    columns += [(f'{v}/ideal', f'{v}_over_ideal', '.2f')]
  per_ideal = lambda r: {
      f'{v}_over_ideal': r[f'{v}_gflop'] / r['ideal_gflop']
      for v in ('grouped',) + _references(rows)
  }
  blocks = lambda r: dict(blocks_text=f"{r['block']} x {r['blocks']}")
  return harness.dict_table(
      columns, [dict(r, **blocks(r), **per_ideal(r)) for r in rows]
  )


def time_table(rows: list[dict]) -> str:
  refs = _references(rows)
  columns = [(c, c, '') for c in _COLUMNS]
  columns += [('1-expert ms', 'one_expert_ms', '.1f')]
  columns += [(f'{v} ms', f'{v}_ms', '.1f') for v in ('grouped',) + refs]
  columns += [(f'{v}/grouped', f'{v}_over_grouped', '.2f') for v in refs]
  columns += [('grouped/1-expert', 'grouped_over_one_expert', '.2f')]
  columns += [(f"max|grouped-{'/'.join(refs)}|", 'max_abs_diff', '.1e')]
  return harness.dict_table(columns, rows)


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  spec = FAMILIES[FLAGS.family]
  sizes = {k: FLAGS[k].value or spec[k] for k in _KEYS}
  for name in ('num_experts', 'batch_sizes'):
    sizes[name] = [int(v) for v in sizes[name]]
  shared = f' + {FLAGS.shared_experts} shared' * (FLAGS.family == 'deepseek')
  print(
      f"one {FLAGS.family} sparse layer: d_model={sizes['d_model']}"
      f" d_ff={sizes['d_ff']} S={FLAGS.seq_len} top-{sizes['top_k']}{shared};"
      f' {jax.devices()[0].platform}, jax {jax.__version__}; medians of'
      f' {FLAGS.repeats} interleaved rounds; ratios are medians of per-round'
      ' ratios',
      flush=True,
  )
  names = ('seq_len', 'expert_capacity', 'shared_experts', 'repeats')
  names += ('family', 'max_dense_gflop')
  rows = run(**sizes, **{name: FLAGS[name].value for name in names})
  print('\nFLOPs (GF = 1e9; XLA cost analysis counts a loop body once)')
  print(flops_table(rows))
  print('\nWall time')
  print(time_table(rows))


if __name__ == '__main__':
  define_flags()
  app.run(main)
