"""Builds a run's data and model from its config."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import data, models, roles
from raptor_jax.models import hf

log = logging.getLogger("raptor_jax")

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
  # Public texts dropped for verbatim overlap with the private train split
  # (`public_disjoint_from_train`); None when not checked.
  public_dropped: int | None = None


def _shard_of(
    train: data.TextClassificationData, index: int, count: int
) -> data.TextClassificationData:
  return data.TextClassificationData(
      train.input_ids[index::count],
      train.attention_mask[index::count],
      train.labels[index::count],
  )


def check_eval_split(dc: ml_collections.ConfigDict) -> None:
  """The evaluation split exists and the holdout never overlaps training records."""
  if dc.eval_split not in ("dev", "holdout"):
    raise ValueError(
        f"data.eval_split must be 'dev' or 'holdout', got {dc.eval_split!r}"
    )
  if dc.holdout < 0:
    raise ValueError(f"data.holdout must be >= 0, got {dc.holdout}")
  if dc.holdout and not dc.train_limit:
    raise ValueError(
        "data.holdout takes the records after the first data.train_limit; set "
        "--config.data.train_limit so that they are not trained on"
    )
  if dc.eval_split == "holdout" and not dc.holdout:
    raise ValueError(
        "data.eval_split='holdout' needs --config.data.holdout=N (N > 0)"
    )
  if dc.eval_split == "holdout" and dc.task == "synthetic":
    raise ValueError(
        "the synthetic task has no holdout; use data.eval_split='dev'"
    )


def load_run_data(
    config: ml_collections.ConfigDict, host: tuple[int, int] = (0, 1)
) -> RunData:
  """Loads train/dev and the public corpus, tokenised for the model.

  Args:
    config: the run's config.
    host: (process index, process count): only the training records i with
      i % count == index are tokenised and kept, record i becoming local
      record i // count (as `parallel.local_microbatches` numbers them). Dev
      and the public corpus are loaded whole.
  """
  dc = config.data
  task = data.get_task(dc.task)
  check_eval_split(dc)
  if task.name == "synthetic":
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
  texts = None
  if dc.public_corpus or dc.public_path:
    texts = data.load_public_corpus(
        dc.public_corpus or None,
        path=dc.public_path or None,
        split=dc.public_split or None,
        text_fields=tuple(dc.public_text_fields) or None,
        n_pub=dc.n_pub,
    )
  dropped = None
  if texts is not None:
    texts, dropped = public_disjoint_from_train(texts, task.name, dc)
  if config.model.tokenizer == PUBLIC_WORDS:
    if texts is None:
      raise ValueError(
          f"model.tokenizer={PUBLIC_WORDS!r} builds its vocabulary from the public "
          "corpus; set --config.data.public_corpus or --config.data.public_path"
      )
    tokenizer = data.public_word_tokenizer(texts)
  else:
    tokenizer = data.load_tokenizer(config.model.tokenizer or config.model.name)
  kwargs = dict(
      tokenizer=tokenizer,
      max_length=dc.max_length,
      text_fields=tuple(dc.text_fields) or None,
      label_field=dc.label_field or None,
  )
  train = data.load_task_split(
      task.name,
      "train",
      path=dc.train_path or None,
      limit=dc.train_limit or None,
      shard=host,
      **kwargs,
  )
  if dc.eval_split == "holdout":
    dev = data.load_task_split(
        task.name,
        "train",
        path=dc.train_path or None,
        offset=dc.train_limit,
        limit=dc.holdout,
        **kwargs,
    )
  else:
    dev = data.load_task_split(
        task.name,
        "dev",
        path=dc.dev_path or None,
        limit=dc.dev_limit or None,
        **kwargs,
    )
  public = (
      None
      if texts is None
      else data.tokenize(tokenizer, texts, max_length=dc.max_length)
  )
  return RunData(task, train, dev, public, tokenizer, None, dropped)


def public_disjoint_from_train(
    texts: list[str], task: str, dc: ml_collections.ConfigDict
) -> tuple[list[str], int]:
  """The public texts without those that overlap the private train split.

  A public text containing a train text verbatim, or contained in one
  (`data.overlap`), is dropped: it is not public. The whole train file is
  checked (also records beyond `data.train_limit`). Only the count is
  logged, never a text; it depends on the private data (curator-side
  pre-processing outside the DP release; 0 for a corpus disjoint by
  construction, whatever the dataset).
  """
  private = data.load_task_texts(task, "train", path=dc.train_path or None)
  kept, dropped = data.drop_overlapping(texts, private)
  if dropped:
    log.warning(
        "%d of %d public texts overlap the private train split verbatim and "
        "were dropped; choose a public corpus disjoint from the private data",
        dropped,
        len(texts),
    )
  if not kept:
    raise ValueError(
        "every public text overlaps the private train split; set "
        "--config.data.public_corpus or --config.data.public_path to a "
        "corpus disjoint from it"
    )
  return kept, dropped


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
  if rc.family == "switch":
    module = models.SwitchEncoder(
        models.SwitchConfig(
            vocab_size=vocab_size,
            d_model=rc.d_model,
            d_kv=rc.d_kv,
            d_ff=rc.d_ff,
            num_layers=rc.num_layers,
            num_heads=rc.num_heads,
            num_experts=rc.num_experts,
            expert_capacity=rc.expert_capacity,
            sparse_step=rc.sparse_step,
        )
    )
  elif rc.family == "olmoe":
    module = models.OlmoeDecoder(
        models.OlmoeConfig(
            vocab_size=vocab_size,
            hidden_size=rc.d_model,
            intermediate_size=rc.d_ff,
            num_hidden_layers=rc.num_layers,
            num_attention_heads=rc.num_heads,
            num_key_value_heads=rc.num_kv_heads,
            num_experts=rc.num_experts,
            num_experts_per_tok=rc.top_k,
            norm_topk_prob=rc.norm_topk_prob,
        )
    )
  else:
    raise ValueError(
        f"unknown random model family {rc.family!r}; use 'switch' or 'olmoe'"
    )
  key_init, key_topics = jax.random.split(jax.random.PRNGKey(seed))
  params = jax.jit(module.init)(key_init, *hf.example_inputs())["params"]
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
  if mc.name == "random":
    return random_backbone(
        mc.random, len(run_data.tokenizer), run_data.token_groups, config.seed
    )
  return models.from_pretrained(mc.name, dtype=mc.dtype)


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
