"""Multiple-choice image tasks through the one training code path (DeepSeek-VL2).

The paper fine-tunes DeepSeek-VL2-Tiny on ScienceQA with LoRA on the
language model and the vision tower frozen (App. D). Frozen and without
dropout, the tower, the projector and the two learned layout embeddings are a
fixed function of each record's image: this module runs them ONCE per record
(`encode_records`) and the trainer never sees an image. Each record's image
tokens become rows of a frozen table in the language model
(`DeepseekConfig.image_table_size`, parameter `image_table`), read by token
ids vocab_size + row at the record's image positions. Everything else (the
methods, the ablations, Poisson sampling, owners, length buckets, the
accountant) is the text trainer, unchanged.

Privacy. A record's ids point only at its own rows, so its loss, hence its
clipped gradient, is a function of that record alone (the table rows of
other records are never read by it): adding or removing a record adds or
removes its rows and its gradient, nothing else. No method trains the
table (`roles.select` never picks it, even for the methods that train every
weight), it is never counted in results.json, and `release.export` refuses
a model holding one (it holds the private records' image features). A record's sequence length is 1 + its image
tokens (a function of its image's size and the public candidate
resolutions, `data.images`) + its text, so its length bucket depends only
on that record.

Tasks: 'shapes' (the generated offline task, `data.shapes`, with the random
model: the `:tiny` preset of configs/deepseek_vl2_scienceqa.py) and
'scienceqa' (ScienceQA's parquet / save_to_disk layout or the Hub, or the
JSONL / CSV layout of `data.multiple_choice.read_image_choices`). The label
is the answer's letter; with `model.pooling='last'` the classifier reads the
state after "Answer:".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from raptor_jax import _validate, data
from raptor_jax.data import images as image_data
from raptor_jax.data import multiple_choice as mc
from raptor_jax.data import shapes
from raptor_jax.models import deepseek, deepseek_vl2, hf, initializers, siglip

IMAGE_TASKS = {
    "shapes": data.TaskSpec(
        name="shapes",
        text_fields=(("question",),),
        label_fields=("answer",),
        label_names=tuple(mc.LETTERS[:4]),
        hub_id=None,
        hub_config=None,
        splits={"train": "train", "dev": "dev"},
    ),
    "scienceqa": data.TaskSpec(
        name="scienceqa",
        text_fields=(("question",),),
        label_fields=("answer",),
        label_names=tuple(mc.LETTERS[:5]),
        hub_id="derek-thomas/ScienceQA",
        hub_config=None,
        splits={"train": "train", "dev": "validation"},
    ),
}


def is_image_task(task: str) -> bool:
  return str(task).lower() in IMAGE_TASKS


def vision_config() -> ml_collections.ConfigDict:
  """`vision`: the image task's options (configs/deepseek_vl2_scienceqa.py)."""
  v = ml_collections.ConfigDict()
  v.without_image = "keep"  # questions without an image: keep | drop
  v.max_choices = 5  # more choices in a row is an error (ScienceQA: <= 5)
  v.n_train = 2000  # task='shapes': generated train records
  v.n_dev = 400  # task='shapes': generated dev records
  v.wide_fraction = 0.5  # task='shapes': pictures two tiles wide
  # model.name='random': the random tower (a pretrained checkpoint brings its own)
  v.random = ml_collections.ConfigDict()
  v.random.image_size = 28  # tile side in pixels
  v.random.patch_size = 7
  v.random.width = 32
  v.random.layers = 2
  v.random.heads = 2
  v.random.mlp_dim = 64
  v.random.candidate_resolutions = ((28, 28), (56, 28))
  return v


def check_fields(config: ml_collections.ConfigDict) -> None:
  """The image task's own checks (replaces the text tasks' field checks)."""
  fix = _validate.config_fix
  vc = config.get("vision")
  _validate.check(
      vc is not None,
      "vision",
      "a `vision` section with an image task",
      None,
      "start from --config=configs/deepseek_vl2_scienceqa.py",
  )
  _validate.one_of(
      "vision.without_image",
      vc.without_image,
      mc.WITHOUT_IMAGE,
      fix("vision.without_image", "keep"),
  )
  _validate.one_of(
      "data.eval_split",
      config.data.eval_split,
      ("dev",),
      "image tasks evaluate on their dev split",
  )
  _validate.check(
      not config.data.public_corpus and not config.data.public_path,
      "data.public_corpus",
      "'' (no format-matched public corpus: raptor.layer is a fixed layer)",
      config.data.public_corpus or config.data.public_path,
      fix("data.public_corpus", "''") + " and --config.raptor.layer=last",
  )
  if config.data.task == "shapes":
    _validate.check(
        config.model.name == "random",
        "model.name",
        "'random' with data.task='shapes' (its words are a vocabulary of"
        " their own)",
        config.model.name,
        "use data.task=scienceqa with a pretrained checkpoint",
    )
  for field in ("train_path", "dev_path"):
    path = config.data[field]
    _validate.check(
        not path or Path(path).expanduser().exists(),
        f"data.{field}",
        "an existing file or directory",
        path,
        fix(f"data.{field}") + " to a file that exists",
    )


