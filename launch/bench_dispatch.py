r"""Benchmarks the expert dispatch of one sparse layer: grouped vs all-experts.

One `SwitchSparseMLP` (frozen router, Hugging Face capacity, E experts of
d_model x d_ff) on B records of S tokens, with the two dispatches of
`SwitchConfig.dispatch`:

* grouped: `moe.grouped_linear`, rows sorted by expert into fixed-size blocks
  and a `lax.scan` over the blocks (work ~ tokens x k);
* dense: `moe.dense_linear`, every expert on every token, then select
  (work ~ tokens x E), the Hugging Face / reference-code way.

Both share the router and capacity, so their outputs must agree; the table
shows the largest difference. Prints two tables, forward and forward+backward
(gradient with respect to the input, what per-record DP gradients need):

1. FLOPs. "ideal" = tokens x k x (2 * 2 d_model d_ff) + the router's
   2 tokens d_model E (doubled for forward+backward). XLA's cost analysis
   counts a loop body once, so for the grouped dispatch it shows XLA's raw
   number and the loop-corrected one (each scan body's XLA count times the
   scan's static trip count, `profiling.loop_corrected_flops`).
2. Wall time, medians of interleaved rounds (1-expert, grouped, dense, ...).
   "1-expert" is one expert MLP on every token plus the router matmul: the
   ideal top-1 compute as two plain matmuls. It is a compute floor, not a
   memory one: with few tokens per expert any dispatch must also stream the
   weights of every expert in use (E x 2 d_model d_ff floats at most), which
   one expert does not.

Paper scale (switch-base-8 / -64 widths; the defaults), and more records:

  python launch/bench_dispatch.py
  python launch/bench_dispatch.py --num_experts=8 --batch_sizes=32 \
      --max_dense_gflop=1000

The dense dispatch's wall time is skipped (its FLOPs still shown) for a pass
where XLA counts more than --max_dense_gflop for it: at E=64 it does 64x the
work and holds a [tokens, E, d_ff] buffer.
"""

import dataclasses
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from raptor_jax import profiling  # noqa: E402
from raptor_jax.models import moe, switch  # noqa: E402


def define_flags() -> None:
  """Defines the command-line flags; only when run as a script, so that tests can
  import several scripts into one process."""
  flags.DEFINE_list('num_experts', ['8', '64'], 'Values of E.')
  flags.DEFINE_list('batch_sizes', ['1', '8'], 'Records per call (B); rows = B x seq_len.')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record (S).')
  flags.DEFINE_integer('d_model', 768, 'Model width.')
  flags.DEFINE_integer('d_ff', 3072, 'Expert hidden width.')
  flags.DEFINE_integer('expert_capacity', 64, 'Per-record expert capacity (HF: 64).')
  flags.DEFINE_integer('repeats', 5, 'Timed rounds per variant.')
  flags.DEFINE_float('max_dense_gflop', 250.0,
                     'Skip timing the dense dispatch of a pass above this many GFLOP.')


PASSES = ('fwd', 'fwd+bwd')
_NAN = float('nan')


def ideal_flops(tokens: int, d_model: int, d_ff: int, num_experts: int,
                top_k: int = 1) -> float:
  """Forward FLOPs of top-k routing done perfectly: k expert MLPs per token."""
  return tokens * top_k * 2 * (2 * d_model * d_ff) + 2 * tokens * d_model * num_experts


