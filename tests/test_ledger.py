"""Tests for raptor_jax.ledger.PrivacyLedger."""

import json

import pytest

from raptor_jax import accounting
from raptor_jax.ledger import LedgerEntry
from raptor_jax.ledger import PrivacyLedger

_Q, _SIGMA_SHARED, _SIGMA_EXPERT, _DELTA = 0.02, 1.3, 4.1, 1e-5


def _alternating(cycles, ledger=None):
  ledger = PrivacyLedger() if ledger is None else ledger
  for _ in range(cycles):
    ledger.record('shared', sample_rate=_Q, noise_multiplier=_SIGMA_SHARED)
    ledger.record('expert', sample_rate=_Q, noise_multiplier=_SIGMA_EXPERT)
  return ledger


def test_counts_merge_per_stream():
  ledger = _alternating(7)
  assert ledger.entries == (
      LedgerEntry('shared', _Q, _SIGMA_SHARED, 7),
      LedgerEntry('expert', _Q, _SIGMA_EXPERT, 7),
  )
  assert ledger.steps('shared') == ledger.steps('expert') == 7
  ledger.record('shared', sample_rate=_Q, noise_multiplier=2.0, steps=3)
  assert len(ledger.entries) == 3 and ledger.steps('shared') == 10


def test_epsilon_is_raptor_epsilon():
  ledger = _alternating(50)
  assert ledger.epsilon(_DELTA) == accounting.raptor_epsilon(
      sigma_shared=_SIGMA_SHARED,
      sigma_expert=_SIGMA_EXPERT,
      sample_rate=_Q,
      steps_shared=50,
      steps_expert=50,
      delta=_DELTA,
  )


def test_epsilon_grows_with_steps():
  ledger = PrivacyLedger()
  assert ledger.epsilon(_DELTA) == 0
  spent = []
  for _ in range(4):
    _alternating(25, ledger)
    spent.append(ledger.epsilon(_DELTA))  # Each record invalidates the cache.
  assert all(a < b for a, b in zip(spent, spent[1:]))


def test_json_round_trip_and_resume():
  ledger = _alternating(20)
  ledger.record('shared', sample_rate=1 / 3, noise_multiplier=(0.1 + 0.2) * 10)
  text = ledger.to_json()
  restored = PrivacyLedger.from_json(text)
  assert restored == ledger and restored.entries == ledger.entries
  assert json.loads(text) == ledger.to_dict()
  # Resuming continues the ledger: 20 + 30 cycles == 50 cycles.
  _alternating(30, restored)
  _alternating(30, ledger)
  assert restored == ledger and restored != _alternating(50)
  assert restored.epsilon(_DELTA) == ledger.epsilon(_DELTA)


@pytest.mark.parametrize(
    'kwargs, match',
    [
        (dict(stream='', sample_rate=0.1, noise_multiplier=1.0), 'stream'),
        (
            dict(stream='s', sample_rate=0.0, noise_multiplier=1.0),
            'sample_rate',
        ),
        (
            dict(stream='s', sample_rate=0.1, noise_multiplier=0.0),
            'noise_multiplier',
        ),
        (
            dict(stream='s', sample_rate=0.1, noise_multiplier=1.0, steps=0),
            'steps',
        ),
    ],
)
def test_invalid_records_raise(kwargs, match):
  stream = kwargs.pop('stream')
  with pytest.raises(ValueError, match=match):
    PrivacyLedger().record(stream, **kwargs)


def test_rejects_unknown_format():
  with pytest.raises(ValueError, match='version'):
    PrivacyLedger.from_dict({'version': 99, 'entries': []})


def test_logged_epsilon_is_kept_on_disk_and_epsilon_never_reads_it(
    tmp_path, monkeypatch
):
  """A progress log's epsilon is read back on a rerun of the plan; the
  epsilon that results and the privacy card report is always computed."""
  monkeypatch.setattr(accounting, '_CACHE_DIRECTORY', None)  # restored after
  ledger = PrivacyLedger()
  ledger.record('shared', sample_rate=0.05, noise_multiplier=1.1, steps=40)
  ledger.record('expert', sample_rate=0.05, noise_multiplier=2.3, steps=40)
  fresh = accounting.epsilon(ledger.event(), 1e-5)
  assert ledger.logged_epsilon(1e-5) == fresh  # cache off: computed
  assert not list(tmp_path.iterdir())
  accounting.set_cache_directory(tmp_path)
  assert ledger.logged_epsilon(1e-5) == fresh
  (entry,) = tmp_path.iterdir()
  assert json.loads(entry.read_text()) == {'result': fresh}
  entry.write_text(json.dumps({'result': 0.5}))  # read back as it is
  assert ledger.logged_epsilon(1e-5) == 0.5
  assert PrivacyLedger(ledger.entries).epsilon(1e-5) == fresh
  other = PrivacyLedger(ledger.entries)
  other.record('shared', sample_rate=0.05, noise_multiplier=1.1, steps=1)
  assert other.logged_epsilon(1e-5) == accounting.epsilon(other.event(), 1e-5)
  assert len(list(tmp_path.iterdir())) == 2
