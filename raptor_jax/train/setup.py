"""Builds a run's data and model from its config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import _validate, data, models, roles
from raptor_jax.models import hf, initializers
from raptor_jax.train import config as config_lib
from raptor_jax import vision

# model.tokenizer value: a word-level tokenizer over the public corpus's words.
PUBLIC_WORDS = "public-words"


@dataclasses.dataclass
class RunData:
  """Tokenised splits, the public corpus and the task's metadata.

  `train` holds this host's share of the training records when loaded with
  `host` (all of them by default).
  """

  task: data.TaskSpec
  train: data.TextClassificationData
  dev: data.TextClassificationData
  public: tuple[np.ndarray, np.ndarray] | None  # (input_ids, attention_mask)
  tokenizer: Any
  token_groups: np.ndarray | None  # synthetic task: token -> topic (-1 none)
  # image tasks (`raptor_jax.vision`): every record's image tokens, float32
  # [rows, hidden]; PRIVATE (the records' image features), never released
  image_table: np.ndarray | None = None
  # image tasks with a pretrained LM head: its rows of the choice letters,
  # the classifier head's initial kernel [hidden, num_labels] (public)
  letter_head: np.ndarray | None = None


def _shard_of(
    train: data.TextClassificationData, index: int, count: int
) -> data.TextClassificationData:
  return data.TextClassificationData(
      train.input_ids[index::count],
      train.attention_mask[index::count],
      train.labels[index::count],
  )


# Fields only a custom task reads (configs/custom.py declares them).
CUSTOM_TASK_ONLY = ("data.label_names", "data.hub_dataset")


def task_spec(dc: ml_collections.ConfigDict) -> data.TaskSpec:
  """The task `dc` names: a GLUE or the generated task, or the user's own
  (`data.task='custom'`: `data.text_fields`, `data.label_field`,
  `data.label_names`, `configs/custom.py`)."""
  if vision.is_image_task(dc.task):
    return vision.IMAGE_TASKS[dc.task.lower()]
  if dc.task != data.CUSTOM:
    return data.get_task(dc.task)
  return data.custom_task(
      tuple(dc.text_fields),
      dc.label_field,
      dc.label_names,
      hub_id=dc.get("hub_dataset") or None,
  )


def check_eval_split(dc: ml_collections.ConfigDict) -> None:
  """The evaluation split exists, is not the train file, and the holdout
  never overlaps training records.

  Run before `check_data_fields`, which refuses a holdout on the generated task.
  """
  fix = _validate.config_fix
  _validate.one_of(
      "data.eval_split",
      dc.eval_split,
      ("dev", "holdout"),
      fix("data.eval_split"),
  )
  _validate.non_negative_int("data.holdout", dc.holdout, fix("data.holdout"))
  if dc.eval_split == "dev":
    _check_dev_is_not_train(dc)
  if task_spec(dc).name == "synthetic" or vision.is_image_task(dc.task):
    return  # no holdout: `check_data_fields` refuses one
  _validate.check(
      not dc.holdout or dc.train_limit,
      "data.train_limit",
      "> 0 when data.holdout > 0 (the holdout is the records after the first"
      " train_limit)",
      dc.train_limit,
      fix("data.train_limit") + " so that the holdout is not trained on",
  )
  if dc.eval_split == "holdout":
    _validate.check(
        dc.holdout > 0,
        "data.holdout",
        "> 0 when data.eval_split='holdout'",
        dc.holdout,
        fix("data.holdout", "N"),
    )


def _check_dev_is_not_train(dc: ml_collections.ConfigDict) -> None:
  """Evaluating on the training file would report training accuracy as dev
  accuracy."""
  fix = _validate.config_fix
  same = (
      dc.train_path
      and dc.dev_path
      and Path(dc.train_path).expanduser().resolve()
      == Path(dc.dev_path).expanduser().resolve()
  )
  _validate.check(
      not same,
      "data.dev_path",
      "another file than data.train_path (evaluating on the training"
      " records reports training accuracy as dev accuracy)",
      dc.dev_path,
      fix("data.dev_path")
      + " to held-out records, or evaluate on train records never trained"
      " on: --config.data.eval_split=holdout --config.data.train_limit=N"
      " --config.data.holdout=M",
  )


# Fields the generated task (data.task='synthetic', the :tiny preset) never
# reads: it makes its own records and public corpus and reads no file.
GENERATED_TASK_IGNORES = (
    "data.train_path",
    "data.dev_path",
    "data.text_fields",
    "data.label_field",
    "data.train_limit",
    "data.dev_limit",
    "data.holdout",
    "data.public_path",
    "data.public_split",
    "data.public_text_fields",
)
# Fields only the generated task reads.
GENERATED_TASK_ONLY = (
    "data.synthetic.n_train",
    "data.synthetic.n_dev",
    "data.synthetic.label_noise",
)
_FILES_PRESET = (
    "to train on files use --config=configs/glue.py:task=<task>,preset=cpu"
    " (the tiny model) or preset=small"
)


def _field(config: ml_collections.ConfigDict, dotted: str) -> Any:
  for key in dotted.split("."):
    config = config[key]
  return config


def _check_random_model_unset(config: ml_collections.ConfigDict) -> None:
  """`model.random.*` describes the random model only: a pretrained one
  brings its own architecture, so a field changed from every family's
  default (`FAMILIES`) has no effect."""
  defaults = [
      family(config_lib.base_config()).model.random
      for family in config_lib.FAMILIES.values()
  ]
  given = config.model.random
  changed = [[k for k in d if given[k] != d[k]] for d in defaults]
  if all(changed):  # the nearest default names the field to unset
    default, names = min(zip(defaults, changed), key=lambda p: len(p[1]))
    _validate.fail(
        f"model.random.{names[0]}",
        f"{default[names[0]]!r} (unset) with model.name="
        f"{config.model.name!r}, which brings its own architecture",
        given[names[0]],
        "set --config.model.name=random (as :tiny and :cpu do) to train a"
        " random model",
    )


def _check_custom_fields(
    dc: ml_collections.ConfigDict, task: data.TaskSpec
) -> None:
  """A custom task has its data; no other task sets a custom task's fields."""
  fix = _validate.config_fix
  if task.name != data.CUSTOM:
    for field in CUSTOM_TASK_ONLY:
      value = dc.get(field.split(".")[1])
      _validate.check(
          not value,
          field,
          f"unset with data.task={dc.task!r}, whose labels and source are"
          " fixed",
          value,
          "set --config.data.task=custom (configs/custom.py) for your own task",
      )
  elif not (dc.train_path or dc.get("hub_dataset")):
    _validate.fail(
        "data.train_path",
        "a file or save_to_disk directory of your task (or set"
        " data.hub_dataset)",
        dc.train_path,
        fix("data.train_path", "/path/to/train.tsv"),
    )
  elif dc.eval_split == "dev" and not (dc.dev_path or dc.get("hub_dataset")):
    _validate.fail(
        "data.dev_path",
        "a file of your task's evaluation records (or set data.eval_split"
        " to 'holdout' with data.train_limit and data.holdout)",
        dc.dev_path,
        fix("data.dev_path", "/path/to/dev.tsv"),
    )