# --- records -> ids and the image table --------------------------------------


def encode_records(
    records: Sequence[mc.ChoiceRecord],
    tokenizer,
    encode_tiles,
    tiles: image_data.TileSpec,
    *,
    max_length: int,
    vocab_size: int,
    first_row: int,
    where: str,
) -> tuple[data.TextClassificationData, np.ndarray]:
  """(ids, mask, labels) and the table rows of `records`, rows from `first_row`.

  A record is [bos] + its image tokens (ids vocab_size + row) + its prompt
  (`multiple_choice.prompt`) without special tokens. `encode_tiles(pixels
  [T, 3, S, S], grid)` returns the record's table [2 + T * side^2, D]
  (`deepseek_vl2.ImageEncoder`'s layout).
  """
  bos = tokenizer.bos_token_id
  if bos is None:
    bos = tokenizer.cls_token_id
  ids = np.full((len(records), max_length), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((len(records), max_length), np.int32)
  labels = np.array([r.answer for r in records], np.int32)
  tiled = [
      None if r.image is None else image_data.tile_image(r.image, tiles)
      for r in records
  ]
  tables = _encode_all(encode_tiles, [t[0] for t in tiled if t is not None])
  rows, next_row = [], first_row
  for i, record in enumerate(records):
    before, after = mc.prompt(record)
    seq = [] if bos is None else [bos]
    seq += tokenizer(before, add_special_tokens=False)["input_ids"]
    if tiled[i] is not None:
      table = tables[len(rows)]
      slots = image_data.image_token_index(*tiled[i][1], tiles)
      seq += list(vocab_size + next_row + slots)
      rows.append(table)
      next_row += len(table)
    seq += tokenizer(after, add_special_tokens=False)["input_ids"]
    if len(seq) > max_length:
      raise ValueError(
          f"{where}, record {i + 1}: {len(seq)} tokens with its image, more"
          f" than data.max_length={max_length}; raise data.max_length"
      )
    ids[i, : len(seq)] = seq
    mask[i, : len(seq)] = 1
  table = np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
  return data.TextClassificationData(ids, mask, labels), table


ENCODE_BATCH = 32


def _encode_all(encode_tiles, pixels: list[np.ndarray]) -> list[np.ndarray]:
  """Each record's table, records of one tile count batched (order kept)."""
  out = [None] * len(pixels)
  by_count: dict[int, list[int]] = {}
  for i, p in enumerate(pixels):
    by_count.setdefault(len(p), []).append(i)
  for members in by_count.values():
    for start in range(0, len(members), ENCODE_BATCH):
      chunk = members[start : start + ENCODE_BATCH]
      batch = np.stack([pixels[i] for i in chunk])
      pad = ENCODE_BATCH - len(chunk)  # one compiled shape per tile count
      if pad:
        batch = np.concatenate([batch, np.zeros((pad,) + batch.shape[1:])])
      tables = encode_tiles(batch.astype(np.float32))
      for j, i in enumerate(chunk):
        out[i] = tables[j]
  return out


class Encoder:
  """The frozen image encoder: records' tiles -> their tables (numpy)."""

  def __init__(self, module: deepseek_vl2.ImageEncoder, params, tiles):
    self.tiles = tiles
    self._apply = jax.jit(lambda p, x: module.apply({"params": p}, x))
    self._params = params

  def __call__(self, pixels_BxTxCxSxS: np.ndarray) -> np.ndarray:
    return np.asarray(self._apply(self._params, jnp.asarray(pixels_BxTxCxSxS)))


def random_encoder(config, hidden_size: int) -> Encoder:
  """The random tower and projector of `vision.random` (seeded by config.seed)."""
  r = config.vision.random
  tower = siglip.SiglipConfig(
      image_size=r.image_size,
      patch_size=r.patch_size,
      width=r.width,
      layers=r.layers,
      heads=r.heads,
      mlp_dim=r.mlp_dim,
  )
  tiles = image_data.TileSpec(
      candidate_resolutions=tuple(tuple(c) for c in r.candidate_resolutions),
      tile=r.image_size,
      patch_size=r.patch_size,
  )
  vl2 = deepseek_vl2.VL2Config(
      vision=tower,
      projector=deepseek_vl2.ProjectorConfig(r.width, hidden_size),
      language=deepseek.DeepseekConfig(
          hidden_size=hidden_size, use_mla=False, num_key_value_heads=16
      ),
      tiles=tiles,
  )
  module = deepseek_vl2.ImageEncoder(vl2)
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 46)
  dummy = jnp.zeros((1, 1, 3, r.image_size, r.image_size))
  params = jax.jit(module.init)(key, dummy)["params"]
  return Encoder(module, params, tiles)


