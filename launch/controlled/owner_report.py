r"""Owner purity, owner shares and H/log E of every condition (owners.json).

  python launch/controlled/owner_report.py --out=results/controlled/owners.json

Measured on the conditions' generated train records (synthetic, public in
this study) and on their public corpora, with the study's frozen model.
"""

import json
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from raptor_jax.studies import controlled

_CONFIG = config_flags.DEFINE_config_file("config", "configs/controlled.py")
_OUT = flags.DEFINE_string("out", "results/controlled/owners.json", "")


def main(argv):
  del argv
  config = _CONFIG.value
  backbone, _, tokenizer = controlled.pretrained(config.model.name)
  layer = backbone.config.sparse_layers[-1]
  out = {}
  for cond in controlled.CONDITIONS:
    data = controlled.condition_data(config, cond, tokenizer, eval_split="dev")
    out[cond.name] = dict(
        relevance=cond.relevance,
        domain_shares=list(cond.domain_shares),
        layer=layer,
        **controlled.owner_measurements(config, data, layer),
    )
    print(cond.name, json.dumps(out[cond.name]), flush=True)
  Path(_OUT.value).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
  app.run(main)
