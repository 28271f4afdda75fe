"""The base training configuration; `configs/*.py` presets start from it."""

from __future__ import annotations

from typing import Callable

import ml_collections
from ml_collections import config_dict

from raptor_jax import _validate, data


def _random_model_config() -> ml_collections.ConfigDict:
  """`model.random`: the randomly initialised stand-in of a pretrained model."""
  r = ml_collections.ConfigDict()
  # switch | olmoe | deepseek | qwen3_moe | qwen2_moe | mixtral
  r.family = "switch"
  r.d_model = 64  # hidden size
  r.num_layers = 4  # blocks
  r.num_heads = 4  # attention heads
  r.d_kv = 16  # head size
  r.d_ff = 128  # feed-forward width (each expert)
  r.num_experts = 4  # experts per sparse block
  r.sparse_step = 2  # HF placement: block i sparse iff i % step == 1
  r.expert_capacity = 16  # per-sequence expert capacity (switch)
  r.top_k = 2  # experts per token (top-k families)
  r.num_kv_heads = 2  # key/value heads (the decoder kit's families)
  r.norm_topk_prob = False  # renormalise the top-k weights (the kit's)
  r.num_shared_experts = 2  # always-active shared experts (deepseek)
  r.first_k_dense = 1  # leading dense blocks (deepseek)
  # MLA latent rank (deepseek); 0 = plain multi-head attention
  r.kv_lora_rank = 32
  # embedding boost shared by same-topic words (routing matters)
  r.topic_scale = 2.0
  return r


def _model_config() -> ml_collections.ConfigDict:
  """`model`: the pretrained model, its adapters and activation dtype."""
  m = ml_collections.ConfigDict()
  m.name = "google/switch-base-8"  # HF hub id or local directory; 'random' = model.random
  m.tokenizer = ""  # tokenizer id/path; '' = same as model.name
  m.lora_rank = 8  # LoRA rank r of every adapter
  m.lora_alpha = 16.0  # LoRA alpha (scale alpha / r)
  m.dtype = "float32"  # activation dtype ('bfloat16' on GPUs); DP sums and noise stay float32
  m.dispatch = "auto"  # expert dispatch: auto (= grouped on CPU, batched elsewhere) | grouped | batched | ragged
  m.kernels = "auto"  # hand-written backwards: auto (fast on CPU, reference elsewhere) | fast | reference
  m.scan_layers = True  # identical blocks as one nn.scan (compile time flat in depth); False = unrolled
  # '' = model default ('mean' for encoders, 'last' for decoders)
  m.pooling = ""
  m.random = _random_model_config()  # architecture of the 'random' model
  return m


def _data_config() -> ml_collections.ConfigDict:
  """`data`: the private task, its public corpus and the synthetic task."""
  d = ml_collections.ConfigDict()
  d.task = "sst2"  # sst2 | mnli | qnli | qqp | synthetic
  # local train file (tsv/csv/parquet/jsonl); '' = the hub dataset
  d.train_path = ""
  d.dev_path = ""  # local dev file; '' = the hub dataset
  d.text_fields = ()  # override the text column(s)
  d.label_field = ""  # override the label column
  d.max_length = 128  # tokens per record, right padding
  # Length buckets (`raptor_jax.length_buckets`): records run padded to the
  # smallest of these lengths that holds them (one compile per bucket).
  # None = powers of two from 16 up to max_length (none for the synthetic
  # and controlled tasks); () = off (everything padded to max_length); or
  # increasing lengths ending at max_length, e.g. '(16,32,64)'.
  d.length_buckets = config_dict.placeholder(tuple)
  d.train_limit = 0  # use only the first N train records (0 = all)
  d.dev_limit = 0  # use only the first N dev records (0 = all)
  d.holdout = 0  # N train-file records after the first train_limit, never trained on (0 = none)
  d.eval_split = "dev"  # dev | holdout (tuning: evaluate on the held-out train records, not dev)
  # preset (imdb | squad | anli_r2 | paws), hub id, or '' for none
  d.public_corpus = "imdb"
  d.public_path = ""  # local public corpus file (overrides the hub)
  d.public_split = ""  # hub split ('' = the preset's)
  d.public_text_fields = ()  # text column(s) of the public corpus ('' = the preset's)
  d.n_pub = 1000  # public texts used for layer selection
  # the embedded offline task (task='synthetic')
  d.synthetic = ml_collections.ConfigDict()
  d.synthetic.n_train = 4000  # private training records
  d.synthetic.n_dev = 500  # dev records
  d.synthetic.label_noise = 0.05  # flipped labels
  return d