def pretrained_encoder(name: str) -> Encoder:
  module, params, tiles = deepseek_vl2.encoder_from_pretrained(name)
  return Encoder(module, params, tiles)


def _records(config, split: str) -> list[mc.ChoiceRecord]:
  dc, vc = config.data, config.vision
  if dc.task == "shapes":
    n = vc.n_train if split == "train" else vc.n_dev
    return shapes.shapes_task(
        config.seed * 2 + (split != "train"),
        n,
        tile=vc.random.image_size,
        wide_fraction=vc.wide_fraction,
    )
  path = dc.train_path if split == "train" else dc.dev_path
  options = dict(without_image=vc.without_image, max_choices=vc.max_choices)
  if path and Path(path).suffix.lower() in (".jsonl", ".csv"):
    records = mc.read_image_choices(path, **options)
  else:
    spec = IMAGE_TASKS["scienceqa"]
    records = mc.read_scienceqa(path, spec.splits[split], **options)
  limit = dc.train_limit if split == "train" else dc.dev_limit
  return records[:limit] if limit else records


def _tokenizer(config):
  if config.model.name == "random":
    return data.build_word_tokenizer(
        list(shapes.VOCABULARY) + ["context", "?", ":", "."],
        model_max_length=config.data.max_length,
    )
  return data.load_tokenizer(config.model.tokenizer or config.model.name)


def image_run_data(config, task: data.TaskSpec) -> dict[str, Any]:
  """`setup.load_run_data`'s fields for an image task: every training record
  (the caller keeps its host's share), dev, the tokenizer, the image table
  and the LM head's choice-letter rows."""
  tokenizer = _tokenizer(config)
  letter_head = None
  if config.model.name == "random":
    encoder = random_encoder(config, config.model.random.d_model)
    vocab = len(tokenizer)
  else:
    encoder = pretrained_encoder(config.model.name)
    vocab, lm_head = deepseek_vl2.language_head(config.model.name)
    _validate.check(
        len(tokenizer) <= vocab,
        "model.tokenizer",
        f"a tokenizer of at most the model's {vocab} tokens",
        len(tokenizer),
        "use the checkpoint's own tokenizer",
    )
    if lm_head is not None:  # the LM head's rows of ' A', ' B', ...
      letters = mc.choice_letter_ids(tokenizer, task.num_labels)
      letter_head = np.ascontiguousarray(lm_head[letters].T)
  kwargs = dict(max_length=config.data.max_length, vocab_size=vocab)
  train, train_table = encode_records(
      _records(config, "train"),
      tokenizer,
      encoder,
      encoder.tiles,
      first_row=0,
      where="train",
      **kwargs,
  )
  dev, dev_table = encode_records(
      _records(config, "dev"),
      tokenizer,
      encoder,
      encoder.tiles,
      first_row=len(train_table),
      where="dev",
      **kwargs,
  )
  tables = [t for t in (train_table, dev_table) if t.size]
  table = np.concatenate(tables) if tables else None
  return dict(
      train=train,
      dev=dev,
      tokenizer=tokenizer,
      image_table=table,
      letter_head=letter_head,
  )


def with_letter_head(params: dict, run_data) -> dict:
  """The classifier's head set to the LM head's choice-letter rows.

  The head is bias-free (DeepSeek's classifier), so its logits are exactly
  the language model's next-token logits of the letters ' A', ' B', ...
  after the prompt: the pretrained head scores the choices. No-op without
  a pretrained LM head (the random model keeps its fresh head).
  """
  letters = getattr(run_data, "letter_head", None)
  if letters is None:
    return params
  head = dict(params["head"])
  if set(head) != {"kernel"} or head["kernel"].shape != letters.shape:
    raise ValueError(
        f"head: expected a bias-free kernel {letters.shape} to take the LM"
        f" head's letter rows, got {jax.tree.map(np.shape, head)}"
    )
  head["kernel"] = jnp.asarray(letters, head["kernel"].dtype)
  return {**params, "head": head}


