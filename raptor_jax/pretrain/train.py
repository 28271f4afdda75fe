"""`pretrain(config, workdir)`: a small MoE language model from public text.

Pipeline (every stage deterministic for a given config and seed):

1. Corpus: read the public sources, clean, deduplicate, drop every document
   that contains a text of the fine-tuning task's evaluation split
   (`corpus.build_corpus`; never its private train split unless the user opts
   in, outside the guarantee), and hold out ~1% of the documents by hash.
2. Tokenizer: WordPiece trained on the training documents only.
3. Rows: documents as `[CLS] text [SEP]`, concatenated and cut into rows of
   `seq_len` tokens (no padding, so no compute is wasted).
4. Training: AdamW with linear warmup and cosine decay, global-norm clipping,
   the family's LM objective plus its router auxiliary losses. Batch `s`
   and its masking key are functions of (seed, s), so a resumed run repeats
   exactly what an uninterrupted one computes.
5. Export: `<workdir>/model/` in `save_pretrained` format with the
   tokenizer, readable by transformers and by `models.from_pretrained`.

Stages 1-3 are cached under `<workdir>/data/` (a rerun reuses them).
Checkpoints (orbax) hold the parameters, the optimizer state and the step;
an interrupt or a crash saves the last finished step first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from raptor_jax import _validate
from raptor_jax.data import encoding
from raptor_jax.models import export
from raptor_jax.pretrain import corpus as corpus_lib
from raptor_jax.pretrain import embeddings, evaluate, model, tokenizer as tokenizer_lib
from raptor_jax.train import metrics
from raptor_jax.train.checkpoint import Checkpointer

log = logging.getLogger("raptor_jax")

# Fields that do not change what is computed: a resumed run may change them.
RESUME_INSENSITIVE = (
    "log_every",
    "eval_every",
    "checkpoint_every",
    "progress_bar",
    "stop_after_steps",
)
_DATA_FIELDS = (
    "seed",
    "corpus",
    "decontaminate",
    "tokenizer",
    "seq_len",
    "eval",
)


def _write_json(path: Path, payload: Any) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=float))
  tmp.replace(path)


def coefficients(config: ml_collections.ConfigDict) -> tuple[float, float]:
  """(aux_loss_coef, z_loss_coef): the config's, or the family's HF defaults (-1)."""
  oc = config.objective
  aux = (
      model.HF_AUX_LOSS_COEF[config.family]
      if oc.aux_loss_coef < 0
      else oc.aux_loss_coef
  )
  z = (
      model.HF_Z_LOSS_COEF[config.family]
      if oc.z_loss_coef < 0
      else oc.z_loss_coef
  )
  return float(aux), float(z)


def validate(config: ml_collections.ConfigDict) -> None:
  """One clear error for a config that cannot run, before any data is read."""
  fix = _validate.config_fix
  _validate.one_of(
      "family", config.family, tuple(model.HF_AUX_LOSS_COEF), fix("family")
  )
  for name in ("steps", "batch_size", "seq_len", "learning_rate"):
    _validate.check(config[name] > 0, name, "> 0", config[name], fix(name))
  _validate.check(
      0 <= config.warmup_steps < config.steps,
      "warmup_steps",
      f"in [0, steps={config.steps})",
      config.warmup_steps,
      fix("warmup_steps"),
  )
  _validate.one_of(
      "model.embedding_init",
      config.model.embedding_init,
      ("normal", "spectral"),
      fix("model.embedding_init"),
  )
  _validate.in_interval(
      "objective.mlm_rate",
      config.objective.mlm_rate,
      "(0, 1)",
      fix("objective.mlm_rate"),
  )


def _tokenize_rows(tok, texts, seq_len: int) -> np.ndarray:
  """Documents as [CLS] text [SEP], concatenated, cut into full rows."""
  ids = tok(list(texts), add_special_tokens=True, verbose=False)["input_ids"]
  flat = np.fromiter((t for doc in ids for t in doc), dtype=np.int32)
  rows = len(flat) // seq_len
  if rows == 0:
    raise ValueError(
        f"the corpus has {len(flat)} tokens, fewer than one row of seq_len="
        f"{seq_len}; add text or lower --config.seq_len"
    )
  return flat[: rows * seq_len].reshape(rows, seq_len)


def prepare_data(
    config: ml_collections.ConfigDict, workdir: Path
) -> dict[str, Any]:
  """Corpus, tokenizer and token rows; cached in `<workdir>/data`."""
  data_dir = workdir / "data"
  key = json.dumps(
      {k: config.to_dict()[k] for k in _DATA_FIELDS}, sort_keys=True
  )
  cached = data_dir / "config.json"
  if cached.exists() and cached.read_text() == key:
    arrays = np.load(data_dir / "rows.npz")
    return dict(
        tokenizer=encoding.load_tokenizer(str(data_dir / "tokenizer")),
        corpus=json.loads((data_dir / "corpus.json").read_text()),
        **arrays,
    )
  cc, dc = config.corpus, config.decontaminate
  contaminants = corpus_lib.tasks_texts(
      dc.task,
      train_paths=dc.train_path,
      dev_paths=dc.dev_path,
      seed=dc.seed,
      text_fields=tuple(dc.get("text_fields", ())),
  )
  sources = [s for s in cc.sources.split(",") if s]
  texts = corpus_lib.build_corpus(
      sources,
      contaminants=contaminants,
      local_dir=cc.local_dir,
      heldout_fraction=cc.heldout_fraction,
      min_chars=cc.min_chars,
      seed=config.seed,
      n_synthetic=cc.n_synthetic,
  )
  log.info("corpus: %s", texts.stats)
  tok = tokenizer_lib.train_wordpiece(
      texts.train,
      vocab_size=config.tokenizer.vocab_size,
      min_frequency=config.tokenizer.min_frequency,
  )
  heldout_ids, heldout_mask = encoding.tokenize(
      tok,
      texts.heldout[: config.eval.records],
      max_length=config.eval.record_length,
  )
  arrays = dict(
      train_rows=_tokenize_rows(tok, texts.train, config.seq_len),
      heldout_rows=_tokenize_rows(tok, texts.heldout, config.seq_len),
      record_ids=heldout_ids,
      record_mask=heldout_mask,
  )
  data_dir.mkdir(parents=True, exist_ok=True)
  tok.save_pretrained(data_dir / "tokenizer")
  np.savez(data_dir / "rows.npz", **arrays)
  stats = dict(
      texts.stats,
      train_tokens=int(arrays["train_rows"].size),
      heldout_tokens=int(arrays["heldout_rows"].size),
      decontaminated_against=dc.task or None,
  )
  _write_json(data_dir / "corpus.json", stats)
  cached.write_text(key)
  return dict(tokenizer=tok, corpus=stats, **arrays)


def special_ids(tok) -> model.SpecialIds:
  specials = [
      tok.convert_tokens_to_ids(t) for t in tokenizer_lib.SPECIAL_TOKENS
  ]
  if specials != list(range(len(specials))):
    raise ValueError(
        f"the tokenizer's special tokens must be ids 0..{len(specials) - 1}"
    )
  return model.SpecialIds(
      pad=tok.pad_token_id,
      mask=tok.mask_token_id,
      first_regular=len(specials),
      vocab_size=len(tok),
  )


def batch_rows(
    num_rows: int, batch_size: int, step: int, seed: int
) -> np.ndarray:
  """Row indices of batch `step`: consecutive slices of per-epoch permutations."""
  positions = step * batch_size + np.arange(batch_size)
  epochs = positions // num_rows
  out = np.empty(batch_size, np.int64)
  for epoch in np.unique(epochs):
    perm = np.random.default_rng((seed, int(epoch))).permutation(num_rows)
    chosen = epochs == epoch
    out[chosen] = perm[positions[chosen] % num_rows]
  return out


def optimizer(
    config: ml_collections.ConfigDict,
) -> optax.GradientTransformation:
  """AdamW, warmup + cosine decay, global-norm clipping; no decay on norm scales."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0,
      config.learning_rate,
      config.warmup_steps,
      config.steps,
      end_value=config.learning_rate * config.end_learning_rate_ratio,
  )
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", "") != "scale", params
  )
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(
          schedule,
          b1=0.9,
          b2=config.adam_b2,
          weight_decay=config.weight_decay,
          mask=decay_mask,
      ),
  )


