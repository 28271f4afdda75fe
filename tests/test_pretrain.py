"""Pretraining: masking, router losses, decontamination, training, export, resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import run_python
from raptor_jax import models
from raptor_jax.data import synthetic
from raptor_jax.pretrain import config as pretrain_config
from raptor_jax.pretrain import corpus, model, objectives, pretrain, tokenizer, train


def tiny_config(steps=20, family="switch"):
  config = pretrain_config.with_preset(
      pretrain_config.base_config(family), "tiny"
  )
  config.steps, config.warmup_steps, config.log_every = (
      steps,
      min(4, steps - 1),
      5,
  )
  config.checkpoint_every, config.progress_bar = 10, False
  return config


@pytest.fixture(scope="module")
def switch_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pretrain_switch")
  return workdir, pretrain(tiny_config(), workdir)


# ---------------------------------------------------------------------------
# Objectives.


def test_masking_statistics():
  """15% of each row's maskable tokens, 80/10/10, never a special or padding token."""
  key_ids, key_mask = jax.random.split(jax.random.PRNGKey(0))
  ids = jax.random.randint(key_ids, (256, 64), 5, 1000)
  lengths = jnp.arange(256) % 50 + 14
  real = jnp.arange(64)[None, :] < lengths[:, None]
  ids = jnp.where(real, ids, 0).at[:, 0].set(2)  # [CLS] first, padding after
  maskable = real & (ids >= 5)
  batch = objectives.mask_tokens(
      key_mask, ids, maskable, mask_id=4, random_ids=(5, 1000)
  )
  chosen = batch.weights > 0
  np.testing.assert_array_equal(
      np.asarray(chosen.sum(1)), np.round(0.15 * np.asarray(maskable.sum(1)))
  )
  picked = np.asarray(jnp.take_along_axis(maskable, batch.positions, 1))[
      np.asarray(chosen)
  ]
  assert picked.all()  # only maskable positions are predicted
  np.testing.assert_array_equal(
      np.asarray(batch.targets)[np.asarray(chosen)],
      np.asarray(jnp.take_along_axis(ids, batch.positions, 1))[
          np.asarray(chosen)
      ],
  )
  new = np.asarray(jnp.take_along_axis(batch.input_ids, batch.positions, 1))[
      np.asarray(chosen)
  ]
  old = np.asarray(batch.targets)[np.asarray(chosen)]
  n = new.size
  as_mask, kept = np.mean(new == 4), np.mean(new == old)
  assert abs(as_mask - 0.8) < 4 * np.sqrt(0.16 / n)
  assert abs(kept - (0.1 + 0.9 / 995 * 0.1)) < 4 * np.sqrt(0.09 / n) + 0.001
  unchosen = np.ones(ids.shape, bool)
  np.put_along_axis(
      unchosen, np.asarray(batch.positions), ~np.asarray(chosen), 1
  )
  np.testing.assert_array_equal(
      np.asarray(batch.input_ids)[unchosen], np.asarray(ids)[unchosen]
  )


