#!/usr/bin/env bash
# Reproduces results/glue_small from the repository root (see PROTOCOL.md).
# Every step resumes: finished cells and tuning runs are skipped.
set -euo pipefail
D=${DATA:-../shared/data}
MODEL=results/glue_small/model

# 1. The model (committed in $MODEL with SHA256SUMS; ~100 min on 2 cores):
if [[ ! -f $MODEL/model.safetensors ]]; then
python launch/pretrain.py --config=configs/pretrain_switch.py --workdir=runs/pretrain_glue \
  --config.corpus.local_dir=$D/pretrain --config.decontaminate.task=sst2,qnli \
  --config.decontaminate.dev_path=$D/glue/sst2/dev.tsv,$D/glue/qnli/dev.tsv \
  --config.seq_len=128 --config.batch_size=64 --config.steps=6000 --config.warmup_steps=200 \
  --config.eval_every=1000 --config.checkpoint_every=200 --config.progress_bar=False --config.log_every=50
cp -r runs/pretrain_glue/model/. $MODEL/
fi

ROWS=nonprivate_lora,monolithic_lora,baseline_a,baseline_b,raptor
# The finished cells' public records are kept in results/glue_small/cells (committed), so
# a fresh clone resumes where the last machine stopped; checkpoints stay in runs/.
COMMON=(--workdir=runs/glue_small --results_dir=results/glue_small
  --archive=results/glue_small/cells
  --config.model.name=$MODEL --config.progress_bar=False
  # Wall time per run is reported (public data here; the trainer warns).
  --config.log_wall_time=True
  --epsilons=1,8 --clip_grid=0.1,1,10 --tune_seed=100)
QNLI=(--config=configs/switch_qnli.py:small --config.epochs=4
  --config.data.train_path=$D/glue/qnli/train_sample.tsv
  --config.data.dev_path=$D/glue/qnli/dev.tsv
  --config.data.public_path=$D/calib/squad/dev_v1.1_contexts.tsv)
SST2=(--config=configs/switch_sst2.py:small --config.epochs=2
  --config.data.train_path=$D/glue/sst2/train.tsv
  --config.data.dev_path=$D/glue/sst2/dev.tsv
  --config.data.public_path=$D/calib/imdb/unsup_sample5000.tsv)

# 2. RAPTOR seed 0 first, with the App. G diagnostics; then every cell.
for TASK in QNLI SST2; do
  declare -n ARGS=$TASK
  python launch/sweep.py "${ARGS[@]}" "${COMMON[@]}" --variants=raptor --seeds=0 --diagnostics
  python launch/sweep.py "${ARGS[@]}" "${COMMON[@]}" --variants=$ROWS --seeds=0,1,2,3,4
done

# 3. The phase-diagram placement, from the archived seed-0 diagnostics and layer selections.
python launch/phase_placement.py --workdir=results/glue_small/cells --controlled=results/controlled \
  --out=results/glue_small/phase_placement.md