def check_data_fields(config: ml_collections.ConfigDict) -> None:
  """Refuses a set field that the chosen data source ignores (one line).

  A field that has no effect must not be accepted silently: a user who sets
  `data.train_path` on the generated task would otherwise train on generated
  records and believe they trained on their file. The generated task ignores
  `GENERATED_TASK_IGNORES` (and a public corpus other than its own, and
  `model.tokenizer` under the random model); a real task ignores
  `GENERATED_TASK_ONLY`; a pretrained model ignores `model.random`. Set data
  files must exist.
  """
  dc, fix = config.data, _validate.config_fix
  if config.model.name != "random":
    _check_random_model_unset(config)
  if vision.is_image_task(dc.task):
    return vision.check_fields(config)
  task = task_spec(dc)
  _check_custom_fields(dc, task)
  if task.name == "synthetic":
    where = "unset with the generated task (data.task='synthetic', as in :tiny)"
    for field in GENERATED_TASK_IGNORES:
      value = _field(config, field)
      _validate.check(not value, field, where, value, _FILES_PRESET)
    _validate.one_of(
        "data.eval_split",
        dc.eval_split,
        ("dev",),
        "the generated task has no holdout; " + _FILES_PRESET,
    )
    _validate.one_of(
        "data.public_corpus",
        dc.public_corpus,
        ("synthetic", ""),
        "the generated task brings its own public corpus; " + _FILES_PRESET,
    )
    if config.model.name == "random":
      _validate.check(
          not config.model.tokenizer,
          "model.tokenizer",
          where + " and model.name='random' (a word tokenizer of its own)",
          config.model.tokenizer,
          _FILES_PRESET,
      )
    return
  defaults = config_lib.base_config()
  for field in GENERATED_TASK_ONLY:
    value, default = _field(config, field), _field(defaults, field)
    _validate.check(
        value == default,
        field,
        f"{default!r} (unset) with data.task={dc.task!r}, which reads no"
        " generated records",
        value,
        "the generated task is --config=configs/glue.py:preset=tiny",
    )
  if dc.eval_split == "holdout":
    for field in ("data.dev_path", "data.dev_limit"):
      value = _field(config, field)
      _validate.check(
          not value,
          field,
          "unset with data.eval_split='holdout' (it evaluates on train records)",
          value,
          fix("data.eval_split", "dev") + " to evaluate on the dev split",
      )
  for field in ("train_path", "dev_path", "public_path"):
    _validate.check(
        not dc[field] or Path(dc[field]).expanduser().exists(),
        f"data.{field}",
        "an existing file",
        dc[field],
        fix(f"data.{field}") + " to a file that exists",
    )


