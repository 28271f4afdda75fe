"""Bad input, as a new user makes it: each is ONE line that says what to fix.

Issues 44 (hygiene) and 48 (a practitioner's own data). Every case is the
input and the line it must give (a fragment of it); the library-level cases
run in-process, the command-line ones start `launch/main.py` (slow). No line
shows a record's text.
"""

import json
import os
import subprocess
import sys

import pytest

from raptor_jax import data
from raptor_jax.data import synthetic, tables
from raptor_jax.train.run import validate

from helpers import ROOT, load_config_module

CLASSES = ("very_neg", "neg", "neutral", "pos", "very_pos")
TASK = dict(text_fields="text", label_field="sentiment", label_names=CLASSES)
# Record content that must never reach an error line.
PRIVATE = "a gripping private sentence"


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic.build_tokenizer()


def _file_error(tmp_path, tokenizer, name, content, task="custom"):
  path = tmp_path / name
  path.write_text(content, encoding="utf-8")
  spec = data.custom_task(**TASK) if task == "custom" else task
  with pytest.raises(ValueError) as error:
    data.load_task_split(spec, "train", tokenizer=tokenizer, path=path)
  message = str(error.value)
  assert str(path) in message
  return message


def _config_error(tmp_path, overrides):
  config = load_config_module("custom").get_config("cpu")
  rows = "".join(f"{PRIVATE}\t{c}\n" for c in CLASSES)
  for name in ("train", "dev"):
    (tmp_path / f"{name}.tsv").write_text("text\tsentiment\n" + rows)
  config.data.train_path = str(tmp_path / "train.tsv")
  config.data.dev_path = str(tmp_path / "dev.tsv")
  config.data.text_fields = ("text",)
  config.data.label_field = "sentiment"
  config.data.label_names = ",".join(CLASSES)
  config.update_from_flattened_dict(
      {
          k: v.format(tmp=tmp_path) if isinstance(v, str) else v
          for k, v in overrides.items()
      }
  )
  with pytest.raises(ValueError) as error:
    validate(config)
  return str(error.value)


FILES = [
    # (file name, content, the line's fix; task: custom unless given)
    (  # 44: a TSV without a header row showed its first record
        "headerless.tsv",
        f"{PRIVATE}\tneg\nanother text\tpos\n",
        "the first row does not read as a header row of column names; add one",
    ),
    (  # 44: an unterminated CSV quote merged two records silently
        "open_quote.csv",
        f'text,sentiment\n"{PRIVATE},neg\nsecond record,pos\n"third",neg\n',
        "a quote opened on line 2 is closed on line 4 or never",
    ),
    (  # 44: a JSON true read as class 1
        "true.jsonl",
        json.dumps(dict(text=PRIVATE, sentiment=True)) + "\n",
        "a JSON true is not a class",
    ),
    (  # 44: a record without its text trained as an empty string
        "no_text.jsonl",
        json.dumps(dict(text=PRIVATE, sentiment="neg"))
        + "\n"
        + json.dumps(dict(sentiment="pos"))
        + "\n",
        "data row 2 has no 'text' (missing or null)",
    ),
    (  # 44: a duplicate header column was dropped silently
        "twice.tsv",
        f"text\tsentiment\ttext\n{PRIVATE}\tneg\tx\n",
        "the header row repeats a column name (text)",
    ),
    (  # 48: a tab-separated .txt read as one text per line
        "table.txt",
        f"text\tsentiment\n{PRIVATE}\tneg\n",
        "line 1 holds a tab, but a .txt file is one text per line; for a"
        " table of columns rename it to .tsv",
    ),
    (  # 48: an unknown label never showed its value
        "typo.tsv",
        f"text\tsentiment\n{PRIVATE}\tnuetral\n",
        "data row 1: 'nuetral' is not a custom label",
    ),
    (  # 48: one-based class ids were not recognised
        "one_based.tsv",
        "text\tsentiment\n"
        + "".join(f"{PRIVATE}\t{i}\n" for i in (1, 2, 3, 4, 5)),
        "the labels are one-based ids 1..5, but class ids start at 0",
    ),
    (  # 48: a GLUE config on the user's own file said only "no text column"
        "own_task.tsv",
        f"review\tstars\n{PRIVATE}\t5\n",
        "if this is not sst2 but a task of your own, declare your own with"
        " --config=configs/custom.py:small",
    ),
]