def test_switch_aux_losses_match_transformers_and_are_minimised_by_uniform_routing():
  from transformers.models.switch_transformers import modeling_switch_transformers as hf_switch

  logits = jax.random.normal(jax.random.PRNGKey(1), (3, 16, 4)) * 2.0
  mask = jnp.ones((3, 16), jnp.int32)
  probs = jax.nn.softmax(logits)
  expected = hf_switch.load_balancing_loss_func(
      torch.tensor(np.asarray(probs)),
      torch.tensor(np.asarray(jnp.argmax(logits, -1))),
  )
  np.testing.assert_allclose(
      objectives.switch_load_balancing_loss(logits, mask),
      float(expected),
      rtol=1e-5,
  )
  np.testing.assert_allclose(
      objectives.router_z_loss(logits, mask),
      float(hf_switch.router_z_loss_func(torch.tensor(np.asarray(logits)))),
      rtol=1e-5,
  )
  # Uniform dispatch (each expert a quarter of the tokens, equal probabilities) gives the
  # minimum 1; random routing more; everything on one expert E.
  uniform = jnp.tile(jnp.eye(4) * 1e-3, (3, 4, 1))
  assert objectives.switch_load_balancing_loss(uniform, mask) == pytest.approx(
      1.0, abs=1e-3
  )
  assert objectives.switch_load_balancing_loss(logits, mask) > 1.0
  collapsed = jnp.zeros((3, 16, 4)).at[..., 0].set(20.0)
  assert objectives.switch_load_balancing_loss(
      collapsed, mask
  ) == pytest.approx(4.0, rel=1e-4)
  # Padding is ignored: padded tokens routed anywhere change nothing.
  padded = jnp.concatenate([logits, collapsed], axis=1)
  pad_mask = jnp.concatenate([mask, jnp.zeros_like(mask)], axis=1)
  np.testing.assert_allclose(
      objectives.switch_load_balancing_loss(padded, pad_mask),
      objectives.switch_load_balancing_loss(logits, mask),
      rtol=1e-6,
  )


def test_owner_balance_loss_is_minimised_by_balanced_owners_and_pushes_the_top_owner_down():
  num_experts = 4
  balanced = jnp.stack(
      [
          jnp.zeros((6, num_experts)).at[:, b % num_experts].set(5.0)
          for b in range(8)
      ]
  )  # record b: every token to expert b % 4
  mask = jnp.ones((8, 6))
  assert objectives.owner_balance_loss(balanced, mask) == pytest.approx(
      1.0, abs=1e-3
  )
  collapsed = jnp.zeros((8, 6, num_experts)).at[..., 0].set(5.0)
  assert objectives.owner_balance_loss(collapsed, mask) > 3.5
  noisy = collapsed + jax.random.normal(jax.random.PRNGKey(0), collapsed.shape)
  grad = jax.grad(lambda l: objectives.owner_balance_loss(l, mask))(noisy)
  assert (
      float(grad[..., 0].sum()) > 0 > float(grad[..., 1:].sum())
  )  # descent moves records off
  # Padding never votes: a record's padded tail routed elsewhere changes nothing.
  tail = jnp.zeros((8, 3, num_experts)).at[..., 3].set(9.0)
  np.testing.assert_allclose(
      objectives.owner_balance_loss(
          jnp.concatenate([balanced, tail], 1),
          jnp.concatenate([mask, jnp.zeros((8, 3))], 1),
      ),
      objectives.owner_balance_loss(balanced, mask),
      rtol=1e-6,
  )


def test_topk_aux_loss_matches_olmoe_transformers():
  from transformers.models.olmoe import modeling_olmoe as hf_olmoe

  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  logits = [jax.random.normal(k, (2, 8, 6)) for k in keys]
  mask = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
  expected = hf_olmoe.load_balancing_loss_func(
      tuple(torch.tensor(np.asarray(l).reshape(-1, 6)) for l in logits),
      6,
      2,
      torch.tensor(np.asarray(mask)),
  )
  np.testing.assert_allclose(
      objectives.topk_load_balancing_loss(logits, mask, 2),
      float(expected),
      rtol=1e-5,
  )
  # Uniform dispatch (tokens cycle over the expert pairs, near-equal probabilities) gives
  # the minimum top_k; routing every token to the same two experts gives more.
  pairs = jnp.stack(
      [
          jnp.zeros(6).at[2 * (t % 3)].set(1e-3).at[2 * (t % 3) + 1].set(1e-3)
          for t in range(8)
      ]
  )
  uniform = [jnp.broadcast_to(pairs, (2, 8, 6))] * 2
  full = jnp.ones((2, 8), jnp.int32)
  assert objectives.topk_load_balancing_loss(uniform, full, 2) == pytest.approx(
      2.0, abs=1e-3
  )
  collapsed = [jnp.zeros((2, 8, 6)).at[..., :2].set(10.0)] * 2
  assert objectives.topk_load_balancing_loss(
      collapsed, full, 2
  ) == pytest.approx(6.0, rel=1e-3)
  assert objectives.topk_load_balancing_loss(logits, full, 2) > 2.0


