"""RAPTOR on a GLUE task: `configs/glue.py:task=...,model=...,preset=...`.

The argument is comma-separated key=value pairs (big_vision style):

  task    sst2 (default) | qnli | qqp | mnli; the public corpus of layer
          selection is the paper's pairing (`raptor_jax.data.TASK_CORPUS`):
          IMDb unsupervised reviews, SQuAD contexts, PAWS-Wiki sentence pairs,
          ANLI R2 premises and hypotheses.
  model   switch (default; google/switch-base-8, the paper's setting) |
          olmoe (allenai/OLMoE-1B-7B-0924, Tab. 2: E=64, top-8, bf16
          activations; the classifier reads the last non-padding token) |
          deepseek (deepseek-ai/deepseek-vl2-tiny's language model: 64 routed
          experts, top-6, 2 shared experts, a dense first block; shared
          experts see every token, so their adapters train in the shared
          stream with the attention adapters and the head (clip C_s): only
          the routed experts of l* form the expert stream, and only the
          routed gates decide owners) |
          qwen3_moe (Qwen/Qwen3-30B-A3B: E=128, top-8) |
          qwen2_moe (Qwen/Qwen1.5-MoE-A2.7B: E=60, top-4, a gated shared
          expert that trains in the shared stream) |
          mixtral (mistralai/Mixtral-8x7B-v0.1: E=8, top-2); the decoder
          kit's families read the last non-padding token
  preset  empty (default; paper scale) | tiny (embedded offline task, a small
          random model; CPU, minutes) | cpu (the tiny model size on the real
          task's files) | small (a small pretrained model from
          launch/pretrain.py on the real task's files; for qnli: max
          length 128, the first 8,000 train records, the last 1,999 held out)

Paper scale (GPU; downloads the model and GLUE through Hugging Face):

  python launch/main.py --config=configs/glue.py:task=sst2 --workdir=/tmp/raptor_sst2

Local GLUE files instead of the Hub (TSV as GLUE ships them):

  python launch/main.py --config=configs/glue.py:task=sst2 --workdir=/tmp/raptor_sst2 \
    --config.data.train_path=glue/sst2/train.tsv --config.data.dev_path=glue/sst2/dev.tsv \
    --config.data.public_path=calib/imdb/unsup_sample5000.tsv

Embedded offline default (a small random OLMoE, 8 experts, top-2):

  python launch/main.py --config=configs/glue.py:task=mnli,model=olmoe,preset=tiny \
    --workdir=/tmp/raptor_olmoe_tiny

`configs/{switch,olmoe,deepseek}_{sst2,qnli,qqp,mnli}.py:<preset>` name the
same configs.
Any field can be overridden, e.g. --config.privacy.epsilon=1 --config.method=baseline_a.
"""

from raptor_jax.train.config import glue_config, parse_arg


def get_config(arg: str = ""):
  return glue_config(**parse_arg(arg, task="sst2", model="switch", preset=""))
