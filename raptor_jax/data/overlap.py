"""Verbatim text overlap between public text and a task's (private) text.

One matcher for both places that need it: the pretraining corpus drops
documents that contain an evaluation text of the task (`pretrain.corpus`),
and the operator's opt-in overlap report (`launch/overlap.py`) counts the
public texts of layer selection that overlap the private train split
(`drop_overlapping`). A run never filters its public corpus against the
private data: that would make the corpus, l* and the vocabulary functions
of D. Matching is on a normalised form (lowercase letters and
digits only), so tokenisation differences (SST-2's PTB style ``does n't``
against ``doesn't``, WikiText's ``@-@``) do not hide a copy. Texts shorter
than `min_chars` normalised characters are not matched: SST-2 train holds
phrases such as "good" that occur in almost every document without it being
a copy.

Cost: building an index is linear in the indexed text; a document is checked
with one dict lookup per word start, so 67k private sentences against
thousands of public texts take seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

_NOT_ALNUM = re.compile(r"[^0-9a-z]+")
_WORD = re.compile(r"[0-9a-z]+")


def normalize(text: str) -> str:
  """The matching form: lowercase letters and digits, nothing else."""
  return _NOT_ALNUM.sub("", text.lower())


def contamination_index(
    texts: Iterable[str], *, min_chars: int
) -> dict[str, set[str]]:
  """The normalised texts of at least `min_chars`, keyed by their prefix."""
  index: dict[str, set[str]] = {}
  for text in texts:
    norm = normalize(text)
    if len(norm) >= min_chars:
      index.setdefault(norm[:min_chars], set()).add(norm)
  return index


def matches(
    document: str, index: dict[str, set[str]], min_chars: int
) -> Iterator[str]:
  """The indexed (normalised) texts that occur verbatim in `document`.

  Candidate positions are the starts of the document's words; each window of
  `min_chars` normalised characters is looked up, and a hit is confirmed by
  comparing the whole indexed text.
  """
  if not index:
    return
  starts, parts, position = [], [], 0
  for match in _WORD.finditer(document.lower()):
    starts.append(position)
    parts.append(match.group())
    position += len(match.group())
  norm = "".join(parts)
  for start in starts:
    for candidate in index.get(norm[start : start + min_chars], ()):
      if norm.startswith(candidate, start):
        yield candidate


def is_contaminated(
    document: str, index: dict[str, set[str]], min_chars: int
) -> bool:
  """Whether any indexed text occurs verbatim (normalised) in `document`."""
  return next(matches(document, index, min_chars), None) is not None


def drop_overlapping(
    public: Sequence[str], private: Iterable[str], *, min_chars: int = 32
) -> tuple[list[str], int]:
  """Public texts that share no verbatim text with the private ones.

  A public text is dropped when it contains a private text, or a private
  text contains it (normalised, at least `min_chars` characters either way).
  Only the count leaves this function; which texts matched is never
  reported.

  Privacy: the count (and which texts are kept) is a function of the
  private data that no epsilon covers. It is for the operator's eyes only
  (`setup.overlap_report`): nothing a run computes or writes reads it, and
  a run's public corpus is never filtered with it.

  Returns:
    (kept public texts in order, number dropped).
  """
  private = list(private)
  inside = contamination_index(private, min_chars=min_chars)
  overlapping = {
      i
      for i, text in enumerate(public)
      if is_contaminated(text, inside, min_chars)
  }
  by_norm: dict[str, list[int]] = {}
  for i, text in enumerate(public):
    by_norm.setdefault(normalize(text), []).append(i)
  outside = contamination_index(public, min_chars=min_chars)
  for text in private:
    for norm in matches(text, outside, min_chars):
      overlapping.update(by_norm[norm])
  kept = [text for i, text in enumerate(public) if i not in overlapping]
  return kept, len(overlapping)