def count_parameters(module, params: dict) -> dict[str, int]:
  """Total parameters and those a token uses (top-k of E experts per sparse block)."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  total = sum(int(np.size(v)) for v in flat.values())
  experts = sum(int(np.size(v)) for p, v in flat.items() if "/experts/" in p)
  cfg = module.config
  active = total - experts + experts * cfg.top_k // cfg.num_experts
  return dict(total=total, active_per_token=active)


def _initial_params(
    config, module, train_rows, vocab_size: int, *, spectral: bool
) -> dict:
  """Fresh parameters; spectral token embeddings when configured (fresh runs only)."""
  params = model.init_params(module, jax.random.PRNGKey(config.seed))
  if config.model.embedding_init == "spectral" and spectral:
    embedding = params["backbone"]["embed_tokens"]["embedding"]
    params["backbone"]["embed_tokens"]["embedding"] = jnp.asarray(
        embeddings.spectral_embeddings(
            train_rows,
            vocab_size,
            embedding.shape[1],
            std=float(jnp.std(embedding)),
            seed=config.seed,
        )
    )
  return params


def _train_step(loss, tx, mask_key):
  """The jitted (params, opt_state, input_ids, step) -> (params, opt_state, parts)."""

  # No buffer donation: an interrupt mid-step must leave the last finished
  # step's (params, opt_state) intact for the checkpoint saved on the way out.
  @jax.jit
  def train_step(params, opt_state, input_ids, step):
    grads, parts = jax.grad(
        lambda p: loss(p, input_ids, jax.random.fold_in(mask_key, step)),
        has_aux=True,
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (
        optax.apply_updates(params, updates),
        opt_state,
        dict(parts, grad_norm=optax.global_norm(grads)),
    )

  return train_step


def _export(
    config, module, params, model_dir: Path, tok, special, aux_coef, z_coef
) -> None:
  """Writes the pretrained backbone (and LM head) in `save_pretrained` format."""
  export.save_pretrained(
      module,
      params["backbone"],
      model_dir,
      tokenizer=tok,
      lm_head=params["lm_head"]["kernel"] if "lm_head" in params else None,
      hf_config_extra=dict(
          pad_token_id=special.pad,
          router_aux_loss_coef=aux_coef,
          **(
              {
                  "router_z_loss_coef": z_coef,
                  "decoder_start_token_id": special.pad,
              }
              if config.family == "switch"
              else {}
          ),
      ),
  )


@dataclasses.dataclass
class _Progress:
  """Pretraining's state; (params, opt_state, step) change together."""

  params: Any
  opt_state: Any
  step: int = 0
  train_time_s: float = 0.0
  earlier_wall_s: float = 0.0  # earlier segments of a resumed run
  start: float = 0.0

  def wall_time_s(self) -> float:
    return self.earlier_wall_s + time.time() - self.start


