"""Flax parameters -> a Hugging Face `save_pretrained` directory.

The inverse of `hf.from_pretrained`: writes `config.json` (through the
transformers config class, so transformers reads it as its own) and
`model.safetensors` in the layout `save_pretrained` uses, so that both
`transformers` (`SwitchTransformersEncoderModel`, `OlmoeForCausalLM`,
`DeepseekV2ForCausalLM`, or `DeepseekV2ForSequenceClassification` with a
`score`) and `models.from_pretrained` load the directory.
Adapters are not exported: merge or drop them first. The tensor names come
from each family's name table (`switch.HF_NAMES`, `olmoe.HF_NAMES`,
`deepseek.HF_NAMES`), the one the loader reads too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from raptor_jax.models import deepseek, hf, olmoe, stack, switch
from raptor_jax.models import family as family_lib


def exporter(module) -> family_lib.Family:
  """The family entry that writes `module` (its name table and config)."""
  entry = family_lib.find(
      (f for f in hf.FAMILIES.values() if f.hf_config is not None), module
  )
  if entry is None:
    raise ValueError(
        f"cannot export {type(module).__name__}; export a SwitchEncoder, an "
        "OlmoeDecoder or a DeepseekDecoder"
    )
  return entry


def save_pretrained(
    module,
    params: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    lm_head: np.ndarray | None = None,
    score: np.ndarray | None = None,
    tokenizer=None,
    hf_config_extra: Mapping[str, Any] | None = None,
) -> Path:
  """Writes a backbone (and optionally its LM head and tokenizer) in HF format.

  Args:
    module: a `SwitchEncoder`, `OlmoeDecoder` or (MLA) `DeepseekDecoder`
      (its config is written).
    params: the backbone's parameters, without adapters, in `module`'s
      layout (scanned segments are written per layer, as Hugging Face
      names them).
    directory: created if needed; existing files are overwritten.
    lm_head: decoders only: the output projection, Flax layout [D, V]
      (`lm_head.weight`). Switch's masked-LM head is tied to the embedding.
    score: DeepSeek only: a classifier's bias-free head, Flax layout [D, K]
      (`score.weight` of `DeepseekV2ForSequenceClassification`; name that
      class in `hf_config_extra['architectures']`).
    tokenizer: saved into the same directory when given.
    hf_config_extra: extra fields of the transformers config (token ids,
      router loss coefficients, ...).

  Returns:
    The directory.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  extra = dict(hf_config_extra or {})
  entry = exporter(module)
  hf_config = entry.hf_config(module.config, **extra)
  tensors = entry.names.to_hf(stack.unstack_layers(params, module.config))
  for head, kernel in (("lm_head", lm_head), ("score", score)):
    if kernel is None:
      continue
    if head not in entry.heads:
      raise ValueError(
          f"{head}: a {type(module).__name__} exports no {head} head"
          f" ({entry.head_note}); pass none"
      )
    tensors[f"{head}.weight"] = family_lib.LINEAR.save(kernel)
  hf_config.save_pretrained(directory)
  tmp = directory / "model.safetensors.tmp"
  save_file(tensors, str(tmp), metadata={"format": "pt"})
  tmp.replace(directory / "model.safetensors")
  if tokenizer is not None:
    tokenizer.save_pretrained(directory)
  return directory