def test_spectral_embeddings_put_words_of_shared_contexts_together():
  """Tokens 10 and 11 always appear between the same neighbours, 20 and 21 between
  others: PPMI + SVD gives each pair nearly the same direction, far from the other.
  """
  from raptor_jax.pretrain import embeddings

  rng = np.random.default_rng(0)
  rows = []
  for _ in range(400):
    a, b = rng.integers(0, 2), rng.integers(0, 2)
    rows.append([30 + a, 10 + b, 31 + a, 40, 50 + a, 20 + b, 51 + a, 41])
  emb = embeddings.spectral_embeddings(np.array(rows), 64, 8, std=1.0, seed=0)
  unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
  assert unit[10] @ unit[11] > 0.9 and unit[20] @ unit[21] > 0.9
  assert abs(unit[10] @ unit[20]) < 0.5
  assert emb.shape == (64, 8) and abs(float(emb.std()) - 1.0) < 0.2
  np.testing.assert_array_equal(
      emb,
      embeddings.spectral_embeddings(np.array(rows), 64, 8, std=1.0, seed=0),
  )


# ---------------------------------------------------------------------------
# Corpus.


def test_decontamination_drops_every_document_holding_a_task_text():
  task = [
      "it 's a charming and often affecting journey . ",
      "the film does n't work as a thriller , and it is not much fun either . ",
      "good",
  ]
  docs = [
      "A review: It's a charming and often affecting journey. Loved it.",
      "Critics said the film doesn't work as a thriller, and it is not much fun either!",
      "This one is good, really good.",  # "good" is too short to count as a copy
      "An unrelated paragraph about trains and weather.",
  ]
  index = corpus.contamination_index(task, min_chars=32)
  assert [corpus.is_contaminated(d, index, 32) for d in docs] == [
      True,
      True,
      False,
      False,
  ]


def test_tokenizer_training_is_deterministic():
  """The trainer's hash-map order must not leak into the vocabulary (see tokenizer.py)."""
  texts = corpus.read_source("synthetic", n_synthetic=400)
  toks = [tokenizer.train_wordpiece(texts, vocab_size=300) for _ in range(3)]
  assert toks[0].get_vocab() == toks[1].get_vocab() == toks[2].get_vocab()
  tok = toks[0]
  assert set(tok.all_special_tokens) == set(tokenizer.SPECIAL_TOKENS)
  assert "##e" in tok.get_vocab()
  assert tok.tokenize("##e") != [
      "##e"
  ]  # text "##e" is not matched as a special token


def test_build_corpus_reports_and_removes_contamination(tmp_path):
  path = tmp_path / "pub.txt"
  task = [
      f"a distinct sentence number {i} from the private task train split ."
      for i in range(5)
  ]
  lines = (
      [
          "= Heading =",
          " ",
          "plain public text one",
          "plain public text one",
          "plain public text two",
      ]
      + [f"prefix {t} suffix" for t in task]
      + [
          f"public document {i} with enough words to be a document"
          for i in range(200)
      ]
  )
  path.write_text("\n".join(lines))
  built = corpus.build_corpus(
      [f"wikitext2={path}"], contaminants=task, heldout_fraction=0.1
  )
  kept = built.train + built.heldout
  assert built.stats["contaminated"] == 5 and built.stats["duplicate"] == 1
  assert built.stats["empty"] == 2  # the heading and the blank line
  assert not any(
      corpus.normalize(t) in corpus.normalize(d) for t in task for d in kept
  )
  assert len(kept) == 202 and 0 < len(built.heldout) < 60
  # The held-out split depends on each text alone, not on the rest of the corpus.
  again = corpus.build_corpus(
      [f"wikitext2={path}"], contaminants=[], heldout_fraction=0.1
  )
  assert set(built.heldout) <= set(again.heldout)


