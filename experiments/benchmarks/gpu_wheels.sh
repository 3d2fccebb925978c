#!/usr/bin/env bash
# Wheels that a GPU machine with its own jax (and no package index) lacks for meshmoe, fetched here into
# .whl/ so that they can travel with the repository:
#
#   bash experiments/benchmarks/gpu_wheels.sh [DIR]      # default DIR: .whl (git-ignored)
#
# then, on the GPU machine (gpu_measure.sh does this itself when it finds DIR):
#   python3 -m pip install --no-index --no-deps --target /tmp/meshmoe_site DIR/*.whl
#
# The list is what a CUDA image holding jax, flax, optax, orbax, numpy, tokenizers, pyarrow, matplotlib
# and protobuf lacks (the image these scripts were measured on): tokamax and what it imports at start-up
# (xprof only for its kernel-stats tool, which needs fire and termcolor too), grain, ml_collections and
# tensorboardX for the trainer, and jax-triton for tokamax's Triton grouped GEMM. Versions are the pins of
# requirements/constraints.txt, except jax-triton: 0.3.1 is the last release that takes the image's
# Triton 3.6 (0.4 needs Triton 3.7).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-$repo/.whl}"
mkdir -p "$dir"
packages=(tokamax einshape pydantic pydantic_core annotated-types typing-inspection typing_extensions qwix
          immutabledict tensorboardX xprof fire termcolor grain array_record portpicker ml_collections)
pins=()
for name in "${packages[@]}"; do
  pin="$(grep -i -E "^${name//[-_]/[-_]}==" "$repo/requirements/constraints.txt" || true)"
  [ -n "$pin" ] || { echo "error: $name has no pin in requirements/constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
pins+=("jax-triton==0.3.1")
# The GPU image's Python is 3.12 on x86-64 (manylinux): fetch for it, whatever this machine runs.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${pins[@]}"
echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
