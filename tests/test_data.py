"""Tests for raptor_jax.data: file formats, tokenisation, corpora, the offline task."""

import dataclasses
import json
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from raptor_jax import data
from raptor_jax.data import overlap, synthetic, tasks

SHARED_DATA = Path(
    os.environ.get(
        "RAPTOR_SHARED_DATA",
        Path(__file__).resolve().parents[2] / "shared" / "data",
    )
)
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"real data not found at {SHARED_DATA} (RAPTOR_SHARED_DATA)",
)


@pytest.fixture(scope="module")
def tokenizer():
  return synthetic.build_tokenizer()


def _write(path: Path, text: str) -> Path:
  path.write_text(text, encoding="utf-8")
  return path


def _ids(tokenizer, *words):
  vocab = tokenizer.get_vocab()
  return [vocab[word] for word in words]


# ---------------------------------------------------------------- local files


def test_tsv_single_text_keeps_quotes_and_trailing_space(
    tmp_path, tokenizer, capsys
):
  path = _write(
      tmp_path / "train.tsv",
      'sentence\tlabel\ncold tea \t1\n"great soup\t0\nthe film " was awful \t0\n',
  )
  expected = ["cold tea ", '"great soup', 'the film " was awful ']
  assert data.read_columns(path)["sentence"] == expected

  split = data.load_task_split(
      "sst2", "train", tokenizer=tokenizer, path=path, max_length=8
  )

  cls, sep, pad = _ids(tokenizer, "[CLS]", "[SEP]", "[PAD]")
  np.testing.assert_array_equal(
      split.input_ids[0],
      [cls, *_ids(tokenizer, "cold", "tea"), sep, pad, pad, pad, pad],
  )
  np.testing.assert_array_equal(split.labels, [1, 0, 0])
  assert len(split) == 3
  assert capsys.readouterr() == (
      "",
      "",
  )  # loading prints nothing about the records


def test_pairs_with_string_labels(tmp_path, tokenizer):
  path = _write(
      tmp_path / "dev.tsv",
      "index\tquestion\tsentence\tlabel\n"
      '0\tcold tea\t"the tea was cold\tentailment\n'
      "1\tfast car\tslow bed\tnot_entailment\n",
  )
  split = data.load_task_split(
      "qnli", "dev", tokenizer=tokenizer, path=path, max_length=12
  )

  cls, sep, pad = _ids(tokenizer, "[CLS]", "[SEP]", "[PAD]")
  expected = [
      cls,
      *_ids(tokenizer, "fast", "car"),
      sep,
      *_ids(tokenizer, "slow", "bed"),
      sep,
  ]
  np.testing.assert_array_equal(split.input_ids[1], expected + [pad] * 5)
  np.testing.assert_array_equal(split.labels, [0, 1])


def test_mnli_and_qqp_local_column_aliases(tmp_path, tokenizer):
  mnli = _write(
      tmp_path / "mnli.tsv",
      "sentence1\tsentence2\tgold_label\n"
      "a\tb\tentailment\nc\td\tneutral\ne\tf\tcontradiction\n",
  )
  qqp = _write(
      tmp_path / "qqp.tsv",
      "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\ta\tb\t1\n4\t5\t6\tc\td\t0\n",
  )
  np.testing.assert_array_equal(
      data.load_task_split(
          "mnli", "dev_mismatched", tokenizer=tokenizer, path=mnli
      ).labels,
      [0, 1, 2],
  )
  np.testing.assert_array_equal(
      data.load_task_split(
          "qqp", "train", tokenizer=tokenizer, path=qqp
      ).labels,
      [1, 0],
  )


def test_csv_parquet_and_jsonl_agree(tmp_path, tokenizer):
  texts, labels = ["cold, soft tea", 'a "loud" song', "plain bread"], [1, 0, 1]
  csv_path = _write(
      tmp_path / "t.csv",
      'sentence,label\n"cold, soft tea",1\n"a ""loud"" song",0\nplain bread,1\n',
  )
  parquet_path = tmp_path / "t.parquet"
  pq.write_table(pa.table({"sentence": texts, "label": labels}), parquet_path)
  jsonl_path = _write(
      tmp_path / "t.jsonl",
      "".join(
          json.dumps({"sentence": t, "label": y}) + "\n"
          for t, y in zip(texts, labels)
      ),
  )
  loaded = [
      data.load_task_split("sst2", "train", tokenizer=tokenizer, path=p)
      for p in (csv_path, parquet_path, jsonl_path)
  ]
  assert data.read_columns(csv_path)["sentence"] == texts
  for split in loaded[1:]:
    np.testing.assert_array_equal(split.input_ids, loaded[0].input_ids)
    np.testing.assert_array_equal(split.labels, labels)


