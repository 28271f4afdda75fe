"""A privacy ledger: what a training run has released so far, for resume.

The trainer records every noisy step as it runs; the ledger keeps, per stream,
how many steps ran with each (sample rate, noise multiplier), serialises to
JSON for checkpoints, and reports the epsilon spent so far. Accounting is by
counts, so the ledger stays a few entries long however long the run.

Example:

  >>> from raptor_jax import ledger as ledger_lib
  >>> ledger = ledger_lib.PrivacyLedger()
  >>> for step in range(500):
  ...   # one shared and one expert step, each on its own Poisson sample
  ...   ledger.record('shared', sample_rate=0.01, noise_multiplier=1.1)
  ...   ledger.record('expert', sample_rate=0.01, noise_multiplier=1.1)
  >>> ledger.steps('shared'), ledger.steps('expert')
  (500, 500)
  >>> round(ledger.epsilon(1e-5), 2)
  1.52
  >>> ledger_lib.PrivacyLedger.from_json(ledger.to_json()) == ledger
  True
"""

from collections.abc import Iterable, Mapping
import dataclasses
import json
from typing import Any

import dp_accounting

from raptor_jax import _validate, accounting

_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
  """``steps`` Poisson-sampled Gaussian releases of one stream."""

  stream: str
  sample_rate: float
  noise_multiplier: float
  steps: int


class PrivacyLedger:
  """Per-stream counts of Poisson-sampled Gaussian releases.

  Entries with the same (stream, sample rate, noise multiplier) merge into one
  count: sequential composition does not depend on the order of the releases,
  so the merged ledger accounts for exactly the same mechanism. Separate
  entries compose sequentially, which is right for streams that draw
  independent Poisson samples (alternating RAPTOR). Streams that share one
  sample are one Gaussian mechanism per step: record them as one stream with
  ``accounting.sigma_eff`` of their noise multipliers (as the trainer does
  for a joint phase).
  """

  def __init__(self, entries: Iterable[LedgerEntry] = ()):
    self._steps: dict[tuple[str, float, float], int] = {}
    self._epsilons: dict[float, float] = {}
    for entry in entries:
      self.record(
          entry.stream,
          sample_rate=entry.sample_rate,
          noise_multiplier=entry.noise_multiplier,
          steps=entry.steps,
      )

  def record(
      self,
      stream: str,
      *,
      sample_rate: float,
      noise_multiplier: float,
      steps: int = 1,
  ) -> None:
    """Records ``steps`` releases of ``stream``, each on a fresh Poisson sample.

    Args:
      stream: the stream's name, e.g. 'shared', 'expert' or 'dpsgd'.
      sample_rate: Poisson inclusion probability of every record.
      noise_multiplier: noise std divided by the stream's clip norm.
      steps: how many releases to record.
    """
    _validate.check(
        isinstance(stream, str) and bool(stream),
        'stream',
        'a non-empty string',
        stream,
        "name it, e.g. 'shared'",
    )
    accounting.dpsgd_event(
        noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps
    )  # Validates.
    key = (stream, float(sample_rate), float(noise_multiplier))
    self._steps[key] = self._steps.get(key, 0) + int(steps)
    self._epsilons.clear()

  @property
  def entries(self) -> tuple[LedgerEntry, ...]:
    """The merged entries, in order of first appearance."""
    return tuple(
        LedgerEntry(stream, sample_rate, sigma, steps)
        for (stream, sample_rate, sigma), steps in self._steps.items()
    )

  def steps(self, stream: str) -> int:
    """Total steps recorded for ``stream`` (its exact name)."""
    return sum(
        steps for (name, _, _), steps in self._steps.items() if name == stream
    )

  def event(self) -> dp_accounting.DpEvent:
    """The composition of everything recorded, as one DpEvent."""
    return accounting.sequential_event(
        (entry.noise_multiplier, entry.sample_rate, entry.steps)
        for entry in self.entries
    )

  def epsilon(self, delta: float) -> float:
    """Epsilon spent so far at ``delta`` (``accounting.epsilon`` of ``event``).

    Cached until the next record; per-mechanism PLDs are cached too, so
    calling this every few steps is cheap.

    Args:
      delta: the target delta, in (0, 1).

    Returns:
      The composed epsilon of all recorded releases (0 for an empty ledger).
    """
    if delta not in self._epsilons:
      self._epsilons[delta] = accounting.epsilon(self.event(), delta)
    return self._epsilons[delta]

  def logged_epsilon(self, delta: float) -> float:
    """``epsilon(delta)`` for a progress log: kept in the accounting cache,
    read back unverified (``accounting.logged_epsilon``)."""
    return accounting.logged_epsilon(self.event(), delta)

  def stream_epsilon(self, stream: str, delta: float) -> float:
    """Epsilon of ``stream``'s releases alone at ``delta`` (0 if none).

    docs/method.md §1.7 reports each stream's epsilon at delta/2 next to the composed
    one: pass ``delta / 2`` for that.
    """
    alone = PrivacyLedger(e for e in self.entries if e.stream == stream)
    return alone.epsilon(delta) if alone.entries else 0.0

  def to_dict(self) -> dict[str, Any]:
    """A JSON-compatible dict (floats round-trip exactly)."""
    return {
        'version': _FORMAT_VERSION,
        'entries': [dataclasses.asdict(entry) for entry in self.entries],
    }

  @classmethod
  def from_dict(cls, state: Mapping[str, Any]) -> 'PrivacyLedger':
    """Inverse of ``to_dict``; validates every entry."""
    _validate.one_of(
        'version',
        state.get('version'),
        (_FORMAT_VERSION,),
        'the ledger was written by another raptor_jax; read it with that one',
    )
    return cls(LedgerEntry(**entry) for entry in state['entries'])

  def to_json(self) -> str:
    """The ledger as a JSON string, e.g. to store next to a checkpoint."""
    return json.dumps(self.to_dict())

  @classmethod
  def from_json(cls, text: str) -> 'PrivacyLedger':
    """Inverse of ``to_json``."""
    return cls.from_dict(json.loads(text))

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, PrivacyLedger):
      return NotImplemented
    return self._steps == other._steps

  def __repr__(self) -> str:
    return f'PrivacyLedger({list(self.entries)!r})'
