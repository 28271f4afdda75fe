"""A WordPiece tokenizer trained on the public pretraining corpus only.

The vocabulary is a statistic of the text it is trained on, so it is never
trained on private data: here it sees only the (decontaminated) public
training documents. It is saved next to the model, and fine-tuning loads it
from the model directory (`AutoTokenizer.from_pretrained(model_dir)`).

Determinism: the `tokenizers` trainer numbers the word-internal characters
(`##a`, `##b`, ...) in the order it meets them in a hash map, which changes
from run to run, and it breaks ties between equally frequent merges by those
numbers. So two trainings on the same text could give different
vocabularies. We fix the numbering by handing the trainer every `##c` first,
in code-point order, then strip them from the special tokens: the same text
always gives the same tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from raptor_jax.data import encoding
from raptor_jax.data.encoding import CLS, PAD, SEP, UNK

MASK = "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4


def train_wordpiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    min_frequency: int = 2,
    model_max_length: int = 512,
) -> transformers.PreTrainedTokenizerFast:
  """Trains a lowercase BERT-style WordPiece tokenizer.

  Args:
    texts: the public training documents.
    vocab_size: target vocabulary size, special tokens included.
    min_frequency: a merge must occur at least this often.
    model_max_length: the longest sequence the model takes.

  Returns:
    A fast tokenizer: `[CLS] a [SEP]` for one text, `[CLS] a [SEP] b [SEP]`
    for a pair, with `[PAD]` = 0 and a `[MASK]` token for masked LM.
  """
  if vocab_size <= len(SPECIAL_TOKENS):
    raise ValueError(
        f"tokenizer vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}"
    )
  backend = tokenizers.Tokenizer(models.WordPiece(unk_token=UNK))
  backend.normalizer = normalizers.BertNormalizer(
      lowercase=True, strip_accents=True, clean_text=True
  )
  backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  backend.decoder = decoders.WordPiece()
  texts = list(texts)
  continuations = _continuation_alphabet(backend.normalizer, texts)
  trainer = trainers.WordPieceTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=list(SPECIAL_TOKENS) + continuations,
      show_progress=False,
  )
  backend.train_from_iterator(texts, trainer=trainer)
  backend = _demote_to_vocabulary(backend, set(continuations))
  return encoding.bert_template_tokenizer(
      backend, mask_token=MASK, model_max_length=model_max_length
  )


def _continuation_alphabet(normalizer, texts: list[str]) -> list[str]:
  """`##c` for every character c that can continue a normalised word, sorted.

  The normaliser (cleaning, accent stripping, lowercasing) acts on each
  character alone, so normalising the distinct raw characters is enough.
  """
  raw = set()
  for text in texts:
    raw.update(text)
  chars = set(normalizer.normalize_str("".join(sorted(raw))))
  split = pre_tokenizers.BertPreTokenizer()
  return [
      f"##{c}"
      for c in sorted(chars)
      if len(split.pre_tokenize_str(f"a{c}a")) == 1
  ]  # c can continue a word


def _demote_to_vocabulary(
    backend: tokenizers.Tokenizer, continuations: set[str]
) -> tokenizers.Tokenizer:
  """Makes the seeded `##c` ordinary vocabulary entries, not special tokens."""
  state = json.loads(backend.to_str())
  state["added_tokens"] = [
      t for t in state["added_tokens"] if t["content"] not in continuations
  ]
  return tokenizers.Tokenizer.from_str(json.dumps(state))
