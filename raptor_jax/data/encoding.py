"""Tokenizers and the fixed-shape arrays every task is turned into.

Every task, real or generated, ends as a :class:`TextClassificationData`:
``int32`` arrays padded on the right to one fixed length, so each jitted step
sees a single shape and compiles once (an invariant of docs/method.md §3), and the attention mask
tells the model, the owner map and the pooling which positions are real.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence

import numpy as np
import tokenizers
import transformers
from tokenizers import models, normalizers, pre_tokenizers, processors

from raptor_jax import _validate

PAD, UNK, CLS, SEP = "[PAD]", "[UNK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP)  # ids 0, 1, 2, 3 in a word tokenizer

Tokenizer = transformers.PreTrainedTokenizerBase

# The words of the `Whitespace` pre-tokenizer of `build_word_tokenizer`.
_WORD = re.compile(r"\w+|[^\w\s]+")


@dataclasses.dataclass(frozen=True)
class TextClassificationData:
  """A tokenised classification dataset: one row per record.

  Attributes:
      input_ids: int32 [N, L] token ids, right-padded with the pad id.
      attention_mask: int32 [N, L], 1 for a token, 0 for padding.
      labels: int32 [N] class ids in ``[0, num_labels)``.
  """

  input_ids: np.ndarray
  attention_mask: np.ndarray
  labels: np.ndarray

  def __len__(self) -> int:
    return self.labels.shape[0]


def check_batch_size(expected_batch_size: int, num_records: int) -> None:
  """Fails unless ``1 <= expected_batch_size <= num_records``.

  Poisson sampling with rate ``q = B / n`` needs ``q <= 1``; a larger ``B``
  is a configuration mistake, not something to clamp silently (clamping
  would change the sampling rate, and so the privacy accounting, behind the
  user's back).

  Args:
      expected_batch_size: the public expected batch size ``B``.
      num_records: the number of training records ``n``.

  Raises:
      ValueError: ``B < 1`` or ``B > n``.
  """
  suggested = max(1, num_records // 10)
  _validate.check(
      1 <= expected_batch_size <= num_records,
      "batch_size",
      f"in [1, n] for the n = {num_records} training records",
      expected_batch_size,
      _validate.config_fix("batch_size", suggested)
      + " (n / 10), or 0 to choose it from n",
  )


def load_tokenizer(name_or_path: str) -> Tokenizer:
  """Loads a Hugging Face tokenizer from a local directory or a Hub id.

  A tokenizer without a padding token (common for decoder models) gets its
  end-of-sequence token as padding: padded positions are masked out, so the
  choice of id does not matter, and right padding keeps the real tokens at
  the same positions.

  Args:
      name_or_path: a directory holding tokenizer files (for example a
          ``save_pretrained`` copy of the model) or a Hub model id.

  Returns:
      The tokenizer.

  Raises:
      FileNotFoundError: the tokenizer is neither local nor reachable/cached.
      ValueError: it has neither a padding nor an end-of-sequence token.
  """
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
  except OSError as e:
    raise FileNotFoundError(
        f"Cannot load the tokenizer of {name_or_path!r}: it is not a local directory and"
        " the Hub is not reachable or does not have it (offline?); point the model path"
        " in the config at a local directory with the tokenizer files."
    ) from e
  if tokenizer.pad_token is None:
    if tokenizer.eos_token is None:
      raise ValueError(
          f"Tokenizer of {name_or_path!r} has neither a padding nor an end-of-sequence"
          " token; save one with a pad_token set and point the config at it."
      )
    tokenizer.pad_token = tokenizer.eos_token
  return tokenizer


def build_word_tokenizer(
    words: Sequence[str], *, model_max_length: int = 512
) -> Tokenizer:
  """Builds a word-level tokenizer over a fixed vocabulary, with no files.

  The ``tokenizers`` pipeline is: lowercase, split on whitespace and
  punctuation, map each word to its id (unknown words to ``[UNK]``), then
  ``[CLS] a [SEP]`` for one text and ``[CLS] a [SEP] b [SEP]`` for a pair.
  It is wrapped in ``transformers.PreTrainedTokenizerFast`` so that it goes
  through exactly the tokenisation code used for real tasks, and
  ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it.

  Args:
      words: the vocabulary, lowercase and unique; ids start at 4, after
          ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3``.
      model_max_length: the longest sequence the model takes.

  Returns:
      The tokenizer.

  Raises:
      ValueError: a word is repeated, not lowercase, or a special token.
  """
  vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
  for word in words:
    if word in vocab or word != word.lower():
      raise ValueError(
          f"Word-tokenizer vocabulary entry {word!r} is repeated, a special token or"
          " not lowercase; give unique lowercase words."
      )
    vocab[word] = len(vocab)
  backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  backend.normalizer = normalizers.Lowercase()
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  return bert_template_tokenizer(backend, model_max_length=model_max_length)


def bert_template_tokenizer(
    backend: tokenizers.Tokenizer, **special: str | int
) -> Tokenizer:
  """`backend` with BERT's template, as a transformers fast tokenizer.

  ``[CLS] a [SEP]`` for one text and ``[CLS] a [SEP] b [SEP]`` for a pair
  (b's tokens of type 1), the ids of ``[CLS]`` and ``[SEP]`` the backend's;
  ``[PAD]`` and ``[UNK]`` are its padding and unknown tokens. Every
  tokenizer the library builds (`build_word_tokenizer`, pretraining's
  WordPiece) ends here; `special` adds the others (``mask_token``) and
  ``model_max_length``.
  """
  backend.post_processor = processors.TemplateProcessing(
      single=f"{CLS} $A {SEP}",
      pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
      special_tokens=[(t, backend.token_to_id(t)) for t in (CLS, SEP)],
  )
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend,
      pad_token=PAD,
      unk_token=UNK,
      cls_token=CLS,
      sep_token=SEP,
      **special,
  )


def public_word_tokenizer(
    public_texts: Sequence[str],
    *,
    max_words: int = 20000,
    model_max_length: int = 512,
) -> Tokenizer:
  """A word-level tokenizer whose vocabulary comes from PUBLIC texts only.

  For CPU-sized runs on real text without a pretrained tokenizer. The
  vocabulary is never built from the private training set: which words occur
  in it is itself private information.

  Args:
      public_texts: the public corpus.
      max_words: keep the most frequent words (ties broken alphabetically).
      model_max_length: the longest sequence the model takes.

  Returns:
      A tokenizer from :func:`build_word_tokenizer`.

  Raises:
      ValueError: the public texts contain no words.
  """
  counts: collections.Counter[str] = collections.Counter()
  for text in public_texts:
    counts.update(_WORD.findall(text.lower()))
  for special in SPECIAL_TOKENS:
    counts.pop(special.lower(), None)
  if not counts:
    raise ValueError(
        "The public corpus has no words to build a vocabulary from; set"
        " --config.data.public_corpus or --config.data.public_path."
    )
  ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[
      :max_words
  ]
  return build_word_tokenizer(
      [word for word, _ in ranked], model_max_length=model_max_length
  )


def tokenize(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    pair_texts: Sequence[str] | None = None,
    max_length: int = 128,
) -> tuple[np.ndarray, np.ndarray]:
  """Tokenises texts (or text pairs) into fixed-shape, right-padded arrays.

  Pairs are tokenised as pairs (the tokenizer inserts its separators and
  truncates the longer text first), never by joining strings, so the model
  sees the format of its pre-training. Padding is always on the right,
  whatever the tokenizer's default, so position 0 is a real token.

  Args:
      tokenizer: a Hugging Face tokenizer with a padding token.
      texts: the first (or only) text of each record.
      pair_texts: the second text of each record, for sentence-pair tasks.
      max_length: every row is truncated or padded to exactly this length.

  Returns:
      ``(input_ids, attention_mask)``, both int32 [len(texts), max_length].

  Raises:
      ValueError: ``max_length < 2``, no texts, or pair texts of another length.
  """
  _validate.check(
      max_length >= 2,
      "data.max_length",
      ">= 2",
      max_length,
      _validate.config_fix("data.max_length"),
  )
  if not texts:
    raise ValueError(
        "No texts to tokenise; check the data file, split or corpus."
    )
  if pair_texts is not None and len(pair_texts) != len(texts):
    raise ValueError("pair_texts must have one entry per text.")
  batch = tokenizer(
      list(texts),
      None if pair_texts is None else list(pair_texts),
      truncation=True,
      max_length=max_length,
      padding="max_length",
      padding_side="right",
      return_attention_mask=True,
      return_token_type_ids=False,
  )
  shape = (len(texts), max_length)
  return (
      np.asarray(batch["input_ids"], dtype=np.int32).reshape(shape),
      np.asarray(batch["attention_mask"], dtype=np.int32).reshape(shape),
  )


def encode(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    pair_texts: Sequence[str] | None = None,
    max_length: int = 128,
) -> TextClassificationData:
  """Tokenises labelled records (see :func:`tokenize`) into a dataset.

  Args:
      tokenizer: a Hugging Face tokenizer with a padding token.
      texts: the first (or only) text of each record.
      labels: the class id of each record.
      pair_texts: the second text of each record, for sentence-pair tasks.
      max_length: every row is truncated or padded to exactly this length.

  Returns:
      The dataset, one row per record in input order.

  Raises:
      ValueError: as :func:`tokenize`, or labels of another length.
  """
  if len(labels) != len(texts):
    raise ValueError("labels must have one entry per text.")
  input_ids, attention_mask = tokenize(
      tokenizer, texts, pair_texts=pair_texts, max_length=max_length
  )
  return TextClassificationData(
      input_ids=input_ids,
      attention_mask=attention_mask,
      labels=np.asarray(labels, dtype=np.int32),
  )
