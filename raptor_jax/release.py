"""Release the model, not the run: a trained workdir -> a directory to publish.

A run's workdir is private. Its checkpoints hold the secret seed of the
Poisson samples and of the noise and the noise transforms' PRNG keys (with
them an adversary could regenerate and subtract the noise), and its reports
hold wall time and counts. `export` writes only what the DP guarantee lets a
user publish: the trained parameters are a post-processing of the noisy
releases, so they carry the run's (epsilon, delta); the tokenizer and the
architecture are public inputs; the privacy card holds public parameters of
the mechanism and the epsilon its accountant computed.

The export directory:

  config.json, model.safetensors   the backbone in `save_pretrained` format,
      every LoRA adapter merged into its kernel (W + (alpha / r) A B), so
      `transformers` loads it as `SwitchTransformersEncoderModel` (Switch),
      `OlmoeModel` (OLMoE) or `DeepseekV2ForSequenceClassification`
      (DeepSeek, MLA attention: the whole classifier, head included, so
      `AutoModelForSequenceClassification` and `pipeline` load it);
      `id2label` names the classes.
  tokenizer files                  the tokenizer the run used (a pretrained
      one, the synthetic task's generated vocabulary or the public corpus's
      words: never built from private records).
  classification_head.safetensors  Switch and OLMoE (transformers 5 has no
      sequence-classification class for either), and DeepSeek with mean
      pooling: `weight` [num_labels, D] and `bias` [num_labels] (torch
      `nn.Linear` layout); its metadata names the `pooling`: 'mean' (masked
      mean of the final hidden states, encoders) or 'last' (the last
      non-padding token, decoders; right padding).
  README.md                        the model card: base model, task, labels,
      the guarantee in words, the privacy unit, the library version and an
      inference snippet (`INFERENCE`, plain transformers + torch).
  privacy_card.json                (epsilon, delta), the accountant, the
      sample rate, the steps, the noise multipliers and clip norms per stream
      (each field only where the method has it), and `record_count`, which
      says that n is treated as public.

The record count n is public, not hidden: the sample rate q = B/n and the
default delta = 1/n^1.1 are functions of it (either gives n back), and the
accountant takes them as public parameters, as DP-SGD accounting does. The
guarantee covers whether any one record was in the data, given n.

An image task (`raptor_jax.vision`, DeepSeek-VL2) is written in DeepSeek-VL2's
own layout instead (`vision.write_model`): the checkpoint's config.json,
frozen tower and projector, the merged language model and the LM head with
the trained letter rows; its records' image table is never written.

Nothing else: no secret, no noise key, no optimizer state, no wall time or
timestamp, no batch size, no owner map or per-expert statistic, no metric of
the private data.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from raptor_jax import models, vision
from raptor_jax.models import export as hf_export
from raptor_jax.models import hf, lora
from raptor_jax.train import step
from raptor_jax.train.checkpoint import Checkpointer
from raptor_jax.train.run import Run, build_run

CARD = "privacy_card.json"
HEAD = "classification_head.safetensors"
MODEL_CARD = "README.md"

# The model card's inference code: transformers + torch + numpy only. The
# backbone class is the one config.json names (`architectures`); the head
# reads the backbone's final hidden states pooled as the run pooled them.
INFERENCE = """\
import numpy as np
import torch
import transformers
from safetensors import safe_open

DIR = {directory!r}  # this directory (its path, from where you run this)
tokenizer = transformers.AutoTokenizer.from_pretrained(DIR)
config = transformers.AutoConfig.from_pretrained(DIR)
backbone = getattr(transformers, config.architectures[0])
model = backbone.from_pretrained(DIR).eval()
with safe_open(f"{{DIR}}/classification_head.safetensors", "np") as f:
  pooling = f.metadata()["pooling"]
  weight, bias = f.get_tensor("weight"), f.get_tensor("bias")


def predict(texts):
  batch = tokenizer(texts, padding=True, truncation=True,
                    max_length={max_length}, return_tensors="pt")
  with torch.no_grad():
    hidden = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).last_hidden_state
  hidden = hidden.float().numpy()
  mask = batch["attention_mask"].numpy().astype(np.float32)
  if pooling == "mean":  # the mean over real tokens (encoders)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  else:  # "last": the last real token (decoders, right padding)
    last = mask.sum(1).astype(int) - 1
    pooled = hidden[np.arange(len(texts)), last]
  logits = pooled @ weight.T + bias
  return [config.id2label[int(i)] for i in logits.argmax(-1)]


