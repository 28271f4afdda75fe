"""configs/glue.py and its aliases configs/{switch,olmoe,deepseek}_{task}.py."""

import re
import subprocess
import sys

import pytest

from helpers import ROOT, load_config_module
from raptor_jax import data
from raptor_jax.train import config as config_lib

_TASKS = ("sst2", "qnli", "qqp", "mnli")
_PRESETS = ("", "tiny", "cpu", "small")


@pytest.mark.parametrize("model", ["switch", "olmoe", "deepseek"])
@pytest.mark.parametrize("task", _TASKS)
def test_alias_is_glue_with_the_same_parameters(task, model):
  glue = load_config_module("glue")
  alias = load_config_module(f"{model}_{task}")
  assert (
      alias.get_config().to_dict()
      == glue.get_config(f"task={task},model={model}").to_dict()
  )
  for preset in _PRESETS:
    expected = glue.get_config(f"model={model},preset={preset},task={task}")
    assert alias.get_config(preset).to_dict() == expected.to_dict()
    assert repr(alias.get_config(preset)) == repr(
        expected
    )  # same field types too
    if preset == "tiny":
      assert (
          expected.data.task == "synthetic"
          and expected.data.public_corpus == "synthetic"
      )
      assert expected.model.name == "random"
    else:
      assert expected.data.task == task
      assert expected.data.public_corpus == data.TASK_CORPUS[task]
    assert expected.model.random.family == model


@pytest.mark.parametrize(
    "model, name",
    [
        ("qwen3_moe", "Qwen/Qwen3-30B-A3B"),
        ("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B"),
        ("mixtral", "mistralai/Mixtral-8x7B-v0.1"),
    ],
)
def test_the_decoder_kits_families_have_every_preset(model, name):
  glue = load_config_module("glue")
  paper = glue.get_config(f"task=qnli,model={model}")
  assert (paper.model.name, paper.model.dtype) == (name, "bfloat16")
  assert paper.microbatch_size == 8
  for preset in ("tiny", "cpu", "small"):
    config = glue.get_config(f"task=qnli,model={model},preset={preset}")
    assert config.model.dtype == "float32"
    assert config.model.random.family == model
    assert (config.model.random.num_experts, config.model.random.top_k) == (
        8,
        2,
    )


def test_glue_fields():
  glue = load_config_module("glue")
  assert (
      glue.get_config().to_dict()
      == glue.get_config("task=sst2,model=switch,preset=").to_dict()
  )
  paper = glue.get_config("task=mnli,model=olmoe")
  assert (
      paper.model.name == "allenai/OLMoE-1B-7B-0924"
      and paper.model.dtype == "bfloat16"
  )
  assert paper.data.public_corpus == "anli_r2" and paper.microbatch_size == 8
  assert (
      paper.batch_size == 1000
      and paper.epochs == 20
      and paper.privacy.epsilon == 8.0
  )
  tiny = glue.get_config("task=mnli,model=olmoe,preset=tiny")
  assert tiny.model.dtype == "float32" and tiny.model.random.top_k == 2
  assert (
      tiny.batch_size == 250 and tiny.epochs == 6 and tiny.data.max_length == 32
  )
  deepseek = glue.get_config("task=sst2,model=deepseek")
  assert deepseek.model.name == "deepseek-ai/deepseek-vl2-tiny"
  assert deepseek.model.dtype == "bfloat16"
  tiny = glue.get_config("task=sst2,model=deepseek,preset=tiny")
  assert (
      tiny.model.dtype == "float32" and tiny.model.random.family == "deepseek"
  )
  assert (
      tiny.model.random.num_shared_experts,
      tiny.model.random.first_k_dense,
  ) == (2, 1)
  cpu = glue.get_config("task=qqp,preset=cpu")
  assert (cpu.data.task, cpu.data.public_corpus, cpu.model.tokenizer) == (
      "qqp",
      "paws",
      "public-words",
  )
  small = glue.get_config("task=sst2,preset=small")
  assert (
      small.model.name == ""
      and small.data.train_limit == 16000
      and small.data.holdout == 2000
      and small.data.max_length == 64
  )
  # QNLI's :small: pairs up to 128 tokens, 8,000 + 1,999 of its 9,999-row
  # train sample, SQuAD contexts as the public corpus.
  qnli = glue.get_config("task=qnli,preset=small")
  assert (qnli.data.train_limit, qnli.data.holdout) == (8000, 1999)
  assert (qnli.data.max_length, qnli.data.public_corpus) == (128, "squad")
  assert qnli.batch_size == small.batch_size == 500


