"""Reading a Hugging Face checkpoint's files, and filling in what it lacks.

The family-independent primitives under `hf.from_pretrained` and
`deepseek_vl2.from_pretrained`: locate a checkpoint (a local directory or a
Hub snapshot), read its `config.json` and float32 tensors, and merge them
into a module's parameter tree, drawing only the adapters the checkpoint
lacks (never a silent random base weight).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from raptor_jax import roles
from raptor_jax.models import initializers

Params = Mapping[str, Any]

_WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")


# ---------------------------------------------------------------------------
# Locating a checkpoint.


def resolve_model_dir(path_or_hub_id: str | os.PathLike) -> Path:
  """A local directory with config.json, downloading from the Hub if needed."""
  path = Path(path_or_hub_id).expanduser()
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise FileNotFoundError(
          f"{path} has no config.json; point at a directory written "
          "by save_pretrained (config.json + *.safetensors)"
      )
    return path
  name = str(path_or_hub_id)
  if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
    raise FileNotFoundError(f"model directory {name!r} does not exist")
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top

  try:
    return Path(snapshot_download(name, allow_patterns=list(_WEIGHT_PATTERNS)))
  except (
      Exception
  ) as e:  # Offline, not cached, gated or missing: one clear line.
    raise OSError(
        f"cannot load model {name!r} from the Hugging Face Hub ({type(e).__name__}); "
        f"the Hub is unreachable or the model is not cached (HF_HUB_OFFLINE="
        f"{os.environ.get('HF_HUB_OFFLINE', '0')}). Download it where you have internet "
        f"(`huggingface-cli download {name}`) or pass a local directory holding "
        "config.json and *.safetensors"
    ) from None


def read_config(model_dir: Path) -> dict[str, Any]:
  return json.loads((model_dir / "config.json").read_text())


def load_tensors(
    model_dir: Path, keep: Callable[[str], bool]
) -> dict[str, np.ndarray]:
  """Reads the float32 tensors whose names pass `keep` from `*.safetensors`."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  files = sorted(model_dir.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(
        f"{model_dir} holds no *.safetensors weights; re-save the model with "
        "save_pretrained(..., safe_serialization=True)"
    )
  tensors = {}
  for file in files:
    with safe_open(str(file), framework="flax") as f:
      for name in f.keys():
        if keep(name):
          tensors[name] = np.asarray(f.get_tensor(name).astype(jnp.float32))
  return tensors


# ---------------------------------------------------------------------------
# Parameter trees.


def merge_params(initialised: Params, pretrained: Params) -> dict:
  """Overlays `pretrained` leaves onto a freshly initialised tree.

  Leaves only in `initialised` (LoRA adapters, heads) keep their initial
  values; every pretrained leaf must exist with the same shape.
  """
  init_flat = flax.traverse_util.flatten_dict(
      flax.core.unfreeze(initialised), sep="/"
  )
  for path, value in flax.traverse_util.flatten_dict(
      flax.core.unfreeze(pretrained), sep="/"
  ).items():
    if path not in init_flat:
      raise ValueError(f"pretrained parameter {path} has no place in the model")
    if tuple(init_flat[path].shape) != tuple(value.shape):
      raise ValueError(
          f"pretrained parameter {path} has shape {tuple(value.shape)}, "
          f"the model expects {tuple(init_flat[path].shape)}"
      )
    init_flat[path] = jnp.asarray(value, init_flat[path].dtype)
  return flax.traverse_util.unflatten_dict(init_flat, sep="/")


def init_missing(
    module: nn.Module,
    pretrained: Params,
    key: jax.Array,
    is_new: Callable[[str], bool] = roles.is_adapter,
) -> dict:
  """Initialises only the adapter parameters that `pretrained` lacks, then merges.

  The new leaves are drawn by `initializers.draw` from the module's own
  initializers (one source of truth), without compiling the forward pass.
  Any other parameter missing from the checkpoint (`is_new(path)` False) is an
  error, never a silent random initialisation. `pretrained` is in the
  module's layout (`stack.stack_layers` of a per-layer tree).
  """
  flatten = lambda tree: flax.traverse_util.flatten_dict(
      flax.core.unfreeze(tree), sep="/"
  )
  known = set(flatten(pretrained))
  shapes = initializers.abstract_params(module)
  absent = [p for p in shapes if p not in known and not is_new(p)]
  if absent:
    raise ValueError(
        f"checkpoint lacks {len(absent)} model parameters, e.g. {absent[0]}"
    )
  fresh = initializers.draw(
      {p: s for p, s in shapes.items() if p not in known}, key
  )
  return merge_params(
      flax.traverse_util.unflatten_dict({**shapes, **fresh}, sep="/"),
      pretrained,
  )