print(predict({examples!r}))
"""
# The same for an export in a transformers sequence-classification class.
INFERENCE_CLASSIFIER = """\
import transformers

DIR = {directory!r}  # this directory (its path, from where you run this)
classifier = transformers.pipeline("text-classification", model=DIR)


def predict(texts):
  return [out["label"] for out in classifier(texts, truncation=True,
                                             max_length={max_length})]


print(predict({examples!r}))
"""
# The transformers class of each backbone (the head is exported apart).
_ARCHITECTURES = {
    f.backbone: f.hf_backbone_class
    for f in hf.FAMILIES.values()
    if f.hf_backbone_class
}
# What the card says about n (see the module docstring).
RECORD_COUNT = (
    "treated as public: the sample rate q = B/n and the default delta ="
    " 1/n^1.1 are functions of n (either gives it back), and the accountant"
    " takes them as public parameters; the guarantee hides whether one record"
    " was added or removed, not n"
)
# Fields of a privacy report that the card copies where the method has them.
_OPTIONAL_FIELDS = ("target_epsilon", "rho", "sigma_shared", "sigma_expert")


def _check_out(out: Path) -> None:
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(
        f"--out {out} is not an empty directory; export into a new or empty one"
    )


def _run_config(workdir: Path) -> ml_collections.ConfigDict:
  """The config the run in `workdir` was trained with (its config.json)."""
  path = workdir / "config.json"
  if not path.is_file() or not (workdir / "checkpoints").is_dir():
    raise FileNotFoundError(
        f"{workdir} holds no trained run (config.json and checkpoints/); "
        "train there first with launch/main.py --workdir"
    )
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def _finished_report(workdir: Path, cycle: int) -> dict:
  """privacy_report.json of a finished run whose last checkpoint is `cycle`."""
  path = workdir / "privacy_report.json"
  report = json.loads(path.read_text()) if path.is_file() else {}
  if not report.get("finished") or report.get("cycles") != cycle:
    raise ValueError(
        f"{workdir}: the latest checkpoint (cycle {cycle}) is not the end of "
        f"a finished run ({path.name}: {report.get('cycles')} of "
        f"{report.get('planned_cycles')} cycles); finish it (rerun "
        "launch/main.py with the same --workdir), then export"
    )
  return report


def trained_model(workdir: str | os.PathLike) -> tuple[Run, dict, dict]:
  """(run, trained classifier parameters, privacy report) of a finished run.

  Rebuilds the run from its config.json as the trainer does (the owner map
  is computed for the dev split only) and reads only the trainable
  parameters of the latest checkpoint: its optimizer states (noise keys) are
  never loaded; its metadata is read for the cycle and the format check.

  Raises:
    FileNotFoundError: no trained run in `workdir`.
    ValueError: the run is not finished, or its report is stale.
  """
  workdir = Path(workdir).expanduser().resolve()
  config = _run_config(workdir)
  checkpointer = Checkpointer(workdir, config)
  try:
    meta = checkpointer.restore_meta()
    if meta is None:
      raise FileNotFoundError(
          f"{workdir}/checkpoints holds no checkpoint; train there first"
      )
    report = _finished_report(workdir, int(meta["cycle"]))
    run = _rebuilt_run(config, workdir)
    if run.plan.cycles != report["cycles"]:
      raise ValueError(
          f"{workdir}: {report['cycles']} cycles ran but the config plans "
          f"{run.plan.cycles}; export from the workdir of a finished run"
      )
    abstract = jax.tree.map(np.asarray, run.trainable)
    trainable = checkpointer.restore_subtree({"trainable": abstract})
  finally:
    checkpointer.close()
  params = step.merged_params(run.frozen, trainable["trainable"])
  return run, params, report


def _rebuilt_run(config: ml_collections.ConfigDict, workdir: Path) -> Run:
  """`build_run` of the run's config.json, its errors in export's terms.

  A training error names a `--config.*` flag, which export does not have:
  export reads the workdir's config.json (its data paths resolved when the
  run started), so the fix is to restore what it names, or edit that file.
  """
  try:
    return build_run(config, owner_records="dev")
  except (ValueError, FileNotFoundError) as e:
    message = re.sub(r";? ?(set|declare) [^;]*--config[^;]*$", "", str(e))
    message = message.replace("--config.", "")
    raise type(e)(
        f"{message}; export rebuilds the run from {workdir}/config.json:"
        " restore what it names (the data where the run read it), or edit"
        f" that file, then rerun launch/export.py --workdir={workdir}"
    ) from None


def privacy_card(report: dict) -> dict[str, Any]:
  """The publishable part of a privacy report: the guarantee and its mechanism.

  Per stream (RAPTOR: `shared` and `expert`; the monolithic methods: `all`)
  the noise multiplier, the clip norm and the number of noisy steps; the
  sample rate, delta, epsilon and the accountant; `target_epsilon`, `rho`
  and `sigma_shared` / `sigma_expert` only where the report has them (a
  field that does not apply to a method is absent, not filled in). Left
  out: the batch size, wall time, the ledger's layout, the secret. The
  record count is public (`record_count` says so; see the module doc).
  """
  private = bool(report["private"])
  streams = {
      name: dict(
          noise_multiplier=part["noise_multiplier"],
          l2_clip=part["l2_clip"],
          steps=report["cycles"],
      )
      for name, part in report["parts"].items()
  }
  card = dict(
      method=report["method"],
      private=private,
      guarantee=(
          "(epsilon, delta)-DP for the addition or removal of one training "
          "record, the record count n treated as public; the model is a "
          "post-processing of the noisy updates"
          if private
          else "none: this method trains without differential privacy"
      ),
      epsilon=report["epsilon"],
      delta=report["delta"],
      accountant=report["accountant"],
      sampling="Poisson",
      sample_rate=report["sample_rate"],
      steps=report["cycles"],
      record_count=RECORD_COUNT,
      streams=streams,
      expert_layer=report["expert_layer"],
  )
  card.update({k: report[k] for k in _OPTIONAL_FIELDS if k in report})
  return card


def _head_tensors(params: dict) -> dict[str, np.ndarray]:
  head = params["head"]
  return dict(
      weight=np.ascontiguousarray(np.asarray(head["kernel"], np.float32).T),
      bias=np.asarray(head["bias"], np.float32),
  )


def write_model(
    directory: str | os.PathLike,
    model: models.SequenceClassifier,
    params: dict,
    tokenizer,
    label_names: Sequence[str],
) -> Path:
  """Writes a classifier as transformers loads it: merged backbone + head.

  Args:
    directory: created if needed.
    model: the run's classifier (backbone with its adapters, pooling, head).
    params: its parameters (`backbone/...` with adapters, `head/...`).
    tokenizer: saved alongside (None: none).
    label_names: class names, written as the config's `id2label`.

  Returns:
    The directory.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  directory = Path(directory)
  backbone = model.backbone
  config = backbone.config
  if getattr(config, "image_table_size", 0):
    # The table holds the private records' image features (raptor_jax.vision).
    raise ValueError(
        "write_model: this model holds its records' image table (an image"
        " task), which must never be published; export image-task runs with"
        " release.export (raptor_jax.vision.write_model)"
    )
  merged = lora.merge(params["backbone"], config.lora_alpha, config.lora_rank)
  classifier = hf.sequence_classification_class(backbone, model.pooling)
  extra = dict(
      architectures=[classifier or _ARCHITECTURES[type(backbone)]],
      id2label={i: str(name) for i, name in enumerate(label_names)},
      label2id={str(name): i for i, name in enumerate(label_names)},
  )
  if classifier is not None:
    if "bias" in params["head"]:
      raise ValueError(
          f"head: {classifier} has a bias-free score, but this head has a"
          " bias (trained before raptor_jax dropped it); retrain to export"
      )
    if tokenizer is not None and tokenizer.pad_token_id is not None:
      # transformers pools the last token that is not padding.
      extra["pad_token_id"] = int(tokenizer.pad_token_id)
  hf_export.save_pretrained(
      backbone,
      merged,
      directory,
      score=None if classifier is None else params["head"]["kernel"],
      tokenizer=tokenizer,
      hf_config_extra=extra,
  )
  if classifier is None:
    save_file(
        _head_tensors(params),
        str(directory / HEAD),
        metadata={"format": "pt", "pooling": model.pooling},
    )
  return directory