@pytest.mark.parametrize(
    "arg, message",
    [
        (
            "tsk=mnli",
            "config argument: must be one of task=..., model=..., preset=...,"
            " got 'tsk=mnli'; pass comma-separated key=value pairs",
        ),
        (
            "tiny",
            "config argument: must be one of task=..., model=..., preset=..., got 'tiny'",
        ),
        (
            "task=cola",
            "task: must be one of 'sst2', 'mnli', 'qnli', 'qqp', got 'cola'",
        ),
        (
            "model=gpt",
            "model: must be one of 'switch', 'olmoe', 'deepseek',"
            " 'qwen3_moe', 'qwen2_moe', 'mixtral', got 'gpt'",
        ),
        (
            "preset=huge",
            "preset: must be one of '', 'tiny', 'cpu', 'small', got 'huge'",
        ),
    ],
)
def test_bad_argument_is_one_clear_line(arg, message):
  with pytest.raises(ValueError, match=re.escape(message)) as error:
    load_config_module("glue").get_config(arg)
  assert "\n" not in str(error.value)


def test_parse_arg():
  assert config_lib.parse_arg("", a="1", b="") == {"a": "1", "b": ""}
  assert config_lib.parse_arg("b=x, a=2", a="1", b="") == {"a": "2", "b": "x"}
  assert config_lib.parse_arg("b=", a="1", b="y") == {"a": "1", "b": ""}


def test_the_config_reference_covers_every_field_preset_and_method():
  """launch/main.py --help_config: built from base_config, config.py's
  comments, the presets each config file accepts, and methods.METHODS."""
  from raptor_jax.train import config_help, methods
  from raptor_jax.train.config import base_config

  rows = config_help.fields()
  leaves = set(base_config().to_dict())  # top-level keys and sections
  assert {dotted.split(".")[0] for dotted, _, _ in rows} == leaves
  assert all(comment for _, _, comment in rows), [
      d for d, _, c in rows if not c
  ]
  assert ("privacy.epsilon", "8.0", "target epsilon of the whole run") in rows
  text = config_help.reference(ROOT / "configs")
  assert "    epsilon = 8.0      target epsilon of the whole run" in text
  assert "  configs/custom.py  presets: (none) | :cpu | :small" in text
  assert (
      "  configs/switch_sst2.py  presets: (none) | :tiny | :cpu | :small"
      in (text)
  )
  assert "configs/glue.py  presets: (none) | :preset=tiny |" in text
  assert "pretrain_" not in text  # launch/pretrain.py's configs
  assert all(f"\n  {m}\n" in text for m in methods.METHODS)
  # Every field a task of your own needs, those of configs/custom.py only
  # included (48.8: label_names and hub_dataset were missing).
  assert "Your own data (--config=configs/custom.py:small" in text
  for field in ("train_path", "dev_path", "text_fields", "label_field"):
    assert f"\n  data.{field} " in text, field
  assert "    label_names = ''" in text and "    hub_dataset = ''" in text


@pytest.mark.slow
def test_main_help_lists_methods_presets_and_fields():
  """`--help` itself shows the short reference; `--help_config` the full
  one, without the required --config and --workdir."""
  run = lambda *flags: subprocess.run(
      [sys.executable, "launch/main.py", *flags],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  shown = run("--help")
  assert "--help_config" in shown.stdout and "--workdir" in shown.stdout
  assert "Methods (--config.method=...): raptor, baseline_a," in shown.stdout
  assert "  configs/deepseek_sst2.py  (none) | :tiny | :cpu | :small" in (
      shown.stdout
  )
  assert "  privacy: clip_expert=1.0 clip_shared=1.0 delta=0.0 epsilon=8.0" in (
      shown.stdout
  )
  full = run("--help_config")
  assert full.returncode == 0, full.stderr
  assert full.stdout.startswith("Methods (--config.method=...):\n  raptor\n")
  assert "    secret_seed = -1   seed of Poisson samples and noise" in (
      full.stdout
  )
