"""Image multiple-choice readers: ScienceQA's layout and a user's own files."""

import io
import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raptor_jax.data import multiple_choice as mc

SECRET = "zebra-secret-question"  # must never appear in an error message


def _png(colour, size=(12, 8)):
  buf = io.BytesIO()
  Image.new("RGB", size, colour).save(buf, format="PNG")
  return buf.getvalue()


def _scienceqa_table(image_rows):
  return pa.table(
      {
          "image": pa.array(
              image_rows,
              pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
          ),
          "question": [SECRET, "Which is red?", "No picture here?"][
              : len(image_rows)
          ],
          "choices": [["yes", "no"], ["a", "b", "c"], ["x", "y"]][
              : len(image_rows)
          ],
          "answer": [1, 0, 1][: len(image_rows)],
          "hint": ["", "Look closely.", ""][: len(image_rows)],
      }
  )


def test_scienceqa_parquet_keep_and_drop(tmp_path):
  path = tmp_path / "train.parquet"
  rows = [
      {"bytes": _png((255, 0, 0)), "path": "a.png"},
      {"bytes": _png((0, 0, 255), (30, 10)), "path": "b.png"},
      None,
  ]
  pq.write_table(_scienceqa_table(rows), path)
  kept = mc.read_scienceqa(path)
  assert [r.answer for r in kept] == [1, 0, 1]
  assert kept[1].image.size == (30, 10) and kept[2].image is None
  assert kept[1].hint == "Look closely." and kept[1].choices == ("a", "b", "c")
  assert np.asarray(kept[0].image)[0, 0].tolist() == [255, 0, 0]
  dropped = mc.read_scienceqa(path, without_image="drop")
  assert [r.question for r in dropped] == [SECRET, "Which is red?"]


def test_scienceqa_save_to_disk(tmp_path):
  ds = datasets.Dataset.from_dict(
      {
          "image": [Image.new("RGB", (5, 5), (0, 255, 0)), None],
          "question": ["q1", "q2"],
          "choices": [["a", "b"], ["c", "d"]],
          "answer": [0, 1],
          "hint": ["", ""],
      },
      features=datasets.Features(
          {
              "image": datasets.Image(),
              "question": datasets.Value("string"),
              "choices": datasets.Sequence(datasets.Value("string")),
              "answer": datasets.Value("int64"),
              "hint": datasets.Value("string"),
          }
      ),
  )
  datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "sqa"))
  records = mc.read_scienceqa(tmp_path / "sqa", "train")
  assert records[0].image.size == (5, 5) and records[1].image is None


def test_jsonl_and_csv_with_paths(tmp_path):
  (tmp_path / "img").mkdir()
  (tmp_path / "img/r.png").write_bytes(_png((255, 0, 0)))
  lines = [
      {
          "image": "img/r.png",
          "question": "colour?",
          "choices": ["red", "blue"],
          "answer": "red",
      },
      {
          "image": None,
          "question": "text only",
          "choices": ["x", "y", "z"],
          "answer": "C",
      },
  ]
  jsonl = tmp_path / "d.jsonl"
  jsonl.write_text("\n".join(json.dumps(l) for l in lines))
  records = mc.read_image_choices(jsonl)
  assert [r.answer for r in records] == [0, 2]
  assert records[0].image.size == (12, 8)
  csv = tmp_path / "d.csv"
  csv.write_text(
      "picture,q,opts,gold\n"
      f"{tmp_path / 'img/r.png'},colour?,red|blue|green,1\n"
  )
  (record,) = mc.read_image_choices(
      csv,
      image_field="picture",
      question_field="q",
      choices_field="opts",
      answer_field="gold",
  )
  assert record.choices == ("red", "blue", "green") and record.answer == 1


@pytest.mark.parametrize(
    "row,message",
    [
        ({"image": "missing.png"}, "row 2: the image file does not exist"),
        ({"image": "bad.png"}, r"row 2: the image does not decode"),
        (
            {"choices": ["a", "b", "c", "d", "e", "f"]},
            "row 2: 6 choices, expected 2 to 5",
        ),
        ({"answer": 7}, "row 2: the answer is not one of the 2 choices"),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, row, message):
  (tmp_path / "bad.png").write_bytes(b"not an image")
  good = {"image": None, "question": "fine", "choices": ["a", "b"], "answer": 0}
  bad = {**good, "question": SECRET, **row}
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps(good) + "\n" + json.dumps(bad))
  with pytest.raises(ValueError, match=message) as e:
    mc.read_image_choices(path)
  text = str(e.value)
  assert str(path) in text and "\n" not in text and SECRET not in text


def test_prompt_ends_in_answer():
  before, after = mc.prompt(
      mc.ChoiceRecord("Which?", ("cat", "dog"), 1, hint="Pets.")
  )
  assert before == ""
  assert after == "\nContext: Pets.\nQuestion: Which?\nA. cat\nB. dog\nAnswer:"
