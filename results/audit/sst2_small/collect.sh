#!/bin/bash
# Copies the finished audits of runs/audit_sst2 (runs/audit_sst2/run.sh, which
# is resumable) here and prints their table.
cd "$(dirname "$0")/../../.."
for d in runs/audit_sst2/*/; do
  n=$(basename "$d")
  [ -f "$d/audit.json" ] && cp "$d/audit.json" "results/audit/sst2_small/$n.json"
done
python results/audit/sst2_small/table.py
