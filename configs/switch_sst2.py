"""RAPTOR on GLUE SST-2 with google/switch-base-8 (the paper's setting).

The same as `configs/glue.py:task=sst2,model=switch,preset=<arg>`.

Paper scale (GPU; downloads the model and GLUE through Hugging Face):

  python launch/main.py --config=configs/switch_sst2.py --workdir=/tmp/raptor_sst2

Local GLUE files instead of the Hub (TSV as GLUE ships them):

  python launch/main.py --config=configs/switch_sst2.py --workdir=/tmp/raptor_sst2 \
    --config.data.train_path=glue/sst2/train.tsv --config.data.dev_path=glue/sst2/dev.tsv \
    --config.data.public_path=calib/imdb/unsup_sample5000.tsv

Embedded offline default (a small random Switch on a generated task; CPU, minutes):

  python launch/main.py --config=configs/switch_sst2.py:tiny --workdir=/tmp/raptor_tiny

`:cpu` is the tiny model size on the real SST-2 files (set the data paths).
Any field can be overridden, e.g. --config.privacy.epsilon=1 --config.method=baseline_a.
"""

from raptor_jax.train.config import glue_config


def get_config(arg: str = ""):
  return glue_config(task="sst2", model="switch", preset=arg)
