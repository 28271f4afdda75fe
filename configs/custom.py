"""RAPTOR on your own text classification data: `configs/custom.py:<preset>`.

Declare the task with four fields (there is no default for them):

  data.text_fields   the text column, or two columns for a sentence pair
  data.label_field   the label column: class names or integers 0 .. K-1
  data.label_names   the K class names, comma-separated; position = class id
  data.train_path    a .tsv (quoting off), .csv, .jsonl or .parquet file, or a
                     datasets.save_to_disk directory (data.dev_path likewise);
                     or, online, data.hub_dataset=<Hub id> with train and
                     validation splits

Sizes are chosen from the number of training records n (every preset):
batch_size = 0 gives an expected batch of n / 10 (at most 1000), epochs = 0
the fewest epochs with at least 200 noisy steps (600 records: batch 60, 20
epochs of 10 steps), so that the noise averages out; set either to a number
to override it. The default delta is 1/(10 n) (privacy.delta = 0). n is
treated as public, as the sample rate B / n is.

The task reports accuracy and macro-F1. Presets, as for GLUE
(`configs/glue.py`): empty (paper scale, google/switch-base-8) | small (CPU,
minutes: the small pretrained Switch committed in results/glue_small/model,
or --config.model.name=<pretrain workdir>/model; on a 600-record 5-topic
set it reached 0.84-0.95 where :cpu reached 0.40-0.47, results/custom_5class) | cpu
(the tiny random model with a word vocabulary from the PUBLIC corpus: a
smoke test; a random frozen model learns a few telling words only).

A 5-class TSV with columns `text, sentiment`, public corpus from a file:

  python launch/main.py --config=configs/custom.py:small --workdir=/tmp/mine \
    --config.data.train_path=train.tsv --config.data.dev_path=dev.tsv \
    --config.data.text_fields=text --config.data.label_field=sentiment \
    --config.data.label_names=very_neg,neg,neutral,pos,very_pos \
    --config.data.public_path=calib/imdb/unsup_sample5000.tsv

The public corpus (layer selection, and the :cpu vocabulary) must not be
your private data: any public text of the same language and domain works
(default: the IMDb preset from the Hub).
"""

from pathlib import Path

from raptor_jax import _validate
from raptor_jax.train.config import base_config, with_preset

PRESETS = ("", "cpu", "small")
# :small's default model: the small Switch this repository commits
# (launch/pretrain.py on public WikiText-2 and IMDb text; results/glue_small).
COMMITTED_MODEL = (
    Path(__file__).resolve().parents[1] / "results" / "glue_small" / "model"
)


def get_config(arg: str = ""):
  _validate.one_of(
      "preset of configs/custom.py",
      arg,
      PRESETS,
      "use --config=configs/custom.py:small, :cpu, or no preset",
  )
  config = base_config()
  config.data.task = "custom"
  config.data.label_names = ""  # comma-separated class names (id = position)
  config.data.hub_dataset = ""  # a Hub dataset id instead of files (online)
  config = with_preset(config, arg)
  if arg == "small":
    config.model.name = str(COMMITTED_MODEL)
  # Your file whole: the GLUE presets' train_limit / holdout (:small's
  # 16,000 / 2,000) are sized for SST-2, not for your data.
  config.data.train_limit = 0
  config.data.holdout = 0
  config.batch_size = 0  # chosen from n: n / 10, at most 1000
  config.epochs = 0  # chosen from n: at least 200 noisy steps
  return config
