"""Public pretraining text: sources, cleaning, deduplication, decontamination.

Pretraining must not see the fine-tuning task's evaluation text (dev), or
the fine-tuned model would be scored on text it memorised: that is what
contamination is about. So every public document that contains a dev text of
the task verbatim is dropped, and the count is reported. The private *train*
split is not read by default: dropping the documents a train record quotes
would make the "public" starting point a function of D (a neighbour adding a
record that copies a public document would change the corpus), outside any
epsilon. A fixed public corpus is DP-safe even where D quotes it, so by
default the corpus is the same for D and for every neighbour.
`decontaminate.train_path` opts in to train-split decontamination as well;
the pretrained model then depends on D, and the fine-tuned model's
guarantee no longer covers that dependence (a warning says so). Matching (`data.overlap`) is on a normalised form
(lowercase letters and digits only), so tokenisation differences do not
hide a copy.

Documents are split into a training part and a held-out part by a hash of
their text, so the split does not depend on file order or on which other
documents exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from raptor_jax import _validate
from raptor_jax.data import synthetic, tables, tasks

# The one matcher, shared with the public corpus of layer selection.
from raptor_jax.data.overlap import (
    contamination_index,
    is_contaminated,
    normalize,
)

log = logging.getLogger("raptor_jax")


@dataclasses.dataclass(frozen=True)
class PretrainSource:
  """A public corpus on the Hub and in a local copy.

  Attributes:
    hub_id, hub_config, split, text_field: where `datasets` finds it.
    local_name: its file under a local data directory (`corpus.local_dir`).
  """

  hub_id: str
  hub_config: str | None
  split: str
  text_field: str
  local_name: str


# WikiText-2 *train* only: its valid split quotes an SST-2 dev sentence.
PRETRAIN_SOURCES: dict[str, PretrainSource] = {
    "wikitext2": PretrainSource(
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
        "train",
        "text",
        "wikitext2/train.txt",
    ),
    "imdb": PretrainSource(
        "stanfordnlp/imdb", None, "unsupervised", "text", "imdb/unsup.tsv"
    ),
}
# Generated offline (the `:tiny` presets): unlabeled reviews and descriptions
# in the synthetic task's vocabulary, from other random streams than the task.
SYNTHETIC = "synthetic"

_WIKITEXT_MARKUP = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_HTML_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_SPACES = re.compile(r"\s+")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Cleaned public documents and what cleaning removed."""

  train: list[str]
  heldout: list[str]
  stats: dict[str, int]


def clean(text: str, source: str) -> str:
  """One document as plain text: markup removed, whitespace collapsed.

  WikiText headings (`= Title =`) become empty, so they are dropped.
  """
  text = _HTML_BREAK.sub(" ", text)
  if source == "wikitext2":
    if text.strip().startswith("="):
      return ""
    for markup, plain in _WIKITEXT_MARKUP:
      text = text.replace(markup, plain)
  return _SPACES.sub(" ", text).strip()


def read_source(
    name: str, *, local_dir: str = "", seed: int = 0, n_synthetic: int = 4000
) -> list[str]:
  """The raw documents of one source, in corpus order.

  Args:
    name: a key of `PRETRAIN_SOURCES`, `"synthetic"`, or `name=path` for a
      local file of that source (`.txt`: one document per line; `.tsv`,
      `.csv`, `.parquet`, `.jsonl`: a `text` column).
    local_dir: a directory holding the sources' local copies under their
      `local_name` (e.g. `../shared/data/pretrain`); '' reads the Hub.
    seed: the seed of the synthetic source.
    n_synthetic: documents of the synthetic source.
  """
  name, _, path = name.partition("=")
  if name == SYNTHETIC:
    reviews = synthetic.generate_records(
        seed + 1_000_003, n_synthetic // 2
    ).texts
    return reviews + synthetic.generate_public_texts(
        seed + 1_000_003, n_synthetic // 2
    )
  if name not in PRETRAIN_SOURCES:
    raise ValueError(
        f"unknown pretraining source {name!r}; use {', '.join(PRETRAIN_SOURCES)}, "
        f"{SYNTHETIC!r} or name=/path/to/file"
    )
  spec = PRETRAIN_SOURCES[name]
  if not path and local_dir:
    path = str(Path(local_dir) / spec.local_name)
  if path:
    columns = tables.read_columns(path)
  else:
    columns = tables.load_hub_columns(
        spec.hub_id,
        spec.hub_config,
        spec.split,
        fix=f"set --config.corpus.local_dir to a directory with {spec.local_name}, or give "
        f"--config.corpus.sources={name}=/path/to/file",
    )
  field = tables.pick_column(
      columns,
      (spec.text_field,),
      source=path or spec.hub_id,
      kind="text",
      option="corpus.sources",
  )
  return [str(t) for t in columns[field] if t is not None]