@pytest.mark.parametrize(
    "name, content, line", FILES, ids=[case[0] for case in FILES]
)
def test_a_bad_file_is_one_line(tmp_path, tokenizer, name, content, line):
  task = "sst2" if name == "own_task.tsv" else "custom"
  message = _file_error(tmp_path, tokenizer, name, content, task)
  assert "\n" not in message
  assert line in message
  assert "gripping" not in message


CONFIGS = [
    # (overrides of the custom config, the line)
    (  # 48: dev = train reported training accuracy as dev accuracy
        {"data.dev_path": "{tmp}/train.tsv"},
        "data.dev_path: must be another file than data.train_path",
    ),
    (  # 48: the label column among the text fields leaked the label
        {"data.text_fields": ("text", "sentiment")},
        "data.label_field: must be a column other than the text column(s)"
        " text, sentiment",
    ),
]


@pytest.mark.parametrize(
    "overrides, line", CONFIGS, ids=["dev_is_train", "label_is_text"]
)
def test_a_bad_config_is_one_line(tmp_path, overrides, line):
  message = _config_error(tmp_path, overrides)
  assert "\n" not in message
  assert message.startswith(line), message


def test_long_fields_spaced_and_literal_names_are_read(tmp_path, tokenizer):
  """What used to fail but is valid input: a field over 131,072 characters
  (it crashed), label names with spaces after the commas (refused), and
  ml_collections tuple literals (read as the label "('a'")."""
  path = tmp_path / "long.tsv"
  path.write_text(f"text\tsentiment\n{'word ' * 40_000}\tneg\nshort\tpos\n")
  for names in (
      "very_neg, neg, neutral, pos, very_pos",
      "('very_neg', 'neg', 'neutral', 'pos', 'very_pos')",
      "[very_neg,neg,neutral,pos,very_pos]",
  ):
    task = data.custom_task("('text',)", "sentiment", names)
    assert task.label_names == CLASSES
    split = data.load_task_split(task, "train", tokenizer=tokenizer, path=path)
    assert split.labels.tolist() == [1, 3]
  assert tables.read_columns(path)["text"][0] == "word " * 40_000


def _main(args, cwd=ROOT):
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "main.py"), *args],
      cwd=cwd,
      capture_output=True,
      text=True,
      timeout=300,
  )
  return proc.returncode, proc.stderr.strip().splitlines()


COMMANDS = [
    # (arguments of launch/main.py, the last line of stderr)
    (  # 48: a mistyped config file name with an override: a 54-line traceback
        ["--config=configs/custm.py:cpu", "--config.batch_size=10"],
        "error: --config=configs/custm.py: no such config file; did you mean"
        " configs/custom.py? the config files are configs/{controlled,custom,",
    ),
    (  # 44: length_buckets='a,b' named neither the file nor the field
        [
            "--config=configs/glue.py:preset=cpu",
            "--config.data.length_buckets=a,b",
        ],
        "error: data.length_buckets: must be increasing positive lengths"
        " ending at max_length 64, got ('a', 'b')",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, line", COMMANDS, ids=["config_file", "buckets"])
def test_a_bad_command_line_is_one_line(tmp_path, args, line):
  code, stderr = _main([*args, f"--workdir={tmp_path / 'w'}"])
  assert code != 0
  assert len(stderr) == 1, stderr
  assert stderr[0].startswith(line), stderr[0]
