#!/usr/bin/env bash
# Downloads, on this machine (it reaches the package registry), the wheels
# that the GPU machine's image lacks for launch/bench/gpu_check.sh, into
# .whl/ (git-ignored): Python 3.12, manylinux x86-64, no dependencies beyond
# this list. The GPU machine reaches nothing; carry .whl with the run:
#
#   bash launch/bench/gpu_wheels.sh          # here, once (a few MB)
#   # then on the device: carry ['.whl'], run `bash launch/bench/gpu_check.sh`
#
# The list: raptor_jax's needs missing from that image (ml-collections,
# dp-accounting and its dm-tree, datasets and its dill and multiprocess,
# tensorboardX) and tokamax's (tokamax, qwix, einshape, immutabledict,
# typeguard, pydantic and pydantic-core). The image's own JAX, flax, optax,
# transformers and torch are used as they are.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
mkdir -p .whl
wheels=(
  ml-collections==1.1.0 dp-accounting==0.6.0 dm-tree==0.1.10 datasets==5.2.0
  dill==0.4.1 multiprocess==0.70.19 tensorboardX==2.6.5
  tokamax==0.0.12 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 typeguard==2.13.3
  pydantic==2.14.4 pydantic-core==2.50.5
)
"$python" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
ls .whl
