"""Multiple-choice questions with images: ScienceQA and a user's own files.

A record is an image (or none), a question, an optional hint (context), 2 to
`max_choices` choices and the index of the right one. Two readers:

* `read_scienceqa`: ScienceQA's public layout (the Hub's
  `derek-thomas/ScienceQA` parquet files: `image` {bytes, path} or null,
  `question`, `choices` list, `answer` int, `hint`), from a local
  `.parquet` file, a `datasets.save_to_disk` directory (images decoded by
  `datasets`) or, online, a Hub id and split.
* `read_image_choices`: a `.jsonl` or `.csv` with an image path column
  (relative paths are relative to the file), a question, the choices (a JSON
  list; in a CSV a JSON list string or `|`-separated) and the answer (its
  index, its letter or its text).

Questions without an image are kept (text-only records) or dropped, by
`without_image='keep' | 'drop'`. Every bad row (missing image file, an image
that does not decode, too few or too many choices, an answer that is not a
choice) raises one line naming the file and the row (1-based, header not
counted) and how to fix it; the row's content is never printed (it is
private data).

The prompt (`prompt`) is the question, the hint and the lettered choices,
ending in "Answer:"; the model's answer is scored on the choice letters'
tokens with the language model's own head (`choice_letter_ids`).
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Sequence

from raptor_jax.data import tables

LETTERS = "ABCDEFGHIJ"
WITHOUT_IMAGE = ("keep", "drop")


@dataclasses.dataclass(frozen=True)
class ChoiceRecord:
  """One question. `image` is a PIL RGB image or None."""

  question: str
  choices: tuple[str, ...]
  answer: int
  image: Any = None
  hint: str = ""


def prompt(record: ChoiceRecord) -> tuple[str, str]:
  """(text before the image, text after it): the image comes first.

  'Context: <hint>\\n' only when there is a hint; the choices are lettered
  'A. ...' one per line; the text ends in 'Answer:' so that the next token
  is the letter.
  """
  lines = []
  if record.hint:
    lines.append(f"Context: {record.hint}")
  lines.append(f"Question: {record.question}")
  lines.extend(f"{LETTERS[i]}. {c}" for i, c in enumerate(record.choices))
  lines.append("Answer:")
  return "", "\n" + "\n".join(lines)


def choice_letter_ids(tokenizer, num_choices: int) -> list[int]:
  """The token id of ' A', ' B', ... (each must be one token of the vocabulary)."""
  ids = []
  for letter in LETTERS[:num_choices]:
    pieces = tokenizer.encode(" " + letter, add_special_tokens=False)
    if len(pieces) != 1:
      pieces = tokenizer.encode(letter, add_special_tokens=False)
    if len(pieces) != 1:
      raise ValueError(
          f"tokenizer: the choice letter {letter!r} is not one token; use a"
          " tokenizer whose vocabulary has the capital letters"
      )
    ids.append(pieces[0])
  return ids


def _open_image(value: Any, base: Path, where: str):
  """A PIL RGB image from a PIL image, {bytes, path}, bytes or a path."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=g-import-not-at-top

  if hasattr(value, "convert"):
    return value.convert("RGB")
  if isinstance(value, dict):
    value = value.get("bytes") or value.get("path")
  if isinstance(value, (bytes, bytearray)):
    source = io.BytesIO(value)
  else:
    path = Path(str(value))
    path = path if path.is_absolute() else base / path
    if not path.is_file():
      raise ValueError(
          f"{where}: the image file does not exist; fix the path (relative"
          " paths are relative to the data file) or drop the row"
      )
    source = path
  try:
    with Image.open(source) as image:
      return image.convert("RGB")
  except (UnidentifiedImageError, OSError, ValueError) as e:
    raise ValueError(
        f"{where}: the image does not decode ({type(e).__name__}); replace"
        " it with a PNG or JPEG file or drop the row"
    ) from None


def _answer_index(value: Any, choices: Sequence[str], where: str) -> int:
  if isinstance(value, str):
    v = value.strip()
    if v.isdigit():
      value = int(v)
    elif len(v) == 1 and v.upper() in LETTERS[: len(choices)]:
      return LETTERS.index(v.upper())
    elif v in choices:
      return list(choices).index(v)
  if isinstance(value, int) and not isinstance(value, bool):
    if 0 <= value < len(choices):
      return value
  raise ValueError(
      f"{where}: the answer is not one of the {len(choices)} choices; give"
      " its 0-based index, its letter or its exact text"
  )