def grouped_blocks(rows: int, num_experts: int) -> tuple[int, int]:
  """(block size, static number of blocks) of `moe.grouped_linear` for `rows`."""
  block = moe.block_size(rows, num_experts)
  return block, -(-(rows + num_experts * (block - 1)) // block)


def _layer_fns(config: switch.SwitchConfig):
  """Forward and input-gradient functions of one sparse layer: f(params, x[, ct])."""
  module = switch.SwitchSparseMLP(config)

  def forward(params, x):
    return module.apply(params, x)[0]

  def forward_backward(params, x, cotangent):
    return jax.grad(lambda x: jnp.vdot(forward(params, x), cotangent))(x)

  return forward, forward_backward


def _one_expert_fns(config: switch.SwitchConfig):
  """The ideal top-1 compute as plain matmuls: router + one expert MLP per token."""

  def forward(weights, x):
    w_router, w_in, w_out = weights
    rows = x.reshape(-1, x.shape[-1])
    logits = rows @ w_router
    out = jax.nn.relu(rows @ w_in) @ w_out
    return out.reshape(x.shape), logits

  def forward_backward(weights, x, cotangent):
    def scalar(x):
      out, logits = forward(weights, x)
      return jnp.vdot(out, cotangent) + jnp.sum(logits)
    return jax.grad(scalar)(x)

  return forward, forward_backward


def run(*, num_experts=(8, 64), batch_sizes=(1, 8), seq_len=128, d_model=768,
        d_ff=3072, expert_capacity=64, repeats=5, max_dense_gflop=250.0,
        seed=0) -> list[dict]:
  """Measures every (E, B, pass); returns one dict per row of the tables.

  Row keys: E, B, pass, block, blocks, ideal_gflop, grouped_xla_gflop,
  grouped_gflop (loop-corrected), dense_gflop, one_expert_ms, grouped_ms,
  dense_ms (NaN when skipped), max_abs_diff (grouped vs dense output, fwd).
  """
  rows_out = []
  key = jax.random.PRNGKey(seed)
  for e in num_experts:
    config = switch.SwitchConfig(d_model=d_model, d_ff=d_ff, num_experts=e,
                                 expert_capacity=expert_capacity)
    for b in batch_sizes:
      k_param, k_x, k_ct = jax.random.split(jax.random.fold_in(key, e * 1000 + b), 3)
      x = jax.random.normal(k_x, (b, seq_len, d_model), jnp.float32)
      cotangent = jax.random.normal(k_ct, x.shape, jnp.float32)
      params = jax.jit(switch.SwitchSparseMLP(config).init)(k_param, x)
      experts = params['params']['experts']
      one_expert = (params['params']['router']['kernel'],
                    experts['wi']['kernel'][0], experts['wo']['kernel'][0])
      fns = {
          'grouped': _layer_fns(config),
          'dense': _layer_fns(dataclasses.replace(config, dispatch='dense')),
          'one_expert': _one_expert_fns(config),
      }
      weights = {'grouped': params, 'dense': params, 'one_expert': one_expert}
      tokens = b * seq_len
      block, blocks = grouped_blocks(tokens, e)
      ideal = ideal_flops(tokens, d_model, d_ff, e)
      results = {}
      out = {}
      for i, name in enumerate(PASSES):
        args = {v: (weights[v], x) + ((cotangent,) if i else ()) for v in fns}
        compiled = {v: jax.jit(fns[v][i]).lower(*args[v]).compile() for v in fns}
        grouped_raw, grouped = profiling.loop_corrected_flops(
            fns['grouped'][i], *args['grouped'], compiled=compiled['grouped'])
        dense = profiling.flops(compiled['dense'])
        time_dense = dense <= max_dense_gflop * 1e9
        calls = {v: functools.partial(compiled[v], *args[v])
                 for v in ('one_expert', 'grouped', 'dense') if v != 'dense' or time_dense}
        times = profiling.interleaved_times(calls, repeats=repeats)
        results[name] = {
            'E': e, 'B': b, 'pass': name, 'block': block, 'blocks': blocks,
            'ideal_gflop': ideal * (i + 1) / 1e9,
            'grouped_xla_gflop': grouped_raw / 1e9, 'grouped_gflop': grouped / 1e9,
            'dense_gflop': dense / 1e9,
            **{f'{v}_ms': profiling.median(times[v]) * 1e3 if v in times else _NAN
               for v in ('one_expert', 'grouped', 'dense')},
            'dense_over_grouped': (profiling.paired_ratio(times['dense'], times['grouped'])
                                   if time_dense else _NAN),
            'grouped_over_one_expert': profiling.paired_ratio(times['grouped'],
                                                              times['one_expert']),
        }
        if i == 0:
          out = {v: calls[v]() for v in ('grouped', 'dense') if v in calls}
      diff = (float(jnp.max(jnp.abs(out['grouped'] - out['dense']))) if 'dense' in out
              else _NAN)
      for name in PASSES:
        results[name]['max_abs_diff'] = diff
        rows_out.append(results[name])
  return rows_out


def _fmt(value: float, spec: str) -> str:
  return '-' if np.isnan(value) else format(value, spec)


def flops_table(rows: list[dict]) -> str:
  header = ['E', 'B', 'pass', 'block x blocks', 'ideal GF', 'grouped XLA raw GF',
            'grouped GF (loops x trips)', 'grouped/ideal', 'dense GF', 'dense/ideal']
  body = [[r['E'], r['B'], r['pass'], f"{r['block']} x {r['blocks']}",
           f"{r['ideal_gflop']:.2f}", f"{r['grouped_xla_gflop']:.3f}",
           f"{r['grouped_gflop']:.2f}", f"{r['grouped_gflop'] / r['ideal_gflop']:.3f}",
           f"{r['dense_gflop']:.1f}", f"{r['dense_gflop'] / r['ideal_gflop']:.2f}"]
          for r in rows]
  return profiling.format_table(header, body)


def time_table(rows: list[dict]) -> str:
  header = ['E', 'B', 'pass', '1-expert ms', 'grouped ms', 'dense ms',
            'dense/grouped', 'grouped/1-expert', 'max|grouped-dense|']
  body = [[r['E'], r['B'], r['pass'], f"{r['one_expert_ms']:.1f}",
           f"{r['grouped_ms']:.1f}", _fmt(r['dense_ms'], '.1f'),
           _fmt(r['dense_over_grouped'], '.2f'), f"{r['grouped_over_one_expert']:.2f}",
           _fmt(r['max_abs_diff'], '.1e')]
          for r in rows]
  return profiling.format_table(header, body)


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  num_experts = [int(v) for v in FLAGS.num_experts]
  batch_sizes = [int(v) for v in FLAGS.batch_sizes]
  print(f'one sparse layer: d_model={FLAGS.d_model} d_ff={FLAGS.d_ff} '
        f'S={FLAGS.seq_len} capacity={FLAGS.expert_capacity} top-1; '
        f'{jax.devices()[0].platform}, jax {jax.__version__}; '
        f'medians of {FLAGS.repeats} interleaved rounds; ratios are medians of '
        'per-round ratios', flush=True)
  rows = run(num_experts=num_experts, batch_sizes=batch_sizes, seq_len=FLAGS.seq_len,
             d_model=FLAGS.d_model, d_ff=FLAGS.d_ff,
             expert_capacity=FLAGS.expert_capacity, repeats=FLAGS.repeats,
             max_dense_gflop=FLAGS.max_dense_gflop)
  print('\nFLOPs (GF = 1e9; XLA cost analysis counts a loop body once)')
  print(flops_table(rows))
  print('\nWall time')
  print(time_table(rows))


if __name__ == '__main__':
  define_flags()
  app.run(main)
