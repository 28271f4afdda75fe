"""The controlled study (`results/controlled`): one config for every cell.

Fine-tunes the small Switch pretrained on the generator's PUBLIC text
(`results/controlled/README.md`, section 1) on `raptor_jax.studies.controlled_data`
records. The study runner sets the method, epsilon, seed and clip of each
cell and the condition's data; everything else is fixed here, so every cell
shares Poisson sampling, the budget, the step count and the compiled steps:

  python launch/controlled_study.py --config=configs/controlled.py \
    --results_dir=results/controlled

`:tiny` shrinks the data and the steps for tests (seconds per run).
"""

import ml_collections

from raptor_jax.train.config import base_config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  config = base_config()
  config.model.name = "results/controlled/model"
  config.model.lora_rank = 4
  config.model.lora_alpha = 8.0
  config.data.task = "controlled"
  config.data.max_length = 32
  config.data.n_pub = 1000
  config.data.synthetic.label_noise = 0.05
  config.batch_size = 100
  config.microbatch_size = 128
  config.epochs = 1
  config.learning_rate = 1e-2
  config.eval_batch_size = 500
  config.progress_bar = False
  # The study's own sizes (records of each split; see PROTOCOL.md).
  config.study = ml_collections.ConfigDict()
  config.study.n_train = 2000
  config.study.n_tune = 1000  # held-out records for clip tuning (own seed)
  config.study.n_dev = 1000  # evaluation records (own seed)
  config.study.diagnostic_records = 256  # dev records of the App. G diagnostics
  config.study.sensitivity_std = 1e-2  # s of lambda_+ (1e-3: float32 floor)
  config.study.sensitivity_draws = 2  # antithetic pairs per role
  if arg == "tiny":
    config.study.n_train = 1000
    config.study.n_tune = 200
    config.study.n_dev = 300
    config.study.diagnostic_records = 200
    config.batch_size = 50
    config.microbatch_size = 64
    config.epochs = 1
  elif arg:
    raise ValueError(f"unknown preset {arg!r}; use '' or 'tiny'")
  return config
