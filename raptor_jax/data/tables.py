"""Reading raw columns from local files and from the Hugging Face Hub.

Everything in ``raptor_jax.data`` reads its raw text through these two
functions, so file formats, quoting rules and the offline error live in one
place. Values come back verbatim: no stripping and no type guessing (a sentence
that reads ``NA`` stays the string ``NA``), because the tokenizer, not the
reader, decides what whitespace means.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

Columns = dict[str, list[Any]]

LOCAL_FORMATS = (".tsv", ".csv", ".parquet", ".jsonl", ".txt")

# A field of a TSV/CSV file may be as long as a document: the tokenizer, not
# the reader, truncates it (Python's csv module stops at 131,072 characters).
_FIELD_LIMIT = 2**31 - 1
# A column name as errors show it: a short name, never a record's text (a
# file without a header row has a record where its names should be).
_COLUMN_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,39}")


def read_columns(path: str | Path, split: str | None = None) -> Columns:
  """Reads a local table into ``{column name: values in file order}``.

  A directory is a ``datasets`` ``save_to_disk`` directory: a ``Dataset``,
  or a ``DatasetDict`` from which ``split`` is read. A file's format follows
  its extension:

  * ``.tsv``: tab-separated, a header row, quoting OFF (``csv.QUOTE_NONE``).
    That is how the official GLUE files are written: some QNLI dev sentences
    start with a literal ``"`` and SST-2 sentences end with a space, and both
    must survive unchanged.
  * ``.csv``: comma-separated, a header row, standard CSV quoting. A quoted
    field that spans lines is refused (it is how an unterminated quote
    reads, merging the records after it into one).
  * ``.parquet``: any parquet file (read with pyarrow).
  * ``.jsonl``: one JSON object per line; a missing key reads as ``None``.
  * ``.txt``: one text per line, returned as the single column ``text``; a
    line with a tab is refused (a table belongs in a ``.tsv``).

  Blank lines in TSV/CSV files are skipped; header names must be distinct;
  a field may be of any length.

  Args:
      path: the local file or ``save_to_disk`` directory.
      split: the split of a saved ``DatasetDict`` (``train``,
          ``validation``); ignored for files.

  Returns:
      A dict from column name to the list of that column's values.

  Raises:
      FileNotFoundError: the file does not exist.
      ValueError: unknown extension, an empty TSV/CSV, a repeated header
          name, a TSV/CSV row whose field count differs from the header's,
          a CSV quote left open across lines, a file that is not UTF-8,
          a bad JSON line, an unreadable parquet file or saved dataset (one
          line naming the file and the fix).
  """
  path = Path(path)
  if path.is_dir():
    return _read_saved(path, split)
  if not path.is_file():
    raise FileNotFoundError(
        f"Data file {path} does not exist; check the path in the config."
    )
  try:
    return _read_file(path)
  except UnicodeDecodeError as e:
    raise ValueError(
        f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8"
    ) from None


def _read_file(path: Path) -> Columns:
  suffix = path.suffix.lower()
  if suffix == ".tsv":
    return _read_delimited(path, delimiter="\t", quoting=csv.QUOTE_NONE)
  if suffix == ".csv":
    return _read_delimited(path, delimiter=",", quoting=csv.QUOTE_MINIMAL)
  if suffix == ".parquet":
    try:
      return pq.read_table(path).to_pydict()
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
      reason = (str(e).splitlines() or [""])[0][:200]
      raise ValueError(
          f"{path} is not a readable parquet file ({reason}); write it with"
          " pandas.DataFrame.to_parquet or pyarrow.parquet.write_table"
      ) from None
  if suffix == ".jsonl":
    return _read_jsonl(path)
  if suffix == ".txt":
    return _read_text_lines(path)
  raise ValueError(
      f"Cannot read {path}: unknown extension {suffix!r}; use one of"
      f" {', '.join(LOCAL_FORMATS)}, or a datasets.save_to_disk directory."
  )


def _read_text_lines(path: Path) -> Columns:
  """A `.txt` file: one text per line; a line with a tab is a table's row."""
  lines = path.read_text(encoding="utf-8").splitlines()
  tabbed = next((i for i, line in enumerate(lines, 1) if "\t" in line), 0)
  if tabbed:
    raise ValueError(
        f"{path} line {tabbed} holds a tab, but a .txt file is one text per"
        " line; for a table of columns rename it to .tsv (with a header row"
        " naming the columns)"
    )
  return {"text": lines}


def _read_saved(path: Path, split: str | None) -> Columns:
  """A `datasets.save_to_disk` directory's columns (a split of a DatasetDict)."""
  import datasets  # pylint: disable=g-import-not-at-top  (1.4 s; few runs need it)

  try:
    saved = datasets.load_from_disk(str(path))
  except (FileNotFoundError, ValueError) as e:
    reason = (str(e).splitlines() or [""])[0][:200]
    raise ValueError(
        f"{path} is a directory but not a datasets.save_to_disk directory"
        f" ({reason}); point the path at a file, or save the dataset with"
        " Dataset.save_to_disk"
    ) from None
  if isinstance(saved, datasets.DatasetDict):
    if split not in saved:
      raise ValueError(
          f"{path} holds the splits {', '.join(saved)}, not {split!r}; save"
          f" that split as {split!r}, or point the path at"
          f" {path}/<split> (a Dataset)"
      )
    saved = saved[split]
  return saved.to_dict()


