r"""Compile time of every program the trainer builds, by model, depth and batch.

Per model shape (switch-base-8, OLMoE-1B-7B, the DeepSeek-VL2-Tiny language
model, Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, Mixtral-8x7B; reduced vocabulary),
depth (2 blocks and full), microbatch and `scan_layers`, in one process:
parameter set-up (`models.init_params`), then lower and compile seconds,
optimised HLO instructions and the largest while-loop trip count of every
program the trainer compiles ahead: the owner pass, per stream (shared;
expert: l*'s owner slices) zero sums, accumulate, packed update and
unpack, and evaluation. The programs are lowered against the parameters'
shapes, so full-depth shapes larger than this machine's memory compile too;
set-up is timed where the parameters fit in `--draw_limit_gb` (else NaN),
once per model, depth and scan setting.

  python -m launch.bench.compile_time --models=switch --dtype=bfloat16 \
      --microbatches=32 --depths=2,full
  python -m launch.bench.compile_time --quick   # a tiny shape, seconds
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

if __name__ == '__main__':  # first, before any library starts a thread
  from raptor_jax import host_memory as _host_memory

  _host_memory.keep_unless_disabled(sys.argv)

import itertools
import time

from absl import app
from absl import flags
import flax
import jax
import numpy as np

from launch.bench import builders
from launch.bench import harness
from raptor_jax import models, ownership
from raptor_jax.models import initializers
from raptor_jax.train import parallel
from raptor_jax.train import setup
from raptor_jax.train import step as step_lib

FLAGS = flags.FLAGS

# Published shapes (HF config.json), depth `full`; vocabularies reduced.
_DECODER = ('hidden_size', 'intermediate_size', 'num_attention_heads')
_DECODER += ('num_key_value_heads', 'num_experts', 'num_experts_per_tok')
_DEEPSEEK = ('hidden_size', 'intermediate_size', 'moe_intermediate_size')
_DEEPSEEK += ('num_attention_heads', 'num_key_value_heads', 'n_routed_experts')
_DEEPSEEK += ('n_shared_experts', 'num_experts_per_tok')
_FIXED = dict(use_mla=False, first_k_dense_replace=1)  # DeepSeek's
_decoder = lambda *sizes, **kw: dict(zip(_DECODER, sizes), **kw)
_QWEN3 = dict(moe_intermediate_size=768, head_dim=128, norm_topk_prob=True)
_QWEN2 = dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
SHAPES = {
    'switch': dict(full=12, config=builders.SWITCH_BASE_8),
    'olmoe': dict(full=16, config=_decoder(2048, 1024, 16, 16, 64, 8)),
    'deepseek': dict(
        full=12,
        config=dict(
            zip(_DEEPSEEK, (1280, 6848, 896, 10, 10, 64, 2, 6)), **_FIXED
        ),
    ),
    'qwen3_moe': dict(  # Qwen/Qwen3-30B-A3B
        full=48,
        config=_decoder(2048, 6144, 32, 4, 128, 8, **_QWEN3),
    ),
    'qwen2_moe': dict(  # Qwen/Qwen1.5-MoE-A2.7B
        full=24,
        config=_decoder(2048, 5632, 16, 16, 60, 4, **_QWEN2),
    ),
    'mixtral': dict(full=32, config=_decoder(4096, 14336, 32, 8, 8, 2)),
}
# `--quick`: every family at toy width (the toy Switch's, d_model and
# capacity doubled), for the CPU tests.
_TOY = _decoder(32, 32, 2, 2, 4, 2)
_SHARED = dict(shared_expert_intermediate_size=32)
_SWITCH = {k: builders.TOY_SWITCH[k] for k in builders.SWITCH_BASE_8}
QUICK = {
    'switch': dict(full=4, config=dict(_SWITCH, d_model=32, expert_capacity=8)),
    'olmoe': dict(full=3, config=_TOY),
    'deepseek': dict(
        full=3,
        config=dict(zip(_DEEPSEEK, (32, 64, 32, 2, 2, 4, 1, 2)), **_FIXED),
    ),
    'qwen3_moe': dict(
        full=3, config=dict(_TOY, moe_intermediate_size=16, head_dim=8)
    ),
    'qwen2_moe': dict(  # a shared expert twice as wide
        full=3, config=dict(_TOY, moe_intermediate_size=16, **_SHARED)
    ),
    'mixtral': dict(full=3, config=_TOY),
}


def define_flags() -> None:
  """Defines the flags; only when run as a script (tests import several)."""
  flags.DEFINE_list('models', list(SHAPES), 'Model shapes.')
  flags.DEFINE_list('depths', ['2', 'full'], 'Blocks: numbers or "full".')
  flags.DEFINE_list('microbatches', ['1', '8', '32'], 'Records per batch.')
  flags.DEFINE_list('scan', ['true', 'false'], 'scan_layers settings.')
  flags.DEFINE_string('dtype', 'bfloat16', 'Compute dtype.')
  flags.DEFINE_integer('seq_len', 128, 'Tokens per record.')
  flags.DEFINE_integer('vocab_size', 8000, 'Reduced vocabulary.')
  flags.DEFINE_bool('quick', False, 'Toy shapes, depths 2 and full, m = 2.')
  flags.DEFINE_float(
      'draw_limit_gb',
      4.0,
      'Time the parameter set-up only where the parameters take at most this'
      ' many GB (the programs are lowered against their shapes either way).',
  )


def model(name: str, depth: int, *, shapes, vocab_size, dtype, scan):
  """(classifier module, its config) of `name`'s shape at `depth` blocks,
  LoRA on attention and on l*'s experts (l* = the last sparse block, kept
  out of the scan as the trainer keeps it)."""
  options = dict(vocab_size=vocab_size, lora_rank=8, attention_lora=True)
  options.update(dtype=dtype, scan_layers=scan, **shapes[name]['config'])
  if name == 'switch':
    options['sparse_step'] = 2
  config_class, _, depth_field, _ = builders.BACKBONES[name]
  config = config_class(**options, **{depth_field: depth})
  config = builders.with_expert_layer(config)
  return builders.classifier(config), config


def abstract_state(dp, params) -> step_lib.StepState:
  """`dp.init(params)` as shapes (replicated, as `init` places them): the
  parameters are never allocated."""
  trainable, frozen = setup.partition(
      params, dp.phase.parts + dp.phase.clip_with
  )
  opt_state = jax.eval_shape(dp.functions.init_opt_states, trainable)
  sharding = jax.sharding.NamedSharding(dp.mesh, jax.sharding.PartitionSpec())
  placed = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
  return step_lib.StepState(
      *jax.tree.map(placed, (trainable, frozen, opt_state))
  )


def programs(module, config, params, m: int, seq_len: int, vocab_size: int):
  """[(name, jitted fn, args)]: the trainer's programs at microbatch `m`."""
  records, owners = builders.batch(m, seq_len, vocab_size, config.num_experts)
  ids, mask = records[:2]
  layer = config.sparse_layers[-1]
  rule = ownership.owner_rule(config, 'count')
  # Every sparse layer's owners: layer selection's program, which the owner
  # map reuses (results/bench before 2026-12-06's second session: l*'s only).
  owner_pass = ownership.owner_program(module.backbone, None, rule)
  out = [('owner pass', owner_pass, (params['backbone'], ids, mask))]
  state = None
  for stream in ('shared', 'expert'):
    denominator = float(m) / (config.num_experts if stream == 'expert' else 1)
    phase, extra = builders.stream_phase(stream, denominator, layer)
    dp = builders.phase_step(
        module, phase, key=jax.random.key(1), devices=1, **extra
    )
    state = abstract_state(dp, params)
    fns = dp.functions
    sums = jax.eval_shape(fns.zero_sums, state.trainable)  # not compiled
    args = builders.accumulate_args(dp, state, records, owners, sums)
    update_args = (state.trainable, state.opt_state, sums)
    layouts = tuple(sorted(fns.layouts(state.trainable).items()))
    vectors = jax.eval_shape(fns.packed_update, *update_args)[0]
    vectors = {n: vectors[n] for n, _ in layouts}
    out += [
        (f'{stream} zero', fns.zero_sums, (state.trainable,)),
        (f'{stream} accumulate', fns.accumulate, args),
        (f'{stream} update', fns.packed_update, update_args),
        (f'{stream} unpack', fns.unpack, (layouts, vectors)),
    ]
  replicated = parallel.replicate((ids, mask), dp.mesh)
  evaluate = (state.trainable, state.frozen, *replicated)
  return out + [('evaluate', step_lib.make_eval_fn(module), evaluate)]


