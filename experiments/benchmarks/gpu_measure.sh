#!/usr/bin/env bash
# meshmoe's GPU measurement on a machine with its own jax and CUDA and no package index (a lent GPU):
#
#   bash experiments/benchmarks/gpu_measure.sh OUT_DIR [gpu_measure flags]
#
# Installs the wheels of .whl/ (experiments/benchmarks/gpu_wheels.sh fetches them, beforehand, where pip
# can reach PyPI) into a private folder, makes this checkout importable as `meshmoe` without installing it,
# and runs experiments/benchmarks/gpu_measure.py. Its log goes to OUT_DIR/measure.log too.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:?usage: gpu_measure.sh OUT_DIR [gpu_measure flags]}"
shift
mkdir -p "$out"
exec > >(tee -a "$out/measure.log") 2>&1
cd "$repo"
py="${PYTHON:-python3}"
site="${MESHMOE_SITE:-/tmp/meshmoe_site}"
echo "meshmoe GPU measurement, $(date -Iseconds), $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
# `meshmoe` is this checkout's folders under one name (pyproject.toml's package-dir), linked, not copied.
mkdir -p "$site/meshmoe"
for entry in src/* models sharding pallas_kernels; do ln -sfn "$repo/$entry" "$site/meshmoe/$(basename "$entry")"; done
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
# jax-triton must import cleanly or tokamax does not import at all (it catches only ImportError).
if ! "$py" -c 'import jax_triton' 2>/dev/null; then
  echo "jax_triton does not import here: removed (tokamax's Triton kernels are then not measured)"
  rm -rf "$site"/jax_triton*
fi
"$py" -c 'import jax, tokamax, importlib.metadata as m; print("jax", jax.__version__, "tokamax", m.version("tokamax"), jax.devices())'
export MESHMOE_MEASURE_COMMAND="bash experiments/benchmarks/gpu_measure.sh \$OUT $*"
exec "$py" -m experiments.benchmarks.gpu_measure --out="$out" "$@"