def _save(checkpointer, run: _Progress) -> None:
  """Checkpoints `run`: (params, opt_state) and the step and timings."""
  checkpointer.save(
      run.step,
      {"params": run.params, "opt_state": run.opt_state},
      dict(
          step=run.step,
          wall_time_s=run.wall_time_s(),
          train_time_s=run.train_time_s,
      ),
  )


def _stop_at(config, run: _Progress) -> int:
  """The step this segment stops at: config.steps, or stop_after_steps more."""
  return (
      config.steps
      if not config.stop_after_steps
      else min(config.steps, run.step + config.stop_after_steps)
  )


def _progress_bar(config, run: _Progress):
  """A tqdm bar at `run.step` of config.steps, or None when turned off."""
  if not config.progress_bar:
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(
      total=config.steps, initial=run.step, unit="step", dynamic_ncols=True
  )


def _advance(config, run: _Progress, train_step, train_rows, stop_at) -> dict:
  """Runs step `run.step` and advances `run` past it.

  Returns:
    The step's loss parts: floats (waited for) when the step will be logged,
    device arrays otherwise.
  """
  step = run.step
  ids = jnp.asarray(
      train_rows[
          batch_rows(len(train_rows), config.batch_size, step, config.seed)
      ]
  )
  step_start = time.time()
  new_params, new_opt_state, parts = train_step(
      run.params, run.opt_state, ids, step
  )
  if (step + 1) % config.log_every == 0 or step + 1 == stop_at:
    parts = {k: float(v) for k, v in parts.items()}  # waits for the step
  run.params, run.opt_state, run.step = (
      new_params,
      new_opt_state,
      step + 1,
  )  # together
  run.train_time_s += time.time() - step_start
  return parts


