"""The classification tasks: GLUE SST-2, MNLI, QNLI, QQP, the generated task
and the user's own (:func:`custom_task`).

A :class:`TaskSpec` holds everything public about a task: where its data lives
on the Hub, which columns hold the text and the label (with the aliases used
by the official GLUE TSV files and common exports, so local files load with no
extra configuration), its label vocabulary and the metrics to report.
:func:`load_task_split` turns one split into right-padded ``int32`` arrays.

Class ids follow the Hugging Face GLUE convention (``nyu-mll/glue``), so Hub
data and local files with string labels agree: MNLI entailment=0, neutral=1,
contradiction=2; QNLI entailment=0, not_entailment=1; QQP not_duplicate=0,
duplicate=1; SST-2 negative=0, positive=1.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raptor_jax import _validate
from raptor_jax.data import encoding, tables

_GLUE = "nyu-mll/glue"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """Public description of a classification task.

  Attributes:
      name: the task name used in configs (``"sst2"``).
      text_fields: one entry per text of a record (one, or two for sentence
          pairs); each entry lists the accepted column names, Hub name first.
      label_fields: the accepted names of the label column, Hub name first.
      label_names: class names; position = class id. String labels in local
          files are mapped through it, integer labels must be in range.
      hub_id: the Hub dataset id, or ``None`` for a generated task.
      hub_config: the Hub config name (``"sst2"``), or ``None``.
      splits: our split name (``"train"``, ``"dev"``) -> Hub split name.
      metrics: metric names to report on the dev split.
  """

  name: str
  text_fields: tuple[tuple[str, ...], ...]
  label_fields: tuple[str, ...]
  label_names: tuple[str, ...]
  hub_id: str | None
  hub_config: str | None
  splits: Mapping[str, str]
  metrics: tuple[str, ...] = ("accuracy",)

  @property
  def num_labels(self) -> int:
    return len(self.label_names)


def _glue_task(
    name: str,
    text_fields: tuple[tuple[str, ...], ...],
    label_names: tuple[str, ...],
    label_fields: tuple[str, ...] = ("label",),
    **fields: Any,
) -> TaskSpec:
  """A GLUE task on the Hub: config ``name``, dev its validation split
  unless ``fields`` say otherwise."""
  return TaskSpec(
      name=name,
      text_fields=text_fields,
      label_fields=label_fields,
      label_names=label_names,
      hub_id=_GLUE,
      hub_config=name,
      **{"splits": {"train": "train", "dev": "validation"}, **fields},
  )


TASKS: dict[str, TaskSpec] = {
    task.name: task
    for task in (
        _glue_task("sst2", (("sentence",),), ("negative", "positive")),
        _glue_task(
            "mnli",
            (("premise", "sentence1"), ("hypothesis", "sentence2")),
            ("entailment", "neutral", "contradiction"),
            label_fields=("label", "gold_label"),
            splits={
                "train": "train",
                "dev": "validation_matched",
                "dev_mismatched": "validation_mismatched",
            },
        ),
        _glue_task(
            "qnli",
            (("question",), ("sentence",)),
            ("entailment", "not_entailment"),
        ),
        _glue_task(
            "qqp",
            (("question1",), ("question2",)),
            ("not_duplicate", "duplicate"),
            label_fields=("label", "is_duplicate"),
            metrics=("accuracy", "f1"),
        ),
        # Generated in code by raptor_jax.data.synthetic_task(); listed here
        # so that configs look its label count and metrics up like any other
        # task's.
        TaskSpec(
            name="synthetic",
            text_fields=(("text",),),
            label_fields=("label",),
            label_names=("negative", "positive"),
            hub_id=None,
            hub_config=None,
            splits={"train": "train", "dev": "dev"},
        ),
    )
}


# `data.task` of a task the user declares (`custom_task`, configs/custom.py).
CUSTOM = "custom"
_CUSTOM_FIX = "declare your own with --config=configs/custom.py:small"


def get_task(name: str) -> TaskSpec:
  """Returns the spec of task ``name`` (case-insensitive).

  Raises:
      ValueError: unknown task (a custom task is built by `custom_task`).
  """
  _validate.check(
      name.lower() != CUSTOM,
      "data.task",
      f"one of {', '.join(TASKS)} here (data.task='custom' is declared by"
      " data.text_fields, data.label_field and data.label_names)",
      name,
      _CUSTOM_FIX,
  )
  _validate.one_of(
      "data.task",
      name.lower(),
      TASKS,
      _validate.config_fix("data.task") + f", or {_CUSTOM_FIX}",
  )
  return TASKS[name.lower()]


def custom_task(
    text_fields: Sequence[str],
    label_field: str,
    label_names: Sequence[str],
    *,
    hub_id: str | None = None,
) -> TaskSpec:
  """The spec of the user's own task: its columns and its label vocabulary.

  Args:
      text_fields: the text column, or two for a sentence pair (also as
          one comma-separated string, as the command line passes it).
      label_field: the label column; its values are class names of
          ``label_names`` or integers 0 .. K-1.
      label_names: the K >= 2 class names; position = class id.
      hub_id: a Hub dataset with ``train`` and ``validation`` splits, read
          when no local file is given (online, or from the ``datasets``
          cache).

  Returns:
      A task reporting accuracy and macro-F1 (the mean F1 over classes).

  Raises:
      ValueError: one line naming the field and its fix.
  """
  fix = lambda field, example: (
      _validate.config_fix(f"data.{field}", example) + " (configs/custom.py)"
  )
  text_fields = names_list(text_fields)
  _validate.check(
      len(text_fields) in (1, 2)
      and all(isinstance(f, str) and f for f in text_fields),
      "data.text_fields",
      "one text column, or two for a sentence pair",
      tuple(text_fields),
      fix("text_fields", "text"),
  )
  _validate.check(
      isinstance(label_field, str) and bool(label_field),
      "data.label_field",
      "the label column's name",
      label_field,
      fix("label_field", "label"),
  )
  _validate.check(
      label_field not in text_fields,
      "data.label_field",
      f"a column other than the text column(s) {', '.join(text_fields)} (the"
      " label would be part of the model's input)",
      label_field,
      "set --config.data.text_fields to the text column(s) only",
  )
  label_names = names_list(label_names)
  _validate.check(
      len(label_names) >= 2
      and all(isinstance(n, str) and n for n in label_names)
      and len(set(label_names)) == len(label_names),
      "data.label_names",
      "two or more distinct class names (position = class id)",
      tuple(label_names),
      fix("label_names", "negative,positive"),
  )
  return TaskSpec(
      name=CUSTOM,
      text_fields=tuple((name,) for name in text_fields),
      label_fields=(label_field,),
      label_names=tuple(label_names),
      hub_id=hub_id or None,
      hub_config=None,
      splits={"train": "train", "dev": "validation"},
      metrics=("accuracy", "macro_f1"),
  )


def names_list(value: str | Sequence[str]) -> tuple[str, ...]:
  """Column or class names as given on a command line, as a tuple.

  Accepts a sequence, one comma-separated string (``"neg, pos"``) or a
  Python tuple or list literal (``"('neg', 'pos')"``, as ml_collections
  users write them); spaces around each name are stripped and empty names
  dropped.
  """
  if isinstance(value, str):
    text = value.strip()
    if text[:1] in "([" and text[-1:] in ")]":
      try:
        value = ast.literal_eval(text)
      except (ValueError, SyntaxError):
        value = text[1:-1].split(",")
      if isinstance(value, str):
        value = (value,)
    else:
      value = text.split(",")
  names = (
      str(name).strip().strip("'\"").strip() if isinstance(name, str) else name
      for name in value
  )
  return tuple(name for name in names if name != "")


def _spec(task: str | TaskSpec) -> TaskSpec:
  return task if isinstance(task, TaskSpec) else get_task(task)


def _check_split_args(spec, split, text_fields, limit, offset):
  """Validates `load_task_split`'s arguments; returns text_fields as a tuple (or None)."""
  _validate.one_of(f"split of task {spec.name}", split, spec.splits)
  _validate.check(limit is None or limit >= 1, "limit", ">= 1 or None", limit)
  _validate.check(offset >= 0, "offset", ">= 0", offset)
  if text_fields is not None:
    text_fields = names_list(text_fields)
  _validate.check(
      text_fields is None or len(text_fields) in (1, 2),
      "data.text_fields",
      "one text column, or two for a sentence pair",
      text_fields,
      _validate.config_fix("data.text_fields"),
  )
  return text_fields