def test_right_padding_truncation_and_mask(tmp_path, tokenizer):
  long_text = " ".join(["tea"] * 50)
  path = _write(
      tmp_path / "t.tsv", f"sentence\tlabel\n{long_text}\t1\ntea\t0\n"
  )

  split = data.load_task_split(
      "sst2", "train", tokenizer=tokenizer, path=path, max_length=16
  )

  assert split.input_ids.shape == split.attention_mask.shape == (2, 16)
  assert (
      split.input_ids.dtype
      == split.attention_mask.dtype
      == split.labels.dtype
      == np.int32
  )
  np.testing.assert_array_equal(split.attention_mask[0], np.ones(16))
  np.testing.assert_array_equal(split.attention_mask[1], [1, 1, 1] + [0] * 13)
  assert (
      split.input_ids[0, -1] == tokenizer.sep_token_id
  )  # truncated, still closed
  np.testing.assert_array_equal(split.input_ids[1, 3:], tokenizer.pad_token_id)


def test_overrides_and_limit(tmp_path, tokenizer):
  path = _write(
      tmp_path / "t.tsv",
      "x\ty\tz\ntea\tsoup\t1\nbeer\tstew\t0\nwine\tcurry\t1\n",
  )

  split = data.load_task_split(
      "qqp",
      "train",
      tokenizer=tokenizer,
      path=path,
      text_fields=("x", "y"),
      label_field="z",
      limit=2,
  )
  single = data.load_task_split(
      "sst2",
      "train",
      tokenizer=tokenizer,
      path=path,
      text_fields="y",
      label_field="z",
  )

  np.testing.assert_array_equal(split.labels, [1, 0])
  assert (
      split.input_ids[0, 2] == tokenizer.sep_token_id
  )  # [CLS] tea [SEP] soup [SEP]
  assert single.input_ids[0, 1] == tokenizer.get_vocab()["soup"]


def test_host_shards_partition_the_records_in_order(tmp_path, tokenizer):
  """Host p of P tokenises records i % P == p (of the first `limit`), as the
  trainer's sampling numbers them; the shards together are the whole split."""
  rows = "".join(f"w{i} tea\t{i % 2}\n" for i in range(11))
  path = _write(tmp_path / "train.tsv", "sentence\tlabel\n" + rows)
  whole = data.load_task_split(
      "sst2", "train", tokenizer=tokenizer, path=path, limit=10
  )
  shards = [
      data.load_task_split(
          "sst2",
          "train",
          tokenizer=tokenizer,
          path=path,
          limit=10,
          shard=(p, 3),
      )
      for p in range(3)
  ]
  assert [len(s) for s in shards] == [4, 3, 3]
  for p, shard in enumerate(shards):
    np.testing.assert_array_equal(shard.input_ids, whole.input_ids[p::3])
    np.testing.assert_array_equal(shard.labels, whole.labels[p::3])
  with pytest.raises(
      ValueError, match=r"shard index: must be in \[0, 3\), got 3"
  ):
    data.load_task_split(
        "sst2", "train", tokenizer=tokenizer, path=path, shard=(3, 3)
    )


def test_offset_selects_a_held_out_slice_after_the_training_records(
    tmp_path, tokenizer
):
  rows = "".join(f"w{i} tea\t{i % 2}\n" for i in range(10))
  path = _write(tmp_path / "train.tsv", "sentence\tlabel\n" + rows)
  whole = data.load_task_split("sst2", "train", tokenizer=tokenizer, path=path)
  held = data.load_task_split(
      "sst2", "train", tokenizer=tokenizer, path=path, offset=6, limit=3
  )
  np.testing.assert_array_equal(held.input_ids, whole.input_ids[6:9])
  np.testing.assert_array_equal(held.labels, whole.labels[6:9])
  with pytest.raises(ValueError, match="fewer than the 11"):
    data.load_task_split(
        "sst2", "train", tokenizer=tokenizer, path=path, offset=6, limit=5
    )


