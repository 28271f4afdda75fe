r"""Writes the controlled study's model: the pretrained Switch, router refit.

  python launch/controlled/fit_router.py --pretrained=runs/controlled/pretrain/model \
    --public=runs/controlled/public_pretrain.txt --out=results/controlled/model

Copies the pretrained model directory and replaces the router kernel of its
sparse layer with `raptor_jax.pretrain.router_fit.fit` on the public texts
(one per line); writes `router_fit.json` (the report and the sha256 of the
weights) next to it.
"""

import hashlib
import json
import shutil
from pathlib import Path

from absl import app, flags
import numpy as np
from safetensors.numpy import load_file, save_file

from raptor_jax import data, models
from raptor_jax.pretrain import router_fit

_PRETRAINED = flags.DEFINE_string("pretrained", None, "pretrained model dir")
_PUBLIC = flags.DEFINE_string("public", None, "public texts, one per line")
_OUT = flags.DEFINE_string("out", None, "output model dir")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 32, "tokens per text")
flags.mark_flags_as_required(["pretrained", "public", "out"])


def main(argv):
  del argv
  backbone, params = models.from_pretrained(_PRETRAINED.value, dtype="float32")
  tokenizer = data.load_tokenizer(_PRETRAINED.value)
  texts = Path(_PUBLIC.value).read_text().splitlines()
  ids, mask = data.tokenize(tokenizer, texts, max_length=_MAX_LENGTH.value)
  (layer,) = backbone.config.sparse_layers[-1:]
  kernel, report = router_fit.fit(backbone, params, ids, mask, layer)
  out = Path(_OUT.value)
  if out.exists():
    shutil.rmtree(out)
  shutil.copytree(_PRETRAINED.value, out)
  weights = out / "model.safetensors"
  tensors = load_file(weights)
  name = f"encoder.block.{layer}.layer.1.mlp.router.classifier.weight"
  if name not in tensors:
    raise ValueError(f"{weights} has no router tensor {name}")
  tensors[name] = np.ascontiguousarray(kernel.T.astype(np.float32))
  save_file(tensors, weights, metadata={"format": "pt"})
  report["sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
  report["public_texts"] = str(_PUBLIC.value)
  (out / "router_fit.json").write_text(json.dumps(report, indent=2))
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  app.run(main)