def _pick_columns(spec, columns, source, text_fields, label_field):
  """(text column names, label column name) by explicit names or the task's aliases."""
  text_candidates = (
      [(name,) for name in text_fields]
      if text_fields is not None
      else spec.text_fields
  )
  try:
    text_names = [
        tables.pick_column(
            columns, names, source=source, kind="text", option="text_fields"
        )
        for names in text_candidates
    ]
    label_name = tables.pick_column(
        columns,
        (label_field,) if label_field is not None else spec.label_fields,
        source=source,
        kind="label",
        option="label_field",
    )
  except ValueError as e:
    if spec.hub_id != _GLUE:
      raise
    raise ValueError(
        f"{str(e).rstrip('.')}, or, if this is not {spec.name} but a task of"
        f" your own, {_CUSTOM_FIX}"
    ) from None
  if label_name in text_names:
    raise ValueError(
        f"{source}: column {label_name!r} is both the label and a text"
        " column, so the label would be part of the model's input; set"
        " --config.data.text_fields to the text column(s) only"
    )
  return text_names, label_name


def _records_stop(
    source: str, total: int, offset: int, limit: int | None
) -> int:
  """End (exclusive) of the records ``offset .. offset + limit - 1``.

  Raises:
      ValueError: the file has no records, or fewer than the slice asks for.
  """
  if not total:
    raise ValueError(
        f"{source} has no records (a header row only); add records or fix"
        " the path."
    )
  stop = total if limit is None else offset + limit
  if stop > total:
    raise ValueError(
        f"{source} has {total} records, fewer than the {stop} that offset"
        f" {offset} and limit {limit} ask for; lower the limit"
        " (train_limit/holdout)."
    )
  return stop