def _choices(value: Any, where: str) -> list[str]:
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      value = value.split("|")
  if not isinstance(value, (list, tuple)):
    raise ValueError(
        f"{where}: the choices are not a list; write a JSON list of strings"
    )
  return [str(c) for c in value]


def _records(
    columns: tables.Columns,
    source: str,
    base: Path,
    fields: dict[str, str],
    *,
    without_image: str,
    max_choices: int,
) -> list[ChoiceRecord]:
  if without_image not in WITHOUT_IMAGE:
    raise ValueError(
        f"without_image: {without_image!r}, must be one of {WITHOUT_IMAGE}"
    )
  if not 2 <= max_choices <= len(LETTERS):
    raise ValueError(
        f"max_choices: {max_choices}, must be in 2..{len(LETTERS)}"
    )
  for role in ("question", "choices", "answer"):
    if fields[role] not in columns:
      raise ValueError(
          f"{source} has no {role} column {fields[role]!r} (it has"
          f" {', '.join(columns) or 'no columns'}); name it with the reader's"
          f" {role}_field"
      )
  n = len(columns[fields["question"]])
  get = lambda role, i: (
      columns[fields[role]][i] if fields[role] in columns else None
  )
  out = []
  for i in range(n):
    where = f"{source}, row {i + 1}"
    choices = _choices(get("choices", i), where)
    if not 2 <= len(choices) <= max_choices:
      raise ValueError(
          f"{where}: {len(choices)} choices, expected 2 to {max_choices};"
          " raise max_choices or drop the row"
      )
    answer = _answer_index(get("answer", i), choices, where)
    raw = get("image", i)
    if raw in (None, "") or (isinstance(raw, dict) and not any(raw.values())):
      if without_image == "drop":
        continue
      image = None
    else:
      image = _open_image(raw, base, where)
    out.append(
        ChoiceRecord(
            question=str(get("question", i) or ""),
            choices=tuple(choices),
            answer=answer,
            image=image,
            hint=str(get("hint", i) or ""),
        )
    )
  return out


SCIENCEQA_FIELDS = dict(
    image="image",
    question="question",
    choices="choices",
    answer="answer",
    hint="hint",
)


def read_scienceqa(
    path: str | Path = "",
    split: str = "train",
    *,
    hub_id: str = "derek-thomas/ScienceQA",
    without_image: str = "keep",
    max_choices: int = 5,
) -> list[ChoiceRecord]:
  """ScienceQA records from a local parquet / save_to_disk path, or the Hub.

  Args:
    path: a `.parquet` file or a `save_to_disk` directory ('' = the Hub).
    split: the split of a saved DatasetDict or of the Hub dataset.
    hub_id: the Hub dataset (online, or from the local datasets cache).
    without_image: 'keep' the text-only questions or 'drop' them.
    max_choices: more choices in a row is an error (ScienceQA has up to 5).
  """
  if path:
    columns = tables.read_columns(path, split)
    source, base = str(path), Path(path).parent
  else:
    columns = tables.load_hub_columns(
        hub_id, None, split, fix="set the path of a local parquet file"
    )
    source, base = f"{hub_id} ({split})", Path(".")
  return _records(
      columns,
      source,
      base,
      SCIENCEQA_FIELDS,
      without_image=without_image,
      max_choices=max_choices,
  )


def read_image_choices(
    path: str | Path,
    *,
    image_field: str = "image",
    question_field: str = "question",
    choices_field: str = "choices",
    answer_field: str = "answer",
    hint_field: str = "hint",
    without_image: str = "keep",
    max_choices: int = 5,
) -> list[ChoiceRecord]:
  """Records of a `.jsonl` or `.csv` with an image path column (see module)."""
  path = Path(path)
  if path.suffix.lower() not in (".jsonl", ".csv"):
    raise ValueError(
        f"{path}: image multiple-choice files are .jsonl or .csv, got"
        f" {path.suffix!r}"
    )
  fields = dict(
      image=image_field,
      question=question_field,
      choices=choices_field,
      answer=answer_field,
      hint=hint_field,
  )
  return _records(
      tables.read_columns(path),
      str(path),
      path.parent,
      fields,
      without_image=without_image,
      max_choices=max_choices,
  )
