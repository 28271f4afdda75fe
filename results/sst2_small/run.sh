#!/usr/bin/env bash
# Reproduces results/sst2_small from the repository root.
# 1. Pretrain the small Switch on public text (~30 min on 2 CPU cores; resumes):
#      python launch/pretrain.py --config=configs/pretrain_switch.py --workdir=runs/pretrain_switch \
#        --config.corpus.local_dir=../shared/data/pretrain \
#        --config.decontaminate.train_path=../shared/data/glue/sst2/train.tsv \
#        --config.decontaminate.dev_path=../shared/data/glue/sst2/dev.tsv
# 2. This script: the sweep, epsilon 1 first (the paper's headline), then the
#    same command with epsilon 8 added; finished cells and tuning runs are reused.
set -euo pipefail
for eps in 1 1,8; do
python launch/sweep.py --config=configs/switch_sst2.py:small --workdir=runs/sst2_small \
  --config.model.name=runs/pretrain_switch/model \
  --config.data.train_path=../shared/data/glue/sst2/train.tsv \
  --config.data.dev_path=../shared/data/glue/sst2/dev.tsv \
  --config.data.public_path=../shared/data/calib/imdb/unsup_sample5000.tsv \
  --config.progress_bar=False \
  --variants=raptor,monolithic_lora,baseline_a,nonprivate_lora --epsilons=$eps --seeds=0,1,2 \
  --clip_grid=0.1,1,10 --tune_seed=100 --results_dir=results/sst2_small
done