def load_task_split(
    task: str | TaskSpec,
    split: str,
    *,
    tokenizer: encoding.Tokenizer,
    path: str | Path | None = None,
    max_length: int = 128,
    text_fields: str | Sequence[str] | None = None,
    label_field: str | None = None,
    limit: int | None = None,
    offset: int = 0,
    shard: tuple[int, int] = (0, 1),
) -> encoding.TextClassificationData:
  """Loads one split of a task as right-padded ``int32`` arrays.

  Without ``path`` the split comes from the Hub (or the local ``datasets``
  cache); with ``path`` from a local ``.tsv`` (quoting off, as GLUE writes
  them), ``.csv``, ``.parquet`` or ``.jsonl`` file, or a
  ``datasets.save_to_disk`` directory. Column names are found
  through the task's aliases (``sentence1``/``premise``, ``gold_label``/
  ``label``, ``is_duplicate``/``label``...) unless given explicitly.
  Sentence pairs are tokenised as pairs.

  Args:
      task: a key of :data:`TASKS`, or a :class:`TaskSpec` (`custom_task`).
      split: ``"train"`` or ``"dev"`` (MNLI also ``"dev_mismatched"``).
      tokenizer: the model's tokenizer.
      path: a local file to read instead of the Hub.
      max_length: tokens per record after truncation and right padding.
      text_fields: column names of the text (one) or text pair (two),
          overriding the task's aliases.
      label_field: column name of the label, overriding the aliases.
      limit: keep only the first ``limit`` records (quick runs).
      offset: skip this many records first (``offset`` and ``limit`` select
          records ``offset .. offset + limit - 1``, e.g. a held-out slice
          after the training records).
      shard: ``(index, count)``: tokenise and return only the records ``i``
          (of the first ``limit``) with ``i % count == index``, this host's
          share in a multi-host run. Every label is still checked, so a bad
          file fails on every host alike.

  Returns:
      The split (or its shard), one row per record in file order.

  Raises:
      ValueError: unknown task or split, missing text or label column, a
          label outside the task's label set, bad ``limit``/``text_fields``.
      FileNotFoundError: missing local file, or a Hub dataset that is neither
          reachable nor cached.
  """
  spec = _spec(task)
  text_fields = _check_split_args(spec, split, text_fields, limit, offset)
  columns, source = _split_columns(spec, split, path)
  text_names, label_name = _pick_columns(
      spec, columns, source, text_fields, label_field
  )
  index, count = shard
  _validate.check(0 <= index < count, "shard index", f"in [0, {count})", index)
  stop = _records_stop(source, len(columns[label_name]), offset, limit)
  labels, texts = _labels_and_texts(
      spec, columns, source, text_names, label_name, (offset, stop), shard
  )
  return encoding.encode(
      tokenizer,
      texts[0],
      labels,
      pair_texts=texts[1] if len(texts) == 2 else None,
      max_length=max_length,
  )


def _labels_and_texts(
    spec, columns, source, text_names, label_name, rows, shard
):
  """(class ids, [texts of each text column]) of records rows[0]..rows[1]-1,
  this shard's; every label and text is checked (one line for the first bad
  one)."""
  offset, stop = rows
  index, count = shard
  raw_labels = columns[label_name][offset:stop]
  labels = [
      _label_id(value, spec)
      if _is_label(value, spec)
      else _bad_label(
          value, raw_labels, spec, row=row, column=label_name, source=source
      )
      for row, value in enumerate(raw_labels, start=offset + 1)
  ][index::count]
  for name in text_names:
    _check_texts(columns[name][offset:stop], name, source, offset)
  texts = [
      [_as_text(value) for value in columns[name][offset:stop][index::count]]
      for name in text_names
  ]
  return labels, texts


