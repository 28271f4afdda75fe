"""The base pretraining configuration; `configs/pretrain_*.py` start from it."""

from __future__ import annotations

import ml_collections

from raptor_jax import _validate


def _model(c: ml_collections.ConfigDict) -> None:
  """Sets `c.model`: the MoE backbone's shape."""
  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128  # hidden size
  c.model.num_layers = 4  # blocks
  c.model.num_heads = 4  # attention heads
  c.model.d_kv = 32  # head size (switch)
  c.model.d_ff = 512  # feed-forward width of every expert and dense block
  c.model.num_experts = 8  # experts per sparse block
  c.model.sparse_step = 2  # switch: block i is sparse iff i % step == 1
  c.model.expert_capacity = 64  # switch: per-sequence capacity of each expert
  c.model.top_k = 2  # olmoe, deepseek: routed experts per token
  c.model.num_kv_heads = 4  # olmoe: key/value heads
  c.model.norm_topk_prob = False  # olmoe: renormalise the top-k weights
  c.model.num_shared_experts = 2  # deepseek: shared experts per sparse block
  c.model.first_k_dense = 1  # deepseek: leading dense blocks
  c.model.kv_lora_rank = (
      64  # deepseek: MLA latent rank (heads: d_kv + d_kv/2 rotary)
  )
  c.model.kernels = (
      "auto"  # hand-written backwards: auto (fast on CPU) | fast | reference
  )
  c.model.embedding_init = "spectral"  # spectral (PPMI + SVD of the corpus) | normal (HF's random init)


def _data(c: ml_collections.ConfigDict) -> None:
  """Sets `c.tokenizer`, `c.corpus` and `c.decontaminate`: the training text."""
  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.vocab_size = (
      8192  # WordPiece vocabulary (special tokens included)
  )
  c.tokenizer.min_frequency = 2  # a merge must occur this often

  c.corpus = ml_collections.ConfigDict()
  c.corpus.sources = "wikitext2,imdb"  # comma list of wikitext2 | imdb | synthetic | name=/path/file
  c.corpus.local_dir = ""  # local copies (<dir>/wikitext2/train.txt, <dir>/imdb/unsup.tsv); '' = the Hub
  c.corpus.heldout_fraction = (
      0.01  # documents held out (by hash) for evaluation
  )
  c.corpus.min_chars = (
      32  # task texts shorter than this (letters+digits) are not matched
  )
  c.corpus.n_synthetic = 4000  # documents of the synthetic source

  c.decontaminate = ml_collections.ConfigDict()
  c.decontaminate.task = "sst2"  # fine-tuning task(s) whose dev texts are removed (GLUE tasks, synthetic, custom; comma list, e.g. sst2,qnli); '' = none
  c.decontaminate.train_path = ""  # opt-in: also remove its private train texts (the corpus then depends on D, outside the DP guarantee); '' = never
  c.decontaminate.dev_path = (
      ""  # its local dev file (comma list, one per task); '' = the Hub
  )
  c.decontaminate.text_fields = ()  # its text column(s), as data.text_fields (custom: required; GLUE: () = its own)
  c.decontaminate.seed = 0  # synthetic task only: the task's seed


def _objective(c: ml_collections.ConfigDict) -> None:
  """Sets `c.objective`: the pretraining loss and its auxiliary terms."""
  c.objective = ml_collections.ConfigDict()
  c.objective.mlm_rate = 0.15  # switch: share of tokens predicted (80% [MASK], 10% random, 10% kept)
  c.objective.aux_loss_coef = (
      -1.0
  )  # load-balancing weight; -1 = HF default (switch 0.001, olmoe 0.01)
  c.objective.z_loss_coef = (
      -1.0
  )  # router z-loss weight; -1 = HF default (switch 0.001, olmoe 0)
  c.objective.owner_balance_coef = (
      0.0  # weight of the record-owner balance loss (not in HF; 0 = off)
  )


def _optimizer(c: ml_collections.ConfigDict) -> None:
  """Sets the batch shape, schedule and AdamW fields of `c`."""
  c.seq_len = 64  # tokens per training row (documents packed, no padding)
  c.batch_size = 128  # rows per step
  c.steps = 900  # optimizer steps
  c.warmup_steps = 60  # linear warmup, then cosine decay
  c.learning_rate = 5e-3  # peak AdamW learning rate
  c.end_learning_rate_ratio = 0.1  # final learning rate / peak
  c.weight_decay = 0.01  # AdamW decay (not on norm scales)
  c.adam_b2 = 0.98  # AdamW second-moment decay
  c.grad_clip = 1.0  # global gradient-norm clip


def _eval(c: ml_collections.ConfigDict) -> None:
  """Sets `c.eval` and the evaluation, logging and checkpoint periods."""
  c.eval = ml_collections.ConfigDict()
  c.eval.records = (
      2000  # held-out documents used as records for the routing report
  )
  c.eval.record_length = 64  # their length in tokens (as fine-tuning inputs)
  c.eval.min_owner_share = (
      0.02  # each expert of the selected layer must own this share
  )

  c.eval_every = 300  # held-out evaluation period in steps (and at the end)
  c.log_every = 20  # training metrics period
  c.checkpoint_every = 100  # checkpoint period (and at the end, and on errors)
  c.stop_after_steps = (
      0  # stop (with a checkpoint) after this many steps; 0 = run to the end
  )
  c.progress_bar = True  # tqdm bar with loss and tokens/s


def base_config(family: str = "switch") -> ml_collections.ConfigDict:
  """A small MoE on WikiText-2 train + IMDb unsup, sized for 2 CPU cores."""
  c = ml_collections.ConfigDict()
  c.family = (
      family  # switch (encoder, masked LM) | olmoe | deepseek (causal LM)
  )
  c.seed = 0  # initialisation, data order and masking (the run is deterministic given it)

  _model(c)
  _data(c)
  _objective(c)
  _optimizer(c)
  _eval(c)

  return c


def tiny_preset(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A micro model on generated text: under a minute on a CPU, offline."""
  c.model.update(
      d_model=32,
      num_layers=2,
      num_heads=2,
      d_kv=16,
      d_ff=64,
      num_experts=4,
      sparse_step=2,
      expert_capacity=32,
      top_k=2,
      num_kv_heads=2,
      kv_lora_rank=16,
  )
  c.tokenizer.vocab_size = 400
  c.corpus.sources = "synthetic"
  c.corpus.heldout_fraction = 0.05
  c.corpus.n_synthetic = 3000
  c.decontaminate.task = "synthetic"
  c.seq_len = 32
  c.batch_size = 16
  c.steps = 60
  c.warmup_steps = 5
  c.learning_rate = 1e-2
  c.eval.records = 200
  c.eval.record_length = 32
  c.eval_every = 0
  c.log_every = 10
  c.checkpoint_every = 30
  return c


def with_preset(
    c: ml_collections.ConfigDict, arg: str
) -> ml_collections.ConfigDict:
  presets = {"": lambda c: c, "tiny": tiny_preset}
  _validate.one_of(
      "preset", arg, presets, "e.g. --config=configs/pretrain_switch.py:tiny"
  )
  return presets[arg](c)
