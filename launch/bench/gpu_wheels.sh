#!/usr/bin/env bash
# Downloads, on this machine (it reaches the package registry), the wheels
# that the GPU machine's image lacks for launch/bench/gpu_check.sh, into
# .whl/ (git-ignored): Python 3.12, manylinux x86-64. The GPU machine reaches
# nothing; carry .whl with the run:
#
#   bash launch/bench/gpu_wheels.sh          # here, once (a few MB)
#   # then on the device: carry ['.whl'], run `bash launch/bench/gpu_check.sh`
#
# The roots: raptor_jax's needs missing from that image and tokamax (the
# [gpu] extra). Every dependency of every carried wheel that the image lacks
# is carried too: launch/bench/gpu_wheels.py reads the wheels' Requires-Dist
# (markers evaluated for the GPU's Python 3.12 on Linux), subtracts the
# image's packages (launch/bench/gpu_image_packages.txt, from the device
# notes) and the wheels already here, and the missing ones are downloaded in
# turn until none is left. One version of each package.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
out="${GPU_WHEELS_DIR:-.whl}"
image=launch/bench/gpu_image_packages.txt
roots=(
  ml-collections==1.1.0 dp-accounting==0.6.0 datasets==5.2.0 tokamax==0.0.12
)
download() {
  "$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$out" "$@"
}
mkdir -p "$out"
download "${roots[@]}"
for round in 1 2 3 4 5 6 7 8 9 10; do
  mapfile -t need < <("$python" -m launch.bench.gpu_wheels "$out" "$image")
  if ((${#need[@]} == 0)); then
    ls "$out"
    exit 0
  fi
  echo "round $round: carrying ${need[*]}"
  download "${need[@]}"
done
echo "error: the dependencies of the wheels in $out did not close in 10 rounds"
exit 1
