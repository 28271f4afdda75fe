"""The user's own task (data.task='custom', configs/custom.py): every file
format, the text_fields override everywhere, one line for every bad file."""

import json
import os
import types
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raptor_jax import data
from raptor_jax.data import synthetic
from raptor_jax.train import methods, metrics, outputs, setup
from raptor_jax.train import train_and_evaluate
from raptor_jax.train.run import validate

from helpers import load_config_module, run_python

CLASSES = ("very_neg", "neg", "neutral", "pos", "very_pos")
WORDS = ("awful", "bad", "okay", "good", "superb")


def _records(n, seed=0):
  """n 5-class records: the class word decides the label, padding words not."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 5, n)
  filler = ("the", "movie", "was", "a", "film", "plot", "and")
  texts = [
      " ".join([*rng.choice(filler, 4), WORDS[label], *rng.choice(filler, 3)])
      for label in labels
  ]
  return texts, [CLASSES[label] for label in labels]


def _write_tsv(path, texts, labels, header=("text", "sentiment")):
  rows = ["\t".join(header), *(f"{t}\t{l}" for t, l in zip(texts, labels))]
  path.write_text("\n".join(rows) + "\n", encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic.build_tokenizer()


def _task():
  return data.custom_task("text", "sentiment", ",".join(CLASSES))


def test_every_format_reads_the_same_five_class_task(tmp_path, tokenizer):
  texts, labels = _records(20)
  table = {"text": texts, "sentiment": labels}
  tsv = _write_tsv(tmp_path / "t.tsv", texts, labels)
  csv = tmp_path / "t.csv"
  csv.write_text(
      "text,sentiment\n"
      + "".join(f'"{t}",{l}\n' for t, l in zip(texts, labels))
  )
  jsonl = tmp_path / "t.jsonl"
  jsonl.write_text(
      "".join(
          json.dumps(dict(text=t, sentiment=l)) + "\n"
          for t, l in zip(texts, labels)
      )
  )
  parquet = tmp_path / "t.parquet"
  pq.write_table(pa.table(table), parquet)
  saved = tmp_path / "saved"
  datasets.Dataset.from_dict(table).save_to_disk(str(saved))
  saved_dict = tmp_path / "saved_dict"
  datasets.DatasetDict(
      train=datasets.Dataset.from_dict(table),
      validation=datasets.Dataset.from_dict(
          {k: v[:3] for k, v in table.items()}
      ),
  ).save_to_disk(str(saved_dict))
  loaded = [
      data.load_task_split(_task(), "train", tokenizer=tokenizer, path=p)
      for p in (tsv, csv, jsonl, parquet, saved, saved_dict)
  ]
  want = [CLASSES.index(label) for label in labels]
  for split in loaded:
    np.testing.assert_array_equal(split.labels, want)
    np.testing.assert_array_equal(split.input_ids, loaded[0].input_ids)
  dev = data.load_task_split(
      _task(), "dev", tokenizer=tokenizer, path=saved_dict
  )
  np.testing.assert_array_equal(dev.labels, want[:3])


def test_integer_labels_and_a_sentence_pair(tmp_path, tokenizer):
  path = tmp_path / "pairs.tsv"
  path.write_text("q\ts\ty\ngood\tbad\t0\nokay\tsuperb\t2\n")
  task = data.custom_task("q,s", "y", ("a", "b", "c"))
  split = data.load_task_split(task, "train", tokenizer=tokenizer, path=path)
  np.testing.assert_array_equal(split.labels, [0, 2])
  assert task.text_fields == (("q",), ("s",))
  assert task.metrics == ("accuracy", "macro_f1")


def _bad(tmp_path, name, content):
  path = tmp_path / name
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content, encoding="utf-8")
  return path


@pytest.mark.parametrize(
    "name, content, fix",
    [
        (
            "no_text.tsv",
            "body\tsentiment\nx\tneg\n",
            "set --config.data.text_fields",
        ),
        (
            "no_label.tsv",
            "text\tstars\nx\tneg\n",
            "set --config.data.label_field",
        ),
        (
            "unknown_class.tsv",
            "text\tsentiment\nx\tmeh, sort of\n",
            "list its classes in --config.data.label_names",
        ),
        (
            "ragged.tsv",
            "text\tsentiment\nx\tneg\textra\n",
            "fix or remove that line",
        ),
        ("empty.tsv", "", "it needs a header row"),
        ("header_only.tsv", "text\tsentiment\n", "add records or fix the path"),
        ("latin1.tsv", b"text\tsentiment\ncaf\xe9\tneg\n", "save it as UTF-8"),
        (
            "bad.jsonl",
            '{"text": "x", "sentiment": "neg"}\n{oops\n',
            "one JSON object per line",
        ),
        ("list.jsonl", '["x", "neg"]\n', "one JSON object per line"),
        ("bad.parquet", "not parquet", "write it with pandas"),
        ("data.xlsx", "x", "use one of"),
    ],
)
def test_a_bad_file_is_one_line_naming_it_and_the_fix(
    tmp_path, tokenizer, name, content, fix
):
  path = _bad(tmp_path, name, content)
  with pytest.raises(ValueError) as error:
    data.load_task_split(_task(), "train", tokenizer=tokenizer, path=path)
  message = str(error.value)
  assert "\n" not in message
  assert str(path) in message
  assert fix in message
  # No record content (a label of several words is not shown).
  assert "meh" not in message and "oops" not in message


def test_bad_directories_are_one_line(tmp_path, tokenizer):
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "a.txt").write_text("x")
  with pytest.raises(ValueError, match="not a datasets.save_to_disk directory"):
    data.load_task_split(_task(), "train", tokenizer=tokenizer, path=plain)
  saved = tmp_path / "only_train"
  table = {"text": ["x"], "sentiment": ["neg"]}
  datasets.DatasetDict(train=datasets.Dataset.from_dict(table)).save_to_disk(
      str(saved)
  )
  with pytest.raises(ValueError) as error:
    data.load_task_split(_task(), "dev", tokenizer=tokenizer, path=saved)
  assert str(error.value) == (
      f"{saved} holds the splits train, not 'validation'; save that split as"
      f" 'validation', or point the path at {saved}/<split> (a Dataset)"
  )
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.load_task_split(
        _task(), "train", tokenizer=tokenizer, path=tmp_path / "missing.tsv"
    )


@pytest.mark.parametrize(
    "args, field",
    [
        (((), "y", "a,b"), "data.text_fields"),
        ((("a", "b", "c"), "y", "a,b"), "data.text_fields"),
        (("t", "", "a,b"), "data.label_field"),
        (("t", "y", ""), "data.label_names"),
        (("t", "y", "a"), "data.label_names"),
        (("t", "y", "a,a"), "data.label_names"),
    ],
)
def test_a_bad_task_declaration_is_one_line(args, field):
  with pytest.raises(ValueError) as error:
    data.custom_task(*args)
  assert str(error.value).startswith(f"{field}: must be")
  assert "(configs/custom.py)" in str(error.value)


def test_custom_is_declared_not_looked_up():
  with pytest.raises(ValueError, match="declare your own with --config="):
    data.get_task("custom")
  with pytest.raises(ValueError, match="configs/custom.py:small"):
    data.get_task("imdb")


def _custom_config(tmp_path, **overrides):
  config = load_config_module("custom").get_config("cpu")
  texts, labels = _records(40)
  config.data.train_path = str(
      _write_tsv(tmp_path / "train.tsv", texts, labels)
  )
  config.data.dev_path = str(
      _write_tsv(tmp_path / "dev.tsv", texts[:10], labels[:10])
  )
  config.data.text_fields = ("text",)
  config.data.label_field = "sentiment"
  config.data.label_names = ",".join(CLASSES)
  config.update_from_flattened_dict(overrides)
  return config


def test_custom_config_validates_before_loading(tmp_path):
  validate(_custom_config(tmp_path))
  with pytest.raises(ValueError, match="^data.label_names: must be"):
    validate(_custom_config(tmp_path, **{"data.label_names": ""}))
  with pytest.raises(ValueError, match="^data.train_path: must be a file"):
    validate(_custom_config(tmp_path, **{"data.train_path": ""}))
  with pytest.raises(ValueError, match="^data.dev_path: must be a file"):
    validate(_custom_config(tmp_path, **{"data.dev_path": ""}))
  with pytest.raises(ValueError) as error:
    validate(_custom_config(tmp_path, **{"data.task": "sst2"}))
  assert str(error.value).startswith(
      "data.label_names: must be unset with data.task='sst2'"
  )
  with pytest.raises(ValueError, match="preset of configs/custom.py"):
    load_config_module("custom").get_config("tiny")


def test_text_fields_reach_the_overlap_report(tmp_path):
  # A GLUE task read from a file with other column names: the override
  # reaches every reader of the train file, the overlap report included.
  config = load_config_module("glue").get_config("preset=cpu")
  texts, labels = _records(6)
  texts[0] = "a sentence long enough to count as quoted by the public text"
  labels = [
      "negative" if l in ("very_neg", "neg") else "positive" for l in labels
  ]
  config.data.train_path = str(
      _write_tsv(tmp_path / "train.tsv", texts, labels)
  )
  config.data.text_fields = ("text",)
  config.data.label_field = "sentiment"
  public = tmp_path / "public.tsv"
  public.write_text(f"text\nIt said: {texts[0]}.\nsomething else entirely\n")
  config.data.public_corpus = ""
  config.data.public_path = str(public)
  assert setup.overlap_report(config) == dict(public_texts=2, overlapping=1)


def test_macro_f1_is_the_mean_f1_over_classes():
  labels = np.array([0, 0, 1, 1, 2, 2, 3])
  predictions = np.array([0, 1, 1, 1, 2, 0, 4])
  # Per class (0..4): 2/4, 4/5, 2/3, 0, 0 (scikit-learn's macro F1).
  want = np.mean([0.5, 0.8, 2 / 3, 0.0, 0.0])
  assert metrics.macro_f1(predictions, labels) == pytest.approx(want)
  assert metrics.macro_f1(labels, labels) == 1.0


@pytest.mark.slow
def test_a_five_class_file_trains_end_to_end(tmp_path):
  texts, labels = _records(1200, seed=1)
  train = _write_tsv(tmp_path / "train.tsv", texts[:1000], labels[:1000])
  dev = _write_tsv(tmp_path / "dev.tsv", texts[1000:], labels[1000:])
  public_texts, _ = _records(200, seed=2)
  public = tmp_path / "public.tsv"
  public.write_text("text\n" + "\n".join(public_texts) + "\n")
  workdir = tmp_path / "run"
  proc = run_python(
      "launch/main.py",
      "--config=configs/custom.py:cpu",
      f"--workdir={workdir}",
      f"--config.data.train_path={train}",
      f"--config.data.dev_path={dev}",
      "--config.data.text_fields=text",
      "--config.data.label_field=sentiment",
      f"--config.data.label_names={','.join(CLASSES)}",
      "--config.data.public_corpus=",
      f"--config.data.public_path={public}",
      "--config.data.n_pub=200",
      "--config.data.max_length=16",
      "--config.batch_size=250",
      "--config.microbatch_size=64",
      "--config.epochs=5",
      "--config.progress_bar=False",
      "--config.privacy.secret_seed=0",
      env=dict(os.environ, XLA_FLAGS=""),
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["task"] == "custom"
  assert set(results) >= {"accuracy", "macro_f1", "delta", "eval_split"}
  assert not any(k.startswith("dev_") for k in results)  # each key once
  # RAPTOR at epsilon 8 learns that the class word decides the label
  # (0.98 and 0.98 measured; chance is 0.2).
  assert results["accuracy"] > 0.6 and results["macro_f1"] > 0.6


@pytest.mark.parametrize("preset", ["", "cpu", "small"])
def test_every_custom_preset_reads_the_whole_file(preset):
  """:small's GLUE sizes (train_limit 16,000, holdout 2,000) refused a
  600-record file ("fewer than the 16000 ... ask for"): a custom task reads
  its file whole, whatever the preset."""
  config = load_config_module("custom").get_config(preset)
  assert (config.data.train_limit, config.data.holdout) == (0, 0)
  assert config.data.eval_split == "dev"


@pytest.mark.slow
def test_small_defaults_to_the_committed_pretrained_model(tmp_path):
  """`configs/custom.py:small` needs no model flag: it loads the small
  Switch the repository commits (results/glue_small/model, its WordPiece
  tokenizer included) and builds the run on a user's file."""
  custom = load_config_module("custom")
  config = custom.get_config("small")
  assert Path(config.model.name) == custom.COMMITTED_MODEL
  assert (custom.COMMITTED_MODEL / "model.safetensors").is_file()
  small = _custom_config(tmp_path)
  small.model = config.model
  small.data.max_length = config.data.max_length
  public = tmp_path / "public.tsv"
  public.write_text("text\n" + "\n".join(_records(50, seed=2)[0]) + "\n")
  small.data.public_corpus, small.data.public_path = "", str(public)
  assert train_and_evaluate(small, str(tmp_path / "run"), dry_run=True) == {}
  assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_small_data_gets_sizes_and_delta_chosen_from_n():
  """configs/custom.py: B = n / 10 and at least 200 noisy steps (48: the GLUE
  batch of 1000 refused 600 records, and 3 epochs gave 18 noisy steps);
  delta 1/(10 n); a number set by the user wins."""
  config = load_config_module("custom").get_config("cpu")
  assert (config.batch_size, config.epochs) == (0, 0)
  assert methods.run_sizes(config, 600) == (60, 20)
  assert methods.run_sizes(config, 67_349) == (1000, 3)  # 68 steps an epoch
  assert methods.run_sizes(config, 30) == (3, 20)
  plan = methods.build_plan(
      config, n=600, num_experts=4, sparse_layers=(1, 3), expert_layer=1
  )
  assert (plan.batch_size, plan.epochs, plan.cycles) == (60, 20, 200)
  assert plan.sample_rate == 0.1 and plan.delta == pytest.approx(1 / 6000)
  assert (
      outputs.header_warnings(
          types.SimpleNamespace(plan=plan, config=config, n=600)
      )
      == []
  )
  config.batch_size, config.epochs = 100, 3
  config.privacy.delta = 1 / 600**1.1
  plan = methods.build_plan(
      config, n=600, num_experts=4, sparse_layers=(1, 3), expert_layer=1
  )
  assert (plan.batch_size, plan.epochs, plan.cycles) == (100, 3, 18)
  assert outputs.header_warnings(
      types.SimpleNamespace(plan=plan, config=config, n=600)
  ) == [
      "warning: only 18 noisy steps; the noise of few steps does not average"
      " out and accuracy suffers: raise --config.epochs (e.g. 34 for 204"
      " steps), or set it to 0 to choose it from n",
      "warning: delta 0.000879 is above 1/(10 n) = 0.000167: the guarantee"
      " may fail with a probability close to one in n records; set"
      " --config.privacy.delta=0.00017 or smaller",
  ]
  glue = load_config_module("glue").get_config("preset=cpu")
  assert methods.default_delta(glue, 600) == 1 / 600**1.1  # the paper's