def _privacy_config() -> ml_collections.ConfigDict:
  """`privacy`: the (epsilon, delta) target, budget split, clips, seed."""
  p = ml_collections.ConfigDict()
  p.epsilon = 8.0  # target epsilon of the whole run
  p.delta = 0.0  # 0 = 1 / n**1.1 (1 / (10 n) for a custom task)
  p.rho = 0.9  # shared stream's share of the budget (RAPTOR)
  p.clip_shared = 1.0  # C_s (and C of one-stream methods)
  p.clip_expert = 1.0  # C_e
  # seed of Poisson samples and noise; -1 = secret OS entropy (>= 0 only for reproducible experiments)
  p.secret_seed = -1
  return p


def _raptor_config() -> ml_collections.ConfigDict:
  """`raptor`: RAPTOR's layer choice, expert stream and ablations."""
  r = ml_collections.ConfigDict()
  r.layer = "entropy"  # expert layer l*: entropy | first | last | a block index
  # Switch owner vote: count | prob (top-k models use gate weights)
  r.owner_weighting = "count"
  # public expert denominator D_e: B/E | B (ablation)
  r.expert_denominator = "B/E"
  r.residual = "shared"  # residual weight logits: shared (expert stream off) | full | none
  r.residual_gamma = 1.0  # w_i ** gamma, gamma in (0, 1]
  # False: both streams from one sample (sigma_eff accounting)
  r.alternate = True
  r.joint_clip = False  # True: one clip C_s over a record's shared + expert grads; each phase releases its part
  # shared stream trains q,k,v,o kernels instead of LoRA
  r.shared_full_weights = False
  r.expert_full_weights = False  # expert stream trains expert kernels instead of LoRA (residual: full | none)
  return r


def base_config() -> ml_collections.ConfigDict:
  """Paper defaults (Sec. 8, App. C) for Switch-base-8 on SST-2."""
  c = ml_collections.ConfigDict()
  c.method = "raptor"  # raptor | monolithic | monolithic_lora | nonprivate_lora | nonprivate_full | baseline_a | baseline_b | baseline_c
  c.seed = 0  # seeds the adapters, the head and the synthetic task (public randomness)

  c.model = _model_config()
  c.data = _data_config()

  c.batch_size = 1000  # expected batch size B (public); sample rate q = B / n; 0 = n / 10 (at most 1000)
  c.microbatch_size = 32  # records per device per vmap(grad) call (memory only; no effect on privacy)
  # data-parallel devices; 0 = all (of every host in a multi-host run)
  c.num_devices = 0
  c.epochs = 20  # one epoch = ceil(1/q) cycles (docs/method.md §1.8); 0 = enough for 200 steps
  c.learning_rate = 5e-4  # Adam learning rate of every stream

  c.privacy = _privacy_config()

  c.raptor = _raptor_config()

  c.eval_every_epochs = 1  # dev evaluation period (and at the end)
  c.eval_batch_size = 64  # records per evaluation batch
  # checkpoint period (and at the end, and on errors)
  c.checkpoint_every_cycles = 100
  # also checkpoint when this many minutes passed since the last one (0: off)
  c.checkpoint_every_minutes = 0.0
  c.log_every_cycles = 10  # progress / epsilon-spent logging period
  # stop (with a checkpoint) after this many cycles; 0 = run to the end
  c.stop_after_cycles = 0
  # opt-in: log the private training loss (not DP; warns)
  c.log_private_stats = False
  c.progress_bar = True  # tqdm progress bar with epsilon spent
  # opt-in: wall time in results.json, TensorBoard and the progress bar's
  # rates; it depends on realised batch sizes (not DP; warns)
  c.log_wall_time = False
  # persistent compilation cache: 'auto' ($XDG_CACHE_HOME/raptor_jax/xla,
  # else ~/.cache/raptor_jax/xla), a directory, or 'off'
  c.compilation_cache = "auto"
  return c


