r"""Plans a privacy budget: the noise a budget buys, or the budget noise spends.

The noise of the trainer's own plan (`methods.build_plan`) for a training
config, any method, before training:

  python launch/privacy.py --config=configs/glue.py:task=sst2 --n=67349
  python launch/privacy.py --config=configs/glue.py:preset=tiny \
      --method=baseline_b --epsilon=4
  python launch/privacy.py --epsilon=8 --n=67349 --batch_size=1000 \
      --epochs=20 --rho=0.9

The reverse: the epsilon at delta that given noise multipliers spend
(`--sigma_shared` and `--sigma_expert` for RAPTOR's two streams, `--sigma`
for the one-sigma methods):

  python launch/privacy.py --config=configs/glue.py:preset=tiny \
      --sigma_shared=0.9 --sigma_expert=3

`--config` takes the files (and `--config.<field>=...` overrides) of
launch/main.py; without it the base config (configs/glue.py's paper
defaults) is planned. n is the number of training records: counted from the
config's data (the generated task's size, `data.train_limit`, or the rows of
`data.train_path`), else `--n`. `--method`, `--epsilon`, `--delta`,
`--batch_size`, `--epochs` and `--rho` override the config's fields;
`--method=joint` is RAPTOR with `raptor.alternate=False` and
`--method=dpsgd` is `monolithic`. Besides the PLD epsilon that training
reports, the table shows what basic composition and an RDP accountant give
for the same noise multipliers.
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import dp_accounting
from ml_collections import config_flags

from raptor_jax import _validate, accounting

_CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    "A training config file, as launch/main.py's --config (default: the base"
    ' config).',
    lock_config=True,
)
_EPSILON = flags.DEFINE_float(
    'epsilon', None, 'Target epsilon (privacy.epsilon; default 8).'
)
_DELTA = flags.DEFINE_float(
    'delta', None, 'Target delta (privacy.delta; default 1/n**1.1).'
)
_N = flags.DEFINE_integer(
    'n',
    None,
    'Number of private training records (default: counted from the data).',
)
_BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', None, 'Expected (Poisson) batch size B (batch_size).'
)
_EPOCHS = flags.DEFINE_integer(
    'epochs', None, 'Epochs; one epoch is ceil(n / B) cycles (epochs).'
)
_RHO = flags.DEFINE_float(
    'rho', None, "Shared stream's share of the budget (privacy.rho)."
)
# The trainer's names, and the two old planner names.
_ALIASES = {'joint': 'raptor', 'dpsgd': 'monolithic'}
_METHOD = flags.DEFINE_string(
    'method',
    None,
    'The method (config.method): raptor, baseline_a, baseline_b, baseline_c,'
    ' monolithic, monolithic_lora; joint (= raptor with'
    ' raptor.alternate=False), dpsgd (= monolithic).',
)
_SIGMA = flags.DEFINE_float(
    'sigma',
    None,
    'Reverse mode: the noise multiplier of a one-sigma method.',
)
_SIGMA_SHARED = flags.DEFINE_float(
    'sigma_shared', None, "Reverse mode: RAPTOR's shared-stream sigma."
)
_SIGMA_EXPERT = flags.DEFINE_float(
    'sigma_expert', None, "Reverse mode: RAPTOR's expert-stream sigma."
)


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  """Epsilon of ``event`` under the RDP accountant (looser, for comparison)."""
  return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def training_config():
  """The config to plan: --config (or the base config) with the flags over it."""
  from raptor_jax.train import config as config_lib
  from raptor_jax.train import methods

  config = _CONFIG.value
  config = (
      config_lib.base_config()
      if config is None
      else config.copy_and_resolve_references()
  )
  method = _METHOD.value
  if method is not None:
    _validate.one_of(
        '--method',
        method,
        (*methods.METHODS, *_ALIASES),
        "the trainer's method names (or joint, dpsgd)",
    )
    config.method = _ALIASES.get(method, method)
    if method == 'joint':
      config.raptor.alternate = False
  for flag, field in (
      (_EPSILON, ('privacy', 'epsilon')),
      (_DELTA, ('privacy', 'delta')),
      (_RHO, ('privacy', 'rho')),
      (_BATCH_SIZE, ('batch_size',)),
      (_EPOCHS, ('epochs',)),
  ):
    if flag.value is not None:
      target = config
      for key in field[:-1]:
        target = target[key]
      target[field[-1]] = flag.value
  _validate.check(
      config.method in methods.PRIVATE_METHODS,
      '--method',
      f'a private method ({", ".join(methods.PRIVATE_METHODS)})',
      config.method,
      f'{config.method} trains without clipping or noise: it has no epsilon'
      ' to plan',
  )
  return config


def train_records(config) -> int:
  """n, as the trainer counts it (`len(run_data.train)`), without loading a model.

  Raises:
    ValueError: n needs data this machine does not have (one line: pass --n).
  """
  from raptor_jax.data import tables, tasks
  from raptor_jax import canaries
  from raptor_jax.train import setup

  dc = config.data
  if canaries.requested(config):
    raise ValueError(
        'n: an audit config adds its included canaries to n; pass --n=N (the'
        ' n of its privacy_report.json)'
    )
  if dc.task == 'synthetic':
    return int(dc.synthetic.n_train)
  spec = setup.task_spec(dc)
  if not dc.train_path:
    if dc.train_limit:  # the trainer refuses a split with fewer records
      return int(dc.train_limit)
    try:
      columns = (
          tables.load_hub_columns(
              spec.hub_id,
              spec.hub_config,
              spec.splits['train'],
              fix='pass --n=N',
          )
          if spec.hub_id
          else None
      )
    except FileNotFoundError:
      columns = None
    if columns is None:
      raise ValueError(
          f'n: the train split of task {spec.name} is neither a local file'
          ' nor in the datasets cache, so its records cannot be counted;'
          ' pass --n=N or set --config.data.train_path'
      )
  else:
    columns = tables.read_columns(dc.train_path, split=spec.splits['train'])
  total = len(next(iter(columns.values()), []))
  if dc.train_limit:
    _validate.check(
        dc.train_limit <= total,
        'data.train_limit',
        f'at most the {total} records of {dc.train_path or spec.hub_id}',
        dc.train_limit,
        _validate.config_fix('data.train_limit'),
    )
    return int(dc.train_limit)
  return total


def given_noise(config) -> dict[str, float] | None:
  """The --sigma* flags of the reverse mode (None: calibrate), checked."""
  from raptor_jax.train import methods

  flags_given = {
      name: flag.value
      for name, flag in (
          ('sigma', _SIGMA),
          ('sigma_shared', _SIGMA_SHARED),
          ('sigma_expert', _SIGMA_EXPERT),
      )
      if flag.value is not None
  }
  if not flags_given:
    return None
  needed = methods.noise_fields(config)
  wanted = ' and '.join(f'--{name}' for name in needed)
  for name, value in flags_given.items():
    _validate.check(
        name in needed,
        f'--{name}',
        f'unset for method {config.method} with this config, which takes'
        f' {wanted}',
        value,
        f'give {wanted} instead',
    )
    _validate.positive(f'--{name}', value, 'give a noise multiplier > 0')
  for name in needed:
    _validate.check(
        name in flags_given,
        f'--{name}',
        f'set with {" ".join("--" + k for k in flags_given)} (method'
        f' {config.method} takes {wanted})',
        None,
        f'give {wanted}',
    )
  _validate.check(
      _EPSILON.value is None,
      '--epsilon',
      'unset when the noise is given (the planner then computes epsilon)',
      _EPSILON.value,
      'drop --epsilon, or drop the --sigma flags to calibrate to it',
  )
  return flags_given


def rows_of(plan, delta: float) -> list[tuple[str, str]]:
  """The table of a plan: its noise per part and the epsilon it spends."""
  from raptor_jax.train import plans

  q, steps = plan.sample_rate, plan.cycles
  rows = [
      (f'sigma_{name}', f'{part["noise_multiplier"]:.6g}')
      for name, part in plans.noise_summary(plan).items()
  ]
  event = plan.event()
  spent = accounting.epsilon(event, delta)
  if len(plan.phases) > 1:
    alone = [
        accounting.dpsgd_epsilon(
            noise_multiplier=phase.noise_multiplier,
            sample_rate=q,
            steps=steps,
            delta=delta / len(plan.phases),
        )
        for phase in plan.phases
    ]
    # The run's epsilon first; each stream's own figure is a bound at a
    # share of delta (above the composed one: it is not what the run spends).
    share = f'delta/{len(plan.phases)}'
    rows.append(('epsilon (PLD, composed)', f'{spent:.4f}'))
    rows += [
        (f'bound: {p.name} stream alone at {share}', f'{e:.4f}')
        for p, e in zip(plan.phases, alone)
    ]
    rows.append(('bound: basic composition (sum)', f'{sum(alone):.4f}'))
  elif len(plan.phases[0].parts) > 1 and not plan.phases[0].joint_clip:
    rows += [
        ('sigma_eff (one sample)', f'{plan.phases[0].noise_multiplier:.6g}'),
        ('epsilon (PLD, joint)', f'{spent:.4f}'),
        ('basic composition', 'n/a: one sample, epsilons do not add'),
    ]
  else:
    rows.append(('epsilon (PLD)', f'{spent:.4f}'))
  return rows + [
      ('epsilon (RDP, same sigmas)', f'{rdp_epsilon(event, delta):.4f}')
  ]


def main(argv: list[str]) -> None:
  del argv
  # dp_accounting's RDP warnings and the libraries' import chatter.
  absl_logging.set_verbosity(absl_logging.ERROR)
  with _validate.errors_exit_in_one_line():
    from raptor_jax.train import methods
    from raptor_jax.train import run as run_lib

    config = training_config()
    run_lib.validate(config)
    n = _N.value
    if n is None:
      n = train_records(config)
    _validate.positive_int('--n', n, 'pass the number of training records')
    noise = given_noise(config)
    batch_size, epochs = methods.run_sizes(config, n)  # 0: chosen from n
    _validate.check(
        1 <= batch_size <= n,
        'batch_size',
        f'in [1, n] for n={n}',
        batch_size,
        f'set --batch_size={max(1, n // 10)} (n / 10), or check --n',
    )
    start = time.perf_counter()
    plan = methods.build_plan(
        config,
        n=n,
        num_experts=1,  # denominators only: no effect on the noise
        sparse_layers=(0,),
        expert_layer=0,
        noise=noise,
    )
    seconds = time.perf_counter() - start
    rc = config.raptor
    rho = config.method == 'raptor' and not (rc.joint_clip and not rc.alternate)
    print(
        f'{config.method}: n={n} B={batch_size} q={plan.sample_rate:.6g}'
        f' epochs={epochs} steps={plan.cycles} delta={plan.delta:.3g}'
        + (
            f' target epsilon={config.privacy.epsilon:g}'
            if noise is None
            else ' given ' + ' '.join(f'{k}={v:g}' for k, v in noise.items())
        )
        + (f' rho={config.privacy.rho:g}' if rho and noise is None else '')
        + ('' if rc.alternate or config.method != 'raptor' else ' one sample')
    )
    rows = rows_of(plan, plan.delta)
    if noise is None:
      rows.append(('calibration time', f'{seconds:.1f} s'))
  width = max(len(label) for label, _ in rows)
  for label, value in rows:
    print(f'  {label:<{width}}  {value}')


def _parse_flags(argv):
  """absl's flag parsing, a bad --config as one line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError) as e:
    if os.environ.get(_validate.TRACEBACK_VARIABLE):
      raise
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    sys.exit(f'error: {(lines or [type(e).__name__])[-1]}')


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