def test_the_pretraining_corpus_is_the_same_for_d_and_d_plus_a_record(
    tmp_path, monkeypatch
):
  """Invariant (docs/method.md §3): the public starting point is no function of D. The
  neighbour adds a record that copies a public document; the corpus is
  decontaminated against the task's dev split only (here served as from the
  Hub, as the default config reads it), never against its train split."""
  docs = [
      f"public document {i} with enough words to be a document of its own"
      for i in range(80)
  ]
  dev = ["a dev sentence that the public text quotes word for word ."]
  path = tmp_path / "pub.txt"
  path.write_text("\n".join([*docs, f"It quotes: {dev[0]} The end."]))
  train = [f"private train sentence number {i} of the task ." for i in range(5)]

  def built(train_texts):
    splits = {"train": train_texts, "dev": dev}
    monkeypatch.setattr(
        corpus.tasks, "load_task_texts", lambda task, split, path: splits[split]
    )
    return corpus.build_corpus(
        [f"wikitext2={path}"],
        contaminants=corpus.task_texts("sst2"),
        heldout_fraction=0.1,
    )

  d, neighbour = built(train), built([*train, docs[7]])
  assert d.stats["contaminated"] == 1  # the document quoting dev
  assert (d.train, d.heldout, d.stats) == (
      neighbour.train,
      neighbour.heldout,
      neighbour.stats,
  )


def test_train_split_decontamination_is_an_explicit_opt_in(tmp_path, caplog):
  """Only a named train file is read, with a warning that the corpus then
  depends on the private data; the generated task has no train file."""
  train = tmp_path / "train.tsv"
  train.write_text(
      "sentence\tlabel\na private train sentence , long enough .\t1\n"
  )
  dev = tmp_path / "dev.tsv"
  dev.write_text(
      "sentence\tlabel\nthe dev sentence , long enough to match .\t0\n"
  )
  assert corpus.task_texts("sst2", dev_path=str(dev)) == [
      "the dev sentence , long enough to match ."
  ]
  with caplog.at_level("WARNING", logger="raptor_jax"):
    texts = corpus.task_texts("sst2", dev_path=str(dev), train_path=str(train))
  assert "a private train sentence , long enough ." in texts
  assert any(
      "outside the DP guarantee" in r.getMessage() for r in caplog.records
  )
  generated = corpus.task_texts("synthetic", seed=3)
  train_texts = synthetic.generate_records(3, 4000).texts  # its train split
  assert len(generated) == 500 and not set(generated) & set(train_texts)
  with pytest.raises(ValueError, match="no train file"):
    corpus.task_texts("synthetic", train_path="x.tsv")


def test_a_custom_tasks_dev_texts_are_read_through_its_text_fields(tmp_path):
  """decontaminate.task='custom' reads the columns that fine-tuning reads
  (data.text_fields of configs/custom.py), not GLUE's column names; without
  them, or without a dev file, one line names the field."""
  dev = tmp_path / "dev.tsv"
  dev.write_text(
      "review\ttitle\tsentiment\n"
      "a custom dev review , long enough to match .\ta title\tpos\n"
  )
  assert corpus.task_texts(
      "custom", dev_path=str(dev), text_fields="review"
  ) == ["a custom dev review , long enough to match ."]
  pair = corpus.task_texts(
      "custom", dev_path=str(dev), text_fields=("review", "title")
  )
  assert pair == ["a custom dev review , long enough to match .", "a title"]
  # A GLUE task's aliases are overridden the same way.
  assert corpus.task_texts(
      "sst2", dev_path=str(dev), text_fields=["title"]
  ) == ["a title"]
  with pytest.raises(ValueError, match=r"^decontaminate.text_fields: must be"):
    corpus.task_texts("custom", dev_path=str(dev))
  with pytest.raises(ValueError, match=r"^decontaminate.dev_path: must be"):
    corpus.task_texts("custom", text_fields="review")
  with pytest.raises(ValueError, match="review"):  # a missing column is named
    corpus.task_texts("custom", dev_path=str(dev), text_fields="text")
  config = pretrain_config.base_config()
  assert config.decontaminate.text_fields == ()