def test_a_bad_label_fails_on_every_host(tmp_path, tokenizer):
  path = _write(tmp_path / "train.tsv", "sentence\tlabel\ntea\t1\nsoup\t7\n")
  for p in range(2):  # row 2 belongs to host 1, host 0 still refuses the file
    with pytest.raises(ValueError, match="data row 2"):
      data.load_task_split(
          "sst2", "train", tokenizer=tokenizer, path=path, shard=(p, 2)
      )


# --------------------------------------------------------------------- errors


def test_unknown_task_and_split(tokenizer):
  with pytest.raises(
      ValueError,
      match=r"data.task: must be one of .*, got 'cola'; set --config.data.task",
  ):
    data.load_task_split("cola", "train", tokenizer=tokenizer)
  with pytest.raises(
      ValueError,
      match=r"split of task sst2: must be one of 'train', 'dev', got 'test'",
  ):
    data.load_task_split("sst2", "test", tokenizer=tokenizer)


def test_missing_label_column(tmp_path, tokenizer):
  path = _write(tmp_path / "test.tsv", "index\tsentence\n0\tcold tea\n")
  message = r"no label column \(looked for label; it has index, sentence\)"
  with pytest.raises(ValueError, match=message):
    data.load_task_split("sst2", "train", tokenizer=tokenizer, path=path)


def test_bad_label_names_the_row_and_never_a_text(tmp_path, tokenizer):
  """A one-word label is shown (it is how a typo is found); a value of
  several words may be a text (a wrongly chosen label column): not shown."""
  path = _write(
      tmp_path / "t.tsv", "sentence\tlabel\ntea\t1\nsoup\ta secret text\n"
  )
  with pytest.raises(
      ValueError,
      match=r"data row 2: a value of 13 characters \(not shown\) is not a sst2",
  ) as info:
    data.load_task_split("sst2", "train", tokenizer=tokenizer, path=path)
  assert "secret" not in str(info.value)
  path = _write(tmp_path / "u.tsv", "sentence\tlabel\ntea\tpositve\n")
  with pytest.raises(ValueError, match=r"row 1: 'positve' is not a sst2 label"):
    data.load_task_split("sst2", "train", tokenizer=tokenizer, path=path)


def test_file_errors(tmp_path, tokenizer):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.load_task_split(
        "sst2", "train", tokenizer=tokenizer, path=tmp_path / "no.tsv"
    )
  ragged = _write(tmp_path / "r.tsv", "sentence\tlabel\ntea\t1\textra\n")
  with pytest.raises(
      ValueError, match=r"line 2 has 3 fields but the header has 2"
  ):
    data.load_task_split("sst2", "train", tokenizer=tokenizer, path=ragged)
  with pytest.raises(ValueError, match="unknown extension '.xml'"):
    data.read_columns(_write(tmp_path / "t.xml", "<a/>"))
  empty = _write(tmp_path / "e.tsv", "sentence\tlabel\n")
  with pytest.raises(ValueError, match=r"e\.tsv has no records"):
    data.load_task_split("sst2", "train", tokenizer=tokenizer, path=empty)


def test_synthetic_task_has_no_hub_dataset(tokenizer):
  with pytest.raises(ValueError, match=r"synthetic_task\(\)"):
    data.load_task_split("synthetic", "train", tokenizer=tokenizer)


def test_check_batch_size():
  data.check_batch_size(872, 872)
  message = (
      r"^batch_size: must be in \[1, n\] for the n = 872 training records, got"
      r" {}; set --config.batch_size=87 \(n / 10\), or 0 to choose it from n$"
  )
  with pytest.raises(ValueError, match=message.format(1000)):
    data.check_batch_size(1000, 872)
  with pytest.raises(ValueError, match=message.format(0)):
    data.check_batch_size(0, 872)


# ------------------------------------------------------------------------ Hub