def _read_delimited(path: Path, *, delimiter: str, quoting: int) -> Columns:
  if csv.field_size_limit() < _FIELD_LIMIT:
    csv.field_size_limit(_FIELD_LIMIT)
  with path.open(encoding="utf-8-sig", newline="") as f:
    rows = csv.reader(f, delimiter=delimiter, quoting=quoting)
    try:
      return _delimited_columns(path, rows)
    except csv.Error as e:
      kind = "TSV" if delimiter == "\t" else "CSV"
      raise ValueError(
          f"{path} line {rows.line_num} is not valid {kind} ({e}); fix that"
          " line"
      ) from None


def _delimited_columns(path: Path, rows) -> Columns:
  header = next(rows, None)
  if header is None:
    raise ValueError(
        f"{path} is empty; it needs a header row naming the columns."
    )
  repeated = sorted({name for name in header if header.count(name) > 1})
  if repeated:
    raise ValueError(
        f"{path}: the header row repeats a column name"
        f" ({shown_names(repeated)}); give every column its own name"
    )
  columns: Columns = {name: [] for name in header}
  line = rows.line_num
  for row in rows:
    first, line = line + 1, rows.line_num
    if not row:  # a blank line holds no record
      continue
    if line > first and any("\n" in value or "\r" in value for value in row):
      raise ValueError(
          f"{path} lines {first}-{line} read as one record: a quote opened"
          f" on line {first} is closed on line {line} or never; close the"
          " quote on its line (a quote inside a field is written twice), or"
          " replace the line breaks inside the field with spaces"
      )
    if len(row) != len(header):
      raise ValueError(
          f"{path} line {line} has {len(row)} fields but the header has"
          f" {len(header)}; fix or remove that line."
      )
    for name, value in zip(header, row):
      columns[name].append(value)
  return columns


def _read_jsonl(path: Path) -> Columns:
  records = []
  with path.open(encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise ValueError(
            f"{path} line {number} is not JSON ({e.msg}); write one JSON"
            " object per line"
        ) from None
      if not isinstance(record, dict):
        raise ValueError(
            f"{path} line {number} is a JSON {type(record).__name__}, not an"
            " object; write one JSON object per line, e.g."
            ' {"text": "...", "label": 1}'
        )
      records.append(record)
  names = list(dict.fromkeys(key for record in records for key in record))
  return {name: [record.get(name) for record in records] for name in names}


def pick_column(
    columns: Columns,
    candidates: Sequence[str],
    *,
    source: str,
    kind: str,
    option: str,
) -> str:
  """Returns the first of ``candidates`` that is a column of ``columns``.

  Args:
      columns: the table.
      candidates: accepted column names, in order of preference.
      source: the table's name for the error (a path or a Hub id).
      kind: what the column holds, for the error (``"label"``).
      option: the config field that overrides the name, for the error.

  Raises:
      ValueError: none of the candidates is a column.
  """
  for name in candidates:
    if name in columns:
      return name
  raise ValueError(
      f"{source} has no {kind} column (looked for {', '.join(candidates)}; it has"
      f" {shown_names(list(columns))}); set --config.data.{option}."
  )


def shown_names(names: Sequence[str]) -> str:
  """Column names for an error: never a record's text.

  A file without a header row has its first record where the names should
  be, so names are shown only when every one is a short name; otherwise
  the count, and the hint that the header row may be missing.
  """
  if not names:
    return "no columns"
  if all(_COLUMN_NAME.fullmatch(str(name)) for name in names):
    return ", ".join(map(str, names))
  return (
      f"{len(names)} columns whose names are not shown: the first row does"
      " not read as a header row of column names; add one"
  )


def load_hub_columns(
    hub_id: str, config: str | None, split: str, *, fix: str
) -> Columns:
  """Loads one split of a Hub dataset into ``{column name: values}``.

  ``datasets`` serves the split from its local cache when the Hub is not
  reachable. With ``HF_DATASETS_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) it
  fails at once instead of waiting on the network. Either way the failure
  becomes one line that names the dataset and how to use a local file.

  Args:
      hub_id: the Hub dataset id, e.g. ``"nyu-mll/glue"``.
      config: the dataset's config name (``"sst2"``) or ``None``.
      split: the Hub split name (``"validation_matched"``).
      fix: how to do without the Hub, ending the error message, e.g.
          ``"set --config.data.train_path=/path/to/train.tsv"``.

  Returns:
      A dict from column name to the list of that column's values.

  Raises:
      FileNotFoundError: the dataset is neither reachable nor cached.
  """
  import datasets  # pylint: disable=g-import-not-at-top  (1.4 s; few runs need it)

  try:
    dataset = datasets.load_dataset(hub_id, config, split=split)
  except (ConnectionError, FileNotFoundError) as e:
    name = hub_id if config is None else f"{hub_id} ({config})"
    raise FileNotFoundError(
        f"Hub dataset {name}, split {split!r}, is not in the local cache and the Hub is"
        f" not reachable (offline?); download it once online, or {fix}."
    ) from e
  return dataset.to_dict()
