#!/bin/bash
# Issue 15: one-run audits on SST-2 with the pretrained small model (:small
# preset, the study's data and the clip norms the study tuned per method and
# epsilon, fixed before any audit ran). Resumable: a finished audit.json is kept.
cd "$(dirname "$0")/../../.."
common="--config=configs/switch_sst2.py:small --config.model.name=runs/pretrain_switch/model \
  --config.data.train_path=../shared/data/glue/sst2/train.tsv \
  --config.data.dev_path=../shared/data/glue/sst2/dev.tsv \
  --config.data.public_path=../shared/data/calib/imdb/unsup_sample5000.tsv \
  --config.progress_bar=False"
run() {  # name method eps clip
  w=runs/audit_sst2/$1
  [ -f $w/audit.json ] && return
  extra=""
  [ -n "$3" ] && extra="--config.privacy.epsilon=$3 --config.privacy.clip_shared=$4 --config.privacy.clip_expert=$4"
  nice -n 19 python launch/audit.py $common --workdir=$w \
    --config.method=$2 $extra > runs/audit_sst2/$1.log 2>&1
}
run raptor_eps8 raptor 8 1
run monolithic_lora_eps8 monolithic_lora 8 1
run nonprivate_lora nonprivate_lora
run raptor_eps1 raptor 1 0.1
run monolithic_lora_eps1 monolithic_lora 1 1
