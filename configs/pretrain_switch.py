"""Pretrains a small Switch encoder (masked LM) on public text.

Default: d_model 256, 4 blocks (2 sparse, E=8), WordPiece 8192, on WikiText-2
train + IMDb unsup, decontaminated against SST-2 train/dev (local copies):

  python launch/pretrain.py --config=configs/pretrain_switch.py --workdir=/tmp/pt_switch \
    --config.corpus.local_dir=../shared/data/pretrain \
    --config.decontaminate.train_path=../shared/data/glue/sst2/train.tsv \
    --config.decontaminate.dev_path=../shared/data/glue/sst2/dev.tsv

Online, leave the paths empty and the corpora and GLUE come from the Hub.
`:tiny` pretrains a micro model on generated text in under a minute, offline:

  python launch/pretrain.py --config=configs/pretrain_switch.py:tiny --workdir=/tmp/pt_tiny

The model lands in <workdir>/model (save_pretrained format with the
tokenizer); fine-tune it with --config.model.name=<workdir>/model.
"""

from raptor_jax.pretrain.config import base_config, with_preset


def get_config(arg: str = ""):
  return with_preset(base_config("switch"), arg)