def _log_train(writer, progress, step, parts, rate, tokens_per_step) -> None:
  """Writes the training metrics of `step` and shows them on the bar."""
  writer.write(
      step,
      {
          **{f"train/{k}": v for k, v in parts.items()},
          "train/tokens_per_s": rate,
          "train/tokens": step * tokens_per_step,
      },
  )
  if progress is not None:
    progress.set_postfix(
        loss=f"{parts['lm_loss']:.3f}",
        tok_s=f"{rate:,.0f}",
        refresh=False,
    )


def _train_loop(
    config,
    run: _Progress,
    train_step,
    train_rows,
    checkpointer,
    writer,
    heldout,
) -> None:
  """Steps until config.steps (or stop_after_steps), logging and checkpointing."""
  tokens_per_step = config.batch_size * config.seq_len
  stop_at = _stop_at(config, run)
  progress = _progress_bar(config, run)
  last_saved, window_start, window_steps = run.step, time.time(), 0
  try:
    while run.step < stop_at:
      parts = _advance(config, run, train_step, train_rows, stop_at)
      step = run.step
      window_steps += 1
      if step % config.log_every == 0 or step == stop_at:
        rate = (
            window_steps
            * tokens_per_step
            / max(time.time() - window_start, 1e-9)
        )
        window_start, window_steps = time.time(), 0
        _log_train(writer, progress, step, parts, rate, tokens_per_step)
      if progress is not None:
        progress.update(1)
      if (
          config.eval_every
          and step % config.eval_every == 0
          and step < config.steps
      ):
        writer.write(
            step, {f"heldout/{k}": v for k, v in heldout()["scalars"].items()}
        )
      if step - last_saved >= config.checkpoint_every:
        _save(checkpointer, run)
        last_saved = step
  except BaseException:
    if run.step > last_saved:  # a crash or an interrupt loses no finished step
      _save(checkpointer, run)
    raise
  finally:
    if progress is not None:
      progress.close()
  if run.step > last_saved:
    _save(checkpointer, run)


def _loss(config, module, special, aux_coef, z_coef):
  """The family's LM loss plus its router auxiliary losses, per `config`."""
  return functools.partial(
      model.loss_fn,
      module,
      special=special,
      mlm_rate=config.objective.mlm_rate,
      aux_loss_coef=aux_coef,
      z_loss_coef=z_coef,
      owner_balance_coef=config.objective.owner_balance_coef,
  )


