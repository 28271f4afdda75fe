#!/usr/bin/env bash
# The one GPU check (at most 8 minutes on one H200), run from the repository
# root on the GPU machine:
#
#   bash launch/bench/gpu_check.sh            # on the GPU
#   bash launch/bench/gpu_check.sh --quick    # toy sizes, any backend (CPU tests)
#
# 1. Wheels carried in .whl/ (packages the machine's image lacks: made here
#    by launch/bench/gpu_wheels.sh, carried with the run as ['.whl']) are
#    installed into a private target first; a module that still cannot be
#    imported is named in one line before anything runs.
# 2. launch.bench.gpu_check: the trainer's shared and expert DP steps of a
#    switch-base-8-shaped classifier at B=1000 (microbatched), bf16 and
#    float32, per expert dispatch (grouped, XLA ragged, tokamax), with step
#    times, peak memory and the fraction of the measured matmul peak; then
#    DeepSeek-VL2-Tiny's language model at image records' lengths (512, 768).
# 3. launch.bench.gpu_dispatch: the OLMoE-1B-7B-shaped sparse layer (and
#    switch-base-8's) per dispatch and ragged_dot lowering.
# Each part has its own time budget, so a slow part cannot eat the others'.
set -uo pipefail
cd "$(dirname "$0")/../.."
quick=() layers=(--families=olmoe,switch --repeats=5)
budget_check=330 budget_layer=120
if [[ "${1:-}" == "--quick" ]]; then
  quick=(--quick) layers=(--families=olmoe --modes=lora --variants=grouped,tokamax)
  budget_check=600 budget_layer=600
fi
python="${PYTHON:-python3}"
wheels="${GPU_CHECK_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/gpu_check_site "$wheels"/*.whl; then
    echo "error: the wheels in $wheels/ did not install; remake them with launch/bench/gpu_wheels.sh"
    exit 1
  fi
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
missing=$("$python" - <<'PY'
import importlib.util
need = ["jax", "flax", "optax", "ml_collections", "dp_accounting", "absl",
        "datasets", "transformers", "safetensors", "orbax.checkpoint"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None))
PY
)
if [[ -n "$missing" ]]; then
  echo "error: missing Python modules: $missing; carry their wheels in .whl/ (see the device notes) and rerun"
  exit 1
fi
"$python" -c "import jax; print('devices:', jax.devices())"
timeout "$budget_check" "$python" -m launch.bench.gpu_check "${quick[@]}"
echo "gpu_check exit status: $?"
timeout "$budget_layer" "$python" -m launch.bench.gpu_dispatch "${quick[@]}" "${layers[@]}"
echo "gpu_dispatch exit status: $?"
