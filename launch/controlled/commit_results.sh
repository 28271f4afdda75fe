#!/usr/bin/env bash
# Commits the controlled study's result files every $1 seconds (default 600)
# while the grid process $2 runs; only results/controlled/* files, and only
# those paths (`git commit -- paths` leaves anything else staged untouched).
set -u
period=${1:-600}
pid=${2:?pid of launch/controlled_study.py}
files=(results/controlled/results.csv results/controlled/tuning.csv
       results/controlled/results.md results/controlled/environment.json
       results/controlled/phase_diagram.png)
commit() {
  present=()
  for f in "${files[@]}"; do [[ -e $f ]] && present+=("$f"); done
  ((${#present[@]})) || return 0
  for _ in 1 2 3 4 5; do
    if git add "${present[@]}" && git commit -q -m \
      "Controlled study: finished runs so far (grid in progress)" \
      -- "${present[@]}"; then return 0; fi
    git diff --quiet HEAD -- "${present[@]}" && return 0
    sleep 7
  done
}
while kill -0 "$pid" 2>/dev/null; do sleep "$period"; commit; done
commit
