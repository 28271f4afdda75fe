"""Public calibration corpora for layer selection (paper Sec. 5.1, App. F).

Layer selection applies the frozen router to a small *public*, unlabeled
corpus format-matched to the task. It costs no privacy budget because the
corpus is fixed, used exactly as loaded: the same for D and every neighbour,
even where a record quotes it (a filter against D would break that). The paper's corpora are presets here; any Hub
dataset or local file works too. Only the first ``n_pub`` texts are kept
(the paper finds ``n = 1000`` enough for a stable choice on all four tasks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from raptor_jax import _validate
from raptor_jax.data import tables


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
  """Where a public corpus lives on the Hub.

  Attributes:
      hub_id: the Hub dataset id.
      hub_config: the Hub config name, or ``None``.
      split: the Hub split.
      text_fields: columns joined with a space into one text (two for
          sentence-pair corpora).
  """

  hub_id: str
  hub_config: str | None
  split: str
  text_fields: tuple[str, ...]


# The paper's calibration corpora (App. F). The local copies under
# shared/data/calib (imdb/unsup_sample5000.tsv, squad/dev_v1.1_contexts.tsv)
# use the same text column names, so a preset name plus a local path works.
PUBLIC_CORPORA: dict[str, CorpusSpec] = {
    "imdb": CorpusSpec("stanfordnlp/imdb", None, "unsupervised", ("text",)),
    # SQuAD v1.1 dev contexts: QNLI's train sentences come from SQuAD train.
    "squad": CorpusSpec("rajpurkar/squad", None, "validation", ("context",)),
    "anli_r2": CorpusSpec(
        "facebook/anli", None, "train_r2", ("premise", "hypothesis")
    ),
    "paws": CorpusSpec(
        "google-research-datasets/paws",
        "labeled_final",
        "train",
        ("sentence1", "sentence2"),
    ),
}

# The corpus the paper pairs with each GLUE task (App. F).
TASK_CORPUS: dict[str, str] = {
    "sst2": "imdb",
    "mnli": "anli_r2",
    "qnli": "squad",
    "qqp": "paws",
}


def load_public_corpus(
    source: str | None = None,
    *,
    path: str | Path | None = None,
    hub_config: str | None = None,
    split: str | None = None,
    text_fields: str | Sequence[str] | None = None,
    n_pub: int = 1000,
) -> list[str]:
  """Returns the first ``n_pub`` distinct non-empty texts of a public corpus.

  The corpus is a local file when ``path`` is set (``.tsv``, ``.csv``,
  ``.parquet``, ``.jsonl`` with a text column, or ``.txt`` with one text per
  line), otherwise a Hub dataset: a preset of :data:`PUBLIC_CORPORA` or any
  Hub id. A preset name together with ``path`` takes the preset's text
  columns for the local file. Explicit ``hub_config``, ``split`` and
  ``text_fields`` override the preset.

  Several columns (sentence-pair corpora) are joined with one space. Texts
  are stripped, empty ones skipped, and repeats dropped, keeping the first
  occurrence: SQuAD repeats each context once per question, and a repeated
  text would only weight the routing statistics towards it.

  Args:
      source: a preset name (``"imdb"``, ``"squad"``, ``"anli_r2"``,
          ``"paws"``) or a Hub dataset id.
      path: a local file to read instead of the Hub.
      hub_config: the Hub config name (Hub ids only).
      split: the Hub split (default: the preset's, else ``"train"``).
      text_fields: the text column(s) (default: the preset's, else ``"text"``).
      n_pub: how many texts to keep.

  Returns:
      At most ``n_pub`` texts, in corpus order.

  Raises:
      ValueError: ``n_pub < 1``, neither ``source`` nor ``path`` given, a
          missing text column, or no non-empty text.
      FileNotFoundError: missing local file, or a Hub dataset that is neither
          reachable nor cached.
  """
  _validate.check(
      n_pub >= 1,
      "data.n_pub",
      ">= 1",
      n_pub,
      _validate.config_fix("data.n_pub"),
  )
  preset = PUBLIC_CORPORA.get(source) if source is not None else None
  if isinstance(text_fields, str):
    text_fields = (text_fields,)
  if text_fields is None:
    text_fields = preset.text_fields if preset is not None else ("text",)
  columns, name = _read_corpus(source, preset, path, hub_config, split)
  if path is not None and Path(path).suffix.lower() == ".txt":
    text_fields = ("text",)
  fields = [
      tables.pick_column(
          columns,
          (field,),
          source=name,
          kind="public text",
          option="public_text_fields",
      )
      for field in text_fields
  ]
  texts = _distinct_texts(zip(*(columns[field] for field in fields)), n_pub)
  if not texts:
    raise ValueError(
        f"Public corpus {name} has no non-empty text in {', '.join(fields)}; check its"
        " source, split and text fields."
    )
  return texts


def _read_corpus(
    source: str | None,
    preset: CorpusSpec | None,
    path: str | Path | None,
    hub_config: str | None,
    split: str | None,
) -> tuple[tables.Columns, str]:
  """Returns the corpus's columns and its name for error messages.

  A local ``path`` wins over ``source``; a Hub source takes the preset's
  config and split unless ``hub_config`` / ``split`` are given.
  """
  if path is not None:
    return tables.read_columns(path), str(path)
  if source is None:
    raise ValueError(
        "No public corpus given; set --config.data.public_corpus to a preset"
        f" ({', '.join(PUBLIC_CORPORA)}) or Hub id, or --config.data.public_path to a file."
    )
  hub_id = preset.hub_id if preset is not None else source
  hub_config = hub_config or (preset.hub_config if preset is not None else None)
  split = split or (preset.split if preset is not None else "train")
  columns = tables.load_hub_columns(
      hub_id,
      hub_config,
      split,
      fix="set --config.data.public_path to a local file",
  )
  return columns, f"{hub_id} split {split}"


def _distinct_texts(rows: Iterable[tuple[Any, ...]], n_pub: int) -> list[str]:
  kept: dict[str, None] = {}
  for parts in rows:
    stripped = (str(part).strip() for part in parts if part is not None)
    text = " ".join(part for part in stripped if part)
    if text:
      kept.setdefault(text)
      if len(kept) == n_pub:
        break
  return list(kept)