def _resume(config, workdir: Path, checkpointer, meta, run: _Progress) -> None:
  """Restores `run` from its checkpoint (if `meta`), else writes config.json.

  A fresh run records its config as `<workdir>/config.json`.
  """
  if meta:
    state = checkpointer.restore_state(
        {"params": run.params, "opt_state": run.opt_state}
    )
    run.params, run.opt_state = state["params"], state["opt_state"]
    run.step, run.earlier_wall_s = int(meta["step"]), float(meta["wall_time_s"])
    run.train_time_s = float(meta["train_time_s"])
    log.info("resumed pretraining at step %d of %d", run.step, config.steps)
  else:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))


def _result(
    config, module, run: _Progress, data, report, coefs, model_dir, finished
) -> dict[str, Any]:
  """The pretraining report of `run` (`report`: the final held-out eval)."""
  step, train_time_s = run.step, run.train_time_s
  tokens_per_step = config.batch_size * config.seq_len
  return dict(
      family=config.family,
      finished=finished,
      steps=step,
      planned_steps=config.steps,
      tokens_seen=step * tokens_per_step,
      batch_size=config.batch_size,
      seq_len=config.seq_len,
      parameters=count_parameters(module, run.params),
      vocab_size=len(data["tokenizer"]),
      aux_loss_coef=coefs[0],
      z_loss_coef=coefs[1],
      corpus=data["corpus"],
      wall_time_s=run.wall_time_s(),
      train_time_s=train_time_s,
      tokens_per_s=step * tokens_per_step / max(train_time_s, 1e-9),
      heldout=report["scalars"],
      routing=report["routing"],
      model_dir=str(model_dir) if finished else None,
      architecture={k: v for k, v in config.model.to_dict().items()},
  )


def pretrain(
    config: ml_collections.ConfigDict, workdir: str | Path
) -> dict[str, Any]:
  """Pretrains per `config` in `workdir` (resuming), exports `<workdir>/model`.

  Returns:
    The report (also written to `<workdir>/pretrain_report.json`).
  """
  validate(config)
  start = time.time()
  workdir = Path(workdir).expanduser().resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  data = prepare_data(config, workdir)
  tok, special = data["tokenizer"], special_ids(data["tokenizer"])
  train_rows = data["train_rows"]
  module = model.backbone(config.family, config.model, len(tok))
  checkpointer = Checkpointer(
      workdir, config, insensitive=RESUME_INSENSITIVE, format_version=None
  )  # pretraining's layout never changed
  meta = checkpointer.restore_meta()
  params = _initial_params(
      config, module, train_rows, len(tok), spectral=not meta
  )
  tx = optimizer(config)
  aux_coef, z_coef = coefficients(config)
  loss = _loss(config, module, special, aux_coef, z_coef)
  train_step = _train_step(loss, tx, jax.random.PRNGKey(config.seed + 1))
  run = _Progress(params, tx.init(params), start=start)
  _resume(config, workdir, checkpointer, meta, run)
  writer = metrics.MetricWriter(workdir)

  def heldout():
    return evaluate.evaluate(
        module,
        run.params,
        loss,
        data["heldout_rows"],
        data["record_ids"],
        data["record_mask"],
        batch_size=config.batch_size,
        seed=config.seed,
        min_share=config.eval.min_owner_share,
    )

  _train_loop(
      config, run, train_step, train_rows, checkpointer, writer, heldout
  )
  checkpointer.close()
  params, step = run.params, run.step

  report = heldout()
  writer.write(step, {f"heldout/{k}": v for k, v in report["scalars"].items()})
  writer.close()
  finished = step >= config.steps
  model_dir = workdir / "model"
  if finished:
    _export(config, module, params, model_dir, tok, special, aux_coef, z_coef)
  result = _result(
      config, module, run, data, report, (aux_coef, z_coef), model_dir, finished
  )
  _write_json(workdir / "pretrain_report.json", result)
  if finished:
    _write_json(model_dir / "pretrain_report.json", result)
  return result