# ---------------------------------------------------------------------------
# Training, export and resume.


@pytest.mark.slow
def test_pretraining_reduces_the_heldout_loss(switch_run):
  workdir, report = switch_run
  config = tiny_config()
  data = train.prepare_data(config, workdir)
  special = train.special_ids(data["tokenizer"])
  module = model.backbone("switch", config.model, len(data["tokenizer"]))
  initial = model.init_params(module, jax.random.PRNGKey(config.seed))
  ids = jnp.asarray(data["heldout_rows"][:16])
  loss = lambda p: model.loss_fn(
      module,
      p,
      ids,
      jax.random.PRNGKey(9),
      special,
      mlm_rate=0.15,
      aux_loss_coef=0.0,
      z_loss_coef=0.0,
  )[1]["lm_loss"]
  _, trained = models.from_pretrained(workdir / "model")
  assert float(loss({"backbone": trained})) < float(loss(initial)) - 0.3
  assert report["finished"] and report["tokens_seen"] == 20 * 16 * 32
  assert report["corpus"]["contaminated"] >= 0 and report["corpus"]["train"] > 0
  routing = report["routing"]
  assert routing["selected_layer"] in (1,) and len(routing["layers"]) == 1
  assert abs(sum(routing["layers"][0]["owner_shares"]) - 1.0) < 1e-6


@pytest.mark.slow
def test_pretraining_trains_the_relative_position_table(switch_run):
  """Switch's only position signal learns: the table moves far more than
  weight decay alone moves it (20 steps at lr 1e-2 and decay 0.01 shrink it
  by well under 1%; with no gradient it moved 0.3% of its norm)."""
  workdir, _ = switch_run
  config = tiny_config()
  data = train.prepare_data(config, workdir)
  module = model.backbone("switch", config.model, len(data["tokenizer"]))
  table = lambda p: np.asarray(
      p["block_0"]["attention"]["relative_attention_bias"]["embedding"]
  )
  initial = table(
      model.init_params(module, jax.random.PRNGKey(config.seed))["backbone"]
  )
  _, trained = models.from_pretrained(workdir / "model")
  moved = np.linalg.norm(table(trained) - initial) / np.linalg.norm(initial)
  assert moved > 0.05, moved


@pytest.mark.slow
def test_export_round_trip_matches_transformers(switch_run):
  from transformers import AutoTokenizer, SwitchTransformersEncoderModel

  workdir, _ = switch_run
  model_dir = workdir / "model"
  module, params = models.from_pretrained(model_dir)
  tok = AutoTokenizer.from_pretrained(model_dir)
  batch = tok(
      ["cold coffee was great", "the loud hotel , awful"],
      padding=True,
      return_tensors="np",
  )
  ours = module.apply(
      {"params": params}, batch["input_ids"], batch["attention_mask"]
  )
  hf = SwitchTransformersEncoderModel.from_pretrained(model_dir).eval()
  with torch.no_grad():
    theirs = hf(
        input_ids=torch.tensor(batch["input_ids"]),
        attention_mask=torch.tensor(batch["attention_mask"]),
        output_router_logits=True,
    )
  real = batch["attention_mask"].astype(bool)
  np.testing.assert_allclose(
      np.asarray(ours.hidden_states)[real],
      theirs.last_hidden_state.numpy()[real],
      atol=1e-4,
      rtol=1e-4,
  )
  np.testing.assert_allclose(
      np.asarray(ours.router_logits[0])[real],
      theirs.router_logits[0].numpy()[real],
      atol=1e-4,
      rtol=1e-4,
  )