def load_run_data(
    config: ml_collections.ConfigDict, host: tuple[int, int] = (0, 1)
) -> RunData:
  """Loads train/dev and the public corpus, tokenised for the model.

  Args:
    host: (process index, process count): only the training records i with
      i % count == index are tokenised and kept, record i becoming local
      record i // count (as `parallel.local_microbatches` numbers them). Dev
      and the public corpus are loaded whole.
  """
  dc = config.data
  task = task_spec(dc)
  check_eval_split(dc)
  check_data_fields(config)
  if task.name == "synthetic":
    return _synthetic_run_data(config, task, host)
  if vision.is_image_task(task.name):
    fields = vision.image_run_data(config, task)
    if host[1] > 1:
      fields["train"] = _shard_of(fields["train"], *host)
    return RunData(task, public=None, token_groups=None, **fields)
  texts = public_texts(dc)
  tokenizer = _run_tokenizer(config, texts)

  def load(split: str, path: str, **where) -> data.TextClassificationData:
    return data.load_task_split(
        task,
        split,
        path=path or None,
        tokenizer=tokenizer,
        max_length=dc.max_length,
        text_fields=tuple(dc.text_fields) or None,
        label_field=dc.label_field or None,
        **where,
    )

  train = load("train", dc.train_path, limit=dc.train_limit or None, shard=host)
  if dc.eval_split == "holdout":
    dev = load("train", dc.train_path, offset=dc.train_limit, limit=dc.holdout)
  else:
    dev = load("dev", dc.dev_path, limit=dc.dev_limit or None)
  public = (
      None
      if texts is None
      else data.tokenize(tokenizer, texts, max_length=dc.max_length)
  )
  return RunData(task, train, dev, public, tokenizer, None)


def _synthetic_run_data(
    config: ml_collections.ConfigDict,
    task: data.TaskSpec,
    host: tuple[int, int],
) -> RunData:
  """`load_run_data` for the generated task: its records and public corpus."""
  dc = config.data
  # A pretrained model reads the task through its own tokenizer.
  model_tokenizer = (
      None
      if config.model.name == "random"
      else data.load_tokenizer(config.model.tokenizer or config.model.name)
  )
  syn = data.synthetic_task(
      config.seed,
      n_train=dc.synthetic.n_train,
      n_dev=dc.synthetic.n_dev,
      n_pub=dc.n_pub,
      max_length=dc.max_length,
      label_noise=dc.synthetic.label_noise,
      tokenizer=model_tokenizer,
  )
  public = data.tokenize(
      syn.tokenizer, syn.public_texts, max_length=dc.max_length
  )
  return RunData(
      task,
      _shard_of(syn.train, *host),
      syn.dev,
      public if dc.public_corpus else None,
      syn.tokenizer,
      syn.token_groups,
  )


def public_texts(dc: ml_collections.ConfigDict) -> list[str] | None:
  """The public corpus exactly as loaded (None if none is set).

  Privacy: layer selection (l*) and the `public-words` vocabulary are
  computed from these texts alone, before the mechanism, so they must not
  depend on the private data D. A fixed public corpus is DP-safe even where
  it overlaps D: it is the same for D and for every neighbour, so nothing
  computed from it spends budget. Filtering it against D (dropping texts
  that a record copies) would make it, l* and the vocabulary functions of
  D, outside any accounting; it is never filtered. An operator who wants to
  know how much of the corpus a train split quotes runs `overlap_report`
  (`launch/overlap.py`), which changes nothing a run computes.
  """
  if not (dc.public_corpus or dc.public_path):
    return None
  return data.load_public_corpus(
      dc.public_corpus or None,
      path=dc.public_path or None,
      split=dc.public_split or None,
      text_fields=tuple(dc.public_text_fields) or None,
      n_pub=dc.n_pub,
  )


def _run_tokenizer(
    config: ml_collections.ConfigDict, texts: list[str] | None
) -> Any:
  """The model's tokenizer, or a word tokenizer over the public `texts`."""
  if config.model.tokenizer == PUBLIC_WORDS:
    if texts is None:
      raise ValueError(
          f"model.tokenizer={PUBLIC_WORDS!r} builds its vocabulary from the public "
          "corpus; set --config.data.public_corpus or --config.data.public_path"
      )
    return data.public_word_tokenizer(texts)
  return data.load_tokenizer(config.model.tokenizer or config.model.name)