def with_image_table(module, params: dict, table: np.ndarray | None):
  """The decoder `module` reading `table` at ids >= its vocab_size."""
  if table is None:
    return module, params
  if not isinstance(module, deepseek.DeepseekDecoder):
    raise ValueError(
        f"model: image tasks need a DeepSeek-MoE language model (DeepSeek-VL2);"
        f" got {type(module).__name__}"
    )
  config = dataclasses.replace(module.config, image_table_size=len(table))
  params = dict(params)
  params["image_table"] = {"embedding": jnp.asarray(table)}
  return type(module)(config), params


def image_backbone(config, run_data):
  """`setup.load_backbone` for an image task: the decoder with its table."""
  mc_ = config.model
  if mc_.name == "random":
    _validate.check(
        mc_.random.family == "deepseek",
        "model.random.family",
        "'deepseek' for an image task (DeepSeek-VL2's language model)",
        mc_.random.family,
        _validate.config_fix("model.random.family", "deepseek"),
    )
    module = hf.backbone_from_sizes(
        "deepseek", mc_.random, len(run_data.tokenizer)
    )
    params = initializers.init_params(module, jax.random.PRNGKey(config.seed))
  else:
    from raptor_jax import models  # pylint: disable=g-import-not-at-top

    module, params = models.from_pretrained(
        mc_.name, dtype=mc_.dtype, language_only=True
    )
  return with_image_table(module, params, run_data.image_table)


# --- export: the whole model in DeepSeek-VL2's layout -------------------------


def write_model(directory, run, params: dict) -> Path:
  """Writes a trained image-task run as a `deepseek_vl_v2` checkpoint.

  The checkpoint `model.name` (config.json, the tower, the projector and the
  layout embeddings: frozen, copied unchanged) with the trained language
  model (every LoRA adapter merged into its kernel, `language.model.*`) and
  its LM head whose rows of the choice letters are the trained classifier
  head, so DeepSeek's own code loads it and its next-token scores of the
  letters are the classifier's logits. The image table (the private
  records' image tokens) is never written. A random model (`:tiny`) has no
  checkpoint to complete and is refused.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  from raptor_jax.models import loading, lora, stack  # pylint: disable=g-import-not-at-top

  name = run.config.model.name
  if name == "random":
    raise ValueError(
        "export: an image task on the random model (:tiny) has no"
        " DeepSeek-VL2 checkpoint to complete; train from a pretrained"
        " deepseek_vl_v2 model.name to export"
    )
  backbone = run.model.backbone
  config = dataclasses.replace(backbone.config, image_table_size=0)
  merged = lora.merge(params["backbone"], config.lora_alpha, config.lora_rank)
  merged.pop("image_table", None)  # private: the records' image tokens
  language = deepseek.HF_NAMES.to_hf(stack.unstack_layers(merged, config))
  tensors = {f"language.{n}": w for n, w in language.items()}
  model_dir, hf = deepseek_vl2.vl2_checkpoint(name)
  frozen = loading.load_tensors(
      model_dir,
      keep=lambda n: not n.startswith("language.")
      or n == "language.lm_head.weight",
  )
  head = np.array(frozen.pop("language.lm_head.weight"), np.float32)
  letters = mc.choice_letter_ids(run.data.tokenizer, run.data.task.num_labels)
  head[letters] = np.asarray(params["head"]["kernel"], np.float32).T
  tensors["language.lm_head.weight"] = head
  tensors.update({n: np.asarray(w, np.float32) for n, w in frozen.items()})
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(
      {n: np.ascontiguousarray(w) for n, w in tensors.items()},
      str(directory / "model.safetensors"),
      metadata={"format": "pt"},
  )
  (directory / "config.json").write_text(json.dumps(hf, indent=2))
  run.data.tokenizer.save_pretrained(str(directory))
  return directory


def model_card(privacy: str, run) -> str:
  """README.md of an exported image-task model (public fields only)."""
  letters = ", ".join(run.data.task.label_names)
  return (
      f"# {run.config.model.name}, fine-tuned with raptor_jax\n\n"
      f"A DeepSeek-VL2 checkpoint in DeepSeek's own layout (load it with"
      f" deepseek-ai/DeepSeek-VL2's code), fine-tuned with"
      f" `{run.config.method}` on the multiple-choice image task"
      f" `{run.data.task.name}`: LoRA on the language model (merged), the"
      f" vision tower and projector unchanged. The prompt is the image, the"
      f" question and the lettered choices, ending in 'Answer:'; the answer"
      f" is the letter ({letters}) with the highest next-token score.\n\n"
      f"## Privacy\n\n{privacy}\n"
  )
