r"""Plans a privacy budget: calibrates noise multipliers and prints a table.

Run before training to see what noise a budget buys:

  python launch/privacy.py --epsilon=8 --n=67349 --batch_size=1000 \
      --epochs=20 --rho=0.9
  python launch/privacy.py --epsilon=8 --n=67349 --batch_size=1000 \
      --epochs=20 --method=dpsgd

``--method=raptor`` (alternating streams, independent samples), ``joint`` (one
sample drives both streams, the "w/o alternating" ablation) or ``dpsgd``
(monolithic). Besides the PLD epsilon that training will report, the table
shows what basic composition and an RDP accountant would give for the same
noise multipliers.
"""

import sys
import time

from absl import app
from absl import flags
import dp_accounting

from raptor_jax import _validate, accounting

_EPSILON = flags.DEFINE_float('epsilon', 8.0, 'Target epsilon of the run.')
_DELTA = flags.DEFINE_float('delta', None, 'Target delta; default 1/n**1.1.')
_N = flags.DEFINE_integer(
    'n', None, 'Number of private records.', required=True
)
_BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 1000, 'Expected (Poisson) batch size B.'
)
_EPOCHS = flags.DEFINE_integer(
    'epochs', 20, 'Epochs; one epoch is ceil(n / B) cycles.'
)
_RHO = flags.DEFINE_float('rho', 0.9, "Shared stream's share of the budget.")
_METHOD = flags.DEFINE_enum(
    'method',
    'raptor',
    ['raptor', 'joint', 'dpsgd'],
    'Which mechanism to plan for.',
)


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
  """Epsilon of ``event`` under the RDP accountant (looser, for comparison)."""
  return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def plan(
    *,
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    rho: float,
    method: str,
) -> list[tuple[str, str]]:
  """Calibrates the noise for ``method`` and returns the table rows."""
  start = time.perf_counter()
  if method == 'dpsgd':
    sigma = accounting.calibrate_dpsgd(
        target_epsilon=epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
    )
    seconds = time.perf_counter() - start
    event = accounting.dpsgd_event(
        noise_multiplier=sigma, sample_rate=sample_rate, steps=steps
    )
    rows = [
        ('noise_multiplier', f'{sigma:.4f}'),
        ('epsilon (PLD)', f'{accounting.epsilon(event, delta):.4f}'),
    ]
  else:
    joint = method == 'joint'
    sigmas = accounting.calibrate_raptor(
        target_epsilon=epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        rho=rho,
        joint=joint,
    )
    seconds = time.perf_counter() - start
    own = [
        accounting.dpsgd_epsilon(
            noise_multiplier=sigma,
            sample_rate=sample_rate,
            steps=steps,
            delta=delta / 2,
        )
        for sigma in sigmas
    ]
    event = accounting.raptor_event(
        sigma_shared=sigmas[0],
        sigma_expert=sigmas[1],
        sample_rate=sample_rate,
        steps_shared=steps,
        steps_expert=steps,
        joint=joint,
    )
    rows = [
        ('sigma_shared', f'{sigmas[0]:.4f}'),
        ('sigma_expert', f'{sigmas[1]:.4f}'),
        ('epsilon shared alone (delta/2)', f'{own[0]:.4f}'),
        ('epsilon expert alone (delta/2)', f'{own[1]:.4f}'),
    ]
    spent = accounting.epsilon(event, delta)
    if joint:
      rows += [
          ('sigma_eff (one sample)', f'{accounting.sigma_eff(*sigmas):.4f}'),
          ('epsilon (PLD, joint)', f'{spent:.4f}'),
          ('basic composition', 'n/a: one sample, epsilons do not add'),
      ]
    else:
      rows += [
          ('epsilon (PLD, composed)', f'{spent:.4f}'),
          ('basic composition (sum)', f'{sum(own):.4f}'),
      ]
  return rows + [
      ('epsilon (RDP, same sigmas)', f'{rdp_epsilon(event, delta):.4f}'),
      ('calibration time', f'{seconds:.1f} s'),
  ]


def main(argv: list[str]) -> None:
  del argv
  n, batch_size, epochs = _N.value, _BATCH_SIZE.value, _EPOCHS.value
  try:
    _validate.check(
        1 <= batch_size <= n,
        '--batch_size',
        f'in [1, n] for --n={n}',
        batch_size,
    )
    _validate.positive_int('--epochs', epochs)
    q = batch_size / n
    steps = epochs * accounting.steps_per_epoch(q)
    delta = _DELTA.value
    if delta is None:
      delta = accounting.default_delta(n)
    accounting.validate_delta(delta, n)
    print(
        f'{_METHOD.value}: n={n} B={batch_size} q={q:.6g} epochs={epochs}'
        f' steps={steps} delta={delta:.3g} target epsilon={_EPSILON.value:g}'
        + ('' if _METHOD.value == 'dpsgd' else f' rho={_RHO.value:g}')
    )
    rows = plan(
        epsilon=_EPSILON.value,
        delta=delta,
        sample_rate=q,
        steps=steps,
        rho=_RHO.value,
        method=_METHOD.value,
    )
  except ValueError as error:
    sys.exit(f'error: {error}')
  width = max(len(label) for label, _ in rows)
  for label, value in rows:
    print(f'  {label:<{width}}  {value}')


if __name__ == '__main__':
  app.run(main)