@pytest.mark.timeout(60)
def test_offline_hub_dataset_error_is_one_clear_line(monkeypatch, tokenizer):
  # A dataset id nobody has cached, so the test means the same on every machine.
  spec = dataclasses.replace(
      tasks.TASKS["sst2"], hub_id="raptor-jax-tests/not-cached"
  )
  monkeypatch.setitem(tasks.TASKS, "sst2", spec)
  with pytest.raises(FileNotFoundError) as info:
    data.load_task_split("sst2", "train", tokenizer=tokenizer)
  message = str(info.value)
  assert "\n" not in message
  assert "raptor-jax-tests/not-cached (sst2)" in message
  assert "--config.data.train_path=" in message


@pytest.mark.timeout(60)
def test_offline_public_corpus_and_tokenizer_errors():
  with pytest.raises(
      FileNotFoundError, match=r"raptor-jax-tests/no-corpus.*public_path"
  ):
    data.load_public_corpus("raptor-jax-tests/no-corpus")
  with pytest.raises(
      FileNotFoundError, match=r"'raptor-jax-tests/no-model'.*local directory"
  ):
    data.load_tokenizer("raptor-jax-tests/no-model")


def test_hub_split_names_and_columns(monkeypatch, tokenizer):
  requests = []

  def fake_load_dataset(hub_id, config, split):
    requests.append((hub_id, config, split))
    columns = {
        "premise": ["tea", "soup"],
        "hypothesis": ["beer", "stew"],
        "label": [2, 0],
    }
    return datasets.Dataset.from_dict({**columns, "idx": [0, 1]})

  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  split = data.load_task_split("mnli", "dev", tokenizer=tokenizer)

  assert requests == [("nyu-mll/glue", "mnli", "validation_matched")]
  np.testing.assert_array_equal(split.labels, [2, 0])
  assert split.input_ids[0, 3] == tokenizer.get_vocab()["beer"]


def test_task_specs():
  assert data.get_task("MNLI").num_labels == 3
  assert data.get_task("qqp").metrics == ("accuracy", "f1")
  assert data.get_task("synthetic").num_labels == 2
  assert {
      spec.splits["dev"] for spec in data.TASKS.values() if spec.hub_id
  } == {
      "validation",
      "validation_matched",
  }


# -------------------------------------------------------------- public corpora


def test_public_corpus_from_local_files(tmp_path):
  tsv = _write(
      tmp_path / "c.tsv",
      "file\ttext\n1\t alpha \n2\t\n3\tbeta\n4\talpha\n5\tgamma\n",
  )
  txt = _write(tmp_path / "c.txt", "alpha\n\nbeta\n")
  pairs = [
      {"premise": "a", "hypothesis": "b"},
      {"premise": "c", "hypothesis": None},
  ]
  jsonl = _write(
      tmp_path / "c.jsonl", "".join(json.dumps(pair) + "\n" for pair in pairs)
  )
  squad = _write(tmp_path / "contexts.tsv", "title\tcontext\nx\tone\ny\ttwo\n")

  assert data.load_public_corpus(path=tsv) == ["alpha", "beta", "gamma"]
  assert data.load_public_corpus(path=tsv, n_pub=2) == ["alpha", "beta"]
  assert data.load_public_corpus(path=txt, text_fields="ignored") == [
      "alpha",
      "beta",
  ]
  assert data.load_public_corpus("anli_r2", path=jsonl) == ["a b", "c"]
  assert data.load_public_corpus("squad", path=squad) == ["one", "two"]


def test_public_corpus_errors(tmp_path):
  empty = _write(tmp_path / "e.tsv", "text\n \n\n")
  with pytest.raises(
      ValueError, match=r"^Public corpus .*e.tsv has no non-empty text in text"
  ):
    data.load_public_corpus(path=empty)
  with pytest.raises(
      ValueError, match=r"no public text column \(looked for context"
  ):
    data.load_public_corpus(path=empty, text_fields="context")
  with pytest.raises(ValueError, match="No public corpus given"):
    data.load_public_corpus()
  with pytest.raises(ValueError, match=r"data.n_pub: must be >= 1, got 0"):
    data.load_public_corpus(path=empty, n_pub=0)


def test_public_corpus_presets_follow_the_paper():
  assert data.PUBLIC_CORPORA["imdb"].split == "unsupervised"
  assert data.PUBLIC_CORPORA["paws"].hub_config == "labeled_final"
  assert set(data.TASK_CORPUS) == set(data.TASKS) - {"synthetic"}