@pytest.mark.slow
def test_resume_is_exact(switch_run, tmp_path):
  workdir, report = switch_run
  config = tiny_config()
  config.stop_after_steps = (
      7  # stops between two checkpoints: the interrupt path saves step 7
  )
  first = pretrain(config, tmp_path)
  assert (
      not first["finished"]
      and first["steps"] == 7
      and first["model_dir"] is None
  )
  config.stop_after_steps = 0
  resumed = pretrain(config, tmp_path)
  assert resumed["finished"] and resumed["steps"] == 20
  assert (tmp_path / "model" / "model.safetensors").read_bytes() == (
      workdir / "model" / "model.safetensors"
  ).read_bytes()
  assert resumed["heldout"] == report["heldout"]


def _assert_exported_lm_matches(model_dir, hf_class, **hf_options):
  """The export's logits (first 5 of the vocabulary) of one padded record:
  `models.from_pretrained`'s hidden states times its lm_head.weight, as
  transformers' `hf_class` computes them. Returns the Flax module."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

  module, params = models.from_pretrained(model_dir)
  ids = np.array([[2, 40, 41, 42, 3, 0]])
  mask = (ids != 0).astype(np.int64)
  hidden = module.apply({"params": params}, ids, mask).hidden_states
  head = load_file(str(model_dir / "model.safetensors"))["lm_head.weight"]
  ours = np.asarray(hidden) @ head.T
  hf = hf_class.from_pretrained(model_dir, **hf_options).eval()
  with torch.no_grad():
    theirs = hf(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)
    ).logits.numpy()
  np.testing.assert_allclose(ours[:, :5], theirs[:, :5], atol=1e-4, rtol=1e-4)
  return module


@pytest.mark.slow
def test_olmoe_pretraining_exports_a_causal_lm(tmp_path):
  from transformers import OlmoeForCausalLM

  config = tiny_config(steps=4, family="olmoe")
  config.checkpoint_every = 100
  report = pretrain(config, tmp_path)
  assert report["finished"] and report["aux_loss_coef"] == 0.01
  _assert_exported_lm_matches(tmp_path / "model", OlmoeForCausalLM)


@pytest.mark.slow
def test_finetuning_reads_the_pretrained_model_and_its_tokenizer(
    switch_run, tmp_path
):
  from raptor_jax.train import config as train_config, setup

  workdir, _ = switch_run
  config = train_config.with_preset(train_config.base_config(), "tiny")
  config.model.name = str(workdir / "model")
  run_data = setup.load_run_data(config)
  assert (
      run_data.tokenizer.mask_token == "[MASK]"
  )  # the model's WordPiece, not the task's
  assert (
      len(run_data.tokenizer)
      == json.loads((workdir / "model" / "config.json").read_text())[
          "vocab_size"
      ]
  )
  assert run_data.token_groups is None
  backbone, _ = setup.load_backbone(config, run_data)
  assert backbone.config.num_experts == 4


def test_validation_errors_name_the_field():
  config = tiny_config()
  config.warmup_steps = 50
  with pytest.raises(ValueError, match="warmup_steps"):
    train.validate(config)
  with pytest.raises(ValueError, match="unknown pretraining source"):
    corpus.read_source("books")


@pytest.mark.slow
def test_launch_pretrain_tiny(tmp_path):
  """The README's pretraining command on the generated corpus (what CI runs)."""
  import subprocess, sys, os  # pylint: disable=g-import-not-at-top,multiple-imports

  env = dict(os.environ, XLA_FLAGS="")
  proc = run_python(
      "launch/pretrain.py",
      "--config=configs/pretrain_switch.py:tiny",
      f"--workdir={tmp_path}",
      "--config.progress_bar=False",
      env=env,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (
      "held-out LM loss" in proc.stdout
      and (tmp_path / "model" / "tokenizer.json").exists()
  )


def test_deepseek_balance_loss_matches_deepseeks_sequence_wise_formula():
  """DeepSeek-V2's MoEGate (seq_aux) per layer, transcribed in torch, summed over layers."""
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  logits = [jax.random.normal(k, (3, 8, 6)) for k in keys]
  full = jnp.ones((3, 8), jnp.int32)
  expected = 0.0
  for layer in logits:
    scores = torch.tensor(np.asarray(layer)).softmax(dim=-1)
    idx = torch.topk(scores, k=2, dim=-1).indices.view(3, -1)
    ce = torch.zeros(3, 6).scatter_add_(1, idx, torch.ones(3, 8 * 2))
    ce = ce.div_(8 * 2 / 6)
    expected += float((ce * scores.mean(dim=1)).sum(dim=1).mean())
  np.testing.assert_allclose(
      objectives.deepseek_balance_loss(logits, full, 2), expected, rtol=1e-5
  )
  # Uniform routing gives 1 per layer (every token on two experts, E / k
  # pairs); all tokens on the same two experts give E / k = 3.
  pairs = jnp.stack(
      [
          jnp.zeros(6).at[2 * (t % 3)].set(1e-3).at[2 * (t % 3) + 1].set(1e-3)
          for t in range(6)
      ]
  )
  uniform = [jnp.broadcast_to(pairs, (3, 6, 6))] * 2
  assert objectives.deepseek_balance_loss(
      uniform, jnp.ones((3, 6)), 2
  ) == pytest.approx(2.0, abs=1e-3)
  collapsed = jnp.zeros((3, 8, 6)).at[..., :2].set(10.0)
  assert objectives.deepseek_balance_loss(
      [collapsed], full, 2
  ) == pytest.approx(3.0, rel=1e-3)
  # Padding takes no part.
  padded = [jnp.concatenate([l, collapsed], axis=1) for l in logits]
  pad_mask = jnp.concatenate([full, jnp.zeros_like(full)], axis=1)
  np.testing.assert_allclose(
      objectives.deepseek_balance_loss(padded, pad_mask, 2), expected, rtol=1e-5
  )


@pytest.mark.slow
def test_deepseek_pretraining_exports_a_causal_lm(tmp_path):
  """DeepSeek-MoE pretraining (MLA, dense block 0, shared experts) exports a
  directory that transformers' DeepseekV2ForCausalLM and
  `models.from_pretrained` read alike."""
  from transformers import DeepseekV2ForCausalLM  # pylint: disable=g-import-not-at-top

  config = tiny_config(steps=4, family="deepseek")
  config.checkpoint_every, config.warmup_steps = 100, 1
  report = pretrain(config, tmp_path)
  assert report["finished"] and report["aux_loss_coef"] == 0.001
  # Block 0 is dense: only block 1 routes.
  assert [row["layer"] for row in report["routing"]["layers"]] == [1]
  module = _assert_exported_lm_matches(
      tmp_path / "model", DeepseekV2ForCausalLM, attn_implementation="eager"
  )
  assert module.config.n_shared_experts == 2 and module.config.use_mla


def test_several_tasks_dev_splits_are_all_decontaminated_against(tmp_path):
  """decontaminate.task='sst2,qnli' (one model for both studies) reads each
  task's dev file, in order; a path list of the wrong length is one line."""
  sst2 = tmp_path / "sst2.tsv"
  sst2.write_text("sentence\tlabel\nan sst2 dev sentence , long enough .\t0\n")
  qnli = tmp_path / "qnli.tsv"
  qnli.write_text(
      "index\tquestion\tsentence\tlabel\n"
      "0\ta qnli question , long enough ?\ta qnli answer , long enough .\t"
      "entailment\n"
  )
  texts = corpus.tasks_texts("sst2,qnli", dev_paths=f"{sst2},{qnli}")
  assert texts == [
      "an sst2 dev sentence , long enough .",
      "a qnli question , long enough ?",
      "a qnli answer , long enough .",
  ]
  assert corpus.tasks_texts("sst2", dev_paths=str(sst2)) == texts[:1]
  assert corpus.tasks_texts("") == []
  with pytest.raises(ValueError, match=r"^decontaminate.dev_path: must be"):
    corpus.tasks_texts("sst2,qnli", dev_paths=str(sst2))
  with pytest.raises(ValueError, match=r"^decontaminate.text_fields"):
    corpus.tasks_texts(
        "sst2,qnli", dev_paths=f"{sst2},{qnli}", text_fields="sentence"
    )