def task_texts(
    task: str,
    *,
    train_path: str = "",
    dev_path: str = "",
    seed: int = 0,
    text_fields: Sequence[str] | str = (),
) -> list[str]:
  """The fine-tuning task's texts to decontaminate against: its dev split.

  Sentence pairs contribute both sides. The synthetic task's dev records are
  regenerated from `seed` with its default sizes (`data.synthetic_task`).
  A custom task (`task='custom'`, configs/custom.py) is read from its
  `dev_path` through its `text_fields`, the columns fine-tuning reads as
  `data.text_fields`; for a GLUE task `text_fields` overrides its column
  aliases.

  Privacy: the private train split is read only when `train_path` names it
  (an explicit opt-in, warned about): the corpus is then a function of D,
  outside the DP guarantee. Without it the corpus is the same for D and for
  every neighbour of D.

  Args:
    task: the fine-tuning task (a GLUE task, 'synthetic' or 'custom').
    train_path: opt-in only: the task's train file, also decontaminated
      against; '' (default) reads no train text.
    dev_path: the task's dev file; '' reads the Hub (a custom task needs it).
    seed: the synthetic task's seed.
    text_fields: the text column, or two for a sentence pair (also as one
      comma-separated string); () = the task's own (GLUE) column names.
  """
  if isinstance(text_fields, str):
    text_fields = tuple(filter(None, text_fields.split(",")))
  text_fields = tuple(text_fields)
  if task == SYNTHETIC:
    for field, value in (
        ("train_path", train_path),
        ("text_fields", text_fields),
    ):
      if value:
        raise ValueError(
            f"decontaminate.{field}: the generated task has no"
            f" {'train file' if field == 'train_path' else 'columns'}; unset"
            f" --config.decontaminate.{field}"
        )
    return synthetic.generate_records(seed, 4000 + 500).texts[4000:]
  spec: str | tasks.TaskSpec = task
  if task == tasks.CUSTOM:
    fix = "(the columns of data.text_fields in configs/custom.py)"
    _validate.check(
        len(text_fields) in (1, 2),
        "decontaminate.text_fields",
        "the custom task's text column, or two for a sentence pair",
        text_fields,
        _validate.config_fix("decontaminate.text_fields", "text") + " " + fix,
    )
    _validate.check(
        bool(dev_path),
        "decontaminate.dev_path",
        "the custom task's dev file",
        dev_path,
        _validate.config_fix("decontaminate.dev_path", "dev.tsv"),
    )
    # Only the text columns are read: the label fields are placeholders.
    spec = tasks.custom_task(text_fields, "label", ("0", "1"))
  kwargs = dict(text_fields=text_fields) if text_fields else {}
  texts = tasks.load_task_texts(spec, "dev", path=dev_path or None, **kwargs)
  if train_path:
    log.warning(
        "decontaminate.train_path is set: the pretraining corpus drops"
        " documents that quote the private train split, so it depends on the"
        " private data, outside the DP guarantee of any model fine-tuned"
        " from it; unset it to decontaminate against the dev split only"
    )
    texts = [
        *texts,
        *tasks.load_task_texts(spec, "train", path=train_path, **kwargs),
    ]
  return texts