# ------------------------------------------------------------ synthetic task


@pytest.fixture(scope="module")
def task():
  return data.synthetic_task(seed=0)


def test_synthetic_task_is_deterministic(task):
  again = data.synthetic_task(seed=0)
  other = data.synthetic_task(seed=1)
  for a, b in ((task.train, again.train), (task.dev, again.dev)):
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.labels, b.labels)
  assert task.public_texts == again.public_texts
  assert not np.array_equal(task.train.input_ids, other.train.input_ids)


def test_synthetic_task_shapes_and_balance(task):
  assert (len(task.train), len(task.dev), len(task.public_texts)) == (
      4000,
      500,
      1000,
  )
  assert task.train.input_ids.shape == (4000, 32)
  lengths = task.train.attention_mask.sum(1)
  assert (
      lengths.min() >= 10 and lengths.max() <= 22
  )  # 8-20 words + [CLS] + [SEP], no truncation
  assert 0.45 < task.train.labels.mean() < 0.55
  assert not np.any(task.train.input_ids == task.tokenizer.unk_token_id)


def test_train_dev_and_public_are_disjoint(task):
  rows = lambda ids: {tuple(row) for row in ids}
  public_ids, _ = data.tokenize(
      task.tokenizer, task.public_texts, max_length=32
  )
  train, dev, public = (
      rows(task.train.input_ids),
      rows(task.dev.input_ids),
      rows(public_ids),
  )
  assert len(train) == 4000 and len(dev) == 500 and len(public) == 1000
  assert not train & dev and not train & public and not dev & public


def test_labels_follow_the_polarity_rule_and_context_words_flip():
  records = synthetic.generate_records(3, 2000, label_noise=0.0)
  for text, label, topic in zip(records.texts, records.labels, records.topics):
    score = sum(synthetic.word_polarity(word, topic) for word in text.split())
    assert (score > 0) == bool(label)
  # "cold" is a positive word for drinks (unflipped) and a negative one for food (flipped).
  with_cold = np.array(["cold" in text.split() for text in records.texts])
  for topic, positive in ((0, True), (1, False)):
    in_topic = with_cold & (records.topics == topic)
    assert in_topic.sum() > 10
    assert records.labels[in_topic].mean() == pytest.approx(
        float(positive), abs=0.2
    )


def test_label_noise_flips_about_that_share():
  clean = synthetic.generate_records(5, 3000, label_noise=0.0)
  noisy = synthetic.generate_records(5, 3000, label_noise=0.1)
  assert clean.texts == noisy.texts
  assert 0.07 < np.mean(clean.labels != noisy.labels) < 0.13


def test_topic_groups(task):
  vocab = task.tokenizer.get_vocab()
  assert task.token_groups.shape == (len(task.tokenizer),)
  assert (
      task.token_groups[vocab["coffee"]]
      == task.token_groups[vocab["latte"]]
      == 0
  )
  assert task.token_groups[vocab["villain"]] == 6
  assert (
      task.token_groups[vocab["cold"]]
      == task.token_groups[vocab["[PAD]"]]
      == -1
  )
  assert (
      np.bincount(task.token_groups[task.token_groups >= 0]).tolist()
      == [12] * 8
  )


def test_word_tokenizer_round_trip(tmp_path, task):
  task.tokenizer.save_pretrained(tmp_path)
  reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
  via_loader = data.load_tokenizer(str(tmp_path))

  texts, pairs = ["Cold TEA, great!", "unknownword soup"], ["warm stew", "beer"]
  expected = data.tokenize(
      task.tokenizer, texts, pair_texts=pairs, max_length=12
  )
  for tok in (reloaded, via_loader):
    np.testing.assert_array_equal(
        data.tokenize(tok, texts, pair_texts=pairs, max_length=12), expected
    )
    assert tok.pad_token_id == 0 and tok.unk_token_id == 1
    np.testing.assert_array_equal(
        synthetic.topic_groups(tok), task.token_groups
    )


