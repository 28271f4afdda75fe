"""RAPTOR on ScienceQA with DeepSeek-VL2-Tiny: the paper's vision-language setting.

App. D / Fig. 3: LoRA on the language model, the vision tower and projector
frozen, the always-active shared experts in the shared stream (with the
attention adapters and the head), and the expert stream at a FIXED layer,
the last routed-expert block (`raptor.layer='last'`): there is no
format-matched public corpus, so no budget or public data is spent on
choosing l*. Images are tiled and encoded once per record by the frozen
tower (`raptor_jax.vision`); the classifier reads the state after
"Answer:" and predicts the choice letter.

Presets:
  ''    (paper scale) deepseek-ai/deepseek-vl2-tiny (or a local directory,
        --config.model.name=/path) on ScienceQA: --config.data.train_path /
        dev_path = parquet files or a save_to_disk directory (default: the
        Hub's derek-thomas/ScienceQA train / validation splits), or your own
        .jsonl / .csv with an image path column.
  tiny  a small random VL2-shaped model on the generated coloured-shapes
        task (4 choices), offline, a few minutes on 2 CPU cores.

  python launch/main.py --config=configs/deepseek_vl2_scienceqa.py:tiny \
    --workdir=/tmp/vl2_tiny
"""

from raptor_jax import _validate
from raptor_jax import vision
from raptor_jax.train.config import base_config, deepseek_family, tiny_preset

PRESETS = ("", "tiny")


def get_config(arg: str = ""):
  _validate.one_of(
      "preset of configs/deepseek_vl2_scienceqa.py",
      arg,
      PRESETS,
      "use --config=configs/deepseek_vl2_scienceqa.py or ...:tiny",
  )
  config = deepseek_family(base_config())
  config.vision = vision.vision_config()
  config.method = "raptor"
  config.raptor.layer = "last"  # fixed l*: no public corpus, no selection
  config.data.task = "scienceqa"
  config.data.public_corpus = ""
  config.data.max_length = 1024  # 1 + 421..1261 image tokens + the prompt
  config.data.length_buckets = (512, 768, 1024)
  config.model.pooling = "last"
  config.batch_size = 1000
  config.epochs = 3
  if arg == "tiny":
    tiny(config)
  return config


def tiny(config):
  """The random VL2-shaped model on `data.shapes` (seconds per epoch): the
  tiny preset's adapters and schedule, no public corpus."""
  corpus, n_pub = config.data.public_corpus, config.data.n_pub
  config = tiny_preset(config)
  config.data.public_corpus, config.data.n_pub = corpus, n_pub
  config.model.dtype = "float32"
  config.model.random.update(
      family="deepseek",
      d_model=64,
      d_ff=64,
      num_layers=3,
      num_heads=4,
      d_kv=16,
      num_experts=4,
      top_k=2,
      num_shared_experts=1,
      first_k_dense=1,
      kv_lora_rank=0,  # plain multi-head attention, as VL2-Tiny
  )
  config.data.task = "shapes"
  # [CLS] + 13 (one tile) or 17 (two tiles) image tokens + 22 prompt tokens
  config.data.max_length = 40
  config.data.length_buckets = (36, 40)
  config.vision.n_train = 2000
  config.vision.n_dev = 400
  config.eval_batch_size = 200
  return config
