#!/usr/bin/env bash
# The one GPU check: five parts, within 9 minutes on one H200, each printed
# as soon as it is done and under its own time budget (`timeout`). From the
# repository root:
#
#   bash launch/bench/gpu_wheels.sh           # here, once: .whl/ for the image
#   bash launch/bench/gpu_check.sh            # on the GPU (carry ['.whl'])
#   bash launch/bench/gpu_check.sh --quick    # toy sizes on the CPU (the tests)
#
# 0. The carried wheels (.whl/) go into a private target; a module that still
#    cannot be imported is named in one line before anything runs.
# 1. Toolchain: jax, jaxlib, devices; jax.jit(lambda x: x + 1)'s compile and
#    first-call seconds; any XLA line about parallel compilation.
# 2. The README's tiny run (launch/main.py, switch_sst2.py:tiny): its
#    output's tail (set-up and compile times, end-of-run table).
# 3. launch.bench.gpu_check: switch-base-8 in bf16 with the GPU's defaults:
#    set-up, each stream's compile, the step at B = 1000.
# 4. pytest under JAX_PLATFORMS=cuda, float32 at full matmul precision: the
#    kernel tests, per-record gradients against brute force
#    (tests/test_grads.py) and the models' per-record adapter gradients
#    against a loop (tests/test_grad_parity.py). --quick: a few, on CPU.
# 5. launch.bench.gpu_dispatch: the sparse layers of switch-base-8, then
#    OLMoE-1B-7B, then DeepSeek-VL2-Tiny (image-tile-length records),
#    Qwen3-30B-A3B and Mixtral-8x7B, per dispatch.
set -uo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
wheels="${GPU_CHECK_WHEELS:-.whl}"
quick=()
# Seconds per part: 30 + 75 + 170 + 120 + 45 + 45 + 40 = 525 of the 540
# (DeepSeek-VL2-Tiny's, Qwen3-MoE's and Mixtral's layers share the last 40:
# rows as far as they get; OLMoE's gave up 15 and pytest 10 for them).
b1=30 b2=75 b3=170 b4=120 b5a=45 b5b=45 b5c=40
platform=cuda
tiny=()
tests=(
  tests/test_kernels.py tests/test_grads.py
  tests/test_grad_parity.py::test_per_record_adapter_gradients_fast_equal_reference_and_a_loop
)
select=()
dispatch=(--modes=lora --variants=grouped,batched,ragged,tokamax,dense
  --ragged_lowerings=xla --isolate=no --repeats=5)
if [[ "${1:-}" == "--quick" ]]; then
  quick=(--quick)
  b1=60 b2=300 b3=400 b4=240 b5a=120 b5b=120 b5c=120  # part 5: one process
  platform=cpu
  tiny=(--config.data.synthetic.n_train=200 --config.data.synthetic.n_dev=64
    --config.data.n_pub=64 --config.batch_size=50 --config.epochs=1
    --config.model.random.d_model=32 --config.model.random.d_ff=32
    --config.model.random.num_heads=2 --config.model.random.d_kv=8
    --config.model.random.num_layers=2)
  tests=(tests/test_kernels.py tests/test_grads.py)
  select=(-k "frozen_expert_dispatch or clipped_grad_sum_equals_brute_force")
  dispatch=(--quick --modes=lora --variants=grouped,batched --isolate=no
    --repeats=1)
fi
if compgen -G "$wheels/*.whl" >/dev/null; then
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/gpu_check_site "$wheels"/*.whl; then
    echo "error: the wheels in $wheels/ did not install; remake them with launch/bench/gpu_wheels.sh"
    exit 1
  fi
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
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
logs=$(mktemp -d)
start=$SECONDS
# part NAME BUDGET, done_ NAME STATUS: a part's first and last lines (exit
# 124: stopped at its budget).
part() { echo; echo "== $1 (budget $2 s; ${SECONDS} s in)"; start=$SECONDS; }
done_() { echo "-- $1: exit $2 in $((SECONDS - start)) s"; }

part "1/5 toolchain" "$b1"
TF_CPP_MIN_LOG_LEVEL=0 timeout "$b1" "$python" - >"$logs/1.out" 2>"$logs/1.err" <<'PY'
import time
start = time.perf_counter()
import jax
import jaxlib
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, devices {jax.devices()}")
print(f"import jax: {time.perf_counter() - start:.1f} s")
add = jax.jit(lambda x: x + 1)
t = time.perf_counter()
compiled = add.lower(1.0).compile()
print(f"jax.jit(lambda x: x + 1): lower + compile {time.perf_counter() - t:.2f} s")
t = time.perf_counter()
jax.block_until_ready(compiled(1.0))
print(f"first call {time.perf_counter() - t:.3f} s")
PY
status=$?
cat "$logs/1.out"
if grep -i "parallel" "$logs/1.err"; then :; else
  echo "(no XLA line mentions parallel compilation)"
fi
done_ toolchain $status

part "2/5 README tiny run (launch/main.py --config=configs/switch_sst2.py:tiny)" "$b2"
timeout "$b2" "$python" launch/main.py --config=configs/switch_sst2.py:tiny \
  --workdir="$logs/tiny" "${tiny[@]}" >"$logs/2.out" 2>&1
status=$?
tail -n 30 "$logs/2.out"
done_ "README tiny run" $status

part "3/5 switch-base-8 DP steps at B=1000 (launch.bench.gpu_check)" "$b3"
timeout "$b3" "$python" -m launch.bench.gpu_check "${quick[@]}" 2>&1 \
  | grep -v "^WARNING\|Unable to initialize backend"
done_ gpu_check "${PIPESTATUS[0]}"

part "4/5 pytest under JAX_PLATFORMS=$platform" "$b4"
JAX_PLATFORMS=$platform JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$b4" \
  "$python" -m pytest -q -p no:cacheprovider -rfE "${tests[@]}" "${select[@]}" 2>&1
done_ pytest $?

part "5/5 expert dispatch rows: switch-base-8's, OLMoE-1B-7B's, DeepSeek-VL2-Tiny's, Qwen3-30B-A3B's and Mixtral-8x7B's layers" "$((b5a + b5b + b5c))"
# dispatch_rows BUDGET FAMILIES: one gpu_dispatch process (--quick: all in one).
dispatch_rows() {
  timeout "$1" "$python" -m launch.bench.gpu_dispatch --families="$2" \
    "${dispatch[@]}" 2>&1 | grep -v "^WARNING\|Unable to initialize backend"
  done_ "gpu_dispatch ${2//,/, }" "${PIPESTATUS[0]}"
}
if ((${#quick[@]})); then
  dispatch_rows "$((b5a + b5b + b5c))" switch,olmoe,deepseek_vl2,qwen3_moe,mixtral
else
  dispatch_rows "$b5a" switch
  dispatch_rows "$b5b" olmoe
  dispatch_rows "$b5c" deepseek_vl2,qwen3_moe,mixtral
fi
echo
echo "gpu_check.sh: done in $SECONDS s"