def test_word_tokenizer_rejects_bad_vocabulary():
  with pytest.raises(ValueError, match="'tea' is repeated"):
    data.build_word_tokenizer(["tea", "tea"])
  with pytest.raises(ValueError, match="'Tea'"):
    data.build_word_tokenizer(["Tea"])


# ------------------------------------------------------------------ real data


@needs_shared_data
def test_real_glue_files(tokenizer):
  glue = SHARED_DATA / "glue"
  sst2 = data.load_task_split(
      "sst2", "dev", tokenizer=tokenizer, path=glue / "sst2" / "dev.tsv"
  )
  assert len(sst2) == 872 and sst2.labels.sum() == 444

  qnli_path = glue / "qnli" / "dev.tsv"
  sentences = data.read_columns(qnli_path)["sentence"]
  assert len(sentences) == 5463  # a quote-aware reader would merge lines here
  assert sum(s.startswith('" ') for s in sentences) > 5
  qnli = data.load_task_split(
      "qnli", "dev", tokenizer=tokenizer, path=qnli_path
  )
  assert len(qnli) == 5463 and (qnli.labels == 0).sum() == 2702

  qqp = data.load_task_split(
      "qqp",
      "train",
      tokenizer=tokenizer,
      path=glue / "qqp" / "train_sample.tsv",
  )
  assert len(qqp) == 9999 and qqp.labels.sum() == 3629

  mnli = data.load_task_split(
      "mnli",
      "dev",
      tokenizer=tokenizer,
      path=glue / "mnli" / "dev_matched_sample1000_tokenized.tsv",
  )
  assert np.bincount(mnli.labels).tolist() == [373, 311, 316]
  assert mnli.input_ids.shape == (1000, 128)
  # Pairs: every row holds [CLS] premise [SEP] hypothesis [SEP].
  assert np.all((mnli.input_ids == tokenizer.sep_token_id).sum(1) == 2)


@needs_shared_data
def test_real_public_corpora():
  calib = SHARED_DATA / "calib"
  imdb = data.load_public_corpus(
      "imdb", path=calib / "imdb" / "unsup_sample5000.tsv"
  )
  squad = data.load_public_corpus(
      "squad", path=calib / "squad" / "dev_v1.1_contexts.tsv", n_pub=5000
  )
  assert len(imdb) == 1000 and all(imdb)
  assert len(squad) == 2067


# -- the public corpus, used as loaded; the operator's overlap report ---------

PRIVATE = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "Normandy is a region in France whose people gave it its name.",
    "good",  # too short to count as a copy
]
PUBLIC = [
    "Some history. NORMANDY is a region in France, whose people gave it "
    "its name! More text follows.",  # contains a private sentence
    "A text about the weather, which is good today and was good before.",
    "the quick brown fox jumps over the lazy dog",  # inside a private one
    "An unrelated paragraph about rivers, foxes and dogs in general terms.",
]


def test_public_texts_overlapping_private_text_are_dropped():
  """Against a brute-force reference: normalised containment either way."""
  kept, dropped = data.drop_overlapping(PUBLIC, PRIVATE, min_chars=32)
  norm = overlap.normalize
  reference = [
      p
      for p in PUBLIC
      if not any(
          min(len(norm(p)), len(norm(q))) >= 32
          and (norm(q) in norm(p) or norm(p) in norm(q))
          for q in PRIVATE
      )
  ]
  assert kept == reference == [PUBLIC[1], PUBLIC[3]] and dropped == 2
  assert data.drop_overlapping(PUBLIC, [], min_chars=32) == (PUBLIC, 0)


def _file_config(tmp_path, private, public=PUBLIC):
  """The :tiny model on a train file of `private` and a public file."""
  from raptor_jax.train import config as train_config

  config = train_config.with_preset(train_config.base_config(), "tiny")
  config.data.task = "sst2"
  config.model.tokenizer = "public-words"
  config.batch_size = 2
  rows = "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(private))
  name = f"train_{len(private)}.tsv"
  config.data.train_path = str(
      _write(tmp_path / name, "sentence\tlabel\n" + rows)
  )
  config.data.dev_path = str(
      _write(tmp_path / f"dev_{name}", "sentence\tlabel\n" + rows)
  )
  config.data.public_corpus = ""
  config.data.public_path = str(_write(tmp_path / "pub.txt", "\n".join(public)))
  return config


