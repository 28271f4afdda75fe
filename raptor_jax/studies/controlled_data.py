"""A generated task with two knobs: expert relevance and routing imbalance.

A sibling of :mod:`raptor_jax.data.synthetic` for the controlled study of the
paper's failure modes (``results/controlled``). Records come from *domains*
marked in their tokens (about half of a record's words are its domain's
words, :data:`DOMAINS`), so a Switch pretrained on the PUBLIC text below routes
a domain's records to one owner expert. Two knobs:

* **Expert relevance** ``relevance`` in [0, 1]: each sentiment slot of a
  record holds a *domain-specific* word with probability ``relevance``, else
  a *shared* word. Shared words (:data:`SHARED_WORDS`) mean the same in every
  domain, a rule attention and the head can learn. Domain words
  (:data:`DOMAIN_RULE_WORDS`) take a polarity that depends on the domain
  (:func:`rule_polarity`, a fixed public table in which every word is
  positive in two domains and negative in the other two), so reading them
  needs the domain-conditional computation that the owner expert at l*
  performs. At 0 the label follows the shared rule only; at 1 only the
  domain rule.
* **Routing imbalance** ``domain_shares``: the probability of each domain.
  Under the owner rule (one owner per domain) the owner shares follow it;
  :func:`normalized_entropy` gives H/log E.

The label is the majority polarity of the sentiment slots (a three-slot
record may carry one slot of the other polarity), then flipped with
probability ``label_noise``.

Public text (:func:`generate_public_texts`) comes from another random stream
and template ("descriptions": domain words and filler, sometimes one
sentiment word, never a label), with its own ``domain_shares``; it is what
the small Switch is pretrained on (balanced) and what layer selection and
the public routing entropy read (at the condition's shares). No public text
equals a record.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import NamedTuple, Sequence

import numpy as np

from raptor_jax import _validate
from raptor_jax.data import synthetic

# Four domains of twelve words (the first four topics of the synthetic task).
DOMAINS: tuple[tuple[str, ...], ...] = synthetic.TOPICS[:4]
NUM_DOMAINS = len(DOMAINS)
# The shared rule: (negative, positive) in every domain.
SHARED_WORDS: tuple[tuple[str, ...], tuple[str, ...]] = synthetic.FIXED_WORDS
# The domain rule: polarity by domain (`rule_polarity`).
DOMAIN_RULE_WORDS: tuple[str, ...] = (
    *synthetic.CONTEXT_WORDS[0],
    *synthetic.CONTEXT_WORDS[1],
)
VOCABULARY: tuple[str, ...] = (
    *(w for words in DOMAINS for w in words),
    *(w for words in SHARED_WORDS for w in words),
    *DOMAIN_RULE_WORDS,
    *synthetic.FILLER_WORDS,
)
# Word j of DOMAIN_RULE_WORDS is positive in domain d iff _RULE[j, d] == 1.
# The words take the six ways of choosing two of the four domains in turn
# (complementary pairs next to each other): a balanced design (each word
# positive in exactly two domains, each domain has eight positive words), so
# no word carries label information without its domain.
_DOMAIN_PAIRS = (
    (1, 1, 0, 0),
    (0, 0, 1, 1),
    (1, 0, 1, 0),
    (0, 1, 0, 1),
    (1, 0, 0, 1),
    (0, 1, 1, 0),
)
_RULE = np.array(
    [
        _DOMAIN_PAIRS[j % len(_DOMAIN_PAIRS)]
        for j in range(len(DOMAIN_RULE_WORDS))
    ],
    np.int32,
)
_RECORD_STREAM, _PUBLIC_STREAM = 10, 11

BALANCED: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)


class ControlledRecords(NamedTuple):
  """Generated labelled records (raw text)."""

  texts: list[str]
  labels: np.ndarray  # int32 [n], 1 = positive, after label noise
  domains: np.ndarray  # int32 [n], the domain of each record


def check_shares(domain_shares: Sequence[float]) -> np.ndarray:
  """`domain_shares` as a probability vector over the domains, or one clear error."""
  shares = np.asarray(domain_shares, np.float64)
  if (
      shares.shape != (NUM_DOMAINS,)
      or np.any(shares <= 0)
      or abs(shares.sum() - 1.0) > 1e-6
  ):
    raise ValueError(
        f"domain_shares must be {NUM_DOMAINS} positive numbers summing to 1,"
        f" got {list(domain_shares)}"
    )
  return shares


def normalized_entropy(shares: Sequence[float]) -> float:
  """H(q) / log E of a share vector (zeros allowed): 1 uniform, 0 one-hot."""
  q = np.asarray(shares, np.float64)
  q = q / q.sum()
  nz = q[q > 0]
  return float(-np.sum(nz * np.log(nz)) / np.log(len(q)))


def skewed_shares(major: float) -> tuple[float, ...]:
  """Domain 0 has share `major`, the others split the rest equally."""
  _validate.check(
      1.0 / NUM_DOMAINS <= major < 1.0,
      "major",
      f"in [1/{NUM_DOMAINS}, 1)",
      major,
  )
  rest = (1.0 - major) / (NUM_DOMAINS - 1)
  return (major, *([rest] * (NUM_DOMAINS - 1)))


def rule_polarity(word: str, domain: int) -> int:
  """+1 / -1 for a sentiment word read in `domain`, 0 for other words.

  The rule that defines the labels: a record's noise-free label is positive
  exactly when the sum of its words' polarities is positive.
  """
  for sign, words in ((-1, SHARED_WORDS[0]), (1, SHARED_WORDS[1])):
    if word in words:
      return sign
  if word in DOMAIN_RULE_WORDS:
    return 1 if _RULE[DOMAIN_RULE_WORDS.index(word), domain] else -1
  return 0


def _sentiment_word(
    rng: np.random.Generator, domain: int, positive: int, relevance: float
) -> str:
  if rng.random() < relevance:
    words = [w for j, w in enumerate(DOMAIN_RULE_WORDS) if _RULE[j, domain]]
    if not positive:
      words = [
          w for j, w in enumerate(DOMAIN_RULE_WORDS) if not _RULE[j, domain]
      ]
    return synthetic.pick(rng, words)
  return synthetic.pick(rng, SHARED_WORDS[positive])


def _record(
    rng: np.random.Generator, domain: int, label: int, relevance: float
) -> str:
  length, polarities = synthetic.slot_polarities(rng, label)
  words = [_sentiment_word(rng, domain, p, relevance) for p in polarities]
  words += [synthetic.pick(rng, DOMAINS[domain]) for _ in range(length // 2)]
  return synthetic.with_filler(rng, words, length)


def generate_records(
    seed: int,
    n: int,
    *,
    relevance: float,
    domain_shares: Sequence[float] = BALANCED,
    label_noise: float = 0.05,
) -> ControlledRecords:
  """Generates `n` distinct labelled records, deterministically from the arguments.

  Args:
    seed: the random seed (train, held-out and dev data use distinct seeds).
    n: the number of records.
    relevance: share of sentiment slots that follow the domain rule, [0, 1].
    domain_shares: probability of each domain (`check_shares`).
    label_noise: probability that a label is flipped, [0, 0.5).

  Returns:
    The texts, labels and domains.
  """
  _validate.check(n >= 1, "n", ">= 1 (controlled records)", n)
  _validate.check(0.0 <= relevance <= 1.0, "relevance", "in [0, 1]", relevance)
  _validate.check(
      0.0 <= label_noise < 0.5, "label_noise", "in [0, 0.5)", label_noise
  )
  shares = check_shares(domain_shares)

  def draw(rng):
    domain = int(rng.choice(NUM_DOMAINS, p=shares))
    label = int(rng.integers(2))
    return domain, label, _record(rng, domain, label, relevance)

  rng = np.random.default_rng((seed, _RECORD_STREAM))
  return ControlledRecords(
      *synthetic.distinct_records(rng, n, draw, label_noise)
  )


def _description(rng: np.random.Generator, domain: int) -> str:
  length = int(rng.integers(10, 25))
  words = [
      synthetic.pick(rng, DOMAINS[domain]) for _ in range(length * 11 // 20)
  ]
  if rng.random() < 0.5:
    pool = (
        DOMAIN_RULE_WORDS
        if rng.random() < 0.5
        else SHARED_WORDS[int(rng.integers(2))]
    )
    words.append(synthetic.pick(rng, pool))
  return synthetic.with_filler(rng, words, length)


def generate_public_texts(
    seed: int,
    n: int,
    *,
    domain_shares: Sequence[float] = BALANCED,
    exclude: AbstractSet[str] = frozenset(),
) -> list[str]:
  """Generates `n` distinct unlabeled descriptions, none of them in `exclude`.

  Another random stream and template than the records: public text matched
  to their format, as pretraining and layer selection need, with no label.
  """
  _validate.check(n >= 1, "n", ">= 1 (public texts)", n)
  shares = check_shares(domain_shares)
  rng = np.random.default_rng((seed, _PUBLIC_STREAM))
  texts: dict[str, None] = {}
  while len(texts) < n:
    text = _description(rng, int(rng.choice(NUM_DOMAINS, p=shares)))
    if text not in exclude:
      texts.setdefault(text)
  return list(texts)


def owner_purity(domains: np.ndarray, owners: np.ndarray) -> np.ndarray:
  """Per domain, the share of its records owned by its modal expert.

  Domains with no record get NaN.
  """
  domains, owners = np.asarray(domains), np.asarray(owners)
  purity = np.full(NUM_DOMAINS, np.nan)
  for d in range(NUM_DOMAINS):
    owned = owners[domains == d]
    if len(owned):
      purity[d] = np.bincount(owned).max() / len(owned)
  return purity


def owner_shares(owners: np.ndarray, num_experts: int) -> np.ndarray:
  """Share of records owned by each expert (float64 [E])."""
  counts = np.bincount(np.asarray(owners), minlength=num_experts)
  return counts / max(counts.sum(), 1)
