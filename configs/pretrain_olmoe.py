"""Pretrains a small OLMoE decoder (causal LM) on public text.

  python launch/pretrain.py --config=configs/pretrain_olmoe.py --workdir=/tmp/pt_olmoe \
    --config.corpus.local_dir=../shared/data/pretrain \
    --config.decontaminate.dev_path=../shared/data/glue/sst2/dev.tsv

`:tiny` pretrains a micro OLMoE on generated text in under a minute, offline.
"""

from raptor_jax.pretrain.config import base_config, with_preset


def get_config(arg: str = ""):
  config = base_config("olmoe")
  config.model.update(num_layers=4, d_ff=512, num_experts=8, top_k=2)
  return with_preset(config, arg)