def tasks_texts(
    tasks_csv: str,
    *,
    dev_paths: str = "",
    train_paths: str = "",
    seed: int = 0,
    text_fields: Sequence[str] | str = (),
) -> list[str]:
  """`task_texts` of several tasks: `decontaminate.task='sst2,qnli'`.

  One pretrained model may serve several fine-tuning tasks; its corpus is
  then decontaminated against each of their dev splits. `dev_paths` (and
  the opt-in `train_paths`) are comma lists in the order of the tasks; an
  empty entry, or an empty list, reads that task's split from the Hub.
  `text_fields` applies to a single task only.

  Privacy: as `task_texts`, for every task.
  """
  names = [t for t in tasks_csv.split(",") if t]

  def per_task(option: str, value: str) -> list[str]:
    paths = value.split(",") if value else [""] * len(names)
    _validate.check(
        len(paths) == len(names),
        f"decontaminate.{option}",
        f"one path per task of decontaminate.task ({len(names)})",
        value,
        _validate.config_fix(f"decontaminate.{option}", "a.tsv,b.tsv"),
    )
    return paths

  devs, trains = per_task("dev_path", dev_paths), per_task(
      "train_path", train_paths
  )
  if len(names) > 1 and text_fields:
    raise ValueError(
        "decontaminate.text_fields: names one task's columns, but"
        f" decontaminate.task lists {len(names)}; unset it or decontaminate"
        " one task"
    )
  return [
      text
      for name, dev, train in zip(names, devs, trains)
      for text in task_texts(
          name,
          train_path=train,
          dev_path=dev,
          seed=seed,
          text_fields=text_fields,
      )
  ]


def heldout_bucket(text: str) -> float:
  """A uniform number in [0, 1) from the text's hash (order independent)."""
  return (
      int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
      / 2.0**64
  )


def build_corpus(
    sources: Sequence[str],
    *,
    contaminants: Iterable[str] = (),
    local_dir: str = "",
    heldout_fraction: float = 0.01,
    min_chars: int = 32,
    seed: int = 0,
    n_synthetic: int = 4000,
) -> Corpus:
  """Reads, cleans, deduplicates and decontaminates the public documents.

  Args:
    sources: see `read_source`.
    contaminants: the fine-tuning task's dev texts (`task_texts`).
    local_dir: local copies of the sources (see `read_source`).
    heldout_fraction: share of documents held out for evaluation.
    min_chars: task texts with fewer normalised characters are not matched.
    seed: the synthetic source's seed.
    n_synthetic: documents of the synthetic source.

  Returns:
    The corpus; `stats` counts documents read, empty, duplicate and
    contaminated (dropped), and kept for training and held out.
  """
  if not sources:
    raise ValueError("no pretraining source; set --config.corpus.sources")
  _validate.in_interval(
      "corpus.heldout_fraction",
      heldout_fraction,
      "(0, 1)",
      _validate.config_fix("corpus.heldout_fraction"),
  )
  index = contamination_index(contaminants, min_chars=min_chars)
  stats = dict(
      read=0,
      empty=0,
      duplicate=0,
      contaminated=0,
      task_texts_indexed=sum(len(v) for v in index.values()),
  )
  seen: set[str] = set()
  train, heldout = [], []
  for source in sources:
    name = source.partition("=")[0]
    for raw in read_source(
        source, local_dir=local_dir, seed=seed, n_synthetic=n_synthetic
    ):
      stats["read"] += 1
      text = clean(raw, name)
      if not text:
        stats["empty"] += 1
        continue
      key = normalize(text)
      if key in seen:
        stats["duplicate"] += 1
        continue
      seen.add(key)
      if is_contaminated(text, index, min_chars):
        stats["contaminated"] += 1
        continue
      (heldout if heldout_bucket(key) < heldout_fraction else train).append(
          text
      )
  stats.update(train=len(train), heldout=len(heldout))
  if not train or not heldout:
    raise ValueError(
        f"the pretraining corpus has {len(train)} training and {len(heldout)} "
        "held-out documents; add sources or change corpus.heldout_fraction"
    )
  return Corpus(train, heldout, stats)
