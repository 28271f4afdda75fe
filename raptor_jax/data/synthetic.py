"""The embedded offline task: generated reviews where routing matters.

The ``:tiny`` presets train on this task so that the whole pipeline (owner
map, layer selection, both DP streams, accounting) runs offline, in minutes on
a CPU, with no files. It is generated from a seed by the code below.

How it is built
---------------
The vocabulary has eight *topics* of twelve words (drinks, food, music, ...),
sentiment words and filler words. A record is a short review (8-20 words)
about ONE topic: about half of its words are that topic's words (sometimes one
word of another topic slips in), plus one to three sentiment words and filler.
Its label is the polarity of the sentiment words, by majority.

Sentiment words come in two kinds:

* *fixed* words (``great``, ``awful``, ...) mean the same in every topic;
* *context* words (``cold``, ``loud``, ``fast``, ...) flip polarity in half
  of the topics (:data:`FLIPPED_TOPICS`): ``cold`` is good for drinks and bad
  for food, ``loud`` is bad for hotels and good for music.

Most sentiment words are context words, so a model that does not know the
topic can only use the fixed ones, while one that does (for example, one whose
records are owned by a topic-specialised expert) can read every record.
Measured on ``synthetic_task(0)`` (dev majority class 0.52, ceiling 0.95 with
the default 5% label noise): bag-of-words logistic regression reaches 0.69 dev
accuracy from words alone and 0.90 with word x topic features (topic = the
most frequent topic among the record's words); a non-private 2-layer
transformer (width 64, Adam) reaches 0.82 after 250 steps of batch 64, about
25 s on a CPU.

Routing hook
------------
:func:`topic_groups` maps every token id to its topic (-1 for other tokens).
A model initialiser can give same-topic words correlated embeddings (a shared
random direction per topic plus a per-word part), so that even a randomly
initialised router sends a topic's words, and hence the records about that
topic, to the same expert. Measured with 8 experts, a random linear router
and majority-vote owners: with no topic direction a topic's records share an
owner about half the time (0.49); with a topic direction of twice the
per-word scale, 0.81.

A disjoint public corpus comes from another random stream and another
template ("descriptions": longer, sometimes about two topics, with few
sentiment words, no labels); none of its texts equals a train or dev text.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Callable, NamedTuple, Sequence

import numpy as np

from raptor_jax import _validate
from raptor_jax.data import encoding

TOPICS: tuple[tuple[str, ...], ...] = (
    (
        "coffee",
        "tea",
        "beer",
        "wine",
        "juice",
        "soda",
        "lemonade",
        "cocktail",
        "smoothie",
        "espresso",
        "cider",
        "latte",
    ),
    (
        "soup",
        "steak",
        "pizza",
        "pasta",
        "burger",
        "curry",
        "noodles",
        "bread",
        "salad",
        "stew",
        "omelette",
        "dumplings",
    ),
    (
        "song",
        "album",
        "band",
        "singer",
        "concert",
        "guitar",
        "melody",
        "chorus",
        "drummer",
        "lyrics",
        "orchestra",
        "playlist",
    ),
    (
        "phone",
        "battery",
        "screen",
        "charger",
        "camera",
        "tablet",
        "laptop",
        "keyboard",
        "headphones",
        "speaker",
        "smartwatch",
        "console",
    ),
    (
        "car",
        "engine",
        "brakes",
        "tires",
        "sedan",
        "truck",
        "wheel",
        "clutch",
        "gearbox",
        "dashboard",
        "motorbike",
        "scooter",
    ),
    (
        "hotel",
        "room",
        "bed",
        "lobby",
        "suite",
        "pillow",
        "balcony",
        "reception",
        "hostel",
        "resort",
        "mattress",
        "elevator",
    ),
    (
        "film",
        "movie",
        "actor",
        "actress",
        "director",
        "plot",
        "scene",
        "sequel",
        "cinema",
        "screenplay",
        "trailer",
        "villain",
    ),
    (
        "gym",
        "treadmill",
        "yoga",
        "marathon",
        "bicycle",
        "swimming",
        "trainer",
        "dumbbell",
        "sneakers",
        "jersey",
        "stadium",
        "racket",
    ),
)
# In these topics (food, music, cars, movies) context words flip polarity.
FLIPPED_TOPICS = frozenset({1, 2, 4, 6})

FIXED_WORDS: tuple[tuple[str, ...], tuple[str, ...]] = (
    (
        "awful",
        "terrible",
        "horrible",
        "dreadful",
        "poor",
        "disappointing",
        "lousy",
        "mediocre",
    ),
    (
        "great",
        "excellent",
        "lovely",
        "wonderful",
        "superb",
        "delightful",
        "perfect",
        "amazing",
    ),
)
# Context words by their polarity in an unflipped topic: (negative, positive).
CONTEXT_WORDS: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("warm", "loud", "heavy", "large", "firm", "fast", "intense", "wild"),
    ("cold", "quiet", "light", "small", "soft", "slow", "mild", "plain"),
)
FILLER_WORDS: tuple[str, ...] = (
    "the",
    "a",
    "an",
    "this",
    "that",
    "it",
    "was",
    "is",
    "were",
    "felt",
    "seemed",
    "really",
    "very",
    "quite",
    "so",
    "too",
    "and",
    "but",
    "with",
    "for",
    "of",
    "my",
    "our",
    "their",
    "we",
    "they",
    "i",
    "honestly",
    "overall",
    "just",
    "rather",
    "here",
    "there",
    "today",
    "again",
    "still",
)

VOCABULARY: tuple[str, ...] = (
    *(word for topic in TOPICS for word in topic),
    *(word for words in FIXED_WORDS for word in words),
    *(word for words in CONTEXT_WORDS for word in words),
    *FILLER_WORDS,
)

_RECORD_STREAM, _PUBLIC_STREAM = 0, 1
_SLOT_COUNTS, _SLOT_PROBS = (1, 2, 3), (0.35, 0.4, 0.25)
_CONTEXT_PROB = 0.7  # a sentiment slot holds a context word, else a fixed word
_OFF_TOPIC_PROB = 0.2  # a record mentions one word of another topic
_MINORITY_PROB = 0.5  # a three-slot record has one slot of the other polarity


class SyntheticRecords(NamedTuple):
  """Generated labelled reviews (raw text)."""

  texts: list[str]
  labels: np.ndarray  # int32 [n], 1 = positive, after label noise
  topics: np.ndarray  # int32 [n], the topic each review is about


class SyntheticTask(NamedTuple):
  """Everything the ``:tiny`` presets need, generated from a seed."""

  train: encoding.TextClassificationData
  dev: encoding.TextClassificationData
  public_texts: list[str]
  tokenizer: encoding.Tokenizer
  token_groups: (
      np.ndarray | None
  )  # int32 [vocab size], topic of each token id or -1


def word_polarity(word: str, topic: int) -> int:
  """Returns +1 / -1 for a sentiment word read in ``topic``, 0 for other words.

  This is the rule that defines the labels: a review's noise-free label is
  positive exactly when the sum of its words' polarities is positive.
  """
  for sign, words in ((-1, FIXED_WORDS[0]), (1, FIXED_WORDS[1])):
    if word in words:
      return sign
  for sign, words in ((-1, CONTEXT_WORDS[0]), (1, CONTEXT_WORDS[1])):
    if word in words:
      return -sign if topic in FLIPPED_TOPICS else sign
  return 0


def generate_records(
    seed: int, n: int, *, label_noise: float = 0.05
) -> SyntheticRecords:
  """Generates ``n`` distinct labelled reviews, deterministically from ``seed``.

  Args:
      seed: the random seed; the same seed gives the same records.
      n: the number of records.
      label_noise: probability that a record's label is flipped after
          generation (so even a perfect model makes mistakes, and outliers
          exist for membership-inference audits). The texts do not depend
          on it.

  Returns:
      The texts, labels and topics.

  Raises:
      ValueError: ``n < 1`` or ``label_noise`` outside [0, 0.5).
  """
  _validate.check(n >= 1, "n", ">= 1 (synthetic records)", n)
  _validate.in_interval(
      "data.synthetic.label_noise",
      label_noise,
      "[0, 0.5)",
      _validate.config_fix("data.synthetic.label_noise"),
  )

  def draw(rng):
    topic, label = int(rng.integers(len(TOPICS))), int(rng.integers(2))
    return topic, label, _review(rng, topic, label)

  rng = np.random.default_rng((seed, _RECORD_STREAM))
  return SyntheticRecords(*distinct_records(rng, n, draw, label_noise))


def distinct_records(
    rng: np.random.Generator,
    n: int,
    draw: Callable[[np.random.Generator], tuple[int, int, str]],
    label_noise: float,
) -> tuple[list[str], np.ndarray, np.ndarray]:
  """The first ``n`` distinct texts that ``draw`` generates, with noisy labels.

  Args:
      rng: the generator every draw uses, in order.
      n: the number of records.
      draw: ``rng`` -> (group, label, text): one candidate record (a topic
          or domain, its clean label and its text).
      label_noise: probability that a kept record's label is flipped (one
          draw of ``rng`` right after the record is kept).

  Returns:
      The texts, int32 labels (after label noise) and int32 groups.
  """
  texts: dict[str, None] = {}
  labels, groups = [], []
  while len(texts) < n:
    group, label, text = draw(rng)
    if text not in texts:
      texts[text] = None
      labels.append(label ^ int(rng.random() < label_noise))
      groups.append(group)
  return (
      list(texts),
      np.asarray(labels, np.int32),
      np.asarray(groups, np.int32),
  )


def generate_public_texts(
    seed: int, n: int, *, exclude: AbstractSet[str] = frozenset()
) -> list[str]:
  """Generates ``n`` distinct unlabeled descriptions, none of them in ``exclude``.

  They use the reviews' vocabulary but another random stream and template,
  so the public corpus is disjoint from the private records yet matched to
  their format, as layer selection requires.

  Args:
      seed: the random seed; the same seed gives the same texts.
      n: the number of texts.
      exclude: texts that must not appear (the private records).

  Returns:
      The texts.

  Raises:
      ValueError: ``n < 1``.
  """
  _validate.check(
      n >= 1, "data.n_pub", ">= 1", n, _validate.config_fix("data.n_pub")
  )
  rng = np.random.default_rng((seed, _PUBLIC_STREAM))
  texts: dict[str, None] = {}
  while len(texts) < n:
    text = _description(rng)
    if text not in exclude:
      texts.setdefault(text)
  return list(texts)


def build_tokenizer(model_max_length: int = 32) -> encoding.Tokenizer:
  """The word-level tokenizer over :data:`VOCABULARY` (see ``build_word_tokenizer``)."""
  return encoding.build_word_tokenizer(
      VOCABULARY, model_max_length=model_max_length
  )


def topic_groups(tokenizer: encoding.Tokenizer) -> np.ndarray:
  """Maps each token id of ``tokenizer`` to its topic index, -1 for other tokens.

  The routing hook: see the module docstring. Works for any tokenizer whose
  vocabulary contains the topic words (including a reloaded copy).

  Returns:
      int32 [len(tokenizer)].
  """
  groups = np.full(len(tokenizer), -1, np.int32)
  vocab = tokenizer.get_vocab()
  for topic, words in enumerate(TOPICS):
    for word in words:
      groups[vocab[word]] = topic
  return groups


def synthetic_task(
    seed: int = 0,
    *,
    n_train: int = 4000,
    n_dev: int = 500,
    n_pub: int = 1000,
    max_length: int = 32,
    label_noise: float = 0.05,
    tokenizer: encoding.Tokenizer | None = None,
) -> SyntheticTask:
  """Generates the offline task: train/dev splits, public corpus, tokenizer.

  Train and dev are disjoint slices of one stream of distinct reviews; the
  public corpus is disjoint from both. Everything is a pure function of the
  arguments.

  Args:
      seed: the random seed.
      n_train: training records.
      n_dev: dev records.
      n_pub: public (unlabeled) texts for layer selection.
      max_length: tokens per record (reviews have at most 20 words + 2).
      label_noise: probability of a flipped label, train and dev alike.
      tokenizer: tokenise with this tokenizer (e.g. a pretrained model's)
          instead of the task's word-level one; ``token_groups`` is then
          ``None`` (it only serves randomly initialised models).

  Returns:
      The task.

  Raises:
      ValueError: ``n_train`` or ``n_dev`` below 1, or as the generators.
  """
  for name, value in (("n_train", n_train), ("n_dev", n_dev)):
    field = f"data.synthetic.{name}"
    _validate.check(
        value >= 1, field, ">= 1", value, _validate.config_fix(field)
    )
  records = generate_records(seed, n_train + n_dev, label_noise=label_noise)
  public = generate_public_texts(seed, n_pub, exclude=frozenset(records.texts))
  groups = None
  if tokenizer is None:
    tokenizer = build_tokenizer(max_length)
    groups = topic_groups(tokenizer)
  train, dev = (
      encoding.encode(
          tokenizer,
          records.texts[part],
          records.labels[part],
          max_length=max_length,
      )
      for part in (slice(0, n_train), slice(n_train, n_train + n_dev))
  )
  return SyntheticTask(train, dev, public, tokenizer, groups)


def pick(rng: np.random.Generator, words: Sequence[str]) -> str:
  """One of ``words``, uniformly (one draw of ``rng``)."""
  return words[int(rng.integers(len(words)))]


def slot_polarities(
    rng: np.random.Generator, label: int
) -> tuple[int, list[int]]:
  """A review's length in words (8 to 20) and its sentiment slots' polarities.

  One to three slots of polarity ``label``; a three-slot review's first slot
  takes the other polarity with probability ``_MINORITY_PROB``.
  """
  length = int(rng.integers(8, 21))
  n_slots = int(rng.choice(_SLOT_COUNTS, p=_SLOT_PROBS))
  polarities = [label] * n_slots
  if n_slots == 3 and rng.random() < _MINORITY_PROB:
    polarities[0] = 1 - label
  return length, polarities


def with_filler(rng: np.random.Generator, words: list[str], length: int) -> str:
  """``words`` padded with filler words to ``length`` words, then shuffled."""
  words = words + [pick(rng, FILLER_WORDS) for _ in range(length - len(words))]
  return " ".join(words[i] for i in rng.permutation(len(words)))


def _sentiment_word(rng: np.random.Generator, topic: int, positive: int) -> str:
  if rng.random() < _CONTEXT_PROB:
    return pick(rng, CONTEXT_WORDS[positive ^ int(topic in FLIPPED_TOPICS)])
  return pick(rng, FIXED_WORDS[positive])


def _other_topic(rng: np.random.Generator, topic: int) -> int:
  return (topic + 1 + int(rng.integers(len(TOPICS) - 1))) % len(TOPICS)


def _review(rng: np.random.Generator, topic: int, label: int) -> str:
  length, polarities = slot_polarities(rng, label)
  words = [_sentiment_word(rng, topic, p) for p in polarities]
  n_topic = length // 2
  topic_words = [pick(rng, TOPICS[topic]) for _ in range(n_topic)]
  if rng.random() < _OFF_TOPIC_PROB:
    topic_words[0] = pick(rng, TOPICS[_other_topic(rng, topic)])
  return with_filler(rng, words + topic_words, length)


def _description(rng: np.random.Generator) -> str:
  length = int(rng.integers(10, 25))
  topic = int(rng.integers(len(TOPICS)))
  topics = [topic, _other_topic(rng, topic)] if rng.random() < 0.3 else [topic]
  words = [
      pick(rng, TOPICS[topics[i % len(topics)]])
      for i in range(length * 11 // 20)
  ]
  if rng.random() < 0.5:
    kind = CONTEXT_WORDS if rng.random() < 0.5 else FIXED_WORDS
    words.append(pick(rng, kind[int(rng.integers(2))]))
  return with_filler(rng, words, length)