def measure(fn, args) -> dict:
  """Lower and compile seconds, HLO instructions, largest while trip count."""
  timed = harness.compile_timed(fn, *args, jitted=True)
  text = timed.compiled.as_text() or ''
  trips = [l['trip_count'] or 0 for l in harness.while_loops(text)]
  return dict(
      lower_s=timed.lower_s,
      compile_s=timed.compile_s,
      hlo=harness.hlo_instructions(text),
      max_trip=max(trips, default=0),  # of the loops with a known count
  )


def param_shapes(module, seq_len: int) -> tuple[dict, tuple]:
  """(the parameters' tree of shapes, example inputs): nothing drawn."""
  ids = np.zeros((1, seq_len), np.int32)
  example = (ids, np.ones_like(ids))
  flat = initializers.abstract_params(module, example)
  return flax.traverse_util.unflatten_dict(flat, sep='/'), example


def gigabytes(tree) -> float:
  """The bytes of a tree of shapes, in GB."""
  leaves = jax.tree.leaves(tree)
  return sum(l.size * np.dtype(l.dtype).itemsize for l in leaves) / 1e9


def setup_seconds(module, example, shapes, draw_limit_gb: float) -> float:
  """`models.init_params` as in a fresh process (`jax.clear_caches()`
  first): compiling its draw programs and drawing every leaf; NaN, nothing
  drawn, where the parameters (`shapes`) take over `draw_limit_gb`."""
  if gigabytes(shapes) > draw_limit_gb:
    return float('nan')
  jax.clear_caches()
  start = time.perf_counter()
  params = models.init_params(module, jax.random.key(0), example)
  jax.block_until_ready(params)
  return time.perf_counter() - start


