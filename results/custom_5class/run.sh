#!/bin/bash
# run.sh SET LR EPOCHS SEED
set -e
cd /work/main
w=/tmp/five/runs/$1_lr$2_ep$3_s$4
[ -f $w/results.json ] && exit 0
extra=()
[ "$3" != "0" ] && extra=(--config.epochs=$3)
start=$(date +%s)
.venv/bin/python launch/main.py --config=configs/custom.py:cpu --workdir=$w \
  --config.data.train_path=/tmp/five/$1/train.tsv --config.data.dev_path=/tmp/five/$1/dev.tsv \
  --config.data.text_fields=text --config.data.label_field=topic \
  --config.data.label_names=sports,food,travel,music,science \
  --config.data.public_path=/work/shared/data/calib/imdb/unsup_sample5000.tsv \
  --config.learning_rate=$2 --config.privacy.secret_seed=$4 "${extra[@]}" > /tmp/five/runs/$1_lr$2_ep$3_s$4.log 2>&1
echo "$1 lr=$2 ep=$3 seed=$4 wall=$(( $(date +%s) - start )) $(python3 -c "import json;r=json.load(open('$w/results.json'));print({k:v for k,v in r.items() if 'acc' in k or 'eps' in k})")"
