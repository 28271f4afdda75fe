"""Audit canaries: random records a privacy audit inserts into a training set.

A run whose config has an ``audit`` section (``audit_config`` adds one; the
base config has none, so ordinary runs never get canaries) is an audit run:
`build_run` draws ``config.audit.num_canaries`` canaries with ``draw`` and
appends each, independently with probability 1/2, to the private training
records (``Run.canaries`` keeps them all and which were included). The
canaries are a pure function of the config's ``audit`` section, the tokenizer
and the frozen router, so every method of a comparison gets the same
canaries and inclusion draws for a given seed, a resumed run gets the same
ones, and the checkpoint's config fingerprint covers them.

Canaries are random token sequences (uniform over the tokenizer's non-special
vocabulary) with uniformly random labels: out-of-distribution records whose
label only memorisation can fit. Only candidates owned by one expert e of l*
(the frozen router's owner rule, as for private records) are kept, so the
same canaries also audit the expert stream.

Privacy. Included canaries are private training records like any other:
Poisson-sampled, clipped, counted in n, so the run's claimed epsilon covers
them. Which canaries were included is the auditor's secret: it stays in
process memory (``Run.canaries``) and is never logged or saved, nor is
``audit.seed``, which recomputes it (``secrecy.public_config`` leaves it out
of config.json; audit.json omits it; only the private checkpoint's config
fingerprint covers it). Choose a seed nobody else knows.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import ml_collections
import numpy as np

from raptor_jax import data

KIND = "random token sequences with random labels"


@dataclasses.dataclass(frozen=True)
class Canaries:
  """The canaries of an audit run.

  Attributes:
    records: all m canaries, included or not.
    included: bool [m], which were appended to the training records (in this
      order, after the real records).
    expert: the expert of l* that owns every canary.
  """

  records: data.TextClassificationData
  included: np.ndarray
  expert: int

  def take(self, included: bool) -> data.TextClassificationData:
    """The included (or the excluded) canaries."""
    return take(self.records, self.included == included)


def audit_config(
    config: ml_collections.ConfigDict,
    *,
    num_canaries: int,
    seed: int = 0,
    expert: int = -1,
) -> ml_collections.ConfigDict:
  """A copy of `config` whose run inserts canaries (see the module doc).

  Args:
    config: any training config.
    num_canaries: m >= 2, canaries drawn (each included with probability 1/2).
    seed: seed of the canaries and of their inclusion (the auditor's own).
    expert: the expert of l* owning the canaries; -1 = the one owning most
      random candidates.
  """
  if num_canaries < 2:
    raise ValueError(f"num_canaries must be at least 2, got {num_canaries}")
  out = ml_collections.ConfigDict(config.to_dict())
  out.audit = ml_collections.ConfigDict(
      dict(num_canaries=num_canaries, seed=seed, expert=expert, kind=KIND)
  )
  return out


def requested(config: ml_collections.ConfigDict) -> bool:
  """Whether `config` is an audit run's (has an ``audit`` section)."""
  return "audit" in config and config.audit.num_canaries > 0


def take(
    records: data.TextClassificationData, index
) -> data.TextClassificationData:
  return data.TextClassificationData(
      records.input_ids[index],
      records.attention_mask[index],
      records.labels[index],
  )


def random_canaries(
    tokenizer, *, count: int, num_labels: int, max_length: int, seed: int
) -> data.TextClassificationData:
  """``count`` random token sequences with random labels, tokenised.

  Lengths are uniform in [max_length / 4, max_length / 2] tokens; the tokens
  are uniform over the vocabulary without special tokens. A pure function of
  the arguments.
  """
  special = set(tokenizer.all_special_ids)
  vocab = np.asarray([i for i in range(len(tokenizer)) if i not in special])
  rng = np.random.default_rng((seed, 0xCA7A))
  low = max(1, max_length // 4)
  lengths = rng.integers(low, max(low, max_length // 2) + 1, size=count)
  texts = [
      tokenizer.decode(rng.choice(vocab, size=int(k)).tolist()) for k in lengths
  ]
  labels = rng.integers(num_labels, size=count).tolist()
  return data.encode(tokenizer, texts, labels, max_length=max_length)


def owned_canaries(
    owner_fn: Callable[[data.TextClassificationData], np.ndarray],
    tokenizer,
    *,
    count: int,
    expert: int,
    num_experts: int,
    num_labels: int,
    max_length: int,
    seed: int,
    max_rounds: int = 20,
) -> tuple[data.TextClassificationData, int]:
  """``count`` random canaries owned by ``expert`` (-1: the expert owning most).

  Args:
    owner_fn: records -> int owners [N] at l* (the run's owner rule).

  Returns:
    (canaries, expert).

  Raises:
    ValueError: too few candidates are owned by the expert.
  """
  if expert >= num_experts:
    raise ValueError(f"audit expert {expert} must be < {num_experts} (or -1)")
  kept, have = [], 0
  for round_ in range(max_rounds):
    candidates = random_canaries(
        tokenizer,
        count=4 * count,
        num_labels=num_labels,
        max_length=max_length,
        seed=seed * max_rounds + round_,
    )
    owners = np.asarray(owner_fn(candidates))
    if expert < 0:
      expert = int(np.argmax(np.bincount(owners, minlength=num_experts)))
    kept.append(take(candidates, owners == expert))
    have += len(kept[-1])
    if have >= count:
      fields = ("input_ids", "attention_mask", "labels")
      joined = (np.concatenate([getattr(k, f) for k in kept]) for f in fields)
      return take(data.TextClassificationData(*joined), slice(count)), expert
  raise ValueError(
      f"only {have} of {max_rounds * 4 * count} random canaries are owned by "
      f"expert {expert}; choose another --expert"
  )


def draw(
    config: ml_collections.ConfigDict,
    tokenizer,
    num_labels: int,
    owner_fn: Callable[[data.TextClassificationData], np.ndarray],
    num_experts: int,
) -> Canaries:
  """The canaries of ``config.audit`` and their independent inclusion draws."""
  spec = config.audit
  records, expert = owned_canaries(
      owner_fn,
      tokenizer,
      count=spec.num_canaries,
      expert=spec.expert,
      num_experts=num_experts,
      num_labels=num_labels,
      max_length=config.data.max_length,
      seed=spec.seed,
  )
  rng = np.random.default_rng((spec.seed, 0x1C1D))
  return Canaries(records, rng.random(spec.num_canaries) < 0.5, expert)


def with_train_records(run_data, records: data.TextClassificationData):
  """`run_data` (a `setup.RunData`) with `records` appended to its training
  records: private records like any other.

  Raises:
    ValueError: the records do not have the training records' length.
  """
  train = run_data.train
  if records.input_ids.shape[1:] != train.input_ids.shape[1:]:
    raise ValueError(
        f"extra training records have length {records.input_ids.shape[1:]}, "
        f"the training records {train.input_ids.shape[1:]}; tokenise them "
        "with the run's tokenizer and data.max_length"
    )
  fields = ("input_ids", "attention_mask", "labels")
  joined = (
      np.concatenate([getattr(train, f), getattr(records, f)]).astype(np.int32)
      for f in fields
  )
  return dataclasses.replace(
      run_data, train=data.TextClassificationData(*joined)
  )
