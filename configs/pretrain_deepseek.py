"""Pretrains a small DeepSeek-MoE decoder (causal LM) on public text.

MLA attention, a dense first block, then sparse blocks with 8 routed experts
(top-2) and 2 always-active shared experts; the router trains with
DeepSeek-V2's sequence-wise expert-level balance loss (coefficient 0.001).

  python launch/pretrain.py --config=configs/pretrain_deepseek.py --workdir=/tmp/pt_deepseek \
    --config.corpus.local_dir=../shared/data/pretrain \
    --config.decontaminate.dev_path=../shared/data/glue/sst2/dev.tsv

`:tiny` pretrains a micro DeepSeek-MoE on generated text in under a minute,
offline. The exported directory loads in `transformers.DeepseekV2ForCausalLM`
and in `configs/deepseek_sst2.py:small` (`--config.model.name=<workdir>/model`).
"""

from raptor_jax.pretrain.config import base_config, with_preset


def get_config(arg: str = ""):
  config = base_config("deepseek")
  config.model.update(
      num_layers=4,
      d_ff=256,
      num_experts=8,
      top_k=2,
      num_shared_experts=2,
      first_k_dense=1,
  )
  return with_preset(config, arg)
