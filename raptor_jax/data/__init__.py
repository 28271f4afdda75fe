"""Data: GLUE tasks, public calibration corpora, and the embedded offline task.

* :func:`load_task_split` reads a split of SST-2, MNLI, QNLI or QQP from the
  Hub or a local TSV/CSV/parquet/JSONL file and tokenises it with the model's
  tokenizer into right-padded ``int32`` arrays (:class:`TextClassificationData`).
* :func:`load_public_corpus` returns the first ``n_pub`` texts of a public
  corpus for layer selection (presets in :data:`PUBLIC_CORPORA`).
* :func:`drop_overlapping` finds public texts that overlap private text
  verbatim, for the operator's opt-in overlap report only
  (``launch/overlap.py``): a run uses its public corpus as loaded.
* :func:`synthetic_task` generates the offline task of the ``:tiny`` presets:
  train/dev records, a disjoint public corpus, a word-level tokenizer and the
  token-to-topic map that lets a model make routing matter.

Privacy: nothing here prints or logs record contents or statistics of the
private data; errors name files, columns and row numbers, never values.
"""

from raptor_jax import _validate

with _validate.needs_extra("raptor_jax.data"):  # datasets, transformers, ...
  from raptor_jax.data.corpora import PUBLIC_CORPORA, TASK_CORPUS, CorpusSpec, load_public_corpus
  from raptor_jax.data.encoding import (
      TextClassificationData,
      Tokenizer,
      build_word_tokenizer,
      check_batch_size,
      encode,
      load_tokenizer,
      public_word_tokenizer,
      tokenize,
  )
  from raptor_jax.data.overlap import drop_overlapping
  from raptor_jax.data.synthetic import SyntheticTask, synthetic_task, topic_groups
  from raptor_jax.data.tables import read_columns
  from raptor_jax.data.tasks import (
      CUSTOM,
      TASKS,
      TaskSpec,
      custom_task,
      get_task,
      load_task_split,
      load_task_texts,
  )

__all__ = [
    "CUSTOM",
    "PUBLIC_CORPORA",
    "TASKS",
    "TASK_CORPUS",
    "CorpusSpec",
    "SyntheticTask",
    "TaskSpec",
    "TextClassificationData",
    "Tokenizer",
    "build_word_tokenizer",
    "check_batch_size",
    "custom_task",
    "drop_overlapping",
    "encode",
    "get_task",
    "load_public_corpus",
    "load_task_split",
    "load_task_texts",
    "load_tokenizer",
    "public_word_tokenizer",
    "read_columns",
    "synthetic_task",
    "tokenize",
    "topic_groups",
]