def _in_words(card: dict) -> str:
  """The guarantee of `card` in a sentence a reader can check."""
  if not card["private"]:
    return (
        "None. This model was trained WITHOUT differential privacy"
        f" (method {card['method']!r}); treat it as the training data."
    )
  epsilon, delta = card["epsilon"], card["delta"]
  return (
      f"({epsilon:.3g}, {delta:.3g})-differential privacy: adding or removing"
      " any one training record changes the probability of any outcome of"
      f" training (this model, and anything computed from it) by at most a"
      f" factor of e^{epsilon:.3g} = {math.exp(epsilon):.3g}, except with"
      f" probability {delta:.3g}."
  )


def model_card(card: dict, run: Run, directory: Path) -> str:
  """README.md of an export: what the model is, its guarantee, how to use it.

  Public only: the config's model name, task and label names, and the
  privacy card's public parameters (no metric of the private data).
  """
  import raptor_jax  # pylint: disable=g-import-not-at-top

  config = run.config
  task = run.data.task
  base = (
      f"a randomly initialised {type(run.model.backbone).__name__} (no"
      " pretrained weights)"
      if config.model.name == "random"
      else config.model.name
  )
  source = config.data.get("hub_dataset") or (
      "a local file" if config.data.train_path else task.hub_id or "generated"
  )
  classifier = hf.sequence_classification_class(
      run.model.backbone, run.model.pooling
  )
  code = (INFERENCE if classifier is None else INFERENCE_CLASSIFIER).format(
      # The directory's name, not the path it was exported to: the card
      # travels with the model, and an absolute path names the exporter's
      # machine (and goes stale once the directory moves).
      directory=directory.name,
      max_length=int(config.data.max_length),
      examples=["an example text", "another example text"],
  )
  labels = ", ".join(f"{i} `{n}`" for i, n in enumerate(task.label_names))
  return f"""# {task.name} classifier, fine-tuned with differential privacy

- **Base model:** {base}
- **Task:** {task.name} ({source}), {task.num_labels} labels: {labels}
- **Method:** {card['method']} (raptor_jax {raptor_jax.__version__})
- **Guarantee:** {_in_words(card)}
- **Privacy unit:** one training record (one row of the training data). The
  number of training records n is treated as public.
- **Accountant:** {card['accountant']}; Poisson sampling at rate
  {card['sample_rate']:.4g}, {card['steps']} noisy steps. Every parameter of
  the mechanism is in `privacy_card.json`.

## Use it

{_use_it(run, classifier)}

```python
{code}```
"""