def overlap_report(config: ml_collections.ConfigDict) -> dict[str, int]:
  """How many texts of a run's public corpus overlap its private train split.

  An operator's check of a corpus choice, opt-in (`launch/overlap.py`): a
  public text that contains a train text verbatim, or is contained in one
  (`data.overlap`, the whole train file), counts. Nothing a run computes
  reads it and it writes no file: the count is a function of the private
  data, not covered by any epsilon, so it is for the operator's eyes (on
  the terminal) only. A run always uses the corpus as loaded
  (`public_texts`).

  Returns:
    dict(public_texts=number of texts loaded, overlapping=how many overlap).
  """
  dc = config.data
  task = task_spec(dc)
  check_data_fields(config)
  if task.name == "synthetic":
    raise ValueError(
        "the generated task's public corpus is generated disjoint from its"
        " records; run the overlap report on a task read from files"
    )
  texts = public_texts(dc)
  if texts is None:
    raise ValueError(
        "the config has no public corpus; set --config.data.public_corpus or"
        " --config.data.public_path"
    )
  private = data.load_task_texts(
      task,
      "train",
      path=dc.train_path or None,
      text_fields=tuple(dc.text_fields) or None,
  )
  _, overlapping = data.drop_overlapping(texts, private)
  return dict(public_texts=len(texts), overlapping=overlapping)


def random_backbone(
    rc: ml_collections.ConfigDict,
    vocab_size: int,
    token_groups: np.ndarray | None,
    seed: int,
) -> tuple[nn.Module, dict]:
  """A randomly initialised backbone standing in for a pretrained checkpoint.

  When `token_groups` maps tokens to topics, every topic gets a random
  direction added (scaled by `topic_scale`) to its words' embeddings, so a
  random router sends a topic's records to the same expert, as a pretrained
  router does for semantically related text: routing then matters.
  """
  _validate.one_of(
      "model.random.family",
      rc.family,
      config_lib.FAMILIES,
      _validate.config_fix("model.random.family"),
  )
  module = hf.backbone_from_sizes(rc.family, rc, vocab_size)
  key_init, key_topics = jax.random.split(jax.random.PRNGKey(seed))
  params = initializers.init_params(module, key_init)
  if token_groups is not None and rc.topic_scale:
    embedding = params["embed_tokens"]["embedding"]
    num_topics = int(token_groups.max()) + 1
    directions = jax.random.normal(
        key_topics, (num_topics, embedding.shape[-1])
    )
    scale = rc.topic_scale * jnp.std(embedding)
    boost = jnp.where(
        jnp.asarray(token_groups)[:, None] >= 0,
        directions[jnp.maximum(jnp.asarray(token_groups), 0)],
        0.0,
    )
    params["embed_tokens"]["embedding"] = embedding + scale * boost
  return module, params


def load_backbone(
    config: ml_collections.ConfigDict, run_data: RunData
) -> tuple[nn.Module, dict]:
  """The frozen pretrained backbone, without adapters."""
  mc = config.model
  if run_data.image_table is not None or vision.is_image_task(config.data.task):
    return vision.image_backbone(config, run_data)
  if mc.name == "random":
    return random_backbone(
        mc.random, len(run_data.tokenizer), run_data.token_groups, config.seed
    )
  return models.from_pretrained(mc.name, dtype=mc.dtype, language_only=True)


def classifier(
    backbone: nn.Module,
    backbone_params: dict,
    num_labels: int,
    pooling: str,
    seed: int,
) -> tuple[models.SequenceClassifier, dict]:
  """Wraps a backbone with pooling and a freshly initialised linear head (`hf.with_head`)."""
  return hf.with_head(
      backbone, backbone_params, num_labels, pooling=pooling, seed=seed
  )


def default_pooling(backbone: nn.Module) -> str:
  """Mean pooling for encoders, last token for causal decoders."""
  return "mean" if isinstance(backbone, models.SwitchEncoder) else "last"


def partition(params: dict, parts) -> tuple[dict[str, dict], dict]:
  """Splits the flat parameters into {part name: leaves} and the frozen rest.

  Raises:
    ValueError: a part selects nothing, or two parts share a leaf.
  """
  flat = roles.flatten(params)
  trainable, taken = {}, set()
  for part in parts:
    paths = roles.select(params, part.roles, part.blocks)
    if not paths:
      raise ValueError(
          f"part {part.name!r} selects no parameters (roles {part.roles}, "
          f"blocks {part.blocks}); check the model's adapters"
      )
    if taken & set(paths):
      raise ValueError(f"part {part.name!r} overlaps another part")
    taken |= set(paths)
    trainable[part.name] = {p: flat[p] for p in paths}
  frozen = {p: v for p, v in flat.items() if p not in taken}
  return trainable, frozen