def load_task_texts(
    task: str | TaskSpec,
    split: str,
    *,
    path: str | Path | None = None,
    text_fields: Sequence[str] | None = None,
) -> list[str]:
  """Every text of one split (both sides of a pair), untokenised, in file order.

  For checks that must see the raw text, such as dropping a task's sentences
  from a public pretraining corpus. Arguments as :func:`load_task_split`.
  """
  spec = _spec(task)
  _validate.one_of(f"split of task {spec.name}", split, spec.splits)
  columns, source = _split_columns(spec, split, path)
  candidates = (
      [(name,) for name in text_fields]
      if text_fields is not None
      else spec.text_fields
  )
  names = [
      tables.pick_column(
          columns, names, source=source, kind="text", option="text_fields"
      )
      for names in candidates
  ]
  return [_as_text(value) for name in names for value in columns[name]]


def _split_columns(
    spec: TaskSpec, split: str, path: str | Path | None
) -> tuple[tables.Columns, str]:
  if path is not None:
    return tables.read_columns(path, split=spec.splits[split]), str(path)
  if spec.hub_id is None:
    raise ValueError(
        f"Task {spec.name} has no Hub dataset: it is generated by"
        f" raptor_jax.data.synthetic_task(); or set --config.data.{split}_path to a file."
        if spec.name != CUSTOM
        else f"the custom task has no {split} data; set"
        f" --config.data.{split}_path to a file, or --config.data.hub_dataset"
    )
  hub_split = spec.splits[split]
  columns = tables.load_hub_columns(
      spec.hub_id,
      spec.hub_config,
      hub_split,
      fix=f"set --config.data.{split}_path=/path/to/{split}.tsv",
  )
  name = (
      spec.hub_id
      if spec.hub_config is None
      else f"{spec.hub_id}/{spec.hub_config}"
  )
  return columns, f"{name} split {hub_split}"


def _as_text(value: Any) -> str:
  return "" if value is None else str(value)


def _check_texts(values: Sequence[Any], column: str, source: str, offset: int):
  """Refuses a record without its text (a missing JSON key, or null)."""
  missing = next((i for i, v in enumerate(values) if v is None), None)
  if missing is not None:
    raise ValueError(
        f"{source}, data row {offset + missing + 1} has no {column!r} (missing"
        " or null); give every record its text, or drop the record"
    )


def _is_label(value: Any, spec: TaskSpec) -> bool:
  """Whether `value` is a class name or a class id of `spec` (no bool)."""
  if isinstance(value, str):
    value = value.strip()
    return value in spec.label_names or (
        value.isdecimal() and int(value) < spec.num_labels
    )
  return (
      isinstance(value, int)
      and not isinstance(value, bool)
      and 0 <= value < spec.num_labels
  )


def _label_id(value: Any, spec: TaskSpec) -> int:
  """The class id of a raw label that `_is_label` accepted (a class name, an
  integer, or an integer string)."""
  if isinstance(value, str):
    value = value.strip()
    if value in spec.label_names:
      return spec.label_names.index(value)
  return int(value)


def _shown_label(value: Any) -> str:
  """A label value for an error: a short word is shown; a longer value
  (a wrongly chosen label column may hold private text) is not."""
  text = str(value)
  if isinstance(value, bool):
    return f"JSON {str(value).lower()}"
  if len(text) <= 24 and not any(c.isspace() for c in text.strip()):
    return repr(value)
  return f"a value of {len(text)} characters (not shown)"


def _one_based(values: Sequence[Any], k: int) -> bool:
  """Whether every label is an integer id in 1..K (and one is K)."""
  ids = []
  for value in values:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.isdecimal():
      text = int(text)
    if not isinstance(text, int) or isinstance(text, bool):
      return False
    ids.append(text)
  return bool(ids) and min(ids) >= 1 and max(ids) == k


def _bad_label(
    value: Any,
    values: Sequence[Any],
    spec: TaskSpec,
    *,
    row: int,
    column: str,
    source: str,
):
  """Raises the one line for `value`, the label of data row `row` (`values`:
  the whole label column, to recognise one-based ids)."""
  where = f"{source}, column {column!r}, data row {row}"
  expected = f"{'/'.join(spec.label_names)} or 0..{spec.num_labels - 1}"
  if _one_based(values, spec.num_labels):
    raise ValueError(
        f"{where}: the labels are one-based ids 1..{spec.num_labels}, but class"
        f" ids start at 0 ({expected}); subtract 1 from every label, or write"
        " the class names"
    )
  if isinstance(value, bool):
    raise ValueError(
        f"{where}: a JSON {str(value).lower()} is not a class (expected"
        f" {expected}); write the class name or id"
    )
  fix = (
      "fix the file, or list its classes in --config.data.label_names"
      if spec.name == CUSTOM
      else "fix the file or set --config.data.label_field"
  )
  raise ValueError(
      f"{where}: {_shown_label(value)} is not a {spec.name} label (expected"
      f" {expected}; an unlabelled test split?); {fix}."
  )