def setting_rows(
    name,
    depth,
    m,
    scan,
    *,
    shapes,
    seq_len,
    vocab_size,
    dtype,
    draw_limit_gb=4.0,
    setups=None,
):
  """(set-up seconds, one dict per program) of one setting.

  The programs are lowered against the parameters' shapes, so a shape
  larger than this machine's memory still compiles. Set-up is timed where
  the parameters take at most `draw_limit_gb` (else NaN), once per (model,
  depth, scan) when `setups` (a dict) keeps it across microbatches.
  """
  module, config = model(
      name, depth, shapes=shapes, vocab_size=vocab_size, dtype=dtype, scan=scan
  )
  params, example = param_shapes(module, seq_len)
  setups = {} if setups is None else setups
  key = (name, depth, scan)
  if key not in setups:
    setups[key] = setup_seconds(module, example, params, draw_limit_gb)
  jax.clear_caches()  # every setting compiles from scratch
  made = programs(module, config, params, m, seq_len, vocab_size)
  return setups[key], [dict(program=p, **measure(f, a)) for p, f, a in made]


def summary(rows) -> dict:
  """Per stream: lower + compile seconds of its zero, accumulate, update and
  unpack; the update's compile; the largest HLO and trip count."""
  out = {}
  for stream in ('shared', 'expert'):
    mine = [r for r in rows if r['program'].startswith(stream)]
    out[f'{stream}_s'] = sum(r['lower_s'] + r['compile_s'] for r in mine)
    (update,) = [r for r in mine if r['program'].endswith('update')]
    out[f'{stream}_update_s'] = update['lower_s'] + update['compile_s']
  out['all_s'] = sum(r['lower_s'] + r['compile_s'] for r in rows)
  out['max_hlo'] = max(r['hlo'] for r in rows)
  out['max_trip'] = max(r['max_trip'] for r in rows)
  return out


