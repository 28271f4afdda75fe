#!/bin/bash
# Protocol B: the README's custom-data command (configs/custom.py:small, the committed model by default).
# (The runs of results.txt passed --config.model.name=results/glue_small/model explicitly: the same value.)
# runB.sh SET SEED
cd "$(dirname "$0")/../.."
w=/tmp/five/runs/B_$1_s$2
[ -f $w/results.json ] && exit 0
start=$(date +%s)
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 nice -n 5 .venv/bin/python launch/main.py --config=configs/custom.py:small --workdir=$w \
  --config.data.train_path=/tmp/five/$1/train.tsv --config.data.dev_path=/tmp/five/$1/dev.tsv \
  --config.data.text_fields=text --config.data.label_field=topic \
  --config.data.label_names=sports,food,travel,music,science \
  --config.data.public_path=/work/shared/data/calib/imdb/unsup_sample5000.tsv \
  --config.privacy.secret_seed=$2 > /tmp/five/runs/B_$1_s$2.log 2>&1
echo "B $1 seed=$2 wall=$(( $(date +%s) - start )) $(python3 -c "import json;r=json.load(open('$w/results.json'));print({k:v for k,v in r.items() if 'acc' in k or 'eps' in k})")" >> /tmp/five/resultsB.txt
