r"""Noise-injection sensitivity per relevance level, to choose the study's levels.

  python launch/controlled/relevance_scan.py --config=configs/controlled.py \
    --levels=0,0.25,0.5,0.75,1 --out=results/controlled/relevance_scan.json

For each level (balanced domains) trains RAPTOR at epsilon 8, clip 1, with
the tuning seed on the tuning split (never a grid seed or the dev split) and
measures lambda_e, lambda_s (App. G, Eq. 40) on the generated held-out
records. Prints and writes ONLY the diagnostics and wall times, never an
accuracy: the levels are chosen on these numbers before any grid result.
"""

import json
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from raptor_jax.studies import controlled_data as gen
from raptor_jax.studies import controlled

_CONFIG = config_flags.DEFINE_config_file("config", "configs/controlled.py")
_LEVELS = flags.DEFINE_list("levels", "0,0.25,0.5,0.75,1", "relevance levels")
_OUT = flags.DEFINE_string("out", "results/controlled/relevance_scan.json", "")
TUNE_SEED = 100


def main(argv):
  del argv
  config = _CONFIG.value
  config.method, config.seed = "raptor", TUNE_SEED
  config.privacy.epsilon = 8.0
  config.privacy.clip_shared = config.privacy.clip_expert = 1.0
  _, _, tokenizer = controlled.pretrained(config.model.name)
  cache, owners, out = controlled.StepCache(), {}, []
  for level in map(float, _LEVELS.value):
    cond = controlled.condition_data(
        config,
        controlled.Condition(f"scan{level:g}", level, gen.BALANCED),
        tokenizer,
        eval_split="tune",
    )
    start = time.perf_counter()
    row = controlled.run_cell(
        config, cond, cache, secret_key=f"scan/{level:g}", memo=owners
    )
    ratio = row["lambda_e"] / row["lambda_s"] if row["lambda_s"] else None
    entry = dict(
        relevance=level,
        lambda_e=row["lambda_e"],
        lambda_s=row["lambda_s"],
        lambda_ratio=ratio,
        delta_loss=row["delta_loss"],
        M_role=row["M_role"],
        seconds=time.perf_counter() - start,
    )
    print(json.dumps(entry), flush=True)
    out.append(entry)
  Path(_OUT.value).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
  app.run(main)