def _use_it(run: Run, classifier: str | None) -> str:
  if classifier is not None:
    return (
        f"The whole classifier loads in `transformers` ({classifier}):"
        " `AutoModelForSequenceClassification.from_pretrained` or"
        " `pipeline('text-classification')` on this directory."
    )
  return (
      f"The backbone loads in `transformers` ({config_architecture(run)}); the"
      " classification head is `classification_head.safetensors` (weight"
      " [num_labels, hidden], bias [num_labels]) over the backbone's final"
      " hidden states, pooled as its metadata says."
  )


def config_architecture(run: Run) -> str:
  backbone = run.model.backbone
  return (
      hf.sequence_classification_class(backbone, run.model.pooling)
      or _ARCHITECTURES[type(backbone)]
  )


def export(workdir: str | os.PathLike, out: str | os.PathLike) -> Path:
  """Writes the trained model of the finished run in `workdir` to `out`.

  `out` must not exist or be empty. It is written in a sibling temporary
  directory and renamed, so it is either complete or absent.

  Returns:
    `out`, holding only publishable files (see the module docstring).

  Raises:
    FileNotFoundError: no trained run in `workdir`.
    ValueError: `out` is not empty, or the run is not finished.
  """
  out = Path(out).expanduser().resolve()
  _check_out(out)
  run, params, report = trained_model(workdir)
  tmp = out.parent / f".{out.name}.export-{os.getpid()}"
  image_task = vision.is_image_task(run.config.data.task)
  try:
    if image_task:  # DeepSeek-VL2's own layout, the image table left out
      vision.write_model(tmp, run, params)
    else:
      write_model(
          tmp, run.model, params, run.data.tokenizer, run.data.task.label_names
      )
    card = privacy_card(report)
    (tmp / CARD).write_text(json.dumps(card, indent=2, sort_keys=True))
    (tmp / MODEL_CARD).write_text(
        vision.model_card(_in_words(card), run)
        if image_task
        else model_card(card, run, out)
    )
    _check_out(out)
    if out.exists():
      out.rmdir()
    tmp.rename(out)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  return out