SETTING_COLUMNS = (  # (header, key or keys, format): a setting's columns
    ('model', 'model', ''),
    ('blocks', 'blocks', 'd'),
    ('m', 'm', 'd'),
    ('scan', 'scan', ''),
)
PROGRAM_COLUMNS = SETTING_COLUMNS + (
    ('program', 'program', ''),
    ('lower s', 'lower_s', '.2f'),
    ('compile s', 'compile_s', '.2f'),
    ('HLO instr', 'hlo', 'd'),
    ('max while trips', 'max_trip', 'd'),
)
SUMMARY_COLUMNS = SETTING_COLUMNS + (
    ('set-up s', 'setup_s', '.2f'),
    ('shared stream s', 'shared_s', '.2f'),
    ('expert stream s', 'expert_s', '.2f'),
    (
        'updates s (shared, expert)',
        ('shared_update_s', 'expert_update_s'),
        '.2f',
    ),
    ('all programs s', 'all_s', '.2f'),
    ('max HLO instr', 'max_hlo', 'd'),
    ('max while trips', 'max_trip', 'd'),
)


def run(names, depths, microbatches, scans, *, quick=False, **options):
  """Every setting's summary dict (and each program's row through `echo`,
  default print); `options`: seq_len (128), vocab_size (8000), dtype."""
  shapes, echo = QUICK if quick else SHAPES, options.pop('echo', print)
  options = dict(
      dict(seq_len=128, vocab_size=8000, dtype='bfloat16'), **options
  )
  summaries, setups = [], {}
  for name, depth, m, scan in itertools.product(
      names, depths, microbatches, scans
  ):
    blocks = shapes[name]['full'] if depth == 'full' else int(depth)
    setup_s, rows = setting_rows(
        name, blocks, m, scan, shapes=shapes, setups=setups, **options
    )
    key = dict(model=name, blocks=blocks, m=m, scan=str(scan))
    echo(harness.dict_table(PROGRAM_COLUMNS, [dict(key, **r) for r in rows]))
    summaries.append(dict(key, setup_s=setup_s, **summary(rows)))
  echo(harness.dict_table(SUMMARY_COLUMNS, summaries))
  return summaries


def main(argv):
  del argv
  quick = FLAGS.quick
  print(
      f'# python -m launch.bench.compile_time {" ".join(sys.argv[1:])}'
      f' ({jax.default_backend()}, jax {jax.__version__}, dtype'
      f' {FLAGS.dtype}, seq_len {16 if quick else FLAGS.seq_len},'
      f' vocab {FLAGS.vocab_size})',
      flush=True,
  )
  microbatches = [2] if quick else [int(m) for m in FLAGS.microbatches]
  scans = [s.lower() in ('1', 'true', 'yes') for s in FLAGS.scan]
  options = dict(vocab_size=FLAGS.vocab_size, dtype=FLAGS.dtype, quick=quick)
  options.update(draw_limit_gb=FLAGS.draw_limit_gb)
  options.update(seq_len=16 if quick else FLAGS.seq_len)
  echo = lambda text: print(text, '\n', flush=True)
  run(FLAGS.models, FLAGS.depths, microbatches, scans, echo=echo, **options)


if __name__ == '__main__':
  define_flags()
  app.run(main)