# How to fix a bad config-file argument (`configs/glue.py:<arg>`).
_ARG_FIX = (
    "pass comma-separated key=value pairs, e.g."
    " --config=configs/glue.py:task=mnli,model=olmoe,preset=tiny"
)


def tiny_preset(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The embedded offline default: a small random Switch on the generated task
  (with its own disjoint public corpus)."""
  config.model.update(name="random", lora_rank=4, lora_alpha=8.0)
  config.data.update(
      task="synthetic", max_length=32, public_corpus="synthetic", n_pub=1000
  )
  config.update(batch_size=250, microbatch_size=64, eval_batch_size=250)
  config.update(epochs=6, learning_rate=1e-2, log_every_cycles=5)
  config.checkpoint_every_cycles = 50
  return config


def cpu_preset(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The tiny model size on a real task's files (set data paths).

  The tokenizer is word-level with a vocabulary from the PUBLIC corpus only.
  """
  task, corpus = config.data.task, config.data.public_corpus
  config = tiny_preset(config)
  config.data.update(task=task, public_corpus=corpus, max_length=64)
  config.model.tokenizer = "public-words"
  config.update(batch_size=1000, microbatch_size=128, epochs=3)
  config.log_every_cycles = 10
  return config


def small_preset(
    config: ml_collections.ConfigDict,
) -> ml_collections.ConfigDict:
  """A small pretrained MoE (`launch/pretrain.py`) on the real task's files.

  Set --config.model.name=<pretrain workdir>/model (its WordPiece tokenizer is
  used) and the data paths. Sized so that one run takes at most ~8 minutes
  on 2 CPU cores: the first 16,000 training records (one epoch of 32 cycles
  at B=500), the next 2,000 held out for tuning, max length 64. The learning
  rate is the non-private LoRA pilot's on the holdout (results/sst2_small).
  """
  config.model.update(name="", lora_rank=8, lora_alpha=16.0)
  config.data.update(max_length=64, train_limit=16000, holdout=2000)
  config.update(batch_size=500, microbatch_size=100, eval_batch_size=250)
  config.update(epochs=1, learning_rate=1e-2, log_every_cycles=10)
  config.checkpoint_every_cycles = 20
  return config


def _family(
    name: str, doc: str, **random
) -> Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict]:
  """A model family instead of Switch-base-8: paper scale loads `name` with
  bfloat16 activations (DP sums and noise stay float32) and microbatch 8;
  the random stand-in has 8 experts, top-2, and the `random` fields."""

  def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config.model.update(name=name, dtype="bfloat16")
    config.microbatch_size = 8
    config.model.random.update(num_experts=8, top_k=2, **random)
    return config

  apply.__doc__ = doc
  return apply


def kit_family(
    family: str, name: str, experts: int, top_k: int
) -> Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict]:
  """A decoder-kit family (`models.decoder`); `experts` and `top_k` are the
  real model's (for its docstring)."""
  doc = f"{name} (E={experts}, top-{top_k}) instead of Switch-base-8."
  return _family(name, doc, family=family, num_kv_heads=2)


olmoe_family = _family(
    "allenai/OLMoE-1B-7B-0924",
    "OLMoE-1B-7B (E=64, top-8, 16 sparse blocks) instead of Switch-base-8.",
    family="olmoe",
    num_kv_heads=2,
)
deepseek_family = _family(
    "deepseek-ai/deepseek-vl2-tiny",
    """DeepSeek-VL2-Tiny's language model instead of Switch-base-8.

    DeepSeekMoE: 64 routed experts (top-6) and 2 always-active shared experts
    per sparse block, the first block dense, 11 sparse blocks. The random
    stand-in has 8 routed experts (top-2), 2 shared experts, MLA attention and
    a dense first block.
    """,
    family="deepseek",
    num_layers=3,
)


