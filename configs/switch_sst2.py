"""RAPTOR on GLUE SST-2 with google/switch-base-8 (the paper's setting).

Paper scale (GPU; downloads the model and GLUE through Hugging Face):

  python launch/main.py --config=configs/switch_sst2.py --workdir=/tmp/raptor_sst2

Local GLUE files instead of the Hub (TSV as GLUE ships them):

  python launch/main.py --config=configs/switch_sst2.py --workdir=/tmp/raptor_sst2 \
    --config.data.train_path=glue/sst2/train.tsv --config.data.dev_path=glue/sst2/dev.tsv \
    --config.data.public_path=imdb/unsup_sample5000.tsv

Embedded offline default (a small random Switch on a generated task; CPU, minutes):

  python launch/main.py --config=configs/switch_sst2.py:tiny --workdir=/tmp/raptor_tiny

`:cpu` keeps real SST-2 files but uses the tiny model size (set the data paths).
Any field can be overridden, e.g. --config.privacy.epsilon=1 --config.method=baseline_a.
"""

from raptor_jax.train.config import base_config


def tiny(config):
  """A small randomly initialised Switch on the embedded offline task."""
  config.model.name = "random"
  config.model.lora_rank = 4
  config.model.lora_alpha = 8.0
  config.data.task = "synthetic"
  config.data.max_length = 32
  config.data.public_corpus = "synthetic"  # the task's own disjoint public corpus
  config.data.n_pub = 1000
  config.batch_size = 250
  config.microbatch_size = 64
  config.epochs = 6
  config.learning_rate = 3e-3
  config.eval_batch_size = 250
  config.log_every_cycles = 5
  config.checkpoint_every_cycles = 50
  return config


def cpu(config):
  """The tiny model size on a real GLUE task (set data paths; IMDb as public corpus)."""
  config = tiny(config)
  config.data.task = "sst2"
  config.data.max_length = 64
  config.data.public_corpus = "imdb"
  config.model.tokenizer = "public-words"  # word-level vocabulary from the PUBLIC corpus only
  return config


def get_config(arg: str = ""):
  config = base_config()
  config.data.task = "sst2"
  config.data.public_corpus = "imdb"
  if arg == "tiny":
    return tiny(config)
  if arg == "cpu":
    return cpu(config)
  if arg:
    raise ValueError(f"unknown preset {arg!r}; use '', 'tiny' or 'cpu'")
  return config