@pytest.mark.slow
def test_the_run_uses_the_public_corpus_as_loaded_overlap_or_not(tmp_path):
  """Filtering the corpus against D would make it a function of D."""
  from raptor_jax.train import setup

  config = _file_config(tmp_path, PRIVATE)
  run_data = setup.load_run_data(config)
  assert not hasattr(run_data, "public_dropped")
  assert len(run_data.public[0]) == len(PUBLIC)  # the two overlapping kept
  config.data.public_path = str(_write(tmp_path / "all.txt", PUBLIC[0]))
  assert len(setup.load_run_data(config).public[0]) == 1


@pytest.mark.slow
def test_nothing_before_the_mechanism_moves_when_a_record_copies_a_public_text(
    tmp_path,
):
  """Invariant (docs/method.md §3): l*, the vocabulary and every file written before the
  mechanism are identical for D and for D plus a record that copies a public
  text (under add/remove adjacency such a neighbour is always possible)."""
  from raptor_jax.train import outputs as run_outputs
  from raptor_jax.train.run import build_run

  public = [
      *PUBLIC,
      *(
          f"Review {i}: the {w} film about {v} was {u} and rather long."
          for i, (w, v, u) in enumerate(
              zip(
                  ("odd", "calm", "loud", "slow", "dark", "warm") * 2,
                  ("ships", "cats", "kings", "trains", "lakes", "bees") * 2,
                  ("dull", "fine", "grand", "weak", "bold", "sweet") * 2,
              )
          )
      ),
  ]
  base = [*PRIVATE[:2], "A plain sentence that is only private.", "Bad."]
  outputs = []
  for private in (base, [*base, public[-1]]):  # the neighbour copies a text
    config = _file_config(tmp_path, private, public)
    run = build_run(config)
    workdir = tmp_path / f"run_{len(private)}"
    workdir.mkdir()
    run_outputs.write_layer_selection(workdir, run)
    run.data.tokenizer.save_pretrained(workdir / "tokenizer")
    files = {
        str(p.relative_to(workdir)): p.read_bytes()
        for p in sorted(workdir.rglob("*"))
        if p.is_file()
    }
    outputs.append(
        (
            run.expert_layer,
            run.data.tokenizer.get_vocab(),
            [a.tolist() for a in run.data.public],
            files,
        )
    )
  assert len(outputs[1][3]) >= 3  # layer_selection.json and tokenizer files
  assert outputs[0] == outputs[1]


def test_the_overlap_report_is_an_operator_command_that_writes_nothing(
    tmp_path,
):
  """Opt-in, apart from training: one line on stdout, no file anywhere."""
  import subprocess
  import sys

  config = _file_config(tmp_path, PRIVATE)
  before = sorted(p.name for p in tmp_path.iterdir())
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  root = Path(__file__).resolve().parents[1]
  proc = subprocess.run(
      [
          sys.executable,
          str(root / "launch" / "overlap.py"),
          f"--config={root / 'configs' / 'glue.py'}:preset=cpu",
          *(
              f"--config.{k}={v}"
              for k, v in (
                  ("data.public_corpus", ""),
                  ("data.train_path", config.data.train_path),
                  ("data.dev_path", config.data.dev_path),
                  ("data.public_path", config.data.public_path),
              )
          ),
      ],
      cwd=cwd,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip().splitlines() == [
      "2 of 4 public texts overlap the private train split verbatim"
      " (private: do not publish)"
  ]
  assert not list(cwd.iterdir())
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "cwd"])


@pytest.mark.slow
@needs_shared_data
def test_real_qnli_overlap_with_squad_dev_contexts():
  """Measured once (README): QNLI dev comes from SQuAD dev, QNLI train not."""
  squad = data.load_public_corpus(
      "squad",
      path=SHARED_DATA / "calib" / "squad" / "dev_v1.1_contexts.tsv",
      n_pub=5000,
  )
  counts = {
      split: data.drop_overlapping(
          squad,
          data.load_task_texts(
              "qnli", split, path=SHARED_DATA / "glue" / "qnli" / name
          ),
      )[1]
      for split, name in (("train", "train_sample.tsv"), ("dev", "dev.tsv"))
  }
  assert counts == {"train": 3, "dev": 1772}