# Model family -> its changes to the (Switch) base config.
FAMILIES = {
    "switch": lambda c: c,
    "olmoe": olmoe_family,
    "deepseek": deepseek_family,
    "qwen3_moe": kit_family("qwen3_moe", "Qwen/Qwen3-30B-A3B", 128, 8),
    "qwen2_moe": kit_family("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B", 60, 4),
    "mixtral": kit_family("mixtral", "mistralai/Mixtral-8x7B-v0.1", 8, 2),
}


def with_preset(
    config: ml_collections.ConfigDict, arg: str, family: str = "switch"
) -> ml_collections.ConfigDict:
  """Applies a model family and the preset named by a config file's argument.

  Args:
    arg: '' (paper scale), 'tiny' (embedded offline task), 'cpu' (tiny
      random model on the real task's files) or 'small' (a small pretrained
      model from launch/pretrain.py on the real task's files).
    family: a key of `FAMILIES`.
  """
  presets = {
      "": lambda c: c,
      "tiny": tiny_preset,
      "cpu": cpu_preset,
      "small": small_preset,
  }
  _validate.one_of("preset", arg, presets, _ARG_FIX)
  _validate.one_of("model", family, FAMILIES, _ARG_FIX)
  config = presets[arg](FAMILIES[family](config))
  if arg and family != "switch":
    config.model.dtype = "float32"
  return config


def glue_config(
    task: str = "sst2", model: str = "switch", preset: str = ""
) -> ml_collections.ConfigDict:
  """A GLUE task with its public corpus (`data.TASK_CORPUS`), a model family and a preset.

  Args:
    task: 'sst2', 'qnli', 'qqp' or 'mnli'.
    model: a key of `FAMILIES` (each names its checkpoint).
    preset: see `with_preset`.
  """
  _validate.one_of("task", task, data.TASK_CORPUS, _ARG_FIX)
  config = base_config()
  config.data.task = task
  config.data.public_corpus = data.TASK_CORPUS[task]
  config = with_preset(config, preset, family=model)
  if preset == "small" and task == "qnli":
    config = qnli_small(config)
  return config


def qnli_small(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`:small` for QNLI: the 10,000-row train sample, pairs up to 128 tokens.

  A question and its sentence average about 40 WordPiece tokens, so 64
  would cut many pairs; length buckets keep the short ones cheap. Of a
  train file with 9,999 records (`glue/qnli/train_sample.tsv`), the first
  8,000 train and the last 1,999 are the tuning holdout. The public corpus
  is the task's default, SQuAD contexts, as in the paper.
  """
  config.data.update(max_length=128, train_limit=8000, holdout=1999)
  return config


def parse_arg(arg: str, **defaults: str) -> dict[str, str]:
  """The `key=value,...` argument of a config file (big_vision style) over `defaults`.

  `parse_arg("model=olmoe,preset=tiny", task="sst2", model="switch", preset="")`
  is `{"task": "sst2", "model": "olmoe", "preset": "tiny"}`. Only the keys of
  `defaults` are accepted; values are strings ('preset=' is the empty string).
  """
  accepted = ", ".join(f"{k}=..." for k in defaults)
  values = dict(defaults)
  for pair in filter(None, arg.split(",")):
    key, eq, value = pair.partition("=")
    _validate.check(
        bool(eq) and key.strip() in defaults,
        "config argument",
        f"one of {accepted}",
        pair,
        _ARG_FIX,
    )
    values[key.strip()] = value.strip()
  return values


# Fields that do not change what the run computes: resuming with other values is fine.
RESUME_INSENSITIVE = (
    "eval_every_epochs",
    "eval_batch_size",
    "checkpoint_every_cycles",
    "checkpoint_every_minutes",
    "log_every_cycles",
    "stop_after_cycles",
    "log_private_stats",
    "log_wall_time",
    "progress_bar",
    "compilation_cache",
    "microbatch_size",
    "num_devices",
    # the computation's layout only (as microbatch_size): the same update
    # up to float summation order
    "data.length_buckets",
)
